"""Where one engine frame's time goes, at a given batch B and KV window (CUDA only).

    python benchmarks/profile_frame.py --batch 1 --window empty
    python benchmarks/profile_frame.py --batch 64 --window full [--kv-dtype fp8] [--kind personaplex]
    python benchmarks/profile_frame.py --batch 128 --window spread --kv-dtype fp8 --kv-blocks fit   # paged KV

Moshi-7B (or PersonaPlex-7B) shapes with random bf16 weights. Two views:

1. Sections, each captured as its own CUDA graph and timed over replays (median): Mimi encode,
   the temporal LM step with text sampling (the LM step minus the depformer), the depformer
   (its n_agent steps with their sampling), Mimi decode, and the host copy of the outputs;
   beside them the whole frame as the engine runs it (one graph + the host copy).
2. Kernels of one LM step by kind, from torch.profiler over graph replays: weight matmuls,
   attention, norms / RoPE / activations, sampling, other; with the bytes each kind must read
   and the bandwidth it reached.

Every figure is printed with the memory-bandwidth floor (frame_setup.py) beside it; `--json`
writes them all.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_setup import (H200_COPY_TBPS, KV_POOLS, WINDOWS, bench_checkpoint, floor_ms, graph_ms,  # noqa: E402
                         kv_bytes, kv_pool, percentile, place_rows, random_models, time_frames, weight_bytes,
                         window_positions)

from parley.engine.backend import BackendOutput, ModelBackend  # noqa: E402
from parley.engine.cuda_graph import CUDAGraphRunner  # noqa: E402
from parley.models.config import FRAME_SAMPLES  # noqa: E402
from parley.models.lm_gen import LMGen  # noqa: E402

# Kernel kinds, by name (first match wins). cuBLAS / CUTLASS GEMM and GEMV kernels are the
# weight matmuls (nvjet is cuBLAS's Hopper GEMM family).
KINDS = (
    ("attention", ("_attn_split_kernel", "_attn_fp8_kernel", "_attn_reduce_kernel", "fmha", "flash", "attention")),
    ("sampling", ("_sample_kernel", "sort", "topk", "exponential", "argmax", "multinomial")),
    ("weight matmuls", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90_", "splitk", "_matmul")),
    ("norms / RoPE / activations", ("_add_rms_norm_kernel", "_rope_write_kernel", "_silu_mul_kernel")),
)


def kind_of(kernel_name: str) -> str:
    low = kernel_name.lower()
    for kind, needles in KINDS:
        if any(n.lower() in low for n in needles):
            return kind
    return "other (elementwise, gathers, copies)"


def kernel_breakdown(runner: CUDAGraphRunner, inputs, replays: int) -> dict[str, dict[str, float]]:
    """Per kind: total kernel time per replay (ms), kernel count per replay, and the 5 costliest
    kernel names with their ms per replay ("top") and count per replay ("top_counts")."""
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(replays):
            runner(*inputs)
        torch.cuda.synchronize()
    kinds: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "kernels": 0, "top": defaultdict(float),
                                                  "top_counts": defaultdict(float)})
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and not evt.name.startswith(("Memcpy", "Memset")):
            k = kinds[kind_of(evt.name)]
            ms = (evt.time_range.end - evt.time_range.start) / 1000 / replays
            k["ms"] += ms
            k["kernels"] += 1 / replays
            k["top"][evt.name[:80]] += ms
            k["top_counts"][evt.name[:80]] += 1 / replays
    for k in kinds.values():  # the 5 costliest kernel names of each kind
        k["top"] = dict(sorted(k["top"].items(), key=lambda item: -item[1])[:5])
        k["top_counts"] = {name: k["top_counts"][name] for name in k["top"]}
    return dict(kinds)


@torch.no_grad()
def profile_frame(models, batch: int, window: str, kv_dtype: torch.dtype | None, kind: str, frames: int,
                  warmup: int, kv_blocks: str | None = None) -> dict:
    lm, mimi, lm_cfg, mimi_cfg = models
    ahead = 3 * (frames + warmup) + 10  # paged: blocks for every replay of the LM sections and the frame
    pool = kv_pool(kv_blocks, batch, [window], lm_cfg, None, ahead) or (None, None)
    weights, lm_weights = weight_bytes(lm, mimi), weight_bytes(lm, torch.nn.Module())
    kv = kv_bytes(lm_cfg, window_positions(batch, window, lm_cfg.context, "cpu"), kv_dtype)
    live = torch.ones(batch, dtype=torch.bool, device="cuda")
    pcm = torch.randn(batch, FRAME_SAMPLES, device="cuda") * 0.1

    # 1. Sections as separate graphs, on states of their own (all rows live).
    gen = LMGen(lm)
    lm_state = gen.init_state(batch, kv_dtype=kv_dtype, kv_blocks=pool[0] and pool[0] + 1, block_size=pool[1])
    mimi_state = mimi.init_state(batch, "cuda")
    place_rows(lm_state, window, lm_cfg.context, ahead)
    codes = torch.randint(0, lm_cfg.card, (batch, lm_cfg.n_user), device="cuda")
    agent = torch.randint(0, lm_cfg.card, (batch, lm_cfg.n_agent), device="cuda")
    hidden = torch.randn(batch, lm_cfg.dim, device="cuda", dtype=torch.bfloat16)
    text = torch.zeros(batch, dtype=torch.long, device="cuda")
    sections = {
        "mimi encode": (lambda x, m: (mimi.encode_step(x, mimi_state, m),), (pcm, live)),
        "LM step (temporal + text + depformer)": (
            lambda c, m: tuple(vars(gen.step(lm_state, c, m)).values()), (codes, live)),
        "depformer": (lambda h, t: (gen.depformer(lm_state, h, t),), (hidden, text)),
        "mimi decode": (lambda a, m: (mimi.decode_step(a, mimi_state, m),), (agent, live)),
    }
    section_ms, breakdown = {}, {}
    for name, (fn, inputs) in sections.items():
        runner = CUDAGraphRunner(fn, inputs)
        section_ms[name] = graph_ms(runner, inputs, frames, warmup)
        if name.startswith("LM step"):
            breakdown = kernel_breakdown(runner, inputs, replays=5)
        runner.close()
    section_ms["temporal + text (LM step - depformer)"] = (section_ms["LM step (temporal + text + depformer)"]
                                                           - section_ms["depformer"])
    lm_state = mimi_state = None  # (not del: the section lambdas close over them)
    torch.cuda.empty_cache()

    # 2. The whole frame as the engine runs it, and its host copy.
    ckpt = bench_checkpoint(lm, mimi, lm_cfg, mimi_cfg, model_type=kind)
    backend = ModelBackend(ckpt, batch, cuda_graphs=True, seed=0, kv_dtype=kv_dtype, kv_blocks=pool[0],
                           kv_block_frames=pool[1])
    place_rows(backend._lm_state, window, lm_cfg.context, ahead)
    host_pcm, host_live = pcm.cpu(), live.cpu()
    whole = time_frames(lambda: backend.step(host_pcm, host_live).to_host(), frames, warmup)
    out = backend.step(host_pcm, host_live)
    copy = BackendOutput(pcm=out.pcm.clone(), text_tokens=out.text_tokens.clone(), valid=out.valid.clone())
    section_ms["host copy (to_host)"] = percentile(time_frames(copy.to_host, frames, warmup), 50)
    backend.close()

    floor = floor_ms(weights, kv)
    result = {
        "B": batch, "window": window, "kind": kind, "kv_dtype": "fp8" if kv_dtype is not None else "bf16",
        "kv_blocks": pool[0],
        "frame_p50_ms": percentile(whole, 50), "frame_p99_ms": percentile(whole, 99),
        "floor_ms": floor, "weights_gb": weights / 1e9, "kv_gb": kv / 1e9, "bandwidth_tbps": H200_COPY_TBPS,
        "sections_ms": section_ms, "lm_step_kernels": breakdown,
        "lm_weight_floor_ms": floor_ms(lm_weights, 0), "kv_floor_ms": floor_ms(0, kv),
    }
    return result


def report(r: dict) -> None:
    paged = f" paged ({r['kv_blocks']} blocks)" if r.get("kv_blocks") else ""
    print(f"\nB={r['B']} window={r['window']} {r['kind']} KV {r['kv_dtype']}{paged}: frame p50 {r['frame_p50_ms']:.2f} ms "
          f"(p99 {r['frame_p99_ms']:.2f}); floor {r['floor_ms']:.2f} ms (weights {r['weights_gb']:.2f} GB + KV "
          f"{r['kv_gb']:.2f} GB at {r['bandwidth_tbps']} TB/s) -> {r['floor_ms'] / r['frame_p50_ms']:.0%} of the floor")
    print("\n| section (own CUDA graph) | ms |\n|---|---:|")
    for name, ms in r["sections_ms"].items():
        print(f"| {name} | {ms:.2f} |")
    print("\n| LM step kernels | ms | kernels | floor ms | note |\n|---|---:|---:|---:|---|")
    for name, k in sorted(r["lm_step_kernels"].items(), key=lambda kv_: -kv_[1]["ms"]):
        floor, note = "", ""
        if name == "weight matmuls":
            floor = f"{r['lm_weight_floor_ms']:.2f}"
            note = f"{r['lm_weight_floor_ms'] / k['ms']:.0%} of the weight floor" if k["ms"] else ""
        elif name == "attention":
            floor = f"{r['kv_floor_ms']:.2f}"
            note = f"{r['kv_floor_ms'] / k['ms']:.0%} of the KV floor" if k["ms"] else ""
        print(f"| {name} | {k['ms']:.2f} | {k['kernels']:.0f} | {floor} | {note} |")
    print("\ncostliest kernels of each kind (ms per LM step):")
    for name, k in r["lm_step_kernels"].items():
        print(f"  {name}: " + "; ".join(f"{n} {ms:.3f}" for n, ms in k["top"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, action="append", help="batch size B (repeatable; default 1)")
    parser.add_argument("--window", choices=WINDOWS, action="append", help="KV window (repeatable; default empty)")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--kind", choices=("moshi", "personaplex"), default="moshi")
    parser.add_argument("--frames", type=int, default=30, help="timed replays per section")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--kv-blocks", help="page the temporal KV ring: a pool of N blocks, 'fit' or 'full' "
                        "(see frame_latency.py); default dense rings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_frame needs a CUDA GPU")
    if args.kv_blocks is not None and args.kv_blocks not in KV_POOLS and not args.kv_blocks.isdigit():
        sys.exit(f"--kv-blocks {args.kv_blocks}: a number of blocks, or one of {', '.join(KV_POOLS)}")
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else None
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    models = random_models(args.kind)
    results = []
    for batch in args.batch or [1]:
        for window in args.window or ["empty"]:
            results.append(profile_frame(models, batch, window, kv_dtype, args.kind, args.frames, args.warmup,
                                         args.kv_blocks))
            report(results[-1])
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
