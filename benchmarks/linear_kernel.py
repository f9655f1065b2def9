"""The decode step's weight matmuls alone (Moshi-7B shapes): `kernels.linear` (each weight row read
once against all rows of x) against F.linear (cuBLAS), at the row counts of a frame's buckets,
as time and bandwidth over the weight bytes. CUDA only.

    python benchmarks/linear_kernel.py --rows 1,8,64
    python benchmarks/linear_kernel.py --rows 1 --launches 16x256x4x4,32x256x4x4,16x512x3x4,8x512x4x4

A frame reads every weight once per layer (temporal: 32 layers x 4 matmuls; depformer: 6 layers
x 4 per codebook step), so the per-frame sum of these times is most of a B = 1 frame's LM step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_setup import H200_COPY_TBPS, model_configs  # noqa: E402

from parley.models import kernels  # noqa: E402
from parley.models.transformer import gated_hidden_dim  # noqa: E402


def weight_shapes() -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, uses per frame) for Moshi-7B's temporal and depformer layers."""
    cfg, _ = model_configs("moshi")
    d, h = cfg.dim, gated_hidden_dim(cfg.dim, int(cfg.hidden_scale * cfg.dim))
    dd, dh = cfg.depformer_dim, gated_hidden_dim(cfg.depformer_dim, cfg.depformer_dim_feedforward)
    steps = cfg.dep_q * cfg.depformer_num_layers
    return {"temporal qkv": (3 * d, d, cfg.num_layers), "temporal out": (d, d, cfg.num_layers),
            "temporal ffn in": (2 * h, d, cfg.num_layers), "temporal ffn out": (d, h, cfg.num_layers),
            "depformer qkv": (3 * dd, dd, steps), "depformer out": (dd, dd, steps),
            "depformer ffn in": (2 * dh, dd, steps), "depformer ffn out": (dd, dh, steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--launches", help="BLOCK_NxBLOCK_KxSTAGESxWARPS, comma-separated (default: the kernel's)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not kernels.have_triton():
        sys.exit("linear_kernel.py needs a CUDA device and Triton")
    import triton.testing

    launches = [None] + [kernels.LinearLaunch(*(int(v) for v in s.split("x"))) for s in (args.launches or "").split(",") if s]
    shapes = weight_shapes()
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for name, (n, k, _) in shapes.items()}
    for m in (int(r) for r in args.rows.split(",")):
        totals = {"F.linear": 0.0}
        for name, (n, k, uses) in shapes.items():
            w = weights[name]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            nbytes = w.numel() * 2
            ms = triton.testing.do_bench(lambda: F.linear(x, w), warmup=25, rep=100, return_mode="median")
            totals["F.linear"] += ms * uses
            line = f"rows {m:3} {name:18} [{n:5} x {k:5}]  F.linear {ms * 1000:7.1f} us {nbytes / ms / 1e9:5.2f} TB/s"
            for launch in launches:
                label = "x".join(map(str, launch)) if launch else "default"
                got = kernels.linear(x, w, launch)
                err = (got.float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(lambda: kernels.linear(x, w, launch), warmup=25, rep=100,
                                             return_mode="median")
                totals[label] = totals.get(label, 0.0) + ms * uses
                line += f" | {label} {ms * 1000:7.1f} us {nbytes / ms / 1e9:5.2f} TB/s (diff {err:.1e})"
            print(line, flush=True)
        floor = sum(n * k * 2 * uses for n, k, uses in shapes.values()) / (H200_COPY_TBPS * 1e9)
        print(f"rows {m:3} per frame (x uses): " + ", ".join(f"{k} {v:.2f} ms" for k, v in totals.items())
              + f"; floor at {H200_COPY_TBPS} TB/s {floor:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
