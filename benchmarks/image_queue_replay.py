"""The image queue's scheduling replayed on a fake clock with measured item costs (CPU, seconds).

The real ImageQueue and SlackRunner schedule a tiny real pipeline whose calls cost scripted
time (tests/clocked_stepper.py): each 80 ms tick a voice frame of `--frame` ms, then the
slack until the boundary minus the guard. K requests stay outstanding (a finished one is
replaced at the next tick, as in benchmarks/diffusion_interference.py). It shows what the
queue's rules make of a GPU's item costs without the GPU: steps/s and its share of
standalone (back-to-back steps of `--max-batch` jobs at the scripted cost), first partial
image p50/max (of every request, and of the replacements only: the K requests of the start
arrive at once, so the last of them waits for the others' first partials under any order;
a replacement arrives into a running queue, the steady state), slack used, items past the boundary, items per kind, and images failed as
stalled (no item for `--stall-timeout` s of the replay's clock; a stalled request is replaced
like a finished one).

    python benchmarks/image_queue_replay.py                 # H200 costs at B=64, 512 px (benchmarks/NOTES.md)
    python benchmarks/image_queue_replay.py --loads 4 --encode-ms 22
    python benchmarks/image_queue_replay.py --cold-side 1.5 --frame 0.055   # 768 px never measured, B=128

`--cold-side` asks for images that many times the measured size's side (the tiny pipeline's
16 px, standing for SD-1.5's 512; rounded to the latent stride): their items cost the measured
ones scaled by pixels to `--pixel-exponent` (0.78: H200 SD-1.5 denoise, 13.5 ms at 512 px,
40.0 ms at 1024 px), and start on the queue's prediction (engine/image_costs.py) until measured.

A projection, not a measurement: real costs vary, estimates are the max of observed costs, and
host time between items is not modelled (the default margin puts estimates 2 % above costs).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # clocked_stepper: the tests' fake-clock stepper
from clocked_stepper import ClockedStepper  # noqa: E402
from parley.engine.image_queue import ImagePartial, ImageQueue, ImageRefused, ImageSpec  # noqa: E402
from parley.engine.slack import SlackRunner  # noqa: E402
from parley.engine.stream import Status, Terminal  # noqa: E402
from parley.models.image_pipeline import stepper_for  # noqa: E402
from parley.models.tiny_diffusion import tiny_pipeline  # noqa: E402


class Clock:
    t = 0.0

    def now(self) -> float:
        return self.t


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


async def replay(args, load: int, inner) -> dict:
    clock = Clock()
    ms = 1e-3
    size = inner.default_size
    stepper = ClockedStepper(inner, clock, {
        "encode": args.encode_ms * ms, "denoise": args.denoise_ms * ms, "denoise_row": args.denoise_row_ms * ms,
        "preview": args.preview_ms * ms, "decode": args.decode_ms * ms}, scale_from=size, exponent=args.pixel_exponent)
    queue = ImageQueue(stepper, max_slack_s=args.tick - args.guard, max_batch=args.max_batch, capacity=load,
                       stall_timeout_s=args.stall_timeout, now=clock.now)
    runner = SlackRunner(clock.now, lambda: None, args.guard)
    side = round(size * args.cold_side / inner.latent_stride) * inner.latent_stride  # what is asked for
    scale = (side / size) ** (2 * args.pixel_exponent)  # its costs over the measured size's
    estimates = ClockedStepper(inner, Clock(), {k: v * (1 + args.margin) for k, v in stepper.costs.items()})
    estimates.seed(runner.costs, queue, size, size)
    runner.add_source(queue)
    submitted: dict = {}
    first: list[float] = []
    steady: list[float] = []  # first partials of the replacements (not the start's K)
    done = count = 0

    def submit() -> None:
        nonlocal count
        request = queue.submit(ImageSpec(f"p{count}", side, side, args.steps, 7.5, seed=count, partial_images=1))
        submitted[request] = [clock.t, False, count >= load]
        count += 1

    for _ in range(load):
        submit()
    for tick in range(args.ticks):
        clock.t = tick * args.tick + args.frame
        runner.run_until((tick + 1) * args.tick)
        for request in list(submitted):
            for event in request.events.drain():
                if isinstance(event, ImagePartial) and not submitted[request][1]:
                    first.append((tick + 1) * args.tick - submitted[request][0])
                    if submitted[request][2]:
                        steady.append(first[-1])
                    submitted[request][1] = True
                elif isinstance(event, Terminal):
                    done += event.status is Status.COMPLETED  # else stalled (counted by the queue)
                    del submitted[request]
                    submit()
    seconds = args.ticks * args.tick
    standalone = args.max_batch / (stepper.denoise_cost(args.max_batch) * scale)
    kinds = Counter(kind if kind != "denoise" else f"denoise x{round((cost / scale - stepper.costs['denoise']) / max(stepper.costs['denoise_row'], 1e-9)) + 1}"
                    for _, kind, cost in stepper.log)
    return {"K": load, "steps_per_s": queue.counts["images_denoise_steps"] / seconds, "standalone": standalone,
            "images_per_min": done * 60 / seconds, "first_p50": pct(first, 50), "first_max": max(first, default=float("nan")),
            "steady_p50": pct(steady, 50), "steady_max": max(steady, default=float("nan")),
            "slack_used": sum(cost for _, _, cost in stepper.log) / seconds, "past_boundary": runner.stats.past_boundary,
            "kinds": dict(sorted(kinds.items())), "stalled": queue.counts["images_stalled"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", default="1,4,16", help="outstanding image requests K")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--ticks", type=int, default=300, help="ticks replayed (80 ms each)")
    parser.add_argument("--tick", type=float, default=0.080)
    parser.add_argument("--guard", type=float, default=0.003)
    parser.add_argument("--frame", type=float, default=0.0175, help="voice frame + host work before the slack, s")
    # H200, SD-1.5 shapes, bf16, 512 px (benchmarks/NOTES.md, eea73f4); encode after the negative-prompt cache
    parser.add_argument("--encode-ms", type=float, default=12.0)
    parser.add_argument("--denoise-ms", type=float, default=13.5, help="a batch-1 CFG step")
    parser.add_argument("--denoise-row-ms", type=float, default=5.5, help="each further job in a step")
    parser.add_argument("--preview-ms", type=float, default=10.3)
    parser.add_argument("--decode-ms", type=float, default=24.3)
    parser.add_argument("--cold-side", type=float, default=1.0, help="requested side over the measured one")
    parser.add_argument("--pixel-exponent", type=float, default=0.78, help="cost ~ pixels ** this")
    parser.add_argument("--stall-timeout", type=float, default=60.0,
                        help="s a request may go without an item before it fails (parley serve --image-stall-timeout)")
    parser.add_argument("--margin", type=float, default=0.02, help="estimates above the costs (max-of-window noise)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    inner = stepper_for(tiny_pipeline("sd"))
    print("| K | steps/s (% of standalone) | images/min | first partial p50/max s | replacements' first partial p50/max s "
          "| slack used | past boundary | items |")
    print("|---|---|---|---|---|---|---|---|")
    for load in (int(x) for x in args.loads.split(",")):
        try:
            r = asyncio.run(replay(args, load, inner))
        except ImageRefused as exc:  # admission predicted an item that never fits the slack
            print(f"| {load} | refused: {exc} ||||||", flush=True)
            continue
        print(f"| {load} | {r['steps_per_s']:.1f} ({100 * r['steps_per_s'] / r['standalone']:.0f} % of "
              f"{r['standalone']:.0f}) | {r['images_per_min']:.0f} | {r['first_p50']:.2f}/{r['first_max']:.2f} | "
              f"{r['steady_p50']:.2f}/{r['steady_max']:.2f} | "
              f"{100 * r['slack_used']:.0f} % | {r['past_boundary']} | "
              + ", ".join([f"{k} {v}" for k, v in r["kinds"].items()]
                          + ([f"{r['stalled']} images stalled"] if r["stalled"] else [])) + " |", flush=True)


if __name__ == "__main__":
    main()
