"""Kyutai's own doors under load: STT streams on /api/asr-streaming, TTS streams on /api/tts_streaming.

    python benchmarks/kyutai_load.py --asr 2 --tts 1 --duplex 1 --duration 5     # the demo server, tiny, CPU
    # one H100 (issue 48's figures): STT 1B, TTS 1.6B and Moshi-7B shapes, random weights
    python benchmarks/write_models.py --dir /tmp/models --device cuda --kinds duplex,tts,stt && \\
    python benchmarks/kyutai_load.py --models /tmp/models --asr 256 --duration 30 --procs 4 \\
        --serve-arg=--device=cuda --serve-arg=--stt-slots=256
    python benchmarks/kyutai_load.py --models /tmp/models --tts 16 --duplex 64 --duration 30 --procs 4 \\
        --serve-arg=--device=cuda --serve-arg=--kv-dtype=fp8
    # past the claim: more streams than rows, the rest refused as moshi-server refuses them
    python benchmarks/kyutai_load.py --models /tmp/models --asr 400 --duration 30 --procs 8 \\
        --serve-arg=--device=cuda --serve-arg=--stt-slots=400

One `parley serve` (the demo unless `--models DIR`, which serves what benchmarks/write_models.py
wrote there; `--serve-arg` adds or overrides flags). Unless given, the server gets `--stt-slots` =
--asr, `--tts-slots` = --tts and `--max-sessions` = --duplex + 2. Everything runs at once for
`--duration` seconds, over real sockets, the clients spoken as Unmute speaks them
(tests/test_kyutai_doors.py):
- asr: `--asr` clients, each waiting for `Ready` (an `Error` first, or a refused upgrade, is a
  refusal), then streaming msgpack `Audio{pcm}` of 1920 float32 samples (80 ms at 24 kHz) paced in
  real time, spread over `--procs` processes. Each `Step{step_idx}` says the row has read step_idx
  of the client's frames: its step delay is its arrival minus the send of frame step_idx. A stream
  is held in real time when it was served to the end, its step delay p99 stays within `--held-ms`,
  and its last Step covers all but `--held-ms` of the audio it sent. Also printed: the server's own
  transcript delay p50 / p99 (`parley_transcript_delay_seconds{path="standalone"}`, observed when a
  step's words go out, as benchmarks/transcript_delay.py reads it; random weights say few words) and
  the words received.
- tts: `--tts` clients, each in a loop until the end: connect (`--tts-query`), `Ready`, the sentence
  as one `Text` message per word, `Eos`, then read until the server closes (1000: a request done).
  First audio: from sending the first word to the first `Audio` message; p50 / p99.
- duplex: `--duplex` /api/chat sessions beside them (benchmarks/load.py's paced Ogg-Opus clients,
  in `--procs` processes): jitter p99, frames lost.
The engine's late ticks and starved STT rows over the run close the table.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import FRAME_S, pct, probe_frame, run_load  # noqa: E402
from mixed_load import TTS_TEXT, fmt, model_flags  # noqa: E402
from mixed_soak import child_server  # noqa: E402
from transcript_delay import delta, quantile, transcript_metrics  # noqa: E402

LOOP_FRAMES = 24  # each client's signal repeats every ~2 s (1 s silence, 1 s tone): packed once
OPEN_TIMEOUT_S = 30.0
TAIL_S = 0.6  # after the last frame: the model's text delay, so the last Steps come back
NO_FREE_CHANNELS = "no free channels"  # moshi-server's words for a full pool (realtime/kyutai/asr.py)


@dataclass
class AsrStats:
    sent_at: list[float] = field(default_factory=list)
    steps: list[tuple[float, int]] = field(default_factory=list)  # (arrival, step_idx)
    words: int = 0
    errors: int = 0  # Error messages after Ready
    refused: bool = False
    dropped: bool = False  # the server closed the stream before its audio was all sent
    reason: str = ""

    def step_delays(self) -> list[float]:
        return [at - self.sent_at[k - 1] for at, k in self.steps if 1 <= k <= len(self.sent_at)]

    def held(self, limit_s: float) -> bool:
        delays = self.step_delays()
        if self.refused or self.dropped or not delays:
            return False
        covered = max(k for _, k in self.steps)
        return (np.percentile(delays, 99) <= limit_s
                and covered >= len(self.sent_at) - math.ceil(limit_s / FRAME_S))


def audio_frames(index: int) -> list[bytes]:
    """Client `index`'s signal as Unmute's SpeechToText.send_audio packs it (float32 msgpack)."""
    return [msgpack.packb({"type": "Audio", "pcm": probe_frame(index, i).tolist()}, use_bin_type=True,
                          use_single_float=True) for i in range(LOOP_FRAMES)]


async def asr_client(url: str, index: int, duration: float, gate: asyncio.Event) -> AsrStats:
    stats, frames = AsrStats(), audio_frames(index)
    try:
        ws = await connect(f"{url}/api/asr-streaming", max_size=None, compression=None, open_timeout=OPEN_TIMEOUT_S)
    except (InvalidStatus, TimeoutError, OSError) as exc:
        stats.refused, stats.reason = True, f"{type(exc).__name__}: {exc}"[:200]
        return stats
    async with ws:
        try:
            first = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60))
        except (ConnectionClosed, TimeoutError) as exc:
            first = {"type": "Error", "message": f"{type(exc).__name__} before Ready"}
        if first["type"] != "Ready":
            stats.refused, stats.reason = True, str(first.get("message"))[:200]
            return stats
        receiver = asyncio.create_task(asr_receive(ws, stats))
        await gate.wait()
        t0 = time.monotonic()
        try:
            for i in range(int(duration / FRAME_S)):
                await asyncio.sleep(max(0.0, t0 + i * FRAME_S - time.monotonic()))
                stats.sent_at.append(time.monotonic())
                await ws.send(frames[i % LOOP_FRAMES])
            await asyncio.sleep(TAIL_S)
        except ConnectionClosed:
            stats.dropped, stats.reason = True, f"closed {ws.close_code} {ws.close_reason}"[:200]
        await ws.close()
        await receiver
    return stats


async def asr_receive(ws, stats: AsrStats) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for raw in ws:
            message = msgpack.unpackb(raw)
            kind = message["type"]
            if kind == "Step":
                stats.steps.append((time.monotonic(), message["step_idx"]))
            elif kind == "Word":
                stats.words += 1
            elif kind == "Error":
                stats.errors += 1
                stats.reason = stats.reason or str(message.get("message"))[:200]


def asr_group(url: str, indices: list[int], duration: float, start_at: float) -> list[AsrStats]:
    """Some of the clients, in this process; every group streams from `start_at` (time.monotonic()
    is one clock for every process on the host)."""

    async def main() -> list[AsrStats]:
        gate = asyncio.Event()
        tasks = [asyncio.create_task(asr_client(url, i, duration, gate)) for i in indices]
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        gate.set()
        return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


async def asr_load(url: str, args) -> dict:
    start_at = time.monotonic() + 2.0 + 0.02 * args.asr
    procs = max(1, min(args.procs, args.asr))
    with concurrent.futures.ProcessPoolExecutor(procs) as pool:
        futures = [asyncio.wrap_future(pool.submit(asr_group, url, list(range(args.asr))[p::procs], args.duration,
                                                   start_at)) for p in range(procs)]
        results = [s for group in await asyncio.gather(*futures) for s in group]
    delays = [d for s in results for d in s.step_delays()]
    reasons = sorted({s.reason for s in results if s.refused or s.dropped})
    if reasons:
        print("asr refusals / drops: " + "; ".join(reasons)[:600], file=sys.stderr)
    return {"streams": args.asr, "served": sum(not s.refused for s in results),
            "refused": sum(s.refused for s in results), "dropped": sum(s.dropped for s in results),
            f"held in real time (<= {args.held_ms:.0f} ms)": sum(s.held(args.held_ms / 1000) for s in results),
            "step delay p50 ms": pct(delays, 50), "step delay p99 ms": pct(delays, 99),
            "words": sum(s.words for s in results), "errors": sum(s.errors for s in results)}


async def tts_request(url: str, words: list[str], firsts: list[float]) -> str:
    """One Unmute-shaped request: 'done', 'refused' (no free channels, at connect or at Eos) or 'error'."""
    try:
        ws = await connect(url, max_size=None, compression=None, open_timeout=OPEN_TIMEOUT_S)
    except InvalidStatus:
        return "refused"
    async with ws:
        if msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60))["type"] != "Ready":
            return "refused"
        sent = time.monotonic()
        for word in words:
            await ws.send(msgpack.packb({"type": "Text", "text": word}))
        await ws.send(msgpack.packb({"type": "Eos"}))
        first, full = None, False
        with contextlib.suppress(ConnectionClosed):
            while True:
                message = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 120))
                if message["type"] == "Audio" and first is None:
                    first = time.monotonic() - sent
                elif message["type"] == "Error":  # a pool full at Eos is a refusal (the door's rule 4)
                    full = full or message.get("message") == NO_FREE_CHANNELS
                    if not full:
                        print(f"tts: {message.get('message')}"[:300], file=sys.stderr)
        if ws.close_code != 1000 or first is None:
            return "refused" if full else "error"
        firsts.append(first)
        return "done"


async def tts_load(url: str, args) -> dict:
    firsts: list[float] = []
    outcomes: list[str] = []
    end = time.monotonic() + args.duration
    target, words = f"{url}/api/tts_streaming?{args.tts_query}", TTS_TEXT.split()

    async def stream() -> None:
        while time.monotonic() < end:
            try:
                outcomes.append(await tts_request(target, words, firsts))
            except (ConnectionClosed, TimeoutError, OSError) as exc:
                print(f"tts: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
                outcomes.append("error")
            if outcomes[-1] != "done":
                await asyncio.sleep(0.5)

    await asyncio.gather(*(stream() for _ in range(args.tts)))
    return {"streams": args.tts, "requests done": outcomes.count("done"), "refused": outcomes.count("refused"),
            "errors": outcomes.count("error"), "first audio p50 ms": pct(firsts, 50),
            "first audio p99 ms": pct(firsts, 99)}


async def duplex_load(url: str, args) -> dict:
    r = await run_load(url, args.duplex, args.duration, procs=args.procs)
    return {"sessions": r["served"], "refused": r["refused"], "jitter p99 ms": r["jitter_p99_ms"],
            "frames lost": r["frames_lost"]}


async def run(base: str, args) -> dict:
    http, ws = f"http://{base}", f"ws://{base}"
    jobs = {"asr": (args.asr, lambda: asr_load(ws, args)), "tts": (args.tts, lambda: tts_load(ws, args)),
            "duplex": (args.duplex, lambda: duplex_load(ws, args))}
    kinds = [kind for kind, (n, _) in jobs.items() if n > 0]
    before = await asyncio.to_thread(transcript_metrics, http)
    results = await asyncio.gather(*(jobs[kind][1]() for kind in kinds))
    d = delta(before, await asyncio.to_thread(transcript_metrics, http))
    figures = dict(zip(kinds, results))
    if "asr" in figures:  # the server's own: only the ASR streams use the standalone path here
        buckets = d["standalone"]["buckets"]
        figures["asr"].update({"server transcript delay p50 ms": 1000 * quantile(buckets, 0.5),
                               "server transcript delay p99 ms": 1000 * quantile(buckets, 0.99)})
    figures["engine"] = {"late ticks": d["late_ticks"], "starved STT rows": d["stt_starved"]}
    return figures


def table(figures: dict) -> list[str]:
    lines = ["| kind | figure | value |", "|---|---|---:|"]
    return lines + [f"| {kind} | {name} | {fmt(value)} |" for kind, named in figures.items()
                    for name, value in named.items()]


def server_flags(args) -> list[str]:
    """--models' flags, then --serve-arg's (the later wins), then the sizes the load needs where not given."""
    flags = [*(model_flags(args.models) if args.models is not None else []), *args.serve_arg]
    needs = {"--max-sessions": args.duplex + 2, "--stt-slots": max(args.asr, 1), "--tts-slots": max(args.tts, 1)}
    return flags + [f"{flag}={n}" for flag, n in needs.items() if not any(a.startswith(flag) for a in flags)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--asr", type=int, default=0, help="/api/asr-streaming clients (default %(default)s)")
    p.add_argument("--tts", type=int, default=0, help="/api/tts_streaming clients (default %(default)s)")
    p.add_argument("--duplex", type=int, default=0, help="/api/chat sessions beside them (default %(default)s)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load (default %(default)s)")
    p.add_argument("--procs", type=int, default=1, help="processes for the ASR clients, and for the duplex ones")
    p.add_argument("--held-ms", type=float, default=500.0,
                   help="a stream is held in real time while its step delay p99 stays within this many ms "
                        "(default %(default)s)")
    p.add_argument("--tts-query", default="format=PcmMessagePack",
                   help="the /api/tts_streaming query every TTS client sends (default %(default)s; Unmute adds "
                        "cfg_alpha=1.5 where the model has that condition)")
    p.add_argument("--models", type=Path, default=None,
                   help="serve what benchmarks/write_models.py wrote in this directory")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an extra `parley serve` argument (repeat); none: the demo server (every modality, tiny)")
    args = p.parse_args(argv)
    if min(args.asr, args.tts, args.duplex) < 0 or args.procs < 1 or args.duration <= 0:
        p.error("--asr, --tts and --duplex must be >= 0, --procs >= 1 and --duration > 0")
    if args.asr + args.tts == 0:
        p.error("nothing to run on Kyutai's doors: give --asr N and/or --tts N")
    with child_server(server_flags(args)) as (base, _pid):
        figures = asyncio.run(run(base, args))
    print("\n".join(table(figures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
