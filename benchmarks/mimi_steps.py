"""Mimi's encode and decode steps alone, each captured as a CUDA graph (CUDA only).

    python benchmarks/mimi_steps.py --batches 1,64,128 --variants float32,plain,bfloat16

Moshi's Mimi with random weights and random codebooks. Per batch B and variant: the median
ms of one graph replay, the CUDA kernels it runs, and its outputs against float32's over
`--frames` frames of noise (encode: the share of equal codes; decode of the same random codes:
the SNR of the audio). Variants:
- `float32`: what the engine runs by default (fused RoPE + ring write, matmul attention and
  codebook search, matmul transposed convs);
- `plain`: float32 with every fused path off (`kernels.enabled(False)`: PyTorch's SDPA, cdist,
  cuDNN's transposed convs; the CPU path's ops on the GPU);
- `bfloat16`: `Mimi.compute_in(torch.bfloat16)`, serve's `--mimi-dtype bfloat16`.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_setup import graph_ms, model_configs, random_mimi  # noqa: E402

from parley.engine.cuda_graph import CUDAGraphRunner  # noqa: E402
from parley.models import kernels  # noqa: E402
from parley.models.config import FRAME_SAMPLES  # noqa: E402
from parley.models.mimi import Mimi  # noqa: E402

VARIANTS = ("float32", "plain", "bfloat16", "float16")


def kernel_count(runner: CUDAGraphRunner, inputs, replays: int = 3) -> float:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            runner(*inputs)
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()) / replays


def run_variant(mimi: Mimi, batch: int, frames: int, fused: bool) -> dict:
    """Graph timings and the outputs of `frames` frames, for encode and decode."""
    live = torch.ones(batch, dtype=torch.bool, device="cuda")
    gen = torch.Generator("cuda").manual_seed(batch)
    pcm = torch.randn(frames, batch, FRAME_SAMPLES, device="cuda", generator=gen) * 0.1
    codes = torch.randint(0, mimi.cardinality, (frames, batch, mimi.num_codebooks), device="cuda", generator=gen)
    result = {}
    with kernels.enabled(fused):
        for step, inputs in (("encode", pcm), ("decode", codes)):
            state = mimi.init_state(batch, "cuda")
            fn = mimi.encode_step if step == "encode" else mimi.decode_step
            runner = CUDAGraphRunner(lambda x, m: (fn(x, state, m),), (inputs[0], live))
            state.reset(live)  # the graph's warm-up stepped it
            outputs = torch.stack([runner(x, live)[0].clone() for x in inputs])
            result[step] = {"ms": graph_ms(runner, (inputs[0], live), frames=50, warmup=5), "kernels": kernel_count(runner, (inputs[0], live)),
                            "out": outputs}
            runner.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,128", help="comma-separated batch sizes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    parser.add_argument("--frames", type=int, default=12, help="frames compared against float32")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        sys.exit(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        sys.exit(f"--batches {args.batches!r}: comma-separated integers")
    if args.frames < 1 or min(batches) < 1:
        sys.exit("--frames and every batch must be at least 1")
    if not torch.cuda.is_available():
        sys.exit("mimi_steps needs a CUDA GPU")
    torch.manual_seed(0)
    mimi = random_mimi(model_configs("moshi")[1])
    models = {"float32": (mimi, True), "plain": (mimi, False),
              "bfloat16": (copy.deepcopy(mimi).compute_in(torch.bfloat16), True),
              "float16": (copy.deepcopy(mimi).compute_in(torch.float16), True)}
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  Moshi Mimi, random weights")
    print("\n| B | variant | encode ms | encode kernels | decode ms | decode kernels | codes equal to float32 "
          "| decode SNR vs float32 |\n|---:|---|---:|---:|---:|---:|---:|---:|")
    for batch in batches:
        reference = run_variant(mimi, batch, args.frames, True)
        for variant in variants:
            model, fused = models[variant]
            r = reference if variant == "float32" else run_variant(model, batch, args.frames, fused)
            same = (r["encode"]["out"] == reference["encode"]["out"]).float().mean().item()
            a, ref = r["decode"]["out"], reference["decode"]["out"]
            noise = (a - ref).pow(2).sum().item()
            snr = "exact" if noise == 0 else f"{10 * torch.log10(ref.pow(2).sum() / noise).item():.1f} dB"
            print(f"| {batch} | {variant} | {r['encode']['ms']:.3f} | {r['encode']['kernels']:.0f} | "
                  f"{r['decode']['ms']:.3f} | {r['decode']['kernels']:.0f} | {same:.2%} | {snr} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
