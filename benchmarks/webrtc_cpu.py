"""CPU per WebRTC call against CPU per WebSocket session, on the same server.

Starts `parley serve` (the tiny demo model by default, so it runs on a CPU box), then for each
transport holds N GPT-Live sessions at once for --seconds, each sending a 440 Hz tone at real-time
pace and reading what comes back, and reads the CPU time (user + system, all threads) before and
after of the server process (the engine, the event loop) and, apart, of its WebRTC worker
processes (`--webrtc-workers`: each call's aiortc peer: Opus, SRTP, DTLS, SCTP; the server's
`parley_webrtc_worker_cpu_seconds`). Prints both per
session-second for each transport, their total, and the ratios.

- websocket: `/v1/live/sessions` over a WebSocket, base64 PCM16 at 24 kHz in JSON events.
- webrtc: `POST /v1/live/sessions` with transport webrtc, aiortc as the client (Opus at 48 kHz,
  SRTP, DTLS, SCTP for the events), as tests/test_webrtc.py drives it.

With `--serve-args "--edge-workers N"` the server is an engine process and N edge workers, each
running its calls' peers on its own loop (no WebRTC worker processes): the figures are then the
engine process's and the edge workers' together, from the server's one scrape
(`parley_process_cpu_seconds_total{process}`), so a WebRTC call's edge CPU stands beside a
WebSocket session's (which also runs in an edge worker).

The engine's own work (the model's frames) is in both server figures; the difference is the
transport's. The clients run in this process, on their own cores where there are any. For many
sessions, with frames lost, late ticks and jitter, use `benchmarks/load.py --doors live,webrtc`.

    python benchmarks/webrtc_cpu.py --sessions 4 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from load import process_cpu  # noqa: E402  (this folder: a split server's per-process CPU series)

ROOT = Path(__file__).resolve().parents[1]
SR = 24000
CHUNK = 480 * 4  # 80 ms at 24 kHz per append


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(base: str) -> str:
    with urllib.request.urlopen(f"http://{base}/metrics", timeout=5) as r:
        return r.read().decode()


def server_cpu(base: str, pid: int) -> tuple[float, float]:
    """(server, workers) CPU seconds so far. One process: its own and its WebRTC worker processes'
    (`parley_webrtc_worker_cpu_seconds`). Split (`--edge-workers`): the engine process's and the edge
    workers' together (load.py's `process_cpu`)."""
    text = scrape(base)
    edges, engine = process_cpu(text)
    if not math.isnan(engine):
        return engine, edges
    workers = re.search(r"^parley_webrtc_worker_cpu_seconds ([0-9.eE+-]+)$", text, re.M)
    return cpu_seconds(pid), float(workers.group(1)) if workers else 0.0


def split(base: str) -> bool:
    return not math.isnan(process_cpu(scrape(base))[1])


def model_name(base: str) -> str:
    with urllib.request.urlopen(f"http://{base}/api/info", timeout=5) as r:
        return json.load(r)["model"]


class Gate:
    """Sessions report in once streaming; the measurement window opens when all have, and `stop` ends them."""

    def __init__(self, sessions: int) -> None:
        self.waiting = sessions
        self.all_in = asyncio.Event()
        self.stop = asyncio.Event()

    def streaming(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.all_in.set()


async def websocket_session(base: str, model: str, gate: Gate) -> None:
    import websockets

    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(CHUNK) / SR) * 32767).astype("<i2").tobytes()
    async with websockets.connect(f"ws://{base}/v1/live/sessions", max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.start", "session": {"model": model}}))
        while json.loads(await ws.recv())["type"] != "session.started":
            pass

        async def drain() -> None:
            async for _ in ws:
                pass

        reader = asyncio.create_task(drain())
        gate.streaming()
        start = time.monotonic()
        sent = 0
        while not gate.stop.is_set():
            await ws.send(json.dumps({"type": "session.input_audio.append", "audio": base64.b64encode(tone).decode()}))
            sent += 1
            await asyncio.sleep(max(0.0, start + sent * CHUNK / SR - time.monotonic()))
        reader.cancel()


async def webrtc_session(base: str, model: str, gate: Gate) -> None:
    import httpx2
    from test_webrtc import Client  # the tests' aiortc client: a tone microphone, the oai-events channel

    client = Client()
    async with httpx2.AsyncClient() as http:
        reply = await http.post(f"http://{base}/v1/live/sessions", timeout=30, json={
            "session": {"model": model}, "transport": {"type": "webrtc", "sdp": await client.offer()}})
        reply.raise_for_status()
    await client.answer(reply.json()["transport"]["sdp"])
    await client.wait(lambda: "session.started" in client.types(), "session.started")
    await client.wait(lambda: bool(client.audio), "the server's track")
    gate.streaming()
    await gate.stop.wait()
    await client.close()


async def measure(base: str, pid: int, kind: str, sessions: int, seconds: float) -> tuple[float, float]:
    """(server, WebRTC workers) CPU seconds per session-second, once every session streams both ways."""
    model = model_name(base)
    run = websocket_session if kind == "websocket" else webrtc_session
    gate = Gate(sessions)
    tasks = [asyncio.create_task(run(base, model, gate)) for _ in range(sessions)]
    await asyncio.wait_for(gate.all_in.wait(), 120)
    await asyncio.sleep(0.5)  # past the sessions' setup
    (server0, workers0), t0 = server_cpu(base, pid), time.monotonic()
    await asyncio.sleep(seconds)
    (server1, workers1), t1 = server_cpu(base, pid), time.monotonic()
    gate.stop.set()
    await asyncio.gather(*tasks)
    per = (t1 - t0) * sessions
    return (server1 - server0) / per, (workers1 - workers0) / per


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    parser.add_argument("--serve-args", default="", help="more `parley serve` flags (default: the tiny demo)")
    args = parser.parse_args()
    if not args.port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "parley.realtime.cli", "serve", "--port", str(args.port), "--device", "cpu",
           "--max-sessions", str(max(2, args.sessions)), *args.serve_args.split()]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://{base}/readyz", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        layout_split = split(base)
        idle = sum(server_cpu(base, proc.pid))
        time.sleep(2.0)
        idle = (sum(server_cpu(base, proc.pid)) - idle) / 2.0
        results = {kind: asyncio.run(measure(base, proc.pid, kind, args.sessions, args.seconds))
                   for kind in ("websocket", "webrtc")}
    finally:
        proc.terminate()
        proc.wait(15)
    print(f"server idle: {idle:.3f} CPU s/s; {args.sessions} sessions for {args.seconds:g} s each; "
          "CPU s per session-second:")
    server_label, workers_label = ("engine", "edge workers") if layout_split else ("server", "webrtc workers")
    print(f"  {'':<9} {server_label:>7} {workers_label:>15} {'total':>7}   (the server's engine included)")
    for kind, (server, workers) in results.items():
        print(f"  {kind:<9} {server:>7.3f} {workers:>15.3f} {server + workers:>7.3f}")
    (ws, _), (rtc_server, rtc_workers) = results["websocket"], results["webrtc"]
    print(f"  webrtc / websocket: server {rtc_server / max(ws, 1e-9):.2f}x, "
          f"total {(rtc_server + rtc_workers) / max(ws, 1e-9):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
