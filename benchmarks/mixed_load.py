"""Every kind of work at once through one `parley serve`, each kind's figures beside its figures alone.

    python benchmarks/mixed_load.py --duration 8                     # the demo server: every modality, tiny, CPU
    # H200 (3.3 minutes with --duration 15 once written; benchmarks/NOTES.md): Moshi-7B, TTS 1.6B, STT 1B and SD-1.5 shapes, random weights
    python benchmarks/write_models.py --dir /tmp/models --device cuda && \\
    python benchmarks/mixed_load.py --models /tmp/models --duplex 64 --tts 16 --transcription 64 --images 4 \\
        --image-size 512x512 --image-steps 20 --duration 20 --procs 4 --serve-arg=--device=cuda --gpu-busy

    # where the together phase's ticks go (docs/benchmarks.md): the server traces its ticks
    # (`parley serve --tick-trace`), the together phase's are kept in PATH and read into one table
    python benchmarks/mixed_load.py --duration 8 --tick-trace /tmp/together.jsonl

`--models DIR` serves what benchmarks/write_models.py wrote there (`--model`, `--tts-model` with its
voices and voice map, `--stt-model`, `--image-model`); `--serve-arg` adds or overrides flags. Unless
given, the server gets `--max-sessions` duplex + 2 (transcription sessions hold no duplex row),
`--tts-slots` = --tts and `--stt-slots` = --transcription, so no client of the load is refused.

Phases, each `--duration` seconds on the same server: every kind alone (duplex, tts, transcription,
image), then all of them at once. Real clients over real sockets:
- duplex: `--duplex` /api/chat sessions (benchmarks/load.py's paced Ogg-Opus clients): delivery jitter
  p99, frames lost;
- tts: `--tts` streams, each POSTing /v1/audio/speech (streamed pcm) back to back: first audio p50 /
  p99 (send -> first body byte) and requests done;
- transcription: `--transcription` /v1/realtime?intent=transcription sessions streaming pcm16 on the
  80 ms grid: the server's transcript delay p50 / p99 (`parley_transcript_delay_seconds`, as
  benchmarks/transcript_delay.py reads it) and deltas;
- image: `--images` concurrent loops of /v1/images/generations (K images in flight, `--image-size`,
  `--image-steps`): images per minute and errors.
Every phase also reports the engine's late ticks (from /metrics), and with `--gpu-busy` the GPU's busy
share (NVML's utilization: the share of time some kernel ran, read every 0.5 s over the phase, as
nvidia-smi reports it). `--tick-trace PATH`: the server writes its tick timeline to PATH.all
(engine/tick_trace.py); once it has stopped, the ticks that started during the together phase go to
PATH (the rest is removed) and benchmarks/tick_timeline.py's table follows. The design's promise is
that the "together" column stays near the "alone" one: the duplex frame on time, the slack kinds
slowed only by what the ticks leave them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx2 as httpx  # the HTTP client the pinned openai SDK ships on

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import pct, run_load, scrape, served_model  # noqa: E402
from tick_timeline import read_trace, table as timeline_table  # noqa: E402
from mixed_soak import child_server, post  # noqa: E402
from transcript_delay import delta, quantile, standalone_client, transcript_metrics  # noqa: E402
from tts_clients import one_request  # noqa: E402

KINDS = ("duplex", "tts", "transcription", "image")
TTS_TEXT = "The quick brown fox jumps over the lazy dog, and then it takes a long nap in the sun."
REQUEST_TIMEOUT_S = 120.0
TICK_S = 0.08  # the engine's tick period: how many ticks a phase holds


async def duplex_load(ws: str, args) -> dict:
    r = await run_load(ws, args.duplex, args.duration, procs=args.procs)
    return {"sessions": r["served"], "refused": r["refused"], "frames back": r["frames_sent"] - r["frames_lost"],
            "jitter p99 ms": r["jitter_p99_ms"], "frames lost": r["frames_lost"]}


async def tts_load(http: str, args) -> dict:
    """`--tts` streams of back-to-back requests until the phase ends; first-audio times of all."""
    firsts: list[float] = []
    errors = 0
    end = time.monotonic() + args.duration

    async def stream(i: int) -> None:
        nonlocal errors
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            while time.monotonic() < end:
                try:
                    first, _, _ = await one_request(client, http, args.tts_voice, TTS_TEXT)
                    firsts.append(first)
                except Exception as exc:  # counted; the stream goes on after a pause
                    errors += 1
                    if errors == 1:
                        print(f"tts stream {i}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
                    await asyncio.sleep(1.0)

    await asyncio.gather(*(stream(i) for i in range(args.tts)))
    return {"requests": len(firsts), "errors": errors, "first audio p50 ms": pct(firsts, 50),
            "first audio p99 ms": pct(firsts, 99)}


async def transcription_load(ws: str, http: str, args) -> dict:
    before = await asyncio.to_thread(transcript_metrics, http)
    model = await asyncio.to_thread(served_model, http, "stt")  # the demo's alias or the checkpoint's name
    deltas = await asyncio.gather(*(standalone_client(ws, i, args.duration, model)
                                    for i in range(args.transcription)))
    d = delta(before, await asyncio.to_thread(transcript_metrics, http))["standalone"]
    return {"sessions": len(deltas), "deltas": int(d["count"]),
            "delay p50 ms": 1000 * quantile(d["buckets"], 0.5), "delay p99 ms": 1000 * quantile(d["buckets"], 0.99)}


async def image(base: str, i: int, args) -> None:
    body = {"prompt": f"a mixed load image {i}", "size": args.image_size, "num_inference_steps": args.image_steps}
    out = json.loads(await asyncio.to_thread(post, base, "/v1/images/generations", json.dumps(body).encode(),
                                             "application/json"))
    if not out.get("data"):
        raise RuntimeError(f"no image: {out}")


async def image_load(base: str, args) -> dict:
    """`--images` loops, each one request after another: K images in flight."""
    done, errors, end = 0, 0, time.monotonic() + args.duration
    started = time.monotonic()

    async def loop(k: int) -> None:
        nonlocal done, errors
        i = k
        while time.monotonic() < end:
            try:
                await image(base, i, args)
                done += 1
            except Exception as exc:  # counted; the loop goes on after a pause
                errors += 1
                if errors == 1:
                    print(f"image loop {k}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
                await asyncio.sleep(1.0)
            i += args.images

    await asyncio.gather(*(loop(k) for k in range(args.images)))
    return {"images": done, "errors": errors, "images/min": 60 * done / (time.monotonic() - started)}


class GpuBusy:
    """A GPU's busy share over a stretch of time: `read()` (a utilization percentage) every `period`
    seconds on a thread, from `start()` to `stop()`, which returns the mean of the readings."""

    def __init__(self, read: Callable[[], float], period: float = 0.5) -> None:
        self._read, self._period = read, period
        self._readings: list[float] = []
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def nvml(cls, index: int) -> "GpuBusy":
        import pynvml  # nvidia-ml-py: only with --gpu-busy

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return cls(lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))

    def start(self) -> None:
        self._readings, self._stopped = [], threading.Event()
        self._thread = threading.Thread(target=self._sample, name="gpu-busy", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            self._readings.append(self._read())
            if self._stopped.wait(self._period):
                return

    def stop(self) -> float:
        self._stopped.set()
        self._thread.join()
        return sum(self._readings) / len(self._readings)


async def phase(kinds: list[str], base: str, args) -> dict:
    """The given kinds at once; {kind: figures} plus the engine's late ticks (and with --gpu-busy the
    GPU's busy share) over the phase."""
    http, ws = f"http://{base}", f"ws://{base}"
    jobs = {"duplex": lambda: duplex_load(ws, args), "tts": lambda: tts_load(http, args),
            "transcription": lambda: transcription_load(ws, http, args), "image": lambda: image_load(base, args)}
    before = await asyncio.to_thread(scrape, http)
    if args.busy is not None:
        args.busy.start()
    results = await asyncio.gather(*(jobs[k]() for k in kinds))
    busy = args.busy.stop() if args.busy is not None else None
    after = await asyncio.to_thread(scrape, http)
    figures = dict(zip(kinds, results))
    late = after["parley_engine_late_ticks_total"] - before["parley_engine_late_ticks_total"]
    figures["engine"] = {"late ticks": late}
    if busy is not None:
        figures["engine"]["GPU busy %"] = busy
    return figures


def table(alone: dict, together: dict) -> list[str]:
    lines = ["| kind | figure | alone | together |", "|---|---|---:|---:|"]
    for kind, figures in together.items():
        lines += [f"| {kind} | {name} | {fmt(alone[kind][name])} | {fmt(value)} |" for name, value in figures.items()]
    return lines


def fmt(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


async def run(base: str, args, kinds: list[str]) -> tuple[float, float]:
    """Each kind alone, then together; returns the together phase's (start, end), time.time()."""
    alone: dict = {}
    for kind in kinds:
        alone[kind] = await phase([kind], base, args)
        print(f"{kind} alone: {json.dumps(alone[kind])}", flush=True)
    started = time.time()
    together = await phase(kinds, base, args)
    window = (started, time.time())
    print(f"together: {json.dumps(together)}", flush=True)
    engine = together.pop("engine")
    print("\n".join(table({k: alone[k][k] for k in kinds}, together)))
    for figure, form in (("late ticks", "{:.0f}"), ("GPU busy %", "{:.1f}")):
        if figure in engine:
            print(f"{figure}: " + ", ".join(f"{k} alone {form.format(alone[k]['engine'][figure])}" for k in kinds)
                  + f", together {form.format(engine[figure])}")
    return window


def server_flags(args, kinds: list[str]) -> list[str]:
    """--models' flags, then --serve-arg's (the later wins), then the sizes the load needs where not given."""
    flags = [*(model_flags(args.models) if args.models is not None else []), *args.serve_arg]
    needs = {"--max-sessions": args.duplex + 2, "--tts-slots": max(args.tts, 1),
             "--stt-slots": max(args.transcription, 1)}
    if args.tick_trace is not None:  # every phase's ticks, twice over (a tick's line is written only once)
        flags.append(f"--tick-trace={full_trace(args.tick_trace)}")
        needs["--tick-trace-ticks"] = int(2 * (len(kinds) + 1) * args.duration / TICK_S) + 1000
    return flags + [f"{flag}={n}" for flag, n in needs.items() if not any(a.startswith(flag) for a in flags)]


def full_trace(path: Path) -> Path:
    """Where the server writes its whole trace, beside the together phase's."""
    return path.with_name(path.name + ".all")


def cut_trace(path: Path, window: tuple[float, float]) -> int:
    """The ticks of the server's trace (PATH.all, then removed) that started within `window` to `path`
    (with the header); returns how many."""
    source = full_trace(path)
    header, ticks = read_trace(source)
    kept = [tick for tick in ticks if window[0] <= tick["wall"] <= window[1]]
    path.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in (header, *kept)))
    source.unlink()
    return len(kept)


def model_flags(directory: Path) -> list[str]:
    from write_models import serve_args  # torch and the writers: only with --models, not in the clients

    flags = serve_args(directory)
    if not flags:
        raise SystemExit(f"mixed_load.py: --models {directory}: no model written there (benchmarks/write_models.py)")
    return flags


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duplex", type=int, default=2, help="/api/chat sessions (default %(default)s)")
    p.add_argument("--tts", type=int, default=1, help="/v1/audio/speech streams (default %(default)s)")
    p.add_argument("--transcription", type=int, default=2, help="transcription sessions (default %(default)s)")
    p.add_argument("--images", type=int, default=1, help="images in flight, K (default %(default)s)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per phase (default %(default)s)")
    p.add_argument("--procs", type=int, default=1, help="processes for the duplex clients (several beyond ~48)")
    p.add_argument("--tts-voice", default="alloy", help="the voice every TTS request asks for (default %(default)s)")
    p.add_argument("--image-size", default="auto", help="each image's size, WxH or auto (default %(default)s)")
    p.add_argument("--image-steps", type=int, default=20, help="denoising steps per image (default %(default)s)")
    p.add_argument("--models", type=Path, default=None,
                   help="serve what benchmarks/write_models.py wrote in this directory")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an extra `parley serve` argument (repeat); none: the demo server (every modality, tiny)")
    p.add_argument("--tick-trace", type=Path, default=None, metavar="PATH",
                   help="keep the server's tick timeline of the together phase in PATH and print its table")
    p.add_argument("--gpu-busy", type=int, nargs="?", const=0, default=None, metavar="INDEX",
                   help="also report each phase's GPU busy share, NVML's utilization of GPU INDEX (default 0, "
                        "as NVML numbers them) read every 0.5 s; needs nvidia-ml-py (the bench extra) and an "
                        "NVIDIA driver")
    args = p.parse_args(argv)
    args.busy = None
    if args.gpu_busy is not None:
        try:
            args.busy = GpuBusy.nvml(args.gpu_busy)
        except Exception as exc:  # no module, no driver, no such index: say which
            p.error(f"--gpu-busy {args.gpu_busy}: NVML cannot read that GPU ({type(exc).__name__}: {exc})")
    kinds = [k for k in KINDS if getattr(args, "images" if k == "image" else k) > 0]
    if not kinds:
        p.error("nothing to run: every kind's count is 0")
    if args.tick_trace is not None and any(a.startswith("--tick-trace") for a in args.serve_arg):
        p.error("--tick-trace sets the server's --tick-trace and --tick-trace-ticks: drop them from --serve-arg")
    if args.tick_trace is not None and not args.tick_trace.parent.is_dir():
        p.error(f"--tick-trace {args.tick_trace}: its directory does not exist")
    with child_server(server_flags(args, kinds)) as (base, _pid):
        window = asyncio.run(run(base, args, kinds))
    if args.tick_trace is not None:  # the server has stopped: its trace is complete
        print(f"tick trace: {cut_trace(args.tick_trace, window)} ticks of the together phase in {args.tick_trace}")
        print("\n".join(timeline_table(*read_trace(args.tick_trace))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
