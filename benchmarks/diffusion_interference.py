"""Voice ticks under image load: does diffusion in the slack make any voice tick late?

The real engine thread on its 80 ms clock runs B duplex sessions (Moshi-7B shapes, random bf16,
the CUDA-graphed frame) while the image queue keeps K text-to-image requests outstanding
(SD-1.5 shapes, random weights, on CUDA with the loader's `speed_up` as the server serves them;
a finished request is replaced at once). Per scenario:

    voice: tick start lateness (actual - scheduled) p50/p99/max and ticks > 1 ms late;
           voice done (tick start -> outputs on the host) p99, against the K = 0 run at that B
    images: denoise steps/s, images/min, time to first partial image (p50/max: of all requests, and
           of those that replaced a finished one, since the K sent together at the start queue
           behind each other), against two baselines without voice:
           - bare: batch-`--max-batch` denoise steps back to back (no clock, no encode, preview or
             decode): the stricter figure, since the engine's steps/s leaves out the other items;
           - queue alone: the same image queue, K and size on the same 80 ms clock for the same
             seconds with no duplex sessions (an idle engine runs no frame, and since `55d2a10` its
             slack runs on past the boundaries: items back to back); steps/s and images/min as % of it measure only what the voice load costs
    slack:  image GPU time / tick time, estimator overruns, items past the boundary, and where
            it went: items, ms per item and the estimate per image item kind (--breakdown)

    python benchmarks/diffusion_interference.py                       # H200: B 1,16,64 x K 0,1,4,16 x 512,1024
    python benchmarks/diffusion_interference.py --smoke --loads 0,1,2   # CPU: tiny models, checks it runs

Pass bar (issue 9; benchmarks/NOTES.md, "Diffusion in the slack"): lateness p99 <= 1 ms, voice done p99
within max(2 %, 0.5 ms) of K = 0, zero items past the boundary; diffusion >= 50 % of standalone at
B = 64, 512 px.
(--no-alone skips the queue-alone runs.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

from parley.engine import Engine, EngineConfig, Terminal, TickClock
from parley.engine.backend import ModelBackend
from parley.engine.image_queue import ImagePartial, ImageQueue, ImageSpec
from parley.engine.slack import CostModel
from parley.models.checkpoint import Checkpoint, load_checkpoint
from parley.models.config import LMConfig, MimiConfig, SamplingDefaults
from parley.models.image_pipeline import ImageStepper, default_speed_up, stepper_for
from parley.models.lm import LMModel
from parley.models.mimi.codec import Mimi
from parley.models.synthetic import write_tiny_checkpoint
from parley.models.tiny_diffusion import sd15_shaped, tiny_pipeline


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class RecordingClock(TickClock):
    """The engine's clock, recording each tick's start lateness."""

    def __init__(self, period: float) -> None:
        super().__init__(period)
        self.starts: list[float] = []  # actual start of each tick
        self.lateness: list[float] = []

    def wait(self, stop: threading.Event, idle: bool = False) -> bool:
        due = self.next_boundary()
        ok = super().wait(stop, idle)
        now = self.now()
        self.starts.append(now)
        if due is not None and not idle:  # (after an idle tick no frame was due: not lateness)
            self.lateness.append(now - due)
        return ok


class TimedBackend:
    """A FrameBackend wrapper that records when each frame's outputs reached the host."""

    def __init__(self, inner, clock: RecordingClock) -> None:
        self.inner, self.clock, self.done = inner, clock, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def text_piece(self, token: int) -> str:
        return ""  # random weights emit arbitrary ids; the transcript is not measured

    def step(self, frames, live_mask):
        host = self.inner.step(frames, live_mask).to_host()
        self.done.append(self.clock.now() - self.clock.starts[-1])
        return _Ready(host)


class _Ready:
    queued = False  # already waited for and copied (BackendOutput.queued)

    def __init__(self, host) -> None:
        self.host = host

    def to_host(self):
        return self.host


def voice_checkpoint(smoke: bool, device: str) -> Checkpoint:
    if smoke:
        directory = Path(tempfile.mkdtemp(prefix="parley-bench-"))
        return load_checkpoint(write_tiny_checkpoint(directory, kind="moshi"), device=device, dtype=torch.float32)
    torch.manual_seed(0)
    lm_cfg, mimi_cfg = LMConfig(), MimiConfig()
    lm = LMModel(lm_cfg, device=device, dtype=torch.bfloat16).eval()
    mimi = Mimi(mimi_cfg).to(device).eval()
    return Checkpoint(lm=lm, mimi=mimi, tokenizer=None, lm_config=lm_cfg, mimi_config=mimi_cfg, voices_dir=None,
                      sampling=SamplingDefaults(), model_type="moshi", path=Path("."))


def image_pipe(smoke: bool, device: str) -> DiffusionPipeline:
    """The tiny SD pipeline (CPU), or SD-1.5's shapes with random bf16 weights on `device`."""
    return tiny_pipeline("sd") if smoke else sd15_shaped().to(device, torch.bfloat16)


def image_stepper(smoke: bool, device: str) -> ImageStepper:
    """As the server loads a pipeline: on CUDA with the loader's default speed-ups."""
    pipe = image_pipe(smoke, device)
    return stepper_for(pipe, "" if smoke else "sd15-shaped", default_speed_up(pipe, device))


def standalone_steps_per_s(stepper: ImageStepper, size: int, batch: int, steps: int, sync) -> float:
    """Denoise steps/s back to back, no voice, no clock: graphed as in the engine (on CUDA)."""
    queue = ImageQueue(stepper, max_slack_s=1e9, max_batch=batch, warm_sizes=[(size, size, True)])
    queue.warm_up(CostModel())
    predict = queue.graphed_predict(size, size, True, batch)
    cond = stepper.encode("standalone", None, True)
    jobs = [stepper.start(cond, size, size, steps + 2, 7.5, i) for i in range(batch)]
    stepper.denoise(jobs, predict=predict)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        stepper.denoise(jobs, predict=predict)
    sync()
    elapsed = time.perf_counter() - start
    queue.close_graphs()
    return steps * batch / elapsed


async def scenario(checkpoint, stepper, args, batch: int, load: int, size: int, voice: bool = True) -> dict:
    """One (B, K, px) run; `voice=False`: the same engine with no duplex session open (the
    queue-alone baseline: every tick is all slack)."""
    clock = RecordingClock(args.tick)
    backend = TimedBackend(ModelBackend(checkpoint, batch, cuda_graphs=args.device == "cuda", seed=0), clock)
    engine = Engine(backend, EngineConfig(tick_seconds=args.tick), clock=clock)
    queue = ImageQueue(stepper, max_slack_s=args.tick - engine.config.slack_guard_s, capacity=max(load, 1),
                       max_batch=args.max_batch, warm_sizes=[(size, size, True)])
    queue.warm_up(engine.slack_costs)
    engine.add_slack_source(queue)
    engine.start()
    sessions = [await engine.open() for _ in range(batch if voice else 0)]
    first_partial: list[float] = []
    first_partial_new: list[float] = []  # requests that replaced a finished one (not the start's K at once)
    done_images = 0
    refused = ""

    async def one_image(i: int) -> None:
        nonlocal done_images
        submitted = time.perf_counter()
        request = queue.submit(ImageSpec(f"image {i}", size, size, args.steps, 7.5, seed=i, partial_images=1))
        seen_partial = False
        async for event in request.events:
            if isinstance(event, ImagePartial) and not seen_partial:
                first_partial.append(time.perf_counter() - submitted)
                if i >= load:
                    first_partial_new.append(first_partial[-1])
                seen_partial = True
            elif isinstance(event, Terminal):
                if event.status.value == "completed":
                    done_images += 1
                else:
                    raise RuntimeError(event.reason)

    async def keep_outstanding(worker: int) -> None:
        nonlocal refused
        i = worker
        while True:
            try:
                await one_image(i)
            except Exception as exc:  # e.g. the size never fits: report it, stop this load
                refused = str(exc)
                return
            i += load

    await asyncio.sleep(args.settle)  # sessions live, graphs warm
    c0, steps0, t_ticks = engine.counters(), queue.counts["images_denoise_steps"], len(clock.lateness)
    by_key0 = engine.slack_by_key()
    done0 = len(backend.done)
    workers = [asyncio.create_task(keep_outstanding(w)) for w in range(load)]
    start = time.perf_counter()
    await asyncio.sleep(args.seconds)
    elapsed = time.perf_counter() - start
    c1, steps1 = engine.counters(), queue.counts["images_denoise_steps"]
    breakdown = {}
    for key, (items, seconds) in engine.slack_by_key().items():
        items0, seconds0 = by_key0.get(key, (0, 0.0))
        if key[0] == "image" and items > items0:
            name = key[1] + (f"x{key[-1]}" if key[1] == "denoise" else "")
            estimate = engine.slack_costs.estimate(key)
            breakdown[name] = {"items": items - items0, "ms_per_item": 1e3 * (seconds - seconds0) / (items - items0),
                               "estimate_ms": 1e3 * estimate if estimate is not None else None}
    lateness = [x * 1e3 for x in clock.lateness[t_ticks:]]
    voice_done = [x * 1e3 for x in backend.done[done0:]]
    for w in workers:
        w.cancel()
    for s in sessions:
        s.close()
    await asyncio.to_thread(engine.shutdown)
    queue.close_graphs()
    ticks = c1["ticks"] - c0["ticks"]
    return {
        "B": batch, "K": load, "px": size,
        "late_p50_ms": pct(lateness, 50), "late_p99_ms": pct(lateness, 99), "late_max_ms": max(lateness, default=0),
        "late_over_1ms": sum(x > 1.0 for x in lateness),
        "voice_done_p99_ms": pct(voice_done, 99),
        "steps_per_s": (steps1 - steps0) / elapsed, "images_per_min": done_images * 60 / elapsed,
        "first_partial_p50_s": pct(first_partial, 50), "first_partial_max_s": max(first_partial, default=float("nan")),
        "first_partial_new_p50_s": pct(first_partial_new, 50),
        "first_partial_new_max_s": max(first_partial_new, default=float("nan")),
        "slack_used": (c1["slack_seconds"] - c0["slack_seconds"]) / max(ticks * args.tick, 1e-9),
        "overruns": c1["slack_overruns"] - c0["slack_overruns"],
        "past_boundary": c1["slack_past_boundary"] - c0["slack_past_boundary"],
        "stale_trials": c1["slack_stale_trials"] - c0["slack_stale_trials"],
        "refused": refused[:120], "breakdown": breakdown,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU (checks the script runs)")
    parser.add_argument("--batches", default=None, help="voice sessions B (default 1,16,64; smoke 1,2)")
    parser.add_argument("--loads", default="0,1,4,16", help="outstanding image requests K")
    parser.add_argument("--sizes", default=None, help="image sides in px (default 512,1024; smoke 16,32)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per image")
    parser.add_argument("--max-batch", type=int, default=4, help="image jobs per shared denoise step")
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per scenario (10; smoke 2)")
    parser.add_argument("--settle", type=float, default=1.0, help="unmeasured seconds before each scenario")
    parser.add_argument("--tick", type=float, default=None,
                        help="the voice clock's period (0.08; smoke 0.5: the tiny CPU frame alone takes ~0.1-0.3 s)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--breakdown", action="store_true", help="print where each scenario's slack went")
    parser.add_argument("--no-alone", action="store_true",
                        help="skip the queue-alone baseline runs (one per K and size: the same queue, no voice)")
    args = parser.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke for the CPU check")
    if args.smoke:
        torch.set_num_threads(1)
    batches = [int(x) for x in (args.batches or ("1,2" if args.smoke else "1,16,64")).split(",")]
    sizes = [int(x) for x in (args.sizes or ("16,32" if args.smoke else "512,1024")).split(",")]
    loads = [int(x) for x in args.loads.split(",")]
    args.seconds = args.seconds or (3.0 if args.smoke else 10.0)
    args.tick = args.tick or (0.5 if args.smoke else 0.08)
    checkpoint = voice_checkpoint(args.smoke, args.device)
    stepper = image_stepper(args.smoke, args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    standalone = {size: standalone_steps_per_s(stepper, size, args.max_batch, 10, sync) for size in sizes}
    rows, alone = [], {}  # alone: (K, px) -> the queue-alone row, measured once (it has no B)

    def queue_alone(batch: int, load: int, size: int) -> dict | None:
        if args.no_alone:
            return None
        if (load, size) not in alone:
            alone[(load, size)] = asyncio.run(scenario(checkpoint, stepper, args, batch, load, size, voice=False))
        return alone[(load, size)]

    def ratio(value: float, base: float | None) -> str:
        return f"{100 * value / base:.0f} %" if base else "-"

    header = ("B", "K", "px", "late p50/p99/max ms", ">1ms", "voice p99 ms (vs K=0)", f"steps/s (% bare x{args.max_batch})",
              "steps % queue alone", "img/min (% queue alone)", "1st partial p50/max s", "new arrivals' 1st partial p50/max s", "slack used", "overruns",
              "past bound")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for batch in batches:
        baseline = None
        for size in sizes:
            for load in loads:
                if load == 0 and size != sizes[0]:
                    continue  # the no-image baseline does not depend on the image size
                row = asyncio.run(scenario(checkpoint, stepper, args, batch, load, size))
                rows.append(row)
                if load == 0:
                    baseline = row["voice_done_p99_ms"]
                share = 100 * row["steps_per_s"] / standalone[size] if load else 0
                base = queue_alone(batch, load, size) if load else None
                row["queue_alone"] = base and {k: base[k] for k in ("steps_per_s", "images_per_min",
                                                                    "first_partial_p50_s", "slack_used")}
                print(f"| {batch} | {load} | {size if load else '-'} | {row['late_p50_ms']:.2f}/{row['late_p99_ms']:.2f}/"
                      f"{row['late_max_ms']:.2f} | {row['late_over_1ms']} | {row['voice_done_p99_ms']:.2f} "
                      f"({row['voice_done_p99_ms'] - (baseline or row['voice_done_p99_ms']):+.2f}) | "
                      f"{row['steps_per_s']:.1f} ({share:.0f} %) | "
                      f"{ratio(row['steps_per_s'], base and base['steps_per_s'])} | {row['images_per_min']:.1f} "
                      f"({ratio(row['images_per_min'], base and base['images_per_min'])}) | "
                      f"{row['first_partial_p50_s']:.2f}/{row['first_partial_max_s']:.2f} | "
                      f"{row['first_partial_new_p50_s']:.2f}/{row['first_partial_new_max_s']:.2f} | "
                      f"{100 * row['slack_used']:.0f} % | {row['overruns']} | {row['past_boundary']} |"
                      + (f" refused: {row['refused']}" if row["refused"] else ""), flush=True)
                if args.breakdown and row["breakdown"]:
                    print("    slack by item: " + ", ".join(
                        f"{name} {v['items']} x {v['ms_per_item']:.1f} ms (est {v['estimate_ms']:.1f})"
                        for name, v in sorted(row["breakdown"].items())), flush=True)
    print("bare denoise steps/s (batch %d, back to back): %s" % (args.max_batch, {k: round(v, 1) for k, v in standalone.items()}))
    for (load, size), row in alone.items():
        print(f"queue alone K={load} {size} px (no voice, {args.seconds:g} s): {row['steps_per_s']:.1f} steps/s, "
              f"{row['images_per_min']:.1f} img/min, 1st partial p50 {row['first_partial_p50_s']:.2f} s, "
              f"slack used {100 * row['slack_used']:.0f} %" + (f", refused: {row['refused']}" if row["refused"] else ""))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "standalone_steps_per_s": standalone,
                                         "queue_alone": [{"K": k, "px": px, **row} for (k, px), row in alone.items()]},
                                        indent=1, default=str))


if __name__ == "__main__":
    main()
