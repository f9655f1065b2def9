"""Capacity signals, refusal before the upgrade, and drain, on the fabricated echo backend.

Real uvicorn on loopback; refusals are read the way a proxy reads them (the HTTP status of
the upgrade response), drains the way a client lives through them (notice, then 1001).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Iterator

import pytest

from parley.engine import Engine, EngineConfig, EngineFull
from parley.engine.slack import Priority, SlackSource
from delay_backend import DelayBackend
from parley.realtime.server.app import create_app
from parley.realtime.server.services import Services
from parley.realtime.server.drain import DrainingServer
from parley.realtime.server.serve import uvicorn_config
from parley.realtime.sessions.session import ServerDefaults
from server_harness import chat_session, delay_app, free_port, serve, tone, wait_for


def run(coro):
    return asyncio.run(coro)


def http(base: str, path: str, method: str = "GET", headers: dict | None = None) -> tuple[int, dict, str]:
    request = urllib.request.Request(f"http://{base}{path}", method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def get_json(base: str, path: str) -> tuple[int, dict]:
    status, _, body = http(base, path)
    return status, json.loads(body)


@contextlib.contextmanager
def serve_draining(app) -> Iterator[tuple[str, threading.Thread]]:
    """Like server_harness.serve, with the drain-aware server (a drain stops it)."""
    port = free_port()
    server = DrainingServer(uvicorn_config(app, "127.0.0.1", port, log_level="warning"), app.state.drainer)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"127.0.0.1:{port}", thread
    finally:
        server.should_exit = True
        thread.join(15)


async def upgrade(base: str, path: str) -> tuple[str, object]:
    """Open a WebSocket; ('admitted', first message) or ('refused', (status, Retry-After, body))
    or ('closed', close code)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    try:
        ws = await connect(f"ws://{base}{path}", open_timeout=10, max_size=None)
    except InvalidStatus as exc:
        r = exc.response
        return "refused", (r.status_code, r.headers.get("Retry-After"), json.loads(r.body or b"{}"))
    try:
        first = await asyncio.wait_for(ws.recv(), 10)
    except ConnectionClosed:
        return "closed", ws.close_code
    return "admitted", (ws, first)


def test_probes_load_and_gauges_follow_the_slot_table():
    app, _ = delay_app(2)
    with serve(app) as base:
        run(wait_for(lambda: get_json(base, "/readyz")[0] == 200, 10))  # warmed: the engine has ticked
        for path in ("/livez", "/health"):
            status, body = get_json(base, path)
            assert status == 200 and body["status"] == "ok"
        assert get_json(base, "/ready") == get_json(base, "/readyz")
        status, load = get_json(base, "/load")
        assert status == 200 and set(load) == {"slots_total", "live", "prefill", "free", "draining",
                                               "tick_ms_p50", "tick_ms_p99", "kv_blocks_total",
                                               "kv_blocks_used", "kv_blocks_free"}
        assert load["kv_blocks_total"] is None  # an engine without a KV block pool (kv_blocks.py)
        assert (load["slots_total"], load["live"], load["prefill"], load["free"], load["draining"]) == (2, 0, 0, 2, False)
        assert 0 <= load["tick_ms_p50"] <= load["tick_ms_p99"]

        async def two_sessions():
            first, second = await upgrade(base, "/api/chat"), await upgrade(base, "/api/chat")
            assert first[0] == second[0] == "admitted"
            readyz = await asyncio.to_thread(get_json, base, "/readyz")
            load = (await asyncio.to_thread(get_json, base, "/load"))[1]
            livez = (await asyncio.to_thread(get_json, base, "/livez"))[0]
            metrics = (await asyncio.to_thread(http, base, "/metrics"))[2]
            third = await upgrade(base, "/v1/realtime")
            for kind, (ws, _) in (first, second):
                await ws.close()
            return readyz, load, livez, metrics, third

        readyz, load, livez, metrics, third = run(two_sessions())
        assert readyz[0] == 503 and (readyz[1]["free"], readyz[1]["total"], readyz[1]["draining"]) == (0, 2, False)
        assert (load["live"], load["prefill"], load["free"]) == (2, 0, 0)
        assert livez == 200  # liveness never depends on load
        for line in ("parley_slots_total 2.0", "parley_sessions_active 2.0", "parley_slots_free 0.0",
                     "parley_draining 0.0", 'parley_admission_rejected_total{reason="full"} 0.0'):
            assert line in metrics, line
        assert third[0] == "refused"
        status, retry_after, body = third[1]
        assert status == 503 and retry_after == "1" and body["reason"] == "full" and body["free"] == 0
        run(wait_for(lambda: get_json(base, "/load")[1]["free"] == 2, 10))
        assert 'parley_admission_rejected_total{reason="full"} 1.0' in http(base, "/metrics")[2]


class _HeldWarmUp(SlackSource):
    """A slack source whose warm-up (on the engine thread, before its first tick) waits for `go`."""

    priority = Priority.IMAGES

    def __init__(self) -> None:
        self.go = threading.Event()

    def offer(self, left_s, costs):
        return None

    def slack_prepare(self, costs) -> None:
        self.go.wait(30)


def test_livez_is_200_while_the_engine_warms_up_and_readyz_waits():
    engine = Engine(DelayBackend(1), EngineConfig())
    warm_up = _HeldWarmUp()
    engine.add_slack_source(warm_up)
    assert not engine.running
    with serve(create_app(Services(engine, web_dir=None))) as base:  # started: the lifespan started the engine thread
        livez, readyz = get_json(base, "/livez"), get_json(base, "/readyz")
        warm_up.go.set()
        run(wait_for(lambda: get_json(base, "/readyz")[0] == 200, 10))
        after = get_json(base, "/livez")
    assert livez == (200, {"status": "ok", "healthy": True, "seconds_since_tick": None})
    assert readyz[0] == 503 and readyz[1]["warmed"] is False
    assert after[0] == 200 and after[1]["seconds_since_tick"] is not None


def test_livez_is_503_while_the_engine_thread_is_not_running():
    engine = Engine(DelayBackend(1), EngineConfig())
    with serve(create_app(Services(engine, web_dir=None, start_engine=False))) as base:
        never_started = get_json(base, "/livez")[0]
        engine.start()
        run(wait_for(lambda: get_json(base, "/readyz")[0] == 200, 10))
        running = get_json(base, "/livez")[0]
        engine.shutdown()
        stopped = get_json(base, "/livez")
    assert (never_started, running) == (503, 200)
    assert stopped[0] == 503 and stopped[1]["status"] == "unhealthy"


def test_ready_min_free_is_honoured():
    app = create_app(Services(Engine(DelayBackend(3), EngineConfig()), ready_min_free=3, web_dir=None))
    with serve(app) as base:
        run(wait_for(lambda: get_json(base, "/load")[1]["tick_ms_p50"] is not None, 10))
        assert get_json(base, "/readyz")[0] == 200

        async def one():
            kind, (ws, _) = await upgrade(base, "/api/chat")
            status = (await asyncio.to_thread(get_json, base, "/readyz"))[0]
            await ws.close()
            return status

        assert run(one()) == 503  # 2 free < 3


@pytest.mark.parametrize("free,clients", [(3, 8)])
def test_simultaneous_upgrades_admit_exactly_the_free_slots(free, clients):
    app, _ = delay_app(free + 1)

    async def scenario(base):
        kind, (holder, _) = await upgrade(base, "/api/chat")  # one slot taken: `free` left
        assert kind == "admitted"
        paths = ["/api/chat" if i % 2 else "/v1/realtime" for i in range(clients)]
        results = await asyncio.gather(*(upgrade(base, p) for p in paths))
        admitted = [r for r in results if r[0] == "admitted"]
        refused = [r for r in results if r[0] == "refused"]
        for _, (ws, _) in admitted:
            await ws.close()
        await holder.close()
        return admitted, refused, results

    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    uvicorn_log = logging.getLogger("uvicorn.error")
    with serve(app) as base:  # (uvicorn's logging setup replaces the logger's handlers at start)
        uvicorn_log.addHandler(handler)
        try:
            admitted, refused, results = run(scenario(base))
        finally:
            uvicorn_log.removeHandler(handler)
    assert not errors, [r.getMessage() for r in errors]  # a routine refusal logs no error
    assert len(admitted) == free, results
    assert len(refused) == clients - free, results
    assert all(r[1][0] == 503 and r[1][2]["reason"] == "full" for r in refused)


def test_slot_lost_after_accept_still_closes_1013_with_an_openai_error_first(monkeypatch):
    app, _ = delay_app(2)
    engine = app.state.sessions.engine

    def full(*args, **kwargs):
        raise EngineFull("all 2 session slots are in use; try again later.")

    monkeypatch.setattr(engine, "open_nowait", full)  # the slot goes between upgrade and admission

    async def scenario(base):
        from websockets.asyncio.client import connect
        async with connect(f"ws://{base}/v1/realtime") as ws:
            err = json.loads(await ws.recv())
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.recv(), 5)
            realtime = (err, ws.close_code)
        chat = await chat_session(base, None)
        return realtime, chat

    with serve(app) as base:
        (err, code), chat = run(scenario(base))
        assert get_json(base, "/load")[1]["free"] == 2  # the reservations were released
    assert err["type"] == "error" and err["error"]["code"] == "session_limit_reached" and code == 1013
    assert chat.handshake_at is None and chat.close_code == 1013


def test_admin_drain_keeps_live_sessions_refuses_new_then_notices_1001_and_exits():
    app, _ = delay_app(4)
    app.state.drainer.timeout_s = 1.5

    async def scenario(base):
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed

        rt = await connect(f"ws://{base}/v1/realtime")
        assert json.loads(await rt.recv())["type"] == "session.created"
        chat_task = asyncio.create_task(chat_session(base, tone(300, 6.0), tail_seconds=0.5))
        await wait_for(lambda: app.state.sessions.live_count == 2, 10)
        status, _, body = await asyncio.to_thread(http, base, "/admin/drain", "POST")
        assert status == 202 and json.loads(body)["started"] is True
        readyz = await asyncio.to_thread(get_json, base, "/readyz")
        livez = (await asyncio.to_thread(get_json, base, "/livez"))[0]
        refused = await upgrade(base, "/api/chat")
        again = json.loads((await asyncio.to_thread(http, base, "/admin/drain", "POST"))[2])
        rt_events = []
        with contextlib.suppress(ConnectionClosed):
            async for msg in rt:
                rt_events.append(json.loads(msg))
        chat = await chat_task
        return readyz, livez, refused, again, rt_events, rt.close_code, chat

    with serve_draining(app) as (base, thread):
        t0 = time.monotonic()
        readyz, livez, refused, again, rt_events, rt_code, chat = run(scenario(base))
        thread.join(15)
        assert not thread.is_alive(), "the server did not exit after the drain"
    assert readyz[0] == 503 and readyz[1]["draining"] is True
    assert livez == 200
    assert refused[0] == "refused" and refused[1][0] == 503 and refused[1][2]["reason"] == "draining"
    assert again["started"] is False
    # the live sessions ran on until the drain timeout, then: notice, 1001
    assert chat.handshake_at is not None and chat.audio_messages > 10
    assert chat.close_code == 1001 and "going away" in chat.close_reason
    assert rt_events[-1]["type"] == "error" and rt_events[-1]["error"]["code"] == "server_shutting_down"
    assert rt_code == 1001
    assert time.monotonic() - t0 < 12


def test_chat_drain_notice_is_an_error_message_before_1001():
    app, _ = delay_app(1)
    app.state.drainer.timeout_s = 0

    async def scenario(base):
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed
        async with connect(f"ws://{base}/api/chat") as ws:
            assert (await ws.recv())[:1] == b"\x00"
            await asyncio.to_thread(http, base, "/admin/drain", "POST")
            messages = []
            with contextlib.suppress(ConnectionClosed):
                async for msg in ws:
                    messages.append(msg)
            return messages, ws.close_code

    with serve_draining(app) as (base, thread):
        messages, code = run(scenario(base))
    assert code == 1001
    assert messages[-1][:1] == b"\x05" and b"going away" in messages[-1]


def test_admin_drain_needs_the_api_key():
    app, _ = delay_app(1, defaults=ServerDefaults(api_key="sekret"))
    with serve_draining(app) as (base, thread):
        assert http(base, "/admin/drain", "POST")[0] == 401
        assert http(base, "/admin/drain", "POST", {"Authorization": "Bearer wrong"})[0] == 401
        assert get_json(base, "/readyz")[1]["draining"] is False
        for path in ("/livez", "/readyz", "/load"):  # probes need no key
            assert http(base, path)[0] in (200, 503) and "API key" not in http(base, path)[2]
        assert http(base, "/admin/drain", "POST", {"Authorization": "Bearer sekret"})[0] == 202
        thread.join(15)
        assert not thread.is_alive()


def test_sigterm_drains_a_real_server_then_it_exits_cleanly(tmp_path, tiny_moshi_dir):
    """`parley serve` as Kubernetes runs it: SIGTERM -> not ready, live session kept for
    --drain-timeout, then the error notice and 1001, then exit 0."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "parley.realtime.cli", "serve", "--model", str(tiny_moshi_dir), "--port", str(port),
           "--max-sessions", "1", "--drain-timeout", "2"]
    base = f"127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ)
        try:
            deadline = time.monotonic() + 90
            while not (_port_open(base) and _status(base, "/readyz") == 200):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)

            async def scenario():
                from websockets.asyncio.client import connect
                from websockets.exceptions import ConnectionClosed
                async with connect(f"ws://{base}/api/chat") as ws:
                    assert (await ws.recv())[:1] == b"\x00"
                    proc.send_signal(signal.SIGTERM)
                    t0 = time.monotonic()
                    await wait_for(lambda: _status(base, "/readyz") == 503, 5)
                    messages, last = 0, b""
                    with contextlib.suppress(ConnectionClosed):
                        async for msg in ws:
                            messages += 1
                            last = msg
                    return messages, last, ws.close_code, time.monotonic() - t0

            messages, last, code, held = run(scenario())
            assert proc.wait(30) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == 1001 and last[:1] == b"\x05" and b"going away" in last
    assert held >= 1.5 and messages > 10  # the session kept being served through the drain window
    text = log.read_text()
    assert "draining (SIGTERM)" in text
    assert f"Uvicorn running on http://{base}" in text  # said by us: uvicorn serves the sockets bound first
    # A clean exit looks clean: no extension reports objects leaked (the frozen models are
    # unfrozen at exit, engine/gc_pauses.py; Triton's nanobind module printed ~45 lines).
    assert "leaked" not in text, text[-3000:]


def _port_open(base: str) -> bool:
    import socket
    host, port = base.split(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def _status(base: str, path: str) -> int:
    return http(base, path)[0]


def test_engine_tick_quantiles_cover_recent_ticks_only():
    from parley.engine.metrics import RECENT_TICKS, EngineMetrics

    metrics = EngineMetrics()
    snap = metrics.snapshot(0, 1, True)
    assert snap["tick_ms_p50"] is None and snap["tick_ms_p99"] is None and snap["seconds_since_tick"] is None
    for ms in range(1, 101):
        metrics.observe_tick(ms / 1000)
    snap = metrics.snapshot(0, 1, True)
    assert (snap["tick_ms_p50"], snap["tick_ms_p99"]) == (pytest.approx(51.0), pytest.approx(100.0))
    assert 0 <= snap["seconds_since_tick"] < 5
    for _ in range(RECENT_TICKS):  # the old ticks leave the window
        metrics.observe_tick(0.2)
    snap = metrics.snapshot(0, 1, True)
    assert snap["tick_ms_p50"] == snap["tick_ms_p99"] == pytest.approx(200.0)
