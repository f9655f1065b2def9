"""/api/chat over a real uvicorn server on 127.0.0.1, with a sphn-based client.

Most tests use the engine's fabricated echo backend (`DelayBackend`: output frame t is
input frame t - 1, exact), so audio identity survives only the two Opus round trips and
can be checked by correlation. The tiny checkpoints run the real model path.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import urllib.request

import numpy as np
import pytest

from parley.engine import Engine
from delay_backend import DelayBackend
from parley.realtime.server.app import ServerInfo, create_app
from parley.realtime.server.services import Services
from server_harness import FRAME, SR, best_lag_correlation, chat_session, delay_app, serve, tone, wait_for

pytestmark = pytest.mark.timeout(60)

MAX_LAG = 6 * FRAME  # the 1-frame echo delay + codec delays + prebuffer slack


def run(coro):
    return asyncio.run(coro)


def test_handshake_then_echo_matches_input():
    app, backend = delay_app(2)
    sent = tone(440, 2.0)
    with serve(app) as base:
        res = run(chat_session(base, sent))
    assert res.handshake_at is not None
    assert res.audio_messages >= 20
    corr, lag = best_lag_correlation(sent, res.pcm, MAX_LAG)
    assert corr > 0.9, (corr, lag)
    assert res.text and res.text[0].startswith("<")  # the backend's text pieces arrive
    assert backend.prefills and backend.prefills[0][1].persona == ""


def test_query_parameters_become_session_options():
    app, backend = delay_app(1)
    query = ("text_prompt=You%20are%20Ada%2C%20a%20pirate.&voice_prompt=NATF2.pt&text_temperature=0.5"
             "&text_topk=30&audio_temperature=0.6&audio_topk=100&pad_mult=0&text_seed=1&audio_seed=2"
             "&repetition_penalty_context=64&repetition_penalty=1.0")
    with serve(app) as base:
        run(chat_session(base, tone(300, 0.4), query=query, tail_seconds=0.2))
    options = backend.prefills[0][1]
    assert options.persona == "You are Ada, a pirate."
    assert options.voice == "NATF2.pt"
    s = backend.sampling[0]
    assert (s.text_temperature, s.text_top_k, s.audio_temperature, s.audio_top_k) == (0.5, 30, 0.6, 100)


def test_bad_query_parameter_closes_with_policy_error():
    app, _ = delay_app(1)
    with serve(app) as base:
        res = run(chat_session(base, None, query="text_topk=abc"))
    assert res.handshake_at is None
    assert res.close_code == 1008 and "text_topk" in res.close_reason


def test_rejected_voice_closes_that_connection():
    app, _ = delay_app(1)
    with serve(app) as base:
        res = run(chat_session(base, None, query="voice_prompt=unknown"))
    assert res.handshake_at is None
    assert res.close_code == 1008 and "unknown" in res.close_reason


@pytest.mark.parametrize("frame_samples", [480, 960, 1920], ids=["20ms", "40ms", "80ms"])
def test_any_page_size_is_reframed(frame_samples):
    app, _ = delay_app(1)
    sent = tone(523, 1.6)
    with serve(app) as base:
        res = run(chat_session(base, sent, frame_samples=frame_samples, prebuffer_frames=6))
    corr, _ = best_lag_correlation(sent, res.pcm, MAX_LAG)
    assert corr > 0.85, corr


def test_health_ready_metrics():
    app, _ = delay_app(1)
    with serve(app) as base:
        def get(path):
            try:
                with urllib.request.urlopen(f"http://{base}{path}", timeout=5) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        assert get("/health")[0] == 200
        assert get("/ready")[0] == 200

        async def hold():
            async def check_full(ws):
                status, body = await asyncio.to_thread(get, "/ready")
                assert status == 503 and '"free_slots":0' in body.replace(" ", "")
            await chat_session(base, tone(200, 0.5), on_open=check_full, tail_seconds=0.1)

        run(hold())
        status, text = get("/metrics")
        assert status == 200
        for name in ("parley_engine_ticks_total", "parley_live_sessions", "parley_bytes_in_total",
                     "parley_bytes_out_total", "parley_frame_send_delay_seconds_bucket",
                     "parley_engine_tick_seconds_bucket", "parley_connections_total",
                     "parley_frame_delay_seconds_bucket", "parley_codec_worker_cpu_seconds"):
            assert name in text, name
        assert "sess" not in text.lower().replace("sessions", "")  # no session ids as labels
        # the session's admission ran as a slack item after a tick
        assert float(re.search(r"^parley_engine_slack_items_total (\S+)$", text, re.M).group(1)) >= 1
        assert "parley_engine_slack_past_boundary_total" in text
        # every frame sent was timed from the end of its engine tick
        delay_count = float(re.search(r"^parley_frame_delay_seconds_count (\S+)$", text, re.M).group(1))
        frames = float(re.search(r'^parley_frames_out_total\{protocol="moshi"\} (\S+)$', text, re.M).group(1))
        assert delay_count == frames > 0
        delay_sum = float(re.search(r"^parley_frame_delay_seconds_sum (\S+)$", text, re.M).group(1))
        assert 0 < delay_sum / delay_count < 0.5


def test_eight_sessions_get_their_own_audio_ninth_refused_then_new_persona_admitted():
    app, backend = delay_app(8)
    freqs = [300 + 110 * i for i in range(8)]
    sents = [tone(f, 2.0) for f in freqs]

    async def scenario(base):
        opened = asyncio.Event()
        handshakes = 0

        async def on_open(_ws):
            nonlocal handshakes
            handshakes += 1
            if handshakes == 8:
                opened.set()

        tasks = [asyncio.create_task(chat_session(base, s, query=f"text_prompt=persona{i}", on_open=on_open))
                 for i, s in enumerate(sents)]
        await asyncio.wait_for(opened.wait(), 15)
        from websockets.exceptions import InvalidStatus
        try:
            await chat_session(base, tone(200, 0.3))
            ninth = None
        except InvalidStatus as exc:  # refused at the upgrade, so a proxy can retry elsewhere
            ninth = exc.response
        results = await asyncio.gather(*tasks)
        late = await chat_session(base, tone(250, 0.8), query="text_prompt=Another%20persona")
        return results, ninth, late

    with serve(app) as base:
        results, ninth, late = run(scenario(base))
    assert ninth is not None and ninth.status_code == 503 and ninth.headers["Retry-After"] == "1"
    assert b"full" in ninth.body
    for i, res in enumerate(results):
        own, _ = best_lag_correlation(sents[i], res.pcm, MAX_LAG)
        assert own > 0.85, (i, own)
        for j in (i - 1, (i + 1) % 8):  # neighbours in frequency: the most similar other audio
            other, _ = best_lag_correlation(sents[j], res.pcm, MAX_LAG)
            assert other < 0.3, (i, j, other)
    assert late.handshake_at is not None and late.audio_messages > 0
    assert backend.prefills[-1][1].persona == "Another persona"


async def _bad_client(base: str, payloads: list[bytes | str], *, abort: bool = False,
                      then_audio: np.ndarray | None = None) -> dict:
    """Send `payloads` after the handshake; report how the server closed (or echoed audio after)."""
    import sphn
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    out = {"close_code": None, "reason": "", "audio": 0}
    async with connect(f"ws://{base}/api/chat", max_size=None, compression=None) as ws:
        assert (await asyncio.wait_for(ws.recv(), 10))[:1] == b"\x00"
        for p in payloads:
            await ws.send(p)
        if abort:  # drop the TCP connection mid-page, no close frame
            ws.transport.abort()
            return out
        if then_audio is not None:
            writer = sphn.OpusStreamWriter(SR)
            for i in range(then_audio.size // FRAME):
                await ws.send(b"\x01" + bytes(writer.append_pcm(then_audio[i * FRAME:(i + 1) * FRAME])))
                await asyncio.sleep(0.08)
        try:
            while True:
                msg = await asyncio.wait_for(ws.recv(), 3)
                if isinstance(msg, bytes) and msg[:1] == b"\x01":
                    out["audio"] += 1
                    if then_audio is not None and out["audio"] >= 5:
                        break
        except ConnectionClosed:
            pass
        except asyncio.TimeoutError:
            pass
        out["close_code"], out["reason"] = ws.close_code, ws.close_reason or ""
    return out


def _vorbis_bytes() -> bytes:
    import io

    import soundfile
    buf = io.BytesIO()
    soundfile.write(buf, tone(300, 0.5), SR, format="OGG", subtype="VORBIS")
    return buf.getvalue()


def test_bad_input_closes_only_that_connection_and_others_keep_cadence():
    import sphn

    app, _ = delay_app(7)
    good_audio = [tone(350, 3.0), tone(700, 3.0)]
    half_page = bytes(sphn.OpusStreamWriter(SR).append_pcm(tone(300, 0.08)))[:120]

    async def scenario(base):
        good = [asyncio.create_task(chat_session(base, a, tail_seconds=0.4)) for a in good_audio]
        await asyncio.sleep(0.8)  # both are streaming now
        bad = await asyncio.gather(
            _bad_client(base, [b"\x01" + b"this is not ogg at all" * 4]),
            _bad_client(base, [b"\x01" + _vorbis_bytes()]),
            _bad_client(base, [b"\x01" + bytes(300 * 1024)]),
            _bad_client(base, [b"\x07junk", b"\x03", b"\x06ping", b"", "a text frame"], then_audio=tone(400, 0.8)),
            _bad_client(base, [b"\x01" + half_page], abort=True),
        )
        results = await asyncio.gather(*good)
        await asyncio.sleep(0.3)
        ready = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://{base}/ready").read().decode())
        return bad, results, ready

    with serve(app) as base:
        bad, results, ready = run(scenario(base))
    garbage, vorbis, oversized, unknown_tags, aborted = bad
    assert garbage["close_code"] == 1007 and "Ogg" in garbage["reason"], garbage
    assert vorbis["close_code"] == 1007, vorbis
    assert oversized["close_code"] == 1009, oversized
    assert unknown_tags["audio"] >= 5, unknown_tags  # ignored tags: the connection works on
    for sent, res in zip(good_audio, results):
        corr, _ = best_lag_correlation(sent, res.pcm, MAX_LAG)
        assert corr > 0.85, corr
        gaps = np.diff(res.arrivals)
        assert gaps.max() < 0.4, gaps.max()  # cadence kept: no stall while the others misbehaved
        assert res.audio_messages >= sent.size // FRAME - 1, res.audio_messages  # nothing lost
    assert '"free_slots":7' in ready.replace(" ", ""), ready  # every slot back, the aborted one too


# ---- codec worker processes ---------------------------------------------------------------


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_codec_worker_crash_fails_only_its_sessions_and_is_restarted():
    """Two sessions pinned to two worker processes; SIGKILL one worker: its session closes 1011
    saying so, the other goes on losing nothing, the worker is restarted and a new session
    works. Leaving the server stops every worker (no orphans)."""
    app, _ = delay_app(4)  # codec_workers=2: two processes
    pool = app.state.codec
    manager = app.state.sessions
    sents = [tone(330, 3.0), tone(660, 3.0)]

    async def scenario(base):
        opened = [asyncio.Event(), asyncio.Event()]

        def on_open(i):
            async def mark(_ws):
                opened[i].set()
            return mark

        first = asyncio.create_task(chat_session(base, sents[0], on_open=on_open(0)))
        await asyncio.wait_for(opened[0].wait(), 10)
        second = asyncio.create_task(chat_session(base, sents[1], on_open=on_open(1)))
        await asyncio.wait_for(opened[1].wait(), 10)
        await asyncio.sleep(0.5)
        edges = sorted(manager._live, key=lambda e: e.number)
        victim_pid, other_pid = edges[0].codec.worker_pid, edges[1].codec.worker_pid
        assert victim_pid != other_pid  # pinned to different workers
        os.kill(victim_pid, signal.SIGKILL)
        crashed, survived = await asyncio.gather(first, second)
        await wait_for(lambda: pool.restarts == 1, timeout=15)
        late = await chat_session(base, tone(440, 0.8))
        return crashed, survived, late, victim_pid

    with serve(app) as base:
        crashed, survived, late, victim_pid = run(scenario(base))
        pids = pool.worker_pids()
        assert len(pids) == 2 and victim_pid not in pids
        text = urllib.request.urlopen(f"http://{base}/metrics", timeout=5).read().decode()
        assert "parley_codec_worker_restarts_total 1.0" in text
    assert crashed.close_code == 1011 and "codec worker" in crashed.close_reason, crashed.close_reason
    corr, _ = best_lag_correlation(sents[1], survived.pcm, MAX_LAG)
    assert corr > 0.85, corr
    assert survived.audio_messages >= sents[1].size // FRAME - 1
    assert late.handshake_at is not None and late.audio_messages > 0
    for pid in pids:  # clean shutdown: the workers exited with the server
        assert _pid_gone(pid), pid


def test_codec_workers_zero_runs_in_process_threads():
    backend = DelayBackend(1)
    app = create_app(Services(Engine(backend), info=ServerInfo(model="delay"), codec_workers=0))
    assert app.state.codec.worker_pids() == []
    sent = tone(440, 1.2)
    with serve(app) as base:
        res = run(chat_session(base, sent))
    corr, _ = best_lag_correlation(sent, res.pcm, MAX_LAG)
    assert corr > 0.9, corr
