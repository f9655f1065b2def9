"""WebRTC calls in worker processes (realtime/webrtc/pool.py, webrtc/worker.py, webrtc/transport.py):

- a worker killed mid-call ends its own call only; a call on the other worker goes on hearing its
  echo, the pool replaces the dead worker, and a new call is served;
- a call no worker can take (none could start) is a 503 before any media, its slot freed;
- `--webrtc-workers`: honoured, its default, and bad values refused by name;
- the queues are bounded at both ends: peer audio and events on the server's side (drop-oldest
  counted; a peer that outruns the event queue ends its call), the model's audio on the worker's
  track (the lag bound), and the wire toward a process that stopped reading;
- the outgoing track keeps a fixed 20 ms grid of its clock (a fake one here), restarting the grid
  after a stall rather than bursting;
- an edge worker's calls (webrtc/local.py): their peers on the app's own loop, no worker process;
  a call whose peer fails or hangs while answering ends alone (503) and the other call goes on.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys

import httpx2 as httpx
import numpy as np
import openai
import pytest

from parley.realtime.webrtc import wire
from parley.realtime.webrtc.transport import CallUnavailable, WebRTCCall
from server_harness import delay_app, serve, webrtc_worker_pids
from test_webrtc import ECHO_SETTINGS, Client, run, wait_live


async def _call(sdk: openai.AsyncOpenAI) -> Client:
    client = Client()
    answer = await sdk.realtime.calls.create(sdp=await client.offer(), session=ECHO_SETTINGS)
    await client.answer(answer.text)
    await client.wait(lambda: "session.created" in client.types(), "session.created")
    return client


def test_a_killed_worker_ends_only_its_call_and_is_replaced():
    app, _ = delay_app(3, webrtc_workers=2)
    pool = app.state.webrtc
    with serve(app) as base:
        async def scenario():
            sdk = openai.AsyncOpenAI(api_key="x", base_url=f"http://{base}/v1")
            doomed = await _call(sdk)
            doomed_pid = next(pid for pid, n in pool.calls().items() if n == 1)
            steady = await _call(sdk)  # pinned to the least-loaded worker: the other one
            assert sorted(pool.calls().values()) == [1, 1]
            assert sorted(webrtc_worker_pids(os.getpid())) == sorted(pool.worker_pids())  # (what the edge tests count)
            await steady.wait(steady.heard_tone, "the steady call hearing its echo")
            os.kill(doomed_pid, signal.SIGKILL)
            await wait_live(base, 1)  # the killed worker's call ended; its slot is free
            steady.audio.clear()
            await steady.wait(steady.heard_tone, "the other worker's call still hearing its echo")
            await steady.wait(lambda: len(pool.worker_pids()) == 2 and doomed_pid not in pool.worker_pids(),
                              "a replacement worker")
            late = await _call(sdk)  # the pool serves new calls after the restart
            await late.wait(late.heard_tone, "a new call after the restart hearing its echo")
            metrics = httpx.get(f"http://{base}/metrics").text
            assert re.search(r"^parley_webrtc_worker_restarts_total 1\.0$", metrics, re.M)
            assert float(re.search(r"^parley_webrtc_worker_cpu_seconds (\S+)$", metrics, re.M).group(1)) > 0
            assert re.search(r"^parley_webrtc_silent_packets_total \d+\.0$", metrics, re.M)  # (the calls' underruns)
            for client in (doomed, steady, late):
                await client.close()
            await sdk.close()
            await wait_live(base, 0)

        run(scenario())


def test_a_call_no_worker_can_take_is_refused_with_503_and_frees_its_slot():
    app, _ = delay_app(2)
    app.state.webrtc.argv = [sys.executable, "-c", "raise SystemExit(3)"]  # a worker that cannot start
    with serve(app) as base:
        async def scenario():
            client = Client()
            async with httpx.AsyncClient() as http:
                reply = await http.post(f"http://{base}/v1/realtime/calls", content=await client.offer(),
                                        headers={"Content-Type": "application/sdp"})
                assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
                assert reply.json()["error"]["code"] == "server_unavailable"
                assert "WebRTC" in reply.json()["error"]["message"]
            await client.close()
            await wait_live(base, 0)

        run(scenario())


def test_the_webrtc_workers_flag_is_honoured_and_bad_values_are_refused(monkeypatch):
    from parley.realtime.webrtc import pool as webrtc_pool
    from parley.realtime.cli import _serve_config, build_parser, serve_flag_error

    parser = build_parser()
    args = parser.parse_args(["serve", "--webrtc-workers", "3"])
    assert serve_flag_error(args) is None
    assert _serve_config(args, None, {}, None, {}).webrtc_workers == 3
    for bad in ("0", "-2"):
        wrong = serve_flag_error(parser.parse_args(["serve", "--webrtc-workers", bad]))
        assert wrong == f"--webrtc-workers must be at least 1 (got {bad}); WebRTC calls always run in workers"
    with pytest.raises(ValueError, match="at least 1"):
        webrtc_pool.WebRTCPool(0)
    monkeypatch.setattr(webrtc_pool, "usable_cpus", lambda: 16)
    assert [webrtc_pool.default_workers(n) for n in (1, 6, 7, 64, 1000)] == [1, 1, 2, 11, 15]
    monkeypatch.setattr(webrtc_pool, "usable_cpus", lambda: 2)
    assert webrtc_pool.default_workers(64) == 1
    app, _ = delay_app(2, webrtc_workers=3)
    assert app.state.webrtc.workers == 3 and app.state.webrtc.worker_pids() == []  # none until a call
    # in one process the peers never run on the loop whose GIL the engine thread shares: refused by name
    from parley.engine import Engine
    from delay_backend import DelayBackend
    from parley.realtime.server.app import create_app
    from parley.realtime.server.services import Services
    with pytest.raises(ValueError, match="webrtc_workers must be at least 1"):
        create_app(Services(Engine(DelayBackend(1)), codec_workers=0, webrtc_workers=0))


# ---- an edge worker's calls: the peers on its own loop (webrtc/local.py) ----

def test_an_edge_workers_calls_run_here_and_a_failing_one_ends_alone(monkeypatch):
    from parley.realtime.webrtc import transport
    from parley.realtime.webrtc.local import LocalPeers
    from parley.realtime.webrtc.peer import Peer

    app, _ = delay_app(3, webrtc_workers=0)
    peers = app.state.webrtc
    assert isinstance(peers, LocalPeers)
    answer = Peer.answer
    failing: list[str] = []  # what the next offers' answering does: "raise", or "hang"

    async def faulty_answer(self, offer: str) -> str:
        if failing:
            if failing.pop(0) == "raise":
                raise RuntimeError("aiortc failed under this call")
            await asyncio.Event().wait()  # never answers
        return await answer(self, offer)

    monkeypatch.setattr(Peer, "answer", faulty_answer)
    monkeypatch.setattr(transport, "ANSWER_TIMEOUT_S", 0.5)
    with serve(app) as base:
        async def scenario():
            sdk = openai.AsyncOpenAI(api_key="x", base_url=f"http://{base}/v1")
            steady = await _call(sdk)
            await steady.wait(steady.heard_tone, "the steady call hearing its echo")
            assert peers.peers() == 1 and webrtc_worker_pids(os.getpid()) == []  # its peer runs here
            async with httpx.AsyncClient() as http:
                for fault, said in (("raise", "ended before it answered"), ("hang", "did not answer within 0.5 s")):
                    failing.append(fault)
                    caller = Client()
                    reply = await http.post(f"http://{base}/v1/realtime/calls", content=await caller.offer(),
                                            headers={"Content-Type": "application/sdp"})
                    assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_unavailable"
                    assert said in reply.json()["error"]["message"], reply.text
                    await caller.close()
            await wait_live(base, 1)  # the failed calls' slots are free
            await steady.wait(lambda: peers.peers() == 1, "the failed calls' peers closed")
            steady.audio.clear()
            await steady.wait(steady.heard_tone, "the steady call still hearing its echo")
            metrics = httpx.get(f"http://{base}/metrics").text
            assert re.search(r"^parley_webrtc_silent_packets_total \d+\.0$", metrics, re.M)
            assert "parley_webrtc_worker_cpu_seconds" not in metrics  # there are none
            await steady.close()
            await sdk.close()
            await wait_live(base, 0)
            await steady.wait(lambda: peers.peers() == 0, "the hung-up call's peer closed")

        run(scenario())
    assert webrtc_worker_pids(os.getpid()) == []


# ---- bounded queues, without processes: a call over a fake pool and link ----

class FakeLink:
    def __init__(self) -> None:
        self.sent: list[tuple[int, int, bytes]] = []
        self.backlog = 0

    def send(self, op: int, call: int, payload: bytes = b"") -> None:
        self.sent.append((op, call, payload))

    def queued(self) -> int:
        return self.backlog


class FakeWorker:
    index, pid = 0, 4242

    def __init__(self) -> None:
        self.link = FakeLink()


class FakePool:
    def __init__(self) -> None:
        self.worker = FakeWorker()
        self.unpinned: list[WebRTCCall] = []
        self.lost: list[str] = []
        self.silent: list[int] = []

    async def pin(self, call: WebRTCCall) -> FakeWorker:
        call.id = 7
        return self.worker

    def unpin(self, call: WebRTCCall) -> None:
        self.unpinned.append(call)

    def stuck(self, call: WebRTCCall, what: str) -> None:
        self.lost.append(what)

    def count_silent(self, packets: int) -> None:
        self.silent.append(packets)


async def _answered_call(pool: FakePool) -> WebRTCCall:
    call = WebRTCCall({}, pool, max_lag_s=1.0)
    answering = asyncio.create_task(call.answer("v=0\r\n"))
    await asyncio.sleep(0)
    call.deliver(wire.ANSWER, b"v=0 answer")
    assert await answering == "v=0 answer"
    assert pool.worker.link.sent[0][:2] == (wire.OFFER, 7)
    return call


def test_the_servers_queues_are_bounded_and_an_outrunning_peer_ends_its_call():
    async def scenario():
        pool = FakePool()
        call = await _answered_call(pool)
        chunk = np.zeros(480, np.float32).tobytes()
        for _ in range(wire.MAX_INPUT_CHUNKS + 30):  # the connection reads none of it
            call.deliver(wire.AUDIO, chunk)
        assert call.media._chunks.qsize() == wire.MAX_INPUT_CHUNKS and call.media.dropped_chunks == 30
        call.deliver(wire.DROPPED_OP, wire.DROPPED.pack(5, 2, 4))  # the worker's own drops, reported
        assert call.media.dropped_chunks == 35 and pool.silent == [4]  # silent packets: to the pool's counter
        assert call.play(np.zeros(1920, np.float32)) == 2  # its track's lag drops, told by the next play
        assert call.play(np.zeros(1920, np.float32)) == 0
        call.deliver(wire.BACKLOG_OP, wire.BACKLOG.pack(12345))
        assert call.backlog() == 12345  # as last reported: no round trip
        pool.worker.link.backlog = wire.SOFT_OUTBOX_BYTES + 1  # the worker is not reading
        sent = len(pool.worker.link.sent)
        assert call.play(np.zeros(3 * 1920, np.float32)) == 3  # dropped here, counted, nothing framed
        assert len(pool.worker.link.sent) == sent
        pool.worker.link.backlog = wire.HARD_OUTBOX_BYTES
        with pytest.raises(ConnectionError):
            await call.send_text("{}")
        assert pool.lost and "stopped reading" in pool.lost[0]
        pool.worker.link.backlog = 0
        for i in range(wire.MAX_QUEUED_MESSAGES + 1):
            call.deliver(wire.TEXT, b'{"type": "x"}')
        assert call.overflowed and not call.open
        assert pool.worker.link.sent[-1][:2] == (wire.CLOSE, 7)  # the worker is told to hang up
        assert pool.unpinned == [call]
        received = 0
        while await call.receive() is not None:
            received += 1
        assert received == wire.MAX_QUEUED_MESSAGES  # what was queued is still read, then None

    asyncio.run(scenario())


def test_a_lost_worker_ends_its_calls_and_fails_an_offer_in_flight():
    async def scenario():
        pool = FakePool()
        live = await _answered_call(pool)
        pending = WebRTCCall({}, pool)
        answering = asyncio.create_task(pending.answer("v=0\r\n"))
        await asyncio.sleep(0)
        for call in (live, pending):
            call.lost("webrtc worker 0 (pid 4242) exited")
        with pytest.raises(CallUnavailable, match="exited"):
            await answering
        assert await live.receive() is None and await live.media.read() is None
        with pytest.raises(ConnectionError):
            await live.send_text("{}")

    asyncio.run(scenario())


def test_the_wire_reassembles_split_frames_and_refuses_an_oversized_one():
    async def scenario():
        got, lost = [], []
        link = wire.FrameProtocol(lambda op, call, payload: got.append((op, call, payload)), lost.append)
        data = wire.frame(wire.AUDIO, 3, b"abc") + wire.frame(wire.READY, 4) + wire.frame(wire.TEXT, 3, b"{}")
        for i in range(0, len(data), 5):
            link.data_received(data[i:i + 5])
        assert got == [(wire.AUDIO, 3, b"abc"), (wire.READY, 4, b""), (wire.TEXT, 3, b"{}")]
        link.data_received(wire.HEADER.pack(wire.BYTES, 1, wire.MAX_FRAME_BYTES + 1))
        assert lost and "over the wire's limit" in lost[0]

    asyncio.run(scenario())


# ---- the worker's side ----

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_track_keeps_a_20ms_grid_bounds_its_queue_and_restarts_the_grid_after_a_stall():
    from parley.realtime.webrtc.peer import ModelAudioTrack

    async def scenario():
        clock = FakeClock()
        track = ModelAudioTrack(max_lag_s=0.16, clock=clock)  # 8 packets
        dropped = track.play(np.full(1920 * 5, 0.5, np.float32))  # ~20 packets (soxr holds a few back)
        assert len(track._packets) == 8 and track.dropped_packets >= 8  # the oldest dropped, counted
        assert dropped == -(-track.dropped_packets // 4)  # in 80 ms frames, as the lag counter counts
        dues = []
        for _ in range(10):
            dues.append(track.due())
            track.next_packet()
        assert np.allclose(np.diff(dues), 0.02) and dues[0] == 100.0  # a fixed grid from the first packet
        assert track.silent_packets == 2  # 8 queued, then silence: nothing waits for audio
        clock.now = dues[-1] + 0.3  # late, under the stall limit: the grid holds (packets go at once)
        assert track.due() == pytest.approx(dues[-1] + 0.02)
        clock.now += 1.0  # a stall: a new grid from now, not a burst of 65 packets
        assert track.due() == clock.now
        track.stop()

    asyncio.run(scenario())


def test_the_workers_outbox_is_bounded():
    from parley.realtime.webrtc.worker import WorkerCall

    class Worker:
        def __init__(self) -> None:
            self.link = FakeLink()
            self.forgotten = []

        def send(self, op, call, payload=b""):
            self.link.send(op, call, payload)

        def forget(self, call):
            self.forgotten.append(call)

    async def scenario():
        worker = Worker()
        call = WorkerCall(worker, 9, [], 1.0)
        call.audio(np.zeros(480, np.float32))
        worker.link.backlog = wire.SOFT_OUTBOX_BYTES + 1  # the server stopped reading
        call.audio(np.zeros(480, np.float32))
        assert [op for op, _, _ in worker.link.sent] == [wire.AUDIO] and call.dropped_in == 1
        call.report()
        assert worker.link.sent[-1] == (wire.DROPPED_OP, 9, wire.DROPPED.pack(1, 0, 0)) and call.dropped_in == 0
        call.peer.outgoing.silent_packets += 3  # the track sent 3 packets of silence
        call.report()
        call.report()  # (nothing new: no frame)
        assert worker.link.sent[-1] == (wire.DROPPED_OP, 9, wire.DROPPED.pack(0, 0, 3))
        assert [op for op, _, _ in worker.link.sent].count(wire.DROPPED_OP) == 2
        worker.link.backlog = wire.HARD_OUTBOX_BYTES
        call.message('{"type": "x"}')  # an event would pass the hard bound: the call ends, overflowed
        assert worker.link.sent[-1] == (wire.ENDED, 9, b"\x01") and worker.forgotten == [call]
        await call.peer.close()

    asyncio.run(scenario())


def test_workers_log_in_the_servers_format(monkeypatch, capsys):
    """`--log-format json` reaches the WebRTC workers: the pool passes the server's format on its
    command line, and a worker started with `json` writes JSON lines (without it, text)."""
    import json
    import logging
    import subprocess

    from parley.realtime.server import log_format
    from parley.realtime.webrtc import pool as webrtc_pool
    from parley.realtime.webrtc import worker as webrtc_worker

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    spawned: list[list[str]] = []

    def no_popen(argv, **kwargs):
        spawned.append(argv)
        raise OSError("not started in this test")

    async def fake_serve(fd: int) -> None:
        logging.getLogger("parley.webrtc.worker").warning("hello %d", fd)

    monkeypatch.setattr(subprocess, "Popen", no_popen)
    monkeypatch.setattr(webrtc_worker, "serve", fake_serve)
    monkeypatch.setattr(webrtc_worker.signal, "signal", lambda *args: None)
    try:
        log_format.configure_logging("info", "json")
        assert log_format.current_kind() == "json"
        with pytest.raises(OSError):
            asyncio.run(webrtc_pool.WebRTCPool(1)._spawn(0))
        assert spawned[0][-1] == "json"
        webrtc_worker.main(["7", "json"])
        line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        assert line["logger"] == "parley.webrtc.worker" and line["message"] == "hello 7"
        webrtc_worker.main(["8"])
        assert "WARNING parley.webrtc.worker: hello 8" in capsys.readouterr().err
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
