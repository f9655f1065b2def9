"""Helpers for the server tests: a real uvicorn server on a free 127.0.0.1 port, run in a
thread with its own event loop, and small protocol clients.

`serve(app)` is a context manager yielding the base URL; leaving it stops the server
(bounded) and with it the app's lifespan, which shuts the engine down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import uvicorn

from parley.engine import Engine
from delay_backend import DelayBackend
from parley.realtime.server.app import EngineLifetime, ServerInfo, assemble_app, create_app, engine_client
from parley.realtime.server.served_models import ServedModels
from parley.realtime.server.services import Services
from parley.realtime.server.serve import uvicorn_config
from parley.realtime.sessions.session import ServerDefaults

FRAME = 1920
SR = 24000
# The duplex names OpenAI's clients send (the SDK examples; openai-agents' default, in its
# session.update; pipecat's and LiveKit's GPT-Live default): the test servers serve them as
# aliases, as `--served-model-name duplex=...` does for an operator. Any other name is
# model_not_found (tests/test_served_models.py).
OPENAI_DUPLEX_NAMES = ("gpt-realtime", "gpt-4o-realtime-preview", "gpt-realtime-2.1", "gpt-live-1")
OPENAI_ALIASES = {"duplex": OPENAI_DUPLEX_NAMES}  # ServeConfig.served_model_names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app, *, startup_timeout: float = 20.0, **config) -> Iterator[str]:
    """`config`: more `uvicorn_config` keywords (ssl_certfile, ssl_keyfile)."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def delay_app(max_sessions: int = 8, *, defaults: ServerDefaults = ServerDefaults(), webrtc_workers: int = 1,
              **backend_kwargs):
    """An app over the fabricated echo backend: output frame t == input frame t - 1,
    text piece '<n>' on every frame (n counts the row's frames since its reset). WebRTC calls run
    in `webrtc_workers` worker processes (started by the first call); 0: the app is built as an
    edge worker builds its own (server/edge_worker.py): the codec on its threads, the calls' peers
    on its loop (webrtc/local.py), the engine in this process all the same."""
    backend = DelayBackend(max_sessions, **backend_kwargs)
    engine = Engine(backend)
    models = ServedModels.build({"duplex": "delay"}, OPENAI_ALIASES)
    if webrtc_workers == 0:
        services = Services(engine, defaults, ServerInfo(model="delay"), codec_workers=0, models=models)

        async def start() -> None:
            engine.start()

        async def stop() -> None:
            await asyncio.to_thread(engine.shutdown)

        spec = dataclasses.replace(services.edge_spec(), webrtc_workers=0)
        return assemble_app(engine_client(services), spec, EngineLifetime(start, stop)), backend
    # codec_workers=2: two codec worker processes, so the protocol tests run the production path
    return create_app(Services(engine, defaults, ServerInfo(model="delay"), codec_workers=2, models=models,
                               webrtc_workers=webrtc_workers)), backend


def tone(freq: float, seconds: float, amp: float = 0.3, sr: int = SR) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def best_lag_correlation(sent: np.ndarray, received: np.ndarray, max_lag: int) -> tuple[float, int]:
    """Highest normalized correlation of `received` against `sent` delayed by 0..max_lag."""
    best, best_lag = -1.0, 0
    for lag in range(0, max_lag + 1, 8):
        n = min(sent.size, received.size - lag)
        if n <= FRAME:
            break
        a, b = sent[:n], received[lag:lag + n]
        denom = float(np.linalg.norm(a) * np.linalg.norm(b)) or 1.0
        c = float(np.dot(a, b)) / denom
        if c > best:
            best, best_lag = c, lag
    return best, best_lag


def wait_healthy(proc, port: int, log, timeout: float = 60) -> None:
    """Until a spawned `parley serve` answers /health (its log, `log`, is shown if it does not)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"parley serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"parley serve not healthy in {timeout} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)


async def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


def assert_transcript_delays(base: str, path: str, sent: int, model_delay: float) -> None:
    """/metrics timed each of the `sent` transcript deltas on `path` ("paired" / "standalone"):
    one observation each, all positive and under a generous bound (the tiny CPU model's steps take
    milliseconds; 2.56 s allows for a crowded box), and the STT model's own text delay is shown."""
    with urllib.request.urlopen(f"http://{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    label = f'path="{path}"'

    def value(suffix: str, extra: str = "") -> float:
        match = re.search(rf"^parley_transcript_delay_seconds_{suffix}\{{{extra}{label}\}} (\S+)$", text, re.M)
        assert match, f"no parley_transcript_delay_seconds_{suffix} for {label}"
        return float(match.group(1))

    count = value("count")
    assert sent > 0 and count == sent
    assert value("sum") > 0
    assert value("bucket", 'le="2.56",') == count
    gauge = "stt_paired_model_delay_seconds" if path == "paired" else "stt_model_delay_seconds"
    assert float(re.search(rf"^parley_engine_{gauge} (\S+)$", text, re.M).group(1)) == pytest.approx(model_delay)


# ---- a sphn-based /api/chat client ----------------------------------------------------------


class ChatResult:
    def __init__(self) -> None:
        self.handshake_at: float | None = None  # seconds after connect
        self.pcm_chunks: list[np.ndarray] = []
        self.text: list[str] = []
        self.user_text: list[str] = []  # 0x07 pieces (?transcript=1)
        self.close_code: int | None = None
        self.close_reason: str = ""
        self.audio_messages = 0
        self.arrivals: list[float] = []  # monotonic time of each audio message
        self.sent_ogg: list[bytes] = []  # the Ogg pages sent, in order (what the server decoded)

    @property
    def pcm(self) -> np.ndarray:
        return np.concatenate(self.pcm_chunks) if self.pcm_chunks else np.zeros(0, np.float32)


async def chat_session(base: str, pcm: np.ndarray | None, *, query: str = "", frame_samples: int = FRAME,
                       prebuffer_frames: int = 3, tail_seconds: float = 0.6, on_open=None,
                       hold_seconds: float = 0.0, until_text: int | None = None) -> ChatResult:
    """Connect to /api/chat, wait for the handshake, stream `pcm` as Ogg-Opus paced in real
    time (after `prebuffer_frames` sent at once), keep reading `tail_seconds` more, close.
    `until_text`: first read until that many text pieces came (at most 30 s): a server on a loaded
    box runs behind the wall clock, and a fixed tail would cut its last frames off."""
    import sphn
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    result = ChatResult()
    url = f"ws://{base}/api/chat" + (f"?{query}" if query else "")
    start = time.monotonic()
    async with connect(url, max_size=None, compression=None, open_timeout=10) as ws:
        reader = sphn.OpusStreamReader(SR)
        writer = sphn.OpusStreamWriter(SR)

        async def receive() -> None:
            try:
                async for msg in ws:
                    if isinstance(msg, str) or not msg:
                        continue
                    if msg[0] == 0 and result.handshake_at is None:
                        result.handshake_at = time.monotonic() - start
                    elif msg[0] == 1:
                        result.audio_messages += 1
                        result.arrivals.append(time.monotonic())
                        out = np.asarray(reader.append_bytes(msg[1:]), np.float32).reshape(-1)
                        if out.size:
                            result.pcm_chunks.append(out)
                    elif msg[0] == 2:
                        result.text.append(msg[1:].decode())
                    elif msg[0] == 7:
                        result.user_text.append(msg[1:].decode())
            except ConnectionClosed:
                pass
            result.close_code = ws.close_code
            result.close_reason = ws.close_reason or ""

        receiver = asyncio.create_task(receive())
        deadline = time.monotonic() + 15
        while result.handshake_at is None and not receiver.done():
            if time.monotonic() > deadline:
                raise AssertionError("no handshake within 15 s")
            await asyncio.sleep(0.005)
        if receiver.done():  # refused or closed before the handshake
            await receiver
            return result
        if on_open is not None:
            await on_open(ws)
        if pcm is not None:
            n_frames = pcm.size // frame_samples
            t0 = time.monotonic()
            for i in range(n_frames):
                page = writer.append_pcm(pcm[i * frame_samples:(i + 1) * frame_samples])
                if page:
                    try:
                        await ws.send(b"\x01" + bytes(page))
                    except ConnectionClosed:  # the server closed this connection: stop sending
                        break
                    result.sent_ogg.append(bytes(page))
                due = t0 + max(0, i + 1 - prebuffer_frames) * frame_samples / SR
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
        deadline = time.monotonic() + 30
        while until_text is not None and len(result.text) < until_text and time.monotonic() < deadline \
                and not receiver.done():
            await asyncio.sleep(0.02)
        await asyncio.sleep(tail_seconds + hold_seconds)
        await ws.close()
        await asyncio.wait_for(receiver, 5)
    return result


def webrtc_worker_pids(root: int) -> list[int]:
    """The WebRTC worker processes (python -m parley.realtime.webrtc.worker) among `root`'s
    descendants, read from /proc (Linux)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited meanwhile
        parents[int(stat.parent.name)] = int(fields[1])

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    found = []
    for pid in parents:
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"parley.realtime.webrtc.worker" in argv and descends(pid):
            found.append(pid)
    return found
