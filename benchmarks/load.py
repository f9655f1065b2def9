"""Load test: N concurrent /api/chat (or GPT-Live) clients over real sockets, paced in real time.

    python benchmarks/load.py --spawn tiny --clients 4 --duration 20      # starts `parley serve` itself
    python benchmarks/load.py --url ws://127.0.0.1:8998 --clients 16      # against a running server
    python benchmarks/load.py --spawn tiny --doors chat,live              # both doors, one after the other

`--doors`: `chat` is /api/chat (Ogg-Opus frames); `live` is /v1/live/sessions (GPT-Live: base64
PCM16 at 24 kHz in `session.input_audio.append`, `session.output_audio.delta` back); `webrtc` is
GPT-Live over WebRTC (`POST /v1/live/sessions`, aiortc as the client: Opus tracks at 48 kHz, the
events on the `oai-events` channel; benchmarks/webrtc_load.py). With several, each door's run
uses the same server, one after the other, and the figures are printed side by side.

Every client streams Ogg-Opus (a tone of its own frequency) on an 80 ms grid and decodes
what comes back. Printed, over all clients:

- delivery jitter: |gap between consecutive audio messages - 80 ms|, p50 / p99 (coalesced
  or bursty delivery shows up here, as does a server that falls behind);
- end-to-end frame delay, p50 / p99: from sending an input frame to receiving the output
  frame that answers it (one frame of model delay, input buffering, the tick grid, codec and
  network; it grows if the server lags). Measured by content, so only with the echo
  checkpoint (`--spawn echo`), whose text follows the input: each client alternates 1 s of
  silence and 1 s of tone, and the first text piece that changes after a switch answers the
  switch frame. Otherwise the server-side part (tick end -> socket write, /metrics
  `parley_frame_delay_seconds`) is printed;
- underruns (from the server's counters: ticks a session had no input), frames lost
  (input frames sent minus output frames received, plus frames the engine dropped);
- ready time: from opening the socket to the server's handshake byte (the session's prompt,
  if any, has been prefilled by then), p50 / max;
- server CPU per session: the server process's CPU seconds (its /metrics
  process_cpu_seconds_total) over the run, per session, as a share of one core; and apart, its
  WebRTC worker processes' (parley_webrtc_worker_cpu_seconds: the calls' aiortc stacks); with
  edge workers, theirs together, and the busiest one's in cores (how evenly they share the load);
- the server's full garbage collections during the run and the longest since it started (each
  one stalls the engine thread; `parley serve` freezes its loaded objects out of them).

`--spawn tiny|echo|DIR` writes the tiny or echo checkpoint (or uses DIR) and runs
`parley serve` on a free 127.0.0.1 port for the run, then stops it. Only 127.0.0.1 is used.
`--text-prompt` / `--voice-prompt` send every client a persona and a voice (PersonaPlex), so an
admission burst of prefills is measured:

    python benchmarks/load.py --spawn /tmp/pp7b --clients 64 --procs 4 --device cuda \
        --text-prompt "You are a helpful assistant." --voice-prompt NATF0.pt
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import contextlib
import json
import math
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sphn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

SR = 24_000
FRAME = 1920
FRAME_S = FRAME / SR
ROOT = Path(__file__).resolve().parents[1]


BLOCK_FRAMES = 12  # ~1 s blocks of silence / tone: each switch is one end-to-end probe


@dataclass
class ClientStats:
    sent_at: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    texts: list[tuple[float, str]] = field(default_factory=list)  # (arrival, piece)
    refused: bool = False
    timed_out: bool = False  # the socket did not open within 30 s, or no handshake came within 60 s
    close_code: int | None = None
    close_reason: str = ""
    ready_s: float | None = None  # socket open -> handshake byte

    def switch_delays(self) -> list[float]:
        """Echo only: for each silence/tone switch, the time from sending the switch frame to
        the first text piece that differs from the one before the switch."""
        delays = []
        for frame in range(BLOCK_FRAMES, len(self.sent_at), BLOCK_FRAMES):
            sent = self.sent_at[frame]
            before = [text for at, text in self.texts if at < sent]
            after = [(at, text) for at, text in self.texts if at >= sent]
            if before:
                changed = next((at for at, text in after if text != before[-1]), None)
                if changed is not None and changed - sent < BLOCK_FRAMES * FRAME_S:
                    delays.append(changed - sent)
        return delays


def probe_frame(index: int, i: int) -> np.ndarray:
    """Frame i of client `index`'s signal: ~1 s blocks of silence, then a tone of its own
    frequency, and so on. Made frame by frame as it is sent: a long run's whole signal made up
    front (262 s per client: 0.4 s of the client process's loop each, on a dev box) held up
    the handshakes of the clients already connected, and counted in their ready time."""
    t = (i * FRAME + np.arange(FRAME)) / SR
    tone_on = (i // BLOCK_FRAMES) % 2 == 1
    return (0.3 * np.sin(2 * np.pi * (200 + 37 * index) * t) * tone_on).astype(np.float32)


async def open_socket(url: str, stats: ClientStats):
    """The WebSocket, or None with `stats` saying why (a 503 before the upgrade is a refusal)."""
    try:
        return await connect(url, max_size=None, compression=None, open_timeout=30)
    except TimeoutError:
        stats.timed_out = True
    except InvalidStatus as exc:
        stats.refused, stats.close_code = True, exc.response.status_code
        stats.close_reason = exc.response.body.decode(errors="replace")[:200] if exc.response.body else ""
    return None


async def handshake(ws, stats: ClientStats, ready) -> bool:
    """Await `ready()` (the door's handshake; False: refused) for 60 s at most; a close before it
    is a refusal, no answer a time-out, both noted in `stats`."""
    try:
        return await asyncio.wait_for(ready(), 60)
    except ConnectionClosed:
        stats.refused, stats.close_code, stats.close_reason = True, ws.close_code, ws.close_reason
    except TimeoutError:
        stats.timed_out = True
    return False


async def stream_frames(ws, stats: ClientStats, index: int, n: int, start_gate: asyncio.Event, encode) -> None:
    """Send n frames of client `index`'s probe signal on the 80 ms grid from the gate on."""
    await start_gate.wait()
    t0 = time.monotonic()
    for i in range(n):
        delay = t0 + i * FRAME_S - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        stats.sent_at.append(time.monotonic())
        await ws.send(encode(probe_frame(index, i)))


async def client(url: str, index: int, duration: float, start_gate: asyncio.Event, query: str = "") -> ClientStats:
    stats = ClientStats()
    n = int(duration / FRAME_S)
    writer, reader = sphn.OpusStreamWriter(SR), sphn.OpusStreamReader(SR)
    opened = time.monotonic()
    if (ws := await open_socket(f"{url}/api/chat{query}", stats)) is None:
        return stats
    async with ws:
        async def handshake_byte() -> bool:
            first = await ws.recv()
            assert first[:1] == b"\x00", first[:8]
            return True

        if not await handshake(ws, stats, handshake_byte):
            return stats
        stats.ready_s = time.monotonic() - opened

        async def receive() -> None:
            try:
                async for msg in ws:
                    if isinstance(msg, bytes) and msg[:1] == b"\x01":
                        stats.arrivals.append(time.monotonic())
                        reader.append_bytes(msg[1:])
                    elif isinstance(msg, bytes) and msg[:1] == b"\x02":
                        stats.texts.append((time.monotonic(), msg[1:].decode(errors="replace")))
            except ConnectionClosed:
                pass

        # Receive from the handshake on: the server talks every tick whether or not input has
        # arrived, so frames must not queue up in the socket while this client waits at the gate.
        receiver = asyncio.create_task(receive())
        await stream_frames(ws, stats, index, n, start_gate, lambda pcm: b"\x01" + bytes(writer.append_pcm(pcm)))
        await asyncio.sleep(0.6)
        await ws.close()
        await receiver
        stats.close_code = ws.close_code
    return stats


def pcm16_event(pcm: np.ndarray) -> str:
    audio = base64.b64encode((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()).decode()
    return json.dumps({"type": "session.input_audio.append", "audio": audio})


async def live_client(url: str, index: int, duration: float, start_gate: asyncio.Event, query: str = "") -> ClientStats:
    """The same probe through /v1/live/sessions: session.start (PCM16 at 24 kHz; `query` is
    the served duplex model's name), then one `session.input_audio.append` a frame; each output
    frame's arrival is the time its `session.output_audio.delta` came (a delta holds whole frames)."""
    stats = ClientStats()
    n = int(duration / FRAME_S)
    opened = time.monotonic()
    if (ws := await open_socket(f"{url}/v1/live/sessions", stats)) is None:
        return stats
    async with ws:
        session = {"model": query, "audio": {"format": {"type": "audio/pcm", "rate": SR}}}
        start = {"type": "session.start", "session": session}
        await ws.send(json.dumps(start))

        async def started() -> bool:
            while (event := json.loads(await ws.recv()))["type"] != "session.started":
                if event["type"] == "error":
                    stats.refused, stats.close_reason = True, event["error"].get("message", "")
                    return False
            return True

        if not await handshake(ws, stats, started):
            return stats
        stats.ready_s = time.monotonic() - opened

        async def receive() -> None:
            try:
                async for raw in ws:
                    event = json.loads(raw)
                    if event["type"] == "session.output_audio.delta":
                        now = time.monotonic()
                        frames = len(base64.b64decode(event["delta"])) // (2 * FRAME)
                        stats.arrivals.extend([now] * frames)
                    elif event["type"] == "session.output_transcript.delta":
                        stats.texts.append((time.monotonic(), event["delta"]))
                    elif event["type"] == "session.closed":
                        return
            except ConnectionClosed:
                pass

        receiver = asyncio.create_task(receive())
        await stream_frames(ws, stats, index, n, start_gate, pcm16_event)
        await asyncio.sleep(0.6)
        await ws.send(json.dumps({"type": "session.close"}))
        await asyncio.wait_for(receiver, 30)
        await ws.close()
        stats.close_code = ws.close_code
    return stats


def webrtc_client(url: str, index: int, duration: float, start_gate: asyncio.Event, query: str = ""):
    from webrtc_load import webrtc_client as call  # aiortc: loaded only when the door is driven

    return call(url, index, duration, start_gate, query)


DOORS = {"chat": client, "live": live_client, "webrtc": webrtc_client}


def process_cpu(text: str) -> tuple[float, float]:
    """(the edge workers' CPU seconds together, the engine process's) from a split server's
    `parley_process_cpu_seconds_total{process}`; nan for both from one process."""
    found = dict(re.findall(r'^parley_process_cpu_seconds_total\{process="([^"]+)"\} ([0-9.eE+-]+)$', text, re.M))
    edges = [float(v) for name, v in found.items() if name.startswith("edge")]
    if not edges or "engine" not in found:
        return float("nan"), float("nan")
    return sum(edges), float(found["engine"])


def scrape(http: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    out = {}
    for name in ("parley_frame_delay_seconds_sum", "parley_frame_delay_seconds_count",
                 "parley_engine_underruns_total", "parley_engine_dropped_events_total",
                 "parley_engine_late_ticks_total", "parley_engine_skipped_ticks_total", "process_cpu_seconds_total",
                 "parley_gc_full_collections_total", "parley_gc_full_pause_max_seconds",
                 "parley_webrtc_worker_cpu_seconds"):
        m = re.search(rf"^{name} ([0-9.eE+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    out["edge_cpu_seconds"], out["engine_cpu_seconds"] = process_cpu(text)
    for name, value in re.findall(r'^parley_process_cpu_seconds_total\{process="(edge[^"]*)"\} ([0-9.eE+-]+)$', text, re.M):
        out[f"cpu {name}"] = float(value)  # each edge worker's own: how evenly the connections spread
    return out


def duplex_model(http: str) -> str:
    return served_model(http, "duplex")


def served_model(http: str, modality: str) -> str:
    """The first name the server serves `modality` as (GET /v1/models)."""
    listing = json.loads(urllib.request.urlopen(f"{http}/v1/models", timeout=10).read())
    return next(m["id"] for m in listing["data"] if m.get("modality") == modality)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (a graceful drain), then kill if it does not exit within 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def spawned_server(model: str, clients: int, device: str, extra: list[str], log_path: Path | None = None):
    """`log_path`: where the server's output goes (default: a temporary file, removed after)."""
    with tempfile.TemporaryDirectory() as tmp:
        if model in ("tiny", "echo"):
            from parley.models.synthetic import write_echo_checkpoint, write_tiny_checkpoint
            ckpt = write_tiny_checkpoint(Path(tmp) / "ckpt") if model == "tiny" else write_echo_checkpoint(Path(tmp) / "ckpt")
            model = str(ckpt)
        port = free_port()
        log_path = log_path or Path(tmp) / "serve.log"
        log = open(log_path, "w")
        proc = subprocess.Popen([sys.executable, "-m", "parley.realtime.cli", "serve", "--model", model, "--port", str(port),
                                 "--max-sessions", str(clients), "--device", device, "--log-level", "warning",
                                 *extra],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"parley serve exited:\n{log_path.read_text()[-2000:]}")
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit("parley serve did not become ready")
                    time.sleep(0.3)
            yield f"ws://127.0.0.1:{port}"
        finally:
            stop_server(proc)
            log.close()


def pct(values, q) -> float:
    return float(np.percentile(values, q)) * 1000 if len(values) else float("nan")


def _client_group(url: str, indices: list[int], duration: float, start_at: float,
                  query: str = "", door: str = "chat") -> list[ClientStats]:
    """Run some of the clients in this process; all groups start streaming at `start_at`
    (time.monotonic() is one clock for every process on the host)."""

    async def main() -> list[ClientStats]:
        gate = asyncio.Event()
        tasks = [asyncio.create_task(DOORS[door](url, i, duration, gate, query)) for i in indices]
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        gate.set()
        return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


async def run_load(url: str, clients: int, duration: float, echo: bool = False, procs: int = 1,
                   query: str = "", door: str = "chat") -> dict:
    """`query`: the /api/chat query string (e.g. "?text_prompt=...&voice_prompt=..."), or "".
    `door`: "chat" (/api/chat), "live" (/v1/live/sessions) or "webrtc" (GPT-Live over WebRTC)."""
    http = url.replace("ws://", "http://").replace("wss://", "https://")
    if door in ("live", "webrtc"):  # GPT-Live's session.model is required: the server's duplex model
        query = duplex_model(http)
    # Handshakes first, then everyone streams from one instant; spread over `procs` processes
    # because each client's Opus work holds its process's GIL (one process tops out near 64).
    start_at = time.monotonic() + 1.0 + 0.02 * clients
    groups = [list(range(clients))[p::procs] for p in range(procs)]
    with concurrent.futures.ProcessPoolExecutor(procs) as pool:
        futures = [asyncio.wrap_future(pool.submit(_client_group, url, g, duration, start_at, query, door)) for g in groups]
        await asyncio.sleep(max(0.0, start_at - 0.05 - time.monotonic()))
        before, t_before = await asyncio.to_thread(scrape, http), time.monotonic()
        results = [stats for group in await asyncio.gather(*futures) for stats in group]
    after, t_after = await asyncio.to_thread(scrape, http), time.monotonic()
    served = [r for r in results if not (r.refused or r.timed_out)]
    reasons = sorted({f"{r.close_code} {r.close_reason}" for r in results if r.refused})
    jitter, delay, lost, sent = [], [], 0, 0
    for r in served:
        # Only the streaming window: output frames that arrived once this client started sending.
        arrivals = [a for a in r.arrivals if r.sent_at and a >= r.sent_at[0]]
        jitter.extend(np.abs(np.diff(arrivals) - FRAME_S))
        if echo:  # the probe reads the echo's text; another model's text says nothing of delay
            delay.extend(r.switch_delays())
        lost += max(0, len(r.sent_at) - len(arrivals))
        sent += len(r.sent_at)
    ready = [r.ready_s for r in served if r.ready_s is not None]
    d = {k: after[k] - before.get(k, float("nan")) for k in after}
    cpu = d["process_cpu_seconds_total"] / (t_after - t_before)
    # the calls' worker processes (their gauge is 0 before the first call; a server without them: nan)
    worker_cpu = (after["parley_webrtc_worker_cpu_seconds"] - np.nan_to_num(before["parley_webrtc_worker_cpu_seconds"])
                  ) / (t_after - t_before)
    edge_cpu = d["edge_cpu_seconds"] / (t_after - t_before)  # a split server's (nan from one process)
    busiest = max((d[k] for k in d if k.startswith("cpu edge") and not math.isnan(d[k])), default=float("nan")) \
        / (t_after - t_before)  # the edge worker that took the most: the spread's worst
    return {"door": door, "clients": clients, "served": len(served), "refused": sum(r.refused for r in results),
            "timed_out": sum(r.timed_out for r in results), "refusals": "; ".join(reasons) or "-",
            "frames_sent": sent, "ready_p50_ms": pct(ready, 50), "ready_max_ms": pct(ready, 100), "jitter_p50_ms": pct(jitter, 50), "jitter_p99_ms": pct(jitter, 99),
            "e2e_p50_ms": pct(delay, 50), "e2e_p99_ms": pct(delay, 99), "e2e_probes": len(delay),
            "server_send_delay_mean_ms": 1000 * d["parley_frame_delay_seconds_sum"]
            / max(1.0, d["parley_frame_delay_seconds_count"]),
            "underruns": d["parley_engine_underruns_total"], "frames_lost": lost,
            "engine_dropped": d["parley_engine_dropped_events_total"],
            "late_ticks": d["parley_engine_late_ticks_total"], "skipped_ticks": d["parley_engine_skipped_ticks_total"],
            "server_cpu_cores": cpu, "server_cpu_per_session_pct": 100 * cpu / max(1, len(served)),
            "webrtc_workers_cpu_cores": worker_cpu,
            "webrtc_workers_cpu_per_session_pct": 100 * worker_cpu / max(1, len(served)),
            "edge_cpu_cores": edge_cpu, "edge_cpu_per_session_pct": 100 * edge_cpu / max(1, len(served)),
            "edge_cpu_busiest_worker_cores": busiest,
            "engine_cpu_cores": d["engine_cpu_seconds"] / (t_after - t_before),
            # Python's full GC passes in the server (each stalls the engine thread; engine/gc_pauses.py)
            "server_full_gcs": d["parley_gc_full_collections_total"],
            "server_full_gc_max_ms": 1000 * after["parley_gc_full_pause_max_seconds"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. ws://127.0.0.1:8998")
    where.add_argument("--spawn", help="start `parley serve` on: tiny, echo, or a checkpoint dir / HF repo id")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of audio each client streams")
    p.add_argument("--device", default="cpu", help="with --spawn: the server's device")
    p.add_argument("--procs", type=int, default=1, help="client processes (use several beyond ~48 clients)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="with --spawn: an extra `parley serve` argument (repeat), e.g. --serve-arg=--kv-dtype=fp8")
    p.add_argument("--text-prompt", help="persona every client sends (/api/chat text_prompt; PersonaPlex)")
    p.add_argument("--voice-prompt", help="voice every client asks for (/api/chat voice_prompt; PersonaPlex)")
    p.add_argument("--serve-log", type=Path, help="with --spawn: write the server's log here (kept after the run)")
    p.add_argument("--echo", action="store_true",
                   help="the server at --url runs the echo checkpoint: measure end-to-end delay by content")
    p.add_argument("--doors", default="chat",
                   help="comma-separated doors to load one after the other: chat (/api/chat), live "
                        "(/v1/live/sessions), webrtc (GPT-Live over WebRTC)")
    args = p.parse_args(argv)
    if not args.spawn and (args.serve_log or args.serve_arg):
        p.error("--serve-log and --serve-arg apply to a server this script starts (--spawn), not to --url")
    doors = args.doors.split(",")
    if unknown := [d for d in doors if d not in DOORS]:
        p.error(f"--doors: unknown door {', '.join(unknown)} (choose from {', '.join(DOORS)})")
    params = {k: v for k, v in (("text_prompt", args.text_prompt), ("voice_prompt", args.voice_prompt)) if v}
    if params and ("live" in doors or "webrtc" in doors):
        p.error("--text-prompt / --voice-prompt are /api/chat parameters: the live and webrtc doors do not send them")
    query = "?" + urllib.parse.urlencode(params) if params else ""
    echo = args.spawn == "echo" or args.echo
    with (spawned_server(args.spawn, args.clients, args.device, args.serve_arg, args.serve_log) if args.spawn
          else contextlib.nullcontext(args.url.rstrip("/"))) as url:
        reports = [asyncio.run(run_load(url, args.clients, args.duration, echo=echo, procs=args.procs,
                                        query=query, door=door)) for door in doors]
    width = max(map(len, reports[0]))
    for key in reports[0]:
        cells = [f"{r[key]:.2f}" if isinstance(r[key], float) else str(r[key]) for r in reports]
        print(f"{key:<{width}}  " + "  ".join(f"{c:>12}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
