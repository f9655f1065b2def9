"""Per-frame latency of Parley's engine frame vs the reference `moshi` package, same GPU, same weights.

One frame = Mimi encode -> temporal transformer -> depformer -> sampling -> Mimi decode for B
sessions at once, plus the host copy of the outputs. Moshi-7B shapes with random bf16 weights
(compute and memory traffic equal those of real weights). The reference (`moshi==0.2.13`, run as
its server runs it: streaming, its own CUDA graphs) and Parley share the very same weight tensors.

Windows: `empty` (rows start at position 0), `spread` (rows evenly over 0..context), `full`
(every row past the context, the KV ring full). The reference attends over its whole ring every
step, so its time does not depend on the window; it is measured once per B.

Each row also shows the memory-bandwidth floor of that frame (weights + the filled KV windows
at the copy bandwidth, see frame_setup.py) and the fraction of it reached (floor / p50).
`--json` writes every figure; `benchmarks/plot_frames.py` draws them.

`--kv-blocks N|fit|full` pages the temporal KV ring (models/paged_kv.py): a pool of N blocks
(`fit`: what the placed rows write over the run, `full`: a whole window per row) of
`--kv-block-frames` frames, each row given the blocks of its window before timing. Compare with
the same command without it (dense rings). `--kv-attention flashinfer` reads a paged bf16 ring
with FlashInfer's decode (installed) through page lists planned each frame, as `parley serve
--kv-attention` does. `--no-reference` needs no `moshi` package.

    python benchmarks/frame_latency.py --batches 1,8,16,32,64,128 --frames 60 --json frames.json
    python benchmarks/frame_latency.py --batches 64,128 --no-reference --kv-dtype fp8 --kv-blocks fit
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_setup import (H200_COPY_TBPS, KV_POOLS, WINDOWS, bench_checkpoint, floor_ms, kv_bytes,  # noqa: E402
                         kv_pool, page_list_planner, percentile, place_rows, random_models, time_frames,
                         weight_bytes, window_positions)

from parley.engine import KV_ATTENTION  # noqa: E402
from parley.engine.backend import ModelBackend  # noqa: E402
from parley.models.config import FRAME_SAMPLES, LMConfig, MimiConfig  # noqa: E402
from parley.models.lm import LMModel, published_state  # noqa: E402
from parley.models.mimi.codec import Mimi  # noqa: E402
from parley.models.mimi.precision import mimi_dtype_for  # noqa: E402


def build_models(device: str, dtype: torch.dtype):
    """Reference models with random weights, and Parley models sharing those tensors."""
    from moshi.models import loaders

    torch.manual_seed(0)
    lm_cfg, mimi_cfg = LMConfig(), MimiConfig()
    ref_lm = loaders.get_moshi_lm(None, lm_kwargs=None, device=device, dtype=dtype)
    ref_mimi = loaders.get_mimi(None, device=device)
    lm = LMModel(lm_cfg, device="meta", dtype=dtype)
    lm.load_state_dict(published_state(ref_lm.state_dict()), assign=True, strict=True)
    mimi = Mimi(mimi_cfg).to("meta")
    mimi.load_state_dict(ref_mimi.state_dict(), assign=True, strict=True)
    mimi.eval()
    lm.eval()
    return ref_lm, ref_mimi, lm, mimi, lm_cfg, mimi_cfg


@torch.no_grad()
def bench_reference(ref_lm, ref_mimi, batch: int, frames: int, warmup: int) -> dict:
    from moshi.models import LMGen

    gen = LMGen(ref_lm, temp=0.8, temp_text=0.7, top_k=250, top_k_text=25)
    pcm = torch.randn(batch, 1, FRAME_SAMPLES, device="cuda") * 0.1
    with ref_mimi.streaming(batch), gen.streaming(batch):
        def frame():
            codes = ref_mimi.encode(pcm)
            tokens = gen.step(codes)
            if tokens is not None:
                ref_mimi.decode(tokens[:, 1:].clamp(0, 2047)).cpu()

        torch.cuda.reset_peak_memory_stats()
        times = time_frames(frame, frames, warmup)
        peak = torch.cuda.max_memory_allocated()
    return {"p50": percentile(times, 50), "p99": percentile(times, 99), "peak_gib": peak / 2**30}


@torch.no_grad()
def bench_parley(lm, mimi, lm_cfg, mimi_cfg, batch: int, frames: int, warmup: int, windows,
                 kv_dtype: torch.dtype | None = None, live_rows: int | None = None,
                 kv_blocks: str | None = None, block_frames: int | None = None,
                 kv_attention: str = "parley") -> dict:
    """`live_rows`: only the lowest rows are live (the others are idle slots), default all.
    `kv_blocks` (a number, `fit` or `full`; see the module doc): paged KV rings, else dense;
    `kv_attention`: who reads them (ModelBackend's `paged_attention`)."""
    ckpt = bench_checkpoint(lm, mimi, lm_cfg, mimi_cfg)
    torch.cuda.reset_peak_memory_stats()
    page_lists = kv_attention == "flashinfer"
    pool = kv_pool(kv_blocks, batch, windows, lm_cfg, block_frames, frames + warmup, divides=page_lists)
    paged = dict(kv_blocks=pool[0], kv_block_frames=pool[1], paged_attention=kv_attention) if pool else {}
    backend = ModelBackend(ckpt, batch, cuda_graphs=True, seed=0, kv_dtype=kv_dtype, **paged)
    pcm = torch.randn(batch, FRAME_SAMPLES) * 0.1
    live = torch.zeros(batch, dtype=torch.bool)
    live[:batch if live_rows is None else live_rows] = True
    results = {}
    for window in windows:
        place_rows(backend._lm_state, window, lm_cfg.context, ahead=frames + warmup)
        plan = page_list_planner(backend, window, lm_cfg.context, live) if page_lists else (lambda: None)

        def frame():
            plan()
            return backend.step(pcm, live).to_host()
        times = time_frames(frame, frames, warmup)
        live_pos = window_positions(batch, window, lm_cfg.context, "cpu")[live]
        floor = floor_ms(weight_bytes(lm, mimi), kv_bytes(lm_cfg, live_pos, kv_dtype))
        results[window] = {"p50": percentile(times, 50), "p99": percentile(times, 99), "floor": floor}
    results["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    results["kv_blocks"] = paged.get("kv_blocks")
    backend.close()
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,16,32,64,128", help="comma-separated batch sizes")
    parser.add_argument("--frames", type=int, default=60, help="timed frames per case")
    parser.add_argument("--warmup", type=int, default=10, help="untimed frames before timing")
    parser.add_argument("--windows", default=",".join(WINDOWS), help="subset of empty,spread,full")
    parser.add_argument("--no-reference", action="store_true", help="time Parley only")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--live", type=int, help="live sessions per case (the lowest rows; the rest of the B slots "
                        "idle), default all B; with it the reference is not run")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                        help="Parley's LM KV cache dtype (fp8: float8_e4m3fn with per-vector scales)")
    parser.add_argument("--kv-blocks", help="page Parley's temporal KV ring: a pool of N blocks, 'fit' (what the "
                        "rows' windows write over the run) or 'full' (a whole window per row); default dense rings")
    parser.add_argument("--kv-block-frames", type=int, help="frames per KV block (default 64, or with "
                        "--kv-attention flashinfer the largest divisor of the context <= 64, 60 for Moshi)")
    parser.add_argument("--kv-attention", choices=KV_ATTENTION, default="parley",
                        help="who reads the paged ring (needs --kv-blocks): our Triton kernel, or FlashInfer's "
                        "decode (bf16 KV, installed)")
    parser.add_argument("--mimi-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="Parley's Mimi, as serve's --mimi-dtype (auto: float16 where it passes its probe); "
                        "the reference's stays float32")
    args = parser.parse_args()
    if args.kv_blocks is not None and args.kv_blocks not in KV_POOLS and not args.kv_blocks.isdigit():
        parser.error(f"--kv-blocks {args.kv_blocks}: a number of blocks, or one of {', '.join(KV_POOLS)}")
    if args.kv_attention != "parley" and args.kv_blocks is None:
        parser.error(f"--kv-attention {args.kv_attention} reads a paged ring: give --kv-blocks too")
    return args


def load_models(args: argparse.Namespace):
    """(reference LM, reference Mimi, LM, Mimi, LM config, Mimi config); without the reference
    (None, None, ...) Parley's own with PyTorch's random init, so no `moshi` package is needed."""
    if args.no_reference:
        ref_lm = ref_mimi = None
        lm, mimi, lm_cfg, mimi_cfg = random_models("moshi", "cuda", torch.bfloat16)
    else:
        ref_lm, ref_mimi, lm, mimi, lm_cfg, mimi_cfg = build_models("cuda", torch.bfloat16)
    dtype = mimi_dtype_for(mimi, None if args.mimi_dtype == "auto" else getattr(torch, args.mimi_dtype))
    args.mimi_dtype = str(dtype).removeprefix("torch.")  # (what auto chose, for the header and --json)
    if dtype != torch.float32:  # a copy: the reference keeps its fp32 Mimi
        mimi = copy.deepcopy(mimi).compute_in(dtype)
    return ref_lm, ref_mimi, lm, mimi, lm_cfg, mimi_cfg


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("frame_latency needs a CUDA GPU")
    windows = [w for w in args.windows.split(",") if w]
    batches = [int(b) for b in args.batches.split(",")]
    if args.live is not None and not 1 <= args.live <= min(batches):
        sys.exit(f"--live {args.live}: must be between 1 and the smallest batch {min(batches)}")
    if args.live is not None:
        args.no_reference = True
    ref_lm, ref_mimi, lm, mimi, lm_cfg, mimi_cfg = load_models(args)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  weights: Moshi-7B shapes, random bf16"
          f"  Parley KV cache: {args.kv_dtype}, {'paged ' + args.kv_blocks if args.kv_blocks else 'dense'}"
          f"{', read by ' + args.kv_attention if args.kv_blocks else ''}"
          f"  Parley Mimi: {args.mimi_dtype}")
    rows = []
    for batch in batches:
        row = {"B": batch}
        try:
            row["parley"] = bench_parley(lm, mimi, lm_cfg, mimi_cfg, batch, args.frames, args.warmup, windows,
                                         torch.float8_e4m3fn if args.kv_dtype == "fp8" else None, args.live,
                                         args.kv_blocks, args.kv_block_frames, args.kv_attention)
        except torch.cuda.OutOfMemoryError:
            row["parley"] = "OOM"
        torch.cuda.empty_cache()
        if not args.no_reference:
            try:
                row["reference"] = bench_reference(ref_lm, ref_mimi, batch, args.frames, args.warmup)
            except torch.cuda.OutOfMemoryError:
                row["reference"] = "OOM"
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(f"\n| B | window | Parley p50 | Parley p99 | floor ({H200_COPY_TBPS} TB/s) | of floor | reference p50 "
          "| reference p99 | ratio (ref/Parley p50) | Parley peak GiB | reference peak GiB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ref = row.get("reference")
        for window in windows:
            par = row["parley"]
            p = par[window] if isinstance(par, dict) else None
            r = ref if isinstance(ref, dict) else None
            cells = [
                f"{p['p50']:.2f}" if p else str(par), f"{p['p99']:.2f}" if p else "",
                f"{p['floor']:.2f}" if p else "", f"{p['floor'] / p['p50']:.0%}" if p else "",
                f"{r['p50']:.2f}" if r else str(ref or "-"), f"{r['p99']:.2f}" if r else "",
                f"{r['p50'] / p['p50']:.2f}x" if (p and r) else "",
                f"{par['peak_gib']:.1f}" if p else "", f"{r['peak_gib']:.1f}" if r else "",
            ]
            print(f"| {row['B']} | {window} | " + " | ".join(cells) + " |")
    realtime = [row["B"] for row in rows if isinstance(row["parley"], dict)
                and "full" in row["parley"] and row["parley"]["full"]["p99"] < 80.0]
    print(f"\nLargest B with full windows and p99 < 80 ms: {max(realtime) if realtime else 'none'}")
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kv_dtype": args.kv_dtype,
                "kv_blocks": args.kv_blocks, "kv_block_frames": args.kv_block_frames,
                "kv_attention": args.kv_attention,
                "mimi_dtype": args.mimi_dtype, "frames": args.frames, "live": args.live, "warmup": args.warmup, "bandwidth_tbps": H200_COPY_TBPS}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
