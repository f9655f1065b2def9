"""Where a frame's slow tail comes from: each frame's wall time (as frame_latency.py times it)
beside its GPU time (CUDA events around the step), with Python's garbage collector as it is and
then with the loaded objects frozen (as the server does, engine/gc_pauses.py). If the slow frames
are slow on the GPU too, the tail is the device's; if only their wall time is, it is the host's.
CUDA only; Moshi-7B shapes with random weights.

    python benchmarks/frame_gpu_time.py --batch 128 --kv-dtype fp8 --mimi-dtype bfloat16 --frames 200
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_latency import build_models  # noqa: E402
from frame_setup import WINDOWS, bench_checkpoint, percentile, place_rows  # noqa: E402

from parley.engine.backend import ModelBackend  # noqa: E402
from parley.engine.gc_pauses import freeze_loaded_objects  # noqa: E402
from parley.models.config import FRAME_SAMPLES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--window", choices=WINDOWS, default="full")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--mimi-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--frames", type=int, default=200, help="timed frames per case")
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    if args.batch < 1 or args.frames < 1 or args.warmup < 0:
        parser.error("--batch and --frames must be at least 1, --warmup at least 0")
    if not torch.cuda.is_available():
        sys.exit("frame_gpu_time needs a CUDA GPU")
    _, _, lm, mimi, lm_cfg, mimi_cfg = build_models("moshi", "cuda", torch.bfloat16)
    if args.mimi_dtype == "bfloat16":
        mimi = copy.deepcopy(mimi).compute_in(torch.bfloat16)
    kv = torch.float8_e4m3fn if args.kv_dtype == "fp8" else None
    backend = ModelBackend(bench_checkpoint(lm, mimi, lm_cfg, mimi_cfg), args.batch, cuda_graphs=True, seed=0,
                           kv_dtype=kv)
    pcm = torch.randn(args.batch, FRAME_SAMPLES) * 0.1
    live = torch.ones(args.batch, dtype=torch.bool)
    place_rows(backend._lm_state, args.window, lm_cfg.context)
    passes = [0]
    gc.callbacks.append(lambda phase, info: passes.__setitem__(0, passes[0] + (phase == "start")))
    print(f"GPU: {torch.cuda.get_device_name()}  B={args.batch} {args.window} KV {args.kv_dtype} "
          f"Mimi {args.mimi_dtype}")
    for label in ("gc as is", "gc frozen"):
        if label == "gc frozen":
            freeze_loaded_objects()
        walls, gpus = [], []
        passes[0] = 0
        for i in range(args.warmup + args.frames):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            out = backend.step(pcm, live)
            end.record()
            out.to_host()
            torch.cuda.synchronize()
            if i >= args.warmup:
                walls.append((time.perf_counter() - t0) * 1e3)
                gpus.append(start.elapsed_time(end))
        print(f"{label}: wall p50 {percentile(walls, 50):.2f} p99 {percentile(walls, 99):.2f} max {max(walls):.2f} | "
              f"gpu p50 {percentile(gpus, 50):.2f} p99 {percentile(gpus, 99):.2f} max {max(gpus):.2f} | "
              f"gc passes {passes[0]}")
        worst = sorted(range(len(walls)), key=lambda j: -walls[j])[:6]
        print("  slowest frames (index: wall / gpu ms):",
              "; ".join(f"{j}: {walls[j]:.2f} / {gpus[j]:.2f}" for j in worst))
    backend.close()


if __name__ == "__main__":
    main()
