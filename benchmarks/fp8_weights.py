"""The temporal transformer's weight matmuls with bf16 weights against fp8 weights (CUDA only).

    python benchmarks/fp8_weights.py --batches 1,64,128

What fp8 weights could take off a frame (issue 32's B = 64 full bf16 frame: 33.0 ms against a
30 ms target, with 5.0 ms of weight matmuls). Moshi-7B's temporal layers (LMConfig: 32 layers,
dim 4096, gated FFN), random weights, every layer's own four matrices (in_proj, out_proj,
linear_in, linear_out), so each step reads them all from memory as the frame does. Per batch B,
one step's 128 matmuls are captured as one CUDA graph, median ms of a replay by CUDA events:
- bf16: `F.linear`, as the engine runs them;
- fp8 rows: each weight in e4m3 with one scale per output row (cast once, outside the graph);
  in the graph each input is scaled per row by its absolute max and cast, then
  `torch._scaled_mm` into bf16. Its rows are padded to a multiple of 16 (the fp8 matmul's
  shape rule);
- fp8 tensor: the same with one scale per weight and one per input (cuBLASLt's fp8 path);
- fp8 matmul only: fp8 tensor's matmuls on inputs cast before the graph, what is left if the
  cast were fused into the kernel before each matmul (the norm, the activation).
Beside them: the bytes each must read and the bandwidth reached, and fp8's error against bf16
on the same inputs (the norm of the difference over the norm of bf16's output, worst matmul).
The error says nothing yet of what it does to the model's tokens: that would need a fidelity
case like Mimi's float16 (mimi_quality.py) before fp8 weights could be served.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_setup import H200_COPY_TBPS, graph_ms, model_configs  # noqa: E402

from parley.engine.cuda_graph import CUDAGraphRunner  # noqa: E402
from parley.models.transformer import gated_hidden_dim  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def layer_shapes(dim: int, hidden_scale: float) -> list[tuple[int, int]]:
    """(out, in) of one temporal layer's four weights."""
    hidden = gated_hidden_dim(dim, int(hidden_scale * dim))
    return [(3 * dim, dim), (dim, dim), (2 * hidden, dim), (dim, hidden)]


def to_fp8(w: torch.Tensor, rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scale) with w ~= q * scale: one scale per row ([N, 1]) or
    one for the tensor (a scalar)."""
    amax = w.float().abs().amax(dim=1, keepdim=True) if rows else w.float().abs().amax()
    scale = amax.clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale).to(FP8), scale


def fp8_linear(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    rows = w_scale.dim() > 0
    xq, x_scale = to_fp8(x, rows)
    return torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=w_scale.t() if rows else w_scale,
                            out_dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,128", help="comma-separated batch sizes")
    parser.add_argument("--layers", type=int, help="temporal layers (default: Moshi-7B's 32)")
    parser.add_argument("--replays", type=int, default=30)
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        sys.exit(f"--batches {args.batches!r}: comma-separated integers")
    if min(batches) < 1 or args.replays < 1 or (args.layers is not None and args.layers < 1):
        sys.exit("every batch, --layers and --replays must be at least 1")
    if not torch.cuda.is_available():
        sys.exit("fp8_weights needs a CUDA GPU")
    cfg = model_configs("moshi")[0]
    layers = cfg.num_layers if args.layers is None else args.layers
    shapes = layer_shapes(cfg.dim, cfg.hidden_scale) * layers
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * k ** -0.5 for n, k in shapes]
    quantized = {"fp8 rows": [to_fp8(w, rows=True) for w in weights],
                 "fp8 tensor": [to_fp8(w, rows=False) for w in weights]}
    bf16_bytes = sum(w.numel() * 2 for w in weights)
    fp8_bytes = sum(q.numel() + s.numel() * 4 for q, s in quantized["fp8 rows"])
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  {layers} temporal layers, "
          f"weights bf16 {bf16_bytes / 1e9:.2f} GB, fp8 {fp8_bytes / 1e9:.2f} GB")
    print("\n| B | matmuls | ms | TB/s | saved ms | error against bf16 (worst) |\n|---:|---|---:|---:|---:|---:|")
    for batch in batches:
        rows = -(-batch // 16) * 16
        inputs = [torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _, k in shapes]

        def bf16_step(*xs):
            return [F.linear(x[:batch], w) for x, w in zip(xs, weights)]

        def fp8_step(weights8):
            return lambda *xs: [fp8_linear(x, q, s)[:batch] for x, (q, s) in zip(xs, weights8)]

        cast = [to_fp8(x, rows=False) for x in inputs]

        def fp8_matmul_only(*xs):
            return [torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=s, out_dtype=torch.bfloat16)[:batch]
                    for (xq, x_scale), (q, s) in zip(cast, quantized["fp8 tensor"])]

        steps = {"bf16": (bf16_step, bf16_bytes), **{name: (fp8_step(w8), fp8_bytes) for name, w8 in quantized.items()},
                 "fp8 matmul only": (fp8_matmul_only, fp8_bytes)}
        reference = None
        for name, (step, nbytes) in steps.items():
            runner = CUDAGraphRunner(step, inputs)
            ms = graph_ms(runner, inputs, frames=args.replays, warmup=3)
            outputs = [y.float() for y in runner(*inputs)]
            runner.close()
            if reference is None:
                reference, bf16_ms = outputs, ms
            error = max(((a - b).norm() / b.norm()).item() for a, b in zip(outputs, reference))
            print(f"| {batch} | {name} | {ms:.2f} | {nbytes / ms / 1e9:.2f} | {bf16_ms - ms:.2f} | {error:.2%} |",
                  flush=True)
    print(f"\n(floor at {H200_COPY_TBPS} TB/s: bf16 {bf16_bytes / H200_COPY_TBPS / 1e9:.2f} ms, "
          f"fp8 {fp8_bytes / H200_COPY_TBPS / 1e9:.2f} ms)")


if __name__ == "__main__":
    main()
