"""`parley launch` end to end: 3 real CPU workers of the tiny model (2 slots each) behind a real
HAProxy on loopback. Placement, retry of a full worker's 503, refusal when all are full,
drain, a killed worker, and both protocols through the proxy.

The workers run with `--ready-min-free 0` (a full worker stays in HAProxy's rotation), so the
session that HAProxy sends to a full worker must be saved by the 503 retry alone; draining and
dead workers leave the rotation through /readyz as usual.

Needs the `haproxy` binary (tests/run.sh installs Debian's package); skipped without it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from parley.realtime.cli import main
from parley.realtime.server.launch import LaunchError, LaunchPlan, haproxy_config, parse_gpus, plan_workers
from server_harness import chat_session, free_port, tone

ROOT = Path(__file__).resolve().parents[1]
HAPROXY = shutil.which("haproxy")
SLOTS = 2
WORKERS = 3


def http(url: str, method: str = "GET") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


class Launch:
    def __init__(self, tmp: Path, model: Path) -> None:
        self.port = free_port()
        self.base = free_port()
        while any(p == self.port for p in range(self.base, self.base + WORKERS)):
            self.base = free_port()
        self.log = tmp / "launch.log"
        cmd = [sys.executable, "-m", "parley.realtime.cli", "launch", "--workers", str(WORKERS), "--device", "cpu",
               "--port", str(self.port), "--base-port", str(self.base), "--check-interval-ms", "300",
               "--run-dir", str(tmp / "run"), "--",
               "--model", str(model), "--max-sessions", str(SLOTS), "--ready-min-free", "0",
               "--drain-timeout", "8", "--log-level", "warning",
               "--served-model-name", "duplex=gpt-realtime"]  # the name the SDK session below sends
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT)

    @property
    def public(self) -> str:
        return f"127.0.0.1:{self.port}"

    def worker(self, i: int) -> str:
        return f"127.0.0.1:{self.base + i}"

    def load(self, i: int) -> dict:
        status, body = http(f"http://{self.worker(i)}/load")
        return json.loads(body) if status == 200 else {}

    def taken(self) -> list[int]:
        return [self.load(i).get("live", -1) + self.load(i).get("prefill", 0) for i in range(WORKERS)]

    def pids(self, i: int) -> list[int]:
        return [int(p) for p in re.findall(rf"worker {i} started on \S+ \(pid (\d+)\)", self.log.read_text())]

    def wait_all_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not all(http(f"http://{self.worker(i)}/readyz")[0] == 200 for i in range(WORKERS)) \
                or http(f"http://{self.public}/readyz")[0] != 200:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "workers not ready:\n" + self.log.read_text()[-3000:]
            time.sleep(0.3)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.out.close()


class Holder:
    """A WebSocket session held open, counting the messages the server sends."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.messages = 0
        self.last: object = None
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed
        try:
            async for msg in self.ws:
                self.messages += 1
                self.last = msg
        except ConnectionClosed:
            pass

    @property
    def code(self) -> int | None:
        return self.ws.close_code if self.task.done() else None

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.wait_for(self.task, 10)


async def hold(base: str, path: str = "/api/chat") -> Holder | tuple[int, str | None]:
    """A held session, or (HTTP status, Retry-After) when the upgrade is refused."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus
    try:
        ws = await connect(f"ws://{base}{path}", open_timeout=20, max_size=None)
    except InvalidStatus as exc:
        return exc.response.status_code, exc.response.headers.get("Retry-After")
    first = await asyncio.wait_for(ws.recv(), 20)  # handshake byte / session.created
    assert first[:1] == b"\x00" or json.loads(first)["type"] == "session.created", first
    holder = Holder(ws)
    return holder


async def until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, f"{what} not met in {timeout} s"
        await asyncio.sleep(0.1)


async def grows(holders: list[Holder], seconds: float = 2.0) -> bool:
    """Every holder received more messages over `seconds` (its session is alive and served)."""
    before = [h.messages for h in holders]
    await asyncio.sleep(seconds)
    return all(h.messages > b and h.code is None for h, b in zip(holders, before))


@pytest.mark.skipif(HAPROXY is None, reason="haproxy binary not installed (tests/run.sh installs it)")
def test_launch_three_workers_behind_haproxy(tmp_path, tiny_moshi_dir):
    launch = Launch(tmp_path, tiny_moshi_dir)
    try:
        launch.wait_all_ready()
        time.sleep(1.0)  # a few health-check rounds: HAProxy has every worker in rotation
        asyncio.run(_scenario(launch))
    finally:
        code = launch.stop()
    assert code == 0, launch.log.read_text()[-3000:]
    for i in range(WORKERS):  # every worker process is gone
        for pid in launch.pids(i):
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


async def _scenario(launch: Launch) -> None:
    openai = pytest.importorskip("openai")
    pub = launch.public

    # 1. Least-loaded first: three sessions, one after the other, land one per worker.
    first = [await hold(pub) for _ in range(WORKERS)]
    await until(lambda: launch.taken() == [1, 1, 1], what="one session per worker")
    for h in first:
        await h.close()
    await until(lambda: launch.taken() == [0, 0, 0], what="all slots free again")

    # 2. A full worker's 503 is retried on a free one: worker 0 is filled behind HAProxy's back,
    #    so HAProxy still sees it as least loaded; every proxied session must land elsewhere.
    direct = [await hold(launch.worker(0)) for _ in range(SLOTS)]
    proxied = [await hold(pub) for _ in range(2 * SLOTS)]
    assert all(isinstance(h, Holder) for h in proxied), proxied
    await until(lambda: launch.taken() == [SLOTS] * WORKERS, what="every worker full")
    metrics0 = http(f"http://{launch.worker(0)}/metrics")[1]
    refused0 = float(re.search(r'parley_admission_rejected_total\{reason="full"\} (\S+)', metrics0).group(1))
    assert refused0 >= 1  # HAProxy did try the full worker, and the session went on elsewhere

    # 3. All full: a clean refusal the client can retry.
    status, retry_after = await hold(pub)
    assert status == 503 and retry_after == "1"

    # 4. Drain worker 1: its sessions live on, new ones land elsewhere, then it exits (and is restarted).
    on_w1 = launch.load(1)["live"]
    pid1 = launch.pids(1)[-1]
    assert http(f"http://{launch.worker(1)}/admin/drain", "POST")[0] == 202
    assert http(f"http://{pub}/admin/drain", "POST")[0] == 403  # never through the public port
    assert await grows(direct + proxied)  # nobody was cut by the drain
    await direct[0].close()  # one slot free on worker 0 (and none on worker 1, which drains)
    await until(lambda: launch.load(0).get("free") == 1, what="a slot free on worker 0")
    late = await hold(pub)
    assert isinstance(late, Holder), late
    assert launch.load(0)["live"] == SLOTS  # the only free slot, not the draining worker's
    await until(lambda: sum(h.code is not None for h in proxied) == on_w1, 20, "worker 1's sessions closed")
    assert [h.code for h in proxied if h.code is not None] == [1001] * on_w1  # notice, then going away
    assert all(h.last[:1] == b"\x05" and b"going away" in h.last for h in proxied if h.code is not None)
    await until(lambda: len(launch.pids(1)) > 1, 30, "worker 1 exited and was restarted")
    assert f"worker 1 (port {launch.base + 1}) exited with 0" in launch.log.read_text()
    assert launch.pids(1)[-1] != pid1

    # 5. Kill worker 2: only its sessions end.
    alive = [h for h in [*direct, *proxied, late] if h.code is None]
    on_w2 = launch.load(2)["live"]
    os.kill(launch.pids(2)[-1], signal.SIGKILL)
    await until(lambda: sum(h.code is not None for h in alive) == on_w2, 10, "worker 2's sessions closed")
    survivors = [h for h in alive if h.code is None]
    assert survivors and await grows(survivors)
    assert all(h.code == 1006 for h in alive if h.code is not None)  # connection lost, no close frame
    await until(lambda: len(launch.pids(2)) > 1, 30, "worker 2 restarted")
    for h in survivors:
        await h.close()

    # 6. Both protocols, the page and the REST endpoints through the one public port.
    await until(lambda: http(f"http://{pub}/readyz")[0] == 200 and launch.taken() == [0, 0, 0], 60,
                "the restarted workers ready")
    assert http(f"http://{pub}/api/info")[0] == 200 and http(f"http://{pub}/")[0] == 200
    chat = await chat_session(pub, tone(300, 1.0), tail_seconds=0.3)
    assert chat.handshake_at is not None and chat.audio_messages > 0
    client = openai.AsyncOpenAI(api_key="sk-test", base_url=f"http://{pub}/v1", websocket_base_url=f"ws://{pub}/v1")
    async with client.realtime.connect(model="gpt-realtime") as conn:
        event = json.loads(await asyncio.wait_for(conn.recv_bytes(), 20))
        assert event["type"] == "session.created"
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
        deadline = time.monotonic() + 20
        while json.loads(await asyncio.wait_for(conn.recv_bytes(), 20))["type"] != "session.updated":
            assert time.monotonic() < deadline


# ---- the generated configuration and the flags, without processes ----------------------------


def test_haproxy_config_is_valid_and_has_the_placement_rules(tmp_path):
    plan = LaunchPlan(workers=plan_workers("0-2,5", None, None, 9100), port=8998, tunnel_timeout_s=7200)
    text = haproxy_config(plan)
    for line in ("balance leastconn", "retry-on conn-failure empty-response 503", "option redispatch 1",
                 "option httpchk GET /readyz", "http-check expect status 200", "timeout tunnel 7200s",
                 "bind 127.0.0.1:8998", "server w3 127.0.0.1:9103 check",
                 "http-request deny deny_status 403 if { path_beg /admin/ }"):
        assert line in text, line
    assert [w.gpu for w in plan.workers] == ["0", "1", "2", "5"]
    if HAPROXY is not None:
        cfg = tmp_path / "h.cfg"
        cfg.write_text(text)
        check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("args,message", [
    (["--workers", "2", "--", "--port", "1"], "--port is set by parley launch"),
    (["--workers", "2", "--", "--device=cuda"], "--device is set by parley launch"),
    (["--gpus", "0-1", "--workers", "2"], "either --gpus"),
    (["--workers", "2", "--device", "cuda"], "placed with --gpus"),
    (["--gpus", "1,1"], "names a GPU twice"),
    (["--gpus", "a"], "not a GPU index"),
    (["--workers", "2", "--port", "9001", "--base-port", "9000"], "collides"),
    (["--workers", "1", "--haproxy", "/nonexistent/haproxy"], "no haproxy binary"),
])
def test_launch_refuses_bad_flags(args, message, capsys):
    assert main(["launch", *args]) == 2  # refused before any process starts
    err = capsys.readouterr().err
    assert message in err, err


def test_parse_gpus():
    assert parse_gpus("0-3,6") == ["0", "1", "2", "3", "6"]
    with pytest.raises(LaunchError):
        parse_gpus("3-1")
