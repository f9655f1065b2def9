"""Per-frame latency of Parley's engine frame vs the reference `moshi` package, same GPU, same weights.

One frame = Mimi encode -> temporal transformer -> depformer -> sampling -> Mimi decode for B
sessions at once, plus the host copy of the outputs. Moshi-7B shapes with random bf16 weights
(compute and memory traffic equal those of real weights). The reference (`moshi==0.2.13`, run as
its server runs it: streaming, its own CUDA graphs) and Parley share the very same weight tensors.

`--shapes hibiki-zero-3b`: Hibiki-Zero 3B instead (frame_setup.py's module doc gives the shapes),
a translation frame: Mimi encodes 16 source codebooks, the depformer writes 16, Mimi decodes them;
both sides conditioned on `description: very_good` (the reference through its own
`get_condition_tensors`, as its inference does), the end-of-text embedding set to padding's as both
loaders do. The header names the attention path each transformer runs: on CUDA the fused Triton
decode kernels, grouped KV heads and rope_concat included (the general path only where they cannot
run, e.g. the CPU; a paged ring is then gathered into a dense copy per layer). `--kv-attention
flashinfer` reads Hibiki-Zero's paged bf16 ring too (its GQA decode over the keys our kernel
rotated). `--reference-batches 1` runs the reference at B = 1 only; the table's
last lines compare every Parley B with it. `--shapes tiny` / `tiny-hibiki-zero`
with `--device cpu` is the CPU smoke run (eager, no CUDA graphs; its times mean nothing).

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

Issue 47's frame (Hibiki-Zero 3B, Parley at B = 1 / 64 / 128 / 256 with full windows, the
reference at B = 1, same run), bf16 KV then fp8 paged KV. A full bf16 window at B = 256 is
82 GiB of KV: on an H100 that row prints OOM, the fp8 run holds it (42 GiB).

    python benchmarks/frame_latency.py --shapes hibiki-zero-3b --batches 1,64,128,256 --windows full \
        --reference-batches 1 --frames 60 --warmup 10 --json hibiki_bf16.json
    python benchmarks/frame_latency.py --shapes hibiki-zero-3b --batches 1,64,128,256 --windows full \
        --reference-batches 1 --frames 60 --warmup 10 --kv-dtype fp8 --kv-blocks fit --json hibiki_fp8.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_setup import (H200_COPY_TBPS, HIBIKI_KINDS, KV_POOLS, MODEL_KINDS, WINDOWS, bench_checkpoint,  # noqa: E402
                         floor_ms, kv_bytes, kv_pool, model_configs, page_list_planner, percentile, place_rows,
                         random_models, time_frames, weight_bytes, window_positions)

from parley.engine import KV_ATTENTION  # noqa: E402
from parley.engine.backend import ModelBackend, default_dtype  # noqa: E402
from parley.models.checkpoint import lm_config_dict, mimi_config_dict  # noqa: E402
from parley.models.config import FRAME_SAMPLES, HIBIKI_CONDITION, TEXT_EOS, TEXT_PAD  # noqa: E402
from parley.models.lm import LMModel, published_state  # noqa: E402
from parley.models.mimi.codec import Mimi  # noqa: E402
from parley.models.mimi.precision import mimi_dtype_for  # noqa: E402


def build_models(shapes: str, device: str, dtype: torch.dtype):
    """Reference models of `shapes` with random weights, and Parley models sharing those tensors."""
    from moshi.models import loaders

    torch.manual_seed(0)
    lm_cfg, mimi_cfg = model_configs(shapes)
    lm_kwargs = None if shapes == "moshi" else lm_config_dict(lm_cfg)  # None: the reference's own Moshi 7B
    ref_lm = loaders.get_moshi_lm(None, lm_kwargs=lm_kwargs, device=device, dtype=dtype)
    mimi_dict = mimi_config_dict(mimi_cfg) if shapes.startswith("tiny") else None  # None: the published Mimi
    ref_mimi = loaders.get_mimi(None, mimi_dict, device=device, num_codebooks=mimi_cfg.num_codebooks)
    lm = LMModel(lm_cfg, device="meta", dtype=dtype)
    lm.load_state_dict(published_state(ref_lm.state_dict()), assign=True, strict=True)
    mimi = Mimi(mimi_cfg).to("meta")
    mimi.load_state_dict(ref_mimi.state_dict(), assign=True, strict=True)
    mimi.eval()
    lm.eval()
    if shapes in HIBIKI_KINDS:
        prepare_hibiki(lm)  # shares the text embedding with the reference: both get the end-of-text change
    return ref_lm, ref_mimi, lm, mimi, lm_cfg, mimi_cfg


@torch.no_grad()
def prepare_hibiki(lm: LMModel) -> None:
    """What both loaders do to a Hibiki after its weights: end of text embeds as padding, and
    every row is conditioned on `description: very_good`."""
    lm.text_emb.weight[TEXT_EOS] = lm.text_emb.weight[TEXT_PAD]
    lm.set_condition(HIBIKI_CONDITION)


def attention_paths(lm: LMModel) -> str:
    """Which attention each of the LM's transformers runs on one-step decodes, and why."""
    probe = torch.empty(1, device=next(lm.parameters()).device)
    paths = []
    for name, tr in (("temporal", lm.transformer), ("depformer", lm.depformer)):
        if tr._can_fuse(probe):
            paths.append(f"{name}: fused Triton decode kernels")
            continue
        head_dim = tr.d_model // tr.num_heads
        why = "no CUDA Triton kernels here" if head_dim & (head_dim - 1) == 0 else f"head dim {head_dim}"
        paths.append(f"{name}: general path ({why})")
    return "; ".join(paths)


def kv_reader(lm: LMModel, attention: str) -> str:
    """Who reads a paged temporal ring: `attention`'s kernel on the fused decode, else the general
    path, which gathers each layer's ring into a dense copy."""
    fused = lm.transformer._can_fuse(torch.empty(1, device=next(lm.parameters()).device))
    return attention if fused else "the general path (each layer's ring gathered to a dense copy)"


@torch.no_grad()
def bench_reference(ref_lm, ref_mimi, batch: int, frames: int, warmup: int, hibiki: bool = False) -> dict:
    """The reference's frame as its server steps it; a Hibiki conditioned as its inference does."""
    from moshi.models import LMGen
    from moshi.run_inference import get_condition_tensors

    conditions = get_condition_tensors("hibiki", ref_lm, batch, cfg_coef=1.0) if hibiki else None
    gen = LMGen(ref_lm, temp=0.8, temp_text=0.7, top_k=250, top_k_text=25, cfg_coef=1.0,
                condition_tensors=conditions)
    device = next(ref_lm.parameters()).device
    pcm = torch.randn(batch, 1, FRAME_SAMPLES, device=device) * 0.1
    with ref_mimi.streaming(batch), gen.streaming(batch):
        def frame():
            codes = ref_mimi.encode(pcm)
            tokens = gen.step(codes)
            if tokens is not None:
                ref_mimi.decode(tokens[:, 1:].clamp(0, 2047)).cpu()

        reset_peak()
        times = time_frames(frame, frames, warmup)
        peak = peak_gib()
    return {"p50": percentile(times, 50), "p99": percentile(times, 99), "peak_gib": peak}


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    """Peak CUDA memory since `reset_peak` (0 without CUDA: the CPU smoke run measures none)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


@torch.no_grad()
def bench_parley(lm, mimi, lm_cfg, mimi_cfg, batch: int, frames: int, warmup: int, windows,
                 kv_dtype: torch.dtype | None = None, live_rows: int | None = None,
                 kv_blocks: str | None = None, block_frames: int | None = None,
                 kv_attention: str = "parley") -> dict:
    """`live_rows`: only the lowest rows are live (the others are idle slots), default all.
    `kv_blocks` (a number, `fit` or `full`; see the module doc): paged KV rings, else dense;
    `kv_attention`: who reads them (ModelBackend's `paged_attention`)."""
    model_type = "hibiki" if lm.cfg.conditioners else "moshi"  # (only the Hibiki shapes condition)
    ckpt = bench_checkpoint(lm, mimi, lm_cfg, mimi_cfg, model_type=model_type)
    reset_peak()
    page_lists = kv_attention == "flashinfer"
    pool = kv_pool(kv_blocks, batch, windows, lm_cfg, block_frames, frames + warmup, divides=page_lists)
    paged = dict(kv_blocks=pool[0], kv_block_frames=pool[1], paged_attention=kv_attention) if pool else {}
    cuda = next(lm.parameters()).device.type == "cuda"
    backend = ModelBackend(ckpt, batch, cuda_graphs=cuda, seed=0, kv_dtype=kv_dtype, **paged)
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
    results["peak_gib"] = peak_gib()
    results["kv_blocks"] = paged.get("kv_blocks")
    backend.close()
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=[k for k in MODEL_KINDS if k != "personaplex"], default="moshi",
                        help="model shapes: Moshi 7B, Hibiki-Zero 3B, or tiny ones for a CPU smoke run")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of the tiny shapes (eager, no CUDA graphs)")
    parser.add_argument("--batches", default="1,8,16,32,64,128", help="comma-separated batch sizes")
    parser.add_argument("--frames", type=int, default=60, help="timed frames per case")
    parser.add_argument("--warmup", type=int, default=10, help="untimed frames before timing")
    parser.add_argument("--windows", default=",".join(WINDOWS), help="subset of empty,spread,full")
    parser.add_argument("--no-reference", action="store_true", help="time Parley only")
    parser.add_argument("--reference-batches", help="comma-separated B at which the reference runs too "
                        "(default: every B; issue 47's proof: 1)")
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
    if args.device == "cpu" and not args.shapes.startswith("tiny"):
        parser.error(f"--device cpu runs the tiny shapes only, not --shapes {args.shapes}")
    if args.device == "cpu" and args.kv_dtype == "fp8":
        parser.error("--kv-dtype fp8 needs --device cuda")
    if args.kv_attention != "parley" and args.kv_blocks is None:
        parser.error(f"--kv-attention {args.kv_attention} reads a paged ring: give --kv-blocks too")
    return args


def load_models(args: argparse.Namespace):
    """(reference LM, reference Mimi, LM, Mimi, LM config, Mimi config); without the reference
    (None, None, ...) Parley's own with PyTorch's random init, so no `moshi` package is needed."""
    dtype = default_dtype(args.device)  # bf16 on CUDA, fp32 on the CPU
    if args.no_reference:
        ref_lm = ref_mimi = None
        lm, mimi, lm_cfg, mimi_cfg = random_models(args.shapes, args.device, dtype)
        if args.shapes in HIBIKI_KINDS:
            prepare_hibiki(lm)
    else:
        ref_lm, ref_mimi, lm, mimi, lm_cfg, mimi_cfg = build_models(args.shapes, args.device, dtype)
    dtype = mimi_dtype_for(mimi, None if args.mimi_dtype == "auto" else getattr(torch, args.mimi_dtype))
    args.mimi_dtype = str(dtype).removeprefix("torch.")  # (what auto chose, for the header and --json)
    if dtype != torch.float32:  # a copy: the reference keeps its fp32 Mimi
        mimi = copy.deepcopy(mimi).compute_in(dtype)
    return ref_lm, ref_mimi, lm, mimi, lm_cfg, mimi_cfg


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_rows(args, models, windows, batches) -> list[dict]:
    """Parley at every B, the reference at the B of --reference-batches; a row per B, printed as it ends."""
    ref_lm, ref_mimi, lm, mimi, lm_cfg, mimi_cfg = models
    ref_batches = batches if args.reference_batches is None else [int(b) for b in args.reference_batches.split(",")]
    rows = []
    for batch in batches:
        row = {"B": batch}
        try:
            row["parley"] = bench_parley(lm, mimi, lm_cfg, mimi_cfg, batch, args.frames, args.warmup, windows,
                                         torch.float8_e4m3fn if args.kv_dtype == "fp8" else None, args.live,
                                         args.kv_blocks, args.kv_block_frames, args.kv_attention)
        except torch.cuda.OutOfMemoryError:
            row["parley"] = "OOM"
        empty_cache()
        if not args.no_reference and batch in ref_batches:
            try:
                row["reference"] = bench_reference(ref_lm, ref_mimi, batch, args.frames, args.warmup,
                                                   hibiki=args.shapes in HIBIKI_KINDS)
            except torch.cuda.OutOfMemoryError:
                row["reference"] = "OOM"
            empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def print_table(rows: list[dict], windows) -> None:
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
    one = next((row["reference"] for row in rows if row["B"] == 1 and isinstance(row.get("reference"), dict)), None)
    if one is None:
        return
    print(f"Against the reference at B = 1 (p50 {one['p50']:.2f} ms, one session a frame):")
    for row in rows:
        for window in windows:
            if isinstance(row["parley"], dict):
                p50 = row["parley"][window]["p50"]
                print(f"  B={row['B']} {window}: Parley p50 {p50:.2f} ms = {p50 / one['p50']:.2f}x the reference's "
                      f"one-session frame, for {row['B']} sessions")


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("frame_latency needs a CUDA GPU (or --shapes tiny|tiny-hibiki-zero --device cpu)")
    windows = [w for w in args.windows.split(",") if w]
    batches = [int(b) for b in args.batches.split(",")]
    if args.live is not None and not 1 <= args.live <= min(batches):
        sys.exit(f"--live {args.live}: must be between 1 and the smallest batch {min(batches)}")
    if args.live is not None:
        args.no_reference = True
    models = load_models(args)
    lm = models[2]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke run: times mean nothing)"
    weights = {"moshi": "Moshi-7B", "hibiki-zero-3b": "Hibiki-Zero 3B"}.get(args.shapes, args.shapes)
    print(f"GPU: {device}  torch {torch.__version__}  weights: {weights} shapes, random "
          f"{str(next(lm.parameters()).dtype).removeprefix('torch.')}"
          f"  Parley KV cache: {args.kv_dtype}, {'paged ' + args.kv_blocks if args.kv_blocks else 'dense'}"
          f"{', read by ' + kv_reader(lm, args.kv_attention) if args.kv_blocks else ''}"
          f"  Parley Mimi: {args.mimi_dtype}")
    print(f"Parley attention: {attention_paths(lm)}")
    if args.shapes in HIBIKI_KINDS:
        print(f"Conditioning: description {HIBIKI_CONDITION['description']} (both sides), cfg_coef 1")
    rows = run_rows(args, models, windows, batches)
    print_table(rows, windows)
    if args.json:
        meta = {"gpu": device, "torch": torch.__version__, "shapes": args.shapes,
                "attention": attention_paths(lm), "kv_dtype": args.kv_dtype,
                "kv_blocks": args.kv_blocks, "kv_block_frames": args.kv_block_frames,
                "kv_attention": args.kv_attention, "mimi_dtype": args.mimi_dtype, "frames": args.frames,
                "live": args.live, "warmup": args.warmup, "bandwidth_tbps": H200_COPY_TBPS}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
