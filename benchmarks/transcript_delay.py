"""How late transcript deltas reach the client (issue 14's target: within the model's delay + 100 ms).

    python benchmarks/transcript_delay.py --spawn tiny --paired 2 --standalone 2 --duration 15
    python benchmarks/transcript_delay.py --url ws://127.0.0.1:8998 --paired 16 --standalone 16

`--paired N` /api/chat?transcript=1 clients (load.py's paced Opus clients; the user's words come
back as 0x07 from the paired STT row) and `--standalone N` /v1/realtime?intent=transcription
sessions (pcm16 appends on an 80 ms grid; deltas from a standalone STT row in the slack) stream at
once. The figures are the server's own, read from /metrics before and after the run:
`parley_transcript_delay_seconds{path}` (from the arrival of the newest input frame an STT step
read to that step's delta being written to the socket) and the model's text delay
(`parley_engine_stt[_paired]_model_delay_seconds`), which comes on top. p50 / p99 are interpolated
within the histogram's buckets, as Prometheus' histogram_quantile does. Printed per path: deltas,
mean, p50, p99, the model delay, p99 + model delay, and the target (model delay + 100 ms); then
the engine counters that explain a tail (late ticks, starved standalone rows, dropped outlier costs).

`--spawn tiny` writes the tiny random duplex and STT checkpoints (the STT reads the duplex Mimi's
codes) and runs `parley serve` for the run; `--spawn DIR --stt-model STT` uses real ones.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import FRAME, FRAME_S, SR, run_load, spawned_server  # noqa: E402
from parley.models.synthetic import write_tiny_checkpoint, write_tiny_stt_checkpoint  # noqa: E402

TARGET_S = 0.1  # on top of the model's own delay
PATHS = ("paired", "standalone")
# Engine counters that explain a tail: late ticks (paired), standalone rows left unstepped in a
# tick's slack, outlier step costs the slack dropped after keeping a key waiting (docs/engine.md).
CONTEXT = ("late_ticks", "stt_starved", "slack_stale_drops")


def transcript_metrics(http: str) -> dict:
    """{path: {"buckets": [(le, cumulative count)], "sum", "count"}} and the model delays."""
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    out: dict = {}
    for path in PATHS:
        buckets = [(float(le.replace("+Inf", "inf")), float(c)) for le, c in re.findall(
            rf'^parley_transcript_delay_seconds_bucket\{{le="([^"]+)",path="{path}"\}} (\S+)$', text, re.M)]
        total = re.search(rf'^parley_transcript_delay_seconds_sum\{{path="{path}"\}} (\S+)$', text, re.M)
        out[path] = {"buckets": buckets, "sum": float(total.group(1)) if total else 0.0,
                     "count": buckets[-1][1] if buckets else 0.0}
    for path, gauge in (("paired", "stt_paired_model_delay_seconds"), ("standalone", "stt_model_delay_seconds")):
        m = re.search(rf"^parley_engine_{gauge} (\S+)$", text, re.M)
        out[path]["model_delay"] = float(m.group(1)) if m else float("nan")
    for name in CONTEXT:
        m = re.search(rf"^parley_engine_{name}_total (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Linear interpolation inside the bucket holding the q-th observation (histogram_quantile)."""
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return le  # past the last finite bound: all a histogram can say is "more than that"
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = le, count
    return lower


def delta(before: dict, after: dict) -> dict:
    """The run's own observations: after minus before, bucket by bucket."""
    out = {name: after[name] - before[name] for name in CONTEXT}
    for path in PATHS:
        a, b = after[path], before[path]
        old = dict(b["buckets"])
        out[path] = {"buckets": [(le, c - old.get(le, 0.0)) for le, c in a["buckets"]],
                     "sum": a["sum"] - b["sum"], "count": a["count"] - b["count"], "model_delay": a["model_delay"]}
    return out


async def standalone_client(url: str, index: int, duration: float, model: str | None = None) -> int:
    """One transcription session: a tone at speech level in pcm16 appends, paced in real time.
    `model`: the transcription model it names (one the server serves); None names none, so the
    server uses its own. Returns the deltas it received."""
    n = int(duration / FRAME_S)
    t = np.arange(n * FRAME) / SR
    pcm = (0.3 * np.sin(2 * np.pi * (180 + 41 * index) * t) * 32767).astype("<i2")
    deltas = 0
    async with connect(f"{url}/v1/realtime?intent=transcription", max_size=None, open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
            "input": {"transcription": {"model": model} if model else {}, "turn_detection": None}}}}))

        async def receive() -> None:
            nonlocal deltas
            try:
                async for raw in ws:
                    event = json.loads(raw)
                    if event["type"] == "conversation.item.input_audio_transcription.delta":
                        deltas += 1
                    elif event["type"] == "error":
                        print(f"standalone client {index}: {event['error']['message']}", file=sys.stderr)
            except ConnectionClosed:
                pass

        receiver = asyncio.create_task(receive())
        t0 = time.monotonic()
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i * FRAME_S - time.monotonic()))
            chunk = base64.b64encode(pcm[i * FRAME:(i + 1) * FRAME].tobytes()).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        await asyncio.sleep(0.6)  # the model's delay: the last words come after the audio
        await ws.close()
        await receiver
    return deltas


async def run(url: str, paired: int, standalone: int, duration: float) -> dict:
    http = url.replace("ws://", "http://").replace("wss://", "https://")
    before = await asyncio.to_thread(transcript_metrics, http)
    jobs = [standalone_client(url, i, duration) for i in range(standalone)]
    if paired:
        jobs.append(run_load(url, paired, duration, query="?transcript=1"))
    await asyncio.gather(*jobs)
    return delta(before, await asyncio.to_thread(transcript_metrics, http))


def report(figures: dict) -> list[str]:
    lines = [f"{'path':<11} {'deltas':>7} {'mean ms':>8} {'p50 ms':>7} {'p99 ms':>7} {'model ms':>9} "
             f"{'p99+model':>10} {'target ms':>10}  met"]
    for path in PATHS:
        f = figures[path]
        if not f["count"]:
            continue
        p50, p99, model = (1000 * quantile(f["buckets"], 0.5), 1000 * quantile(f["buckets"], 0.99),
                           1000 * f["model_delay"])
        target = model + 1000 * TARGET_S
        over = f">{1000 * f['buckets'][-2][0]:.0f}"  # in the +Inf bucket
        ms = [over if v == float("inf") else f"{v:.1f}" for v in (p50, p99, p99 + model)]
        lines.append(f"{path:<11} {int(f['count']):>7} {1000 * f['sum'] / f['count']:>8.1f} {ms[0]:>7} {ms[1]:>7} "
                     f"{model:>9.0f} {ms[2]:>10} {target:>10.0f}  {'yes' if p99 + model <= target else 'NO'}")
    lines.append("during the run: " + ", ".join(f"{name} {int(figures[name])}" for name in CONTEXT))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server with an STT model, e.g. ws://127.0.0.1:8998")
    where.add_argument("--spawn", help="start `parley serve` on: tiny, or a checkpoint dir / HF repo id")
    p.add_argument("--stt-model", help="with --spawn DIR: the STT checkpoint (tiny writes its own)")
    p.add_argument("--paired", type=int, default=2, help="/api/chat?transcript=1 clients")
    p.add_argument("--standalone", type=int, default=2, help="/v1/realtime?intent=transcription clients")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of audio each client streams")
    p.add_argument("--device", default="cpu", help="with --spawn: the server's device")
    args = p.parse_args(argv)
    if args.paired + args.standalone < 1:
        p.error("--paired and --standalone are both 0: nothing to measure")
    if args.url:
        figures = asyncio.run(run(args.url.rstrip("/"), args.paired, args.standalone, args.duration))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model, stt = args.spawn, args.stt_model
            if model == "tiny":
                model = str(write_tiny_checkpoint(Path(tmp) / "duplex"))
                stt = str(write_tiny_stt_checkpoint(Path(tmp) / "stt", mimi_from=model))
            if stt is None:
                p.error("--spawn DIR needs --stt-model")
            extra = ["--stt-model", stt, "--stt-slots", str(max(1, args.standalone))]
            with spawned_server(model, max(1, args.paired), args.device, extra) as url:
                figures = asyncio.run(run(url, args.paired, args.standalone, args.duration))
    print("\n".join(report(figures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
