"""Image items per speed-up variant: which of diffusers' inference advice makes them faster.

SD-1.5 shapes with random bf16 weights (diffusion_interference.py's builder), one copy per
variant of `speed_up` (models/image_pipeline.py): plain, channels_last (UNet and VAE weights
NHWC), fused_qkv (one GEMM for Q, K and V; the loader's default on CUDA, `CUDA_SPEEDUPS`
there, chosen by these figures), both. Each
variant's items run as the engine runs them: the image queue's warm-up captures its CUDA
graphs, then per size the median of `--replays` calls, timed with CUDA events, of

    step b1 / b4 (CFG): one denoise step of 1 / 4 images (2 / 8 UNet rows), graphed
    decode: the VAE decode of one image (graphed; above one VAE tile: tile by tile, eager)
    preview: the cheap look at unfinished latents (graphed)
    weights: the denoiser's and VAE's parameters (fusion keeps the unfused ones too)

    python benchmarks/image_step.py                        # H200: 512 px, all four variants (~1 min)
    python benchmarks/image_step.py --sizes 512,1024 --variants plain,both
    python benchmarks/image_step.py --smoke                # CPU: the tiny pipeline, checks it runs
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

from parley.engine.image_queue import ImageQueue
from parley.engine.slack import CostModel
from parley.models.image_pipeline import ImageStepper, speed_up, stepper_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusion_interference import image_pipe  # noqa: E402
from profile_frame import graph_ms  # noqa: E402

VARIANTS = {"plain": {"channels_last": False, "fused_qkv": False},
            "channels_last": {"channels_last": True, "fused_qkv": False},
            "fused_qkv": {"channels_last": False, "fused_qkv": True},
            "both": {"channels_last": True, "fused_qkv": True}}


def median_ms(fn, replays: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of `replays` calls after `warmup` (CUDA events on the GPU, as
    profile_frame.py times its graphs; the host clock for the CPU smoke run)."""
    if cuda:
        return graph_ms(fn, (), replays, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(replays):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def weights_mib(stepper: ImageStepper) -> float:
    modules = (stepper.denoiser, stepper.pipe.vae)
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters()) / 2 ** 20


def measure(stepper: ImageStepper, size: int, batches: list[int], args, cuda: bool) -> dict[str, float]:
    queue = ImageQueue(stepper, max_slack_s=1e9, max_batch=max(batches), warm_sizes=[(size, size, True)])
    queue.warm_up(CostModel())  # captures the graphs the engine would replay (eager on the CPU)
    cond = stepper.encode("benchmark", None, True, embed=queue.graphed_embed())
    steps = args.warmup + args.replays + 1
    row = {}
    for batch in batches:
        predict = queue.graphed_predict(size, size, True, batch)
        jobs = [stepper.start(cond, size, size, steps, 7.5, i) for i in range(batch)]
        row[f"step b{batch}"] = median_ms(lambda: stepper.denoise(jobs, predict=predict), args.replays,
                                          args.warmup, cuda)
    latents = jobs[0].latents

    def tiled_decode(latents):
        tiles = stepper.tiled_decode(latents)
        while not tiles.done:
            tiles.step()
        return tiles.image()

    decode = (tiled_decode if stepper.tiled(size, size)
              else queue.graphed(queue.decode_key(size, size)) or stepper.decode)
    row["decode"] = median_ms(lambda: decode(latents), args.replays, args.warmup, cuda)
    preview = queue.graphed(queue.preview_key(size, size)) or stepper.preview
    row["preview"] = median_ms(lambda: preview(latents), args.replays, args.warmup, cuda)
    row["weights MiB"] = weights_mib(stepper)
    queue.close_graphs()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--sizes", default=None, help="square sizes in px (default 512; --smoke: 16)")
    ap.add_argument("--batches", default="1,4", help="images per denoise step (CFG: twice the UNet rows)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="the tiny pipeline on the CPU (checks the code path)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if not args.smoke and not torch.cuda.is_available():
        ap.error("needs a CUDA device (--smoke runs the tiny pipeline on the CPU)")
    if args.replays < 1 or args.warmup < 0:
        ap.error("--replays must be at least 1 and --warmup at least 0")
    batches = sorted({int(b) for b in args.batches.split(",")})
    if batches[0] < 1:
        ap.error("--batches must be at least 1")
    device = "cpu" if args.smoke else "cuda"
    cuda = device == "cuda"
    sizes = [int(s) for s in (args.sizes or ("16" if args.smoke else "512")).split(",")]
    base = image_pipe(args.smoke, device)
    probe = stepper_for(base)
    for size in sizes:
        if size <= 0 or size % probe.latent_stride:
            ap.error(f"--sizes: {size} is not a positive multiple of {probe.latent_stride}")
    tiled = {size for size in sizes if probe.tiled(size, size)}
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}, "
          f"{next(base.unet.parameters()).dtype}, median of {args.replays} replays after {args.warmup}", flush=True)
    rows: dict[tuple[str, int], dict[str, float]] = {}
    for variant in variants:
        pipe = copy.deepcopy(base)
        stepper = stepper_for(pipe, variant, speed_up(pipe, **VARIANTS[variant]))
        for size in sizes:
            rows[variant, size] = measure(stepper, size, batches, args, cuda)
            print(f"  {variant} {size} px: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[variant, size].items()),
                  flush=True)
        del stepper, pipe
        if cuda:
            torch.cuda.empty_cache()
    columns = [f"step b{b}" for b in batches] + ["decode", "preview"]
    print("\n| variant | px | " + " | ".join(f"{c} ms" for c in columns) + " | weights MiB |")
    print("|---|---|" + "---|" * (len(columns) + 1))
    for (variant, size), row in rows.items():
        plain = rows.get(("plain", size))
        cells = [f"{row[c]:.2f}" + (f" ({100 * (row[c] / plain[c] - 1):+.1f} %)" if plain and variant != "plain"
                                    else "") for c in columns]
        print(f"| {variant} | {size}{'*' if size in tiled else ''} | " + " | ".join(cells)
              + f" | {row['weights MiB']:.1f} |")
    if tiled:
        print("* decode: tile by tile, eager (the latents exceed one VAE tile)")


if __name__ == "__main__":
    main()
