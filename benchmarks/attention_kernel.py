"""The decode-attention kernel alone (models/kernels.py), one layer of Moshi-7B shapes, over
launch shapes: time, bandwidth reached against the bytes it must read, and agreement with the
default launch. CUDA only.

    python benchmarks/attention_kernel.py --batches 64,128 --kv bf16,fp8

Bytes: every live row's filled window of keys and values (plus the fp8 scales). Windows as in
frame_setup.py (`empty`, `spread`, `full`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_setup import H200_COPY_TBPS, window_positions  # noqa: E402

from parley.models import kernels  # noqa: E402
from parley.models.transformer import quantize_kv, ring_slot_positions  # noqa: E402

H, S, D = 32, 3000, 128
# (block_n, blocks, stages, warps); blocks = 0: one split covering the whole ring.
CANDIDATES = [(64, 8, 3, 4), (64, 0, 3, 4), (128, 4, 3, 4), (128, 4, 3, 8), (128, 0, 3, 8), (64, 16, 3, 4),
              (32, 16, 4, 4), (128, 8, 2, 8), (128, 0, 3, 4), (128, 4, 2, 4), (128, 2, 3, 4), (128, 8, 3, 4),
              (256, 2, 2, 4), (256, 2, 2, 8), (128, 4, 4, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,128")
    parser.add_argument("--kv", default="bf16,fp8")
    parser.add_argument("--windows", default="empty,spread,full")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", help="comma-separated launch shapes to try, e.g. 128x4x3x4,64x0x3x4 (blocks 0: one "
                        "split over the ring); default: the built-in list")
    args = parser.parse_args()
    candidates = CANDIDATES
    if args.only:
        candidates = [tuple(int(x) for x in c.split("x")) for c in args.only.split(",")]
    rows = []
    g = torch.Generator("cuda").manual_seed(0)
    for kv in args.kv.split(","):
        for B in (int(b) for b in args.batches.split(",")):
            ck = torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
            cv = torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16) * 0.1
            scales = ()
            if kv == "fp8":
                (ck, ks), (cv, vs) = quantize_kv(ck), quantize_kv(cv)
                scales = (ks, vs)
            q, kn, vn = (torch.randn(B, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
            for window in args.windows.split(","):
                pos = window_positions(B, window, S, "cuda")
                sp = ring_slot_positions(pos, S)
                filled = pos.clamp(max=S).sum().item()
                nbytes = filled * H * D * 2 * (1 if kv == "fp8" else 2) + (filled * H * 8 if kv == "fp8" else 0)
                ref = kernels.decode_attention(q, kn, vn, ck, cv, sp, pos, S, *scales).float()
                default = tuple(kernels.attention_launch(B, H, S, kv == "fp8"))
                longest_first = torch.argsort(pos.clamp(max=S), descending=True)
                # Launches of one split a ring take the rows longest first, as the transformer
                # passes them (kernels.row_order); the default also runs in plain row order.
                for cand, ordered in [(default, True), (default, False)] + [(c, True) for c in candidates
                                                                             if c != default]:
                    block_n, blocks, stages, warps = cand
                    launch = kernels.AttentionLaunch(block_n, blocks or triton.cdiv(S, block_n), stages, warps)
                    one_split = launch.block_n * launch.blocks >= S
                    if not one_split and not ordered:
                        continue
                    order = longest_first if one_split and ordered else None
                    try:
                        fn = lambda: kernels.decode_attention(q, kn, vn, ck, cv, sp, pos, S, *scales,  # noqa: E731
                                                              launch=launch, order=order)
                        err = (fn().float() - ref).abs().max().item()
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    except Exception as exc:  # a launch shape the GPU cannot run (shared memory)
                        print(f"{kv} B={B} {window} {cand}: {type(exc).__name__}")
                        continue
                    row = {"kv": kv, "B": B, "window": window, "launch": cand, "default": cand == default,
                           "longest_first": order is not None, "ms": ms, "tbps": nbytes / ms / 1e9,
                           "max_diff_vs_default": err}
                    rows.append(row)
                    tag = ("  <- default" if cand == default else "") + ("" if ordered or not one_split else ", row order")
                    print(f"{kv} B={B} {window:6} {str(cand):16} {ms:7.3f} ms  {row['tbps']:5.2f} TB/s "
                          f"(of {H200_COPY_TBPS})  diff {err:.1e}{tag}", flush=True)
            ck = cv = scales = None  # free the caches (not del: the timed lambda closes over them)
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
