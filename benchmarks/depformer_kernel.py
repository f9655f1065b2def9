"""One frame's depformer, layer by layer against the persistent kernel (CUDA only).

    python benchmarks/depformer_kernel.py [--kind moshi|personaplex] [--batches 1,8,32,64,128]
        [--launch 16,16,32,128,256,1,8 ...] [--frames 100] [--json out.json]

Moshi-7B (or PersonaPlex-7B) depformer shapes, random bf16 weights (the temporal transformer is
cut to one layer: the depformer never reads it). For each B, the depformer's n_agent steps with
their sampling, captured as a CUDA graph each way:
- `layers`: the layer-by-layer fused path (what serve runs by default);
- `persistent`: one kernel a step (models/depformer_kernel.py) with the default launch, then
  with each `--launch block_m,block_n,block_n_wide,block_k,block_k_long,stages,warps`;
- `phases`: the same kernel launched once per phase (no grid barrier), which tells what the
  barriers save against plain launches.
It prints the median GPU ms per frame, kernels per frame, the floor of reading the depformer's
weights once a step, the start-up check (`persistent_depformer.check`): the logits' largest
difference from the layer path, relative to their largest, and the greedy agreement; and, from
the `phases` launches, where a step's time goes by phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_setup import H200_COPY_TBPS, graph_ms, model_configs  # noqa: E402

from parley.engine.cuda_graph import CUDAGraphRunner  # noqa: E402
from parley.models import depformer_kernel  # noqa: E402
from parley.models.lm import LMModel  # noqa: E402
from parley.models.lm_gen import LMGen  # noqa: E402
from parley.models.persistent_depformer import PersistentDepformer, check  # noqa: E402


PHASE_NAMES = ("input", "norm + QKV", "attention", "out + residual", "norm + FFN in", "FFN out + residual")


def replay_kernels(runner: CUDAGraphRunner, inputs) -> list[tuple[str, float]]:
    """(name, ms) of each kernel of one replay, in start order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner(*inputs)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and not e.name.startswith(("Memcpy", "Memset"))), key=lambda e: e.time_range.start)
    return [(e.name, (e.time_range.end - e.time_range.start) / 1000) for e in events]


def phase_ms(kernels: list[tuple[str, float]], layers: int) -> dict[str, float]:
    """ms a frame by phase kind, from a replay of one launch a phase (`phases`): the i-th
    `_depformer_kernel` of a step runs phase i."""
    per_step = 1 + 5 * layers
    out = dict.fromkeys(PHASE_NAMES, 0.0)
    launches = [ms for name, ms in kernels if "_depformer_kernel" in name]
    for i, ms in enumerate(launches):
        phase = i % per_step
        out[PHASE_NAMES[0 if phase == 0 else 1 + (phase - 1) % 5]] += ms
    return out


def depformer_weight_bytes(lm: LMModel) -> int:
    """What n_agent steps read: each step's input projection, layers and output head."""
    cfg = lm.cfg
    per_step = sum(lm.depformer.layers[0].self_attn.weights(0)[i].numel() for i in range(2))
    g = lm.depformer.layers[0].gating[0]
    per_step += g.linear_in.weight.numel() + g.linear_out.weight.numel()
    per_step = per_step * cfg.depformer_num_layers + lm.depformer_in[0].weight.numel() + lm.linears[0].weight.numel()
    return per_step * cfg.n_agent * 2  # bf16


@torch.no_grad()
def time_path(gen: LMGen, batch: int, frames: int, warmup: int) -> tuple[float, list[tuple[str, float]]]:
    cfg = gen.cfg
    state = gen.init_state(batch)
    state.set_sampling(torch.ones(batch, dtype=torch.bool, device="cuda"), audio_temp=0.0)
    hidden = torch.randn(batch, cfg.dim, device="cuda", dtype=torch.bfloat16)
    text = torch.randint(0, cfg.text_card, (batch,), device="cuda")
    runner = CUDAGraphRunner(lambda h, t: (gen.depformer(state, h, t),), (hidden, text))
    ms = graph_ms(runner, (hidden, text), frames, warmup)
    kernels = replay_kernels(runner, (hidden, text))
    runner.close()
    return ms, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("moshi", "personaplex"), default="moshi")
    parser.add_argument("--batches", default="1,8,32,64,128", help="comma-separated batch sizes")
    parser.add_argument("--launch", action="append", default=[],
                        help="also time this launch: block_m,block_n,block_n_wide,block_k,block_k_long,stages,warps (repeatable)")
    parser.add_argument("--frames", type=int, default=100, help="timed replays per case")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("depformer_kernel needs a CUDA GPU")
    launches = [depformer_kernel.DepformerLaunch(*(int(v) for v in text.split(","))) for text in args.launch]
    torch.manual_seed(0)
    cfg = dataclasses.replace(model_configs(args.kind)[0], num_layers=1)
    lm = LMModel(cfg, device="cuda", dtype=torch.bfloat16).eval()
    gen = LMGen(lm)
    persistent = PersistentDepformer(lm)
    floor = depformer_weight_bytes(lm) / (H200_COPY_TBPS * 1e9)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  {args.kind} depformer: "
          f"{cfg.depformer_num_layers} layers x {cfg.n_agent} steps, weights floor {floor:.3f} ms a frame")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        row = {"B": batch}
        lm.persistent_depformer = None
        ms, kernels = time_path(gen, batch, args.frames, args.warmup)
        row["layers"] = (ms, len(kernels))
        lm.persistent_depformer = persistent
        row["check"] = check(lm, batch, torch.Generator().manual_seed(0))
        for name, launch, phases in ([("persistent", None, False)] + [(str(tuple(l)), l, False) for l in launches]
                                     + [("phases", None, True)]):
            persistent.launch, persistent.phase_by_phase = launch, phases
            ms, kernels = time_path(gen, batch, args.frames, args.warmup)
            row[name] = (ms, len(kernels))
            if phases:
                row["phase_ms"] = phase_ms(kernels, cfg.depformer_num_layers)
        persistent.launch, persistent.phase_by_phase = None, False
        row["default_launch"] = list(depformer_kernel.depformer_launch(batch))
        rows.append(row)
        print(json.dumps(row), flush=True)
    lm.persistent_depformer = None

    names = [k for k in rows[0] if k not in ("B", "check", "default_launch", "phase_ms")]
    print(f"\nms a frame (kernels a frame); floor {floor:.3f} ms ({H200_COPY_TBPS} TB/s)")
    print("| B | " + " | ".join(names) + " | logits max diff | greedy agreement |")
    print("|---:|" + "---:|" * (len(names) + 2))
    for row in rows:
        cells = [f"{row[n][0]:.3f} ({row[n][1]})" for n in names]
        print(f"| {row['B']} | " + " | ".join(cells)
              + f" | {row['check']['max_diff']:.2%} | {row['check']['agreement']:.1%} |")
    print("\nms a frame by phase (one launch a phase, default launch; GPU time of the launches only)")
    print("| B | " + " | ".join(PHASE_NAMES) + " |")
    print("|---:|" + "---:|" * len(PHASE_NAMES))
    for row in rows:
        print(f"| {row['B']} | " + " | ".join(f"{row['phase_ms'][n]:.3f}" for n in PHASE_NAMES) + " |")
    if args.json:
        args.json.write_text(json.dumps({"kind": args.kind, "floor_ms": floor, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
