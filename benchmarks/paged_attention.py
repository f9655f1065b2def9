"""Paged decode attention, one layer: our kernel through a block table against our dense ring, and
FlashInfer's BatchDecodeWithPagedKVCacheWrapper over the very same pools when it is installed.

    python benchmarks/paged_attention.py --batches 128,256 --kv bf16,fp8 --blocks 60,64
    python benchmarks/paged_attention.py --batches 64 --launches default,64x24x3x4   # our kernels' launch shapes
    python benchmarks/paged_attention.py --device cpu     # tiny shapes, our kernels in Triton's interpreter

Moshi 7B's temporal attention: H = 32 heads of D = 128, a `--window`-slot ring (3000) in blocks of
each of `--blocks` slots (64, Parley's default: the last of a row's 47 blocks holds 56 slots; 60
divides the ring but costs the kernels a padded tile a block), every row's window full and its
blocks in a shuffled order. Each case prints
the median time of one call (CUDA events over --iters calls) and the KV bytes it reads per second.
FlashInfer is imported only here (it is no dependency of Parley); its fp8 KV takes one scale per
tensor where ours keeps one per vector, so its fp8 figure is a speed reference, not the same sums.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batches", default="128,256", help="comma-separated rows B (cpu default: 2)")
    parser.add_argument("--kv", default="bf16,fp8", help="KV dtypes: bf16, fp8")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=3000, help="ring slots, all filled")
    parser.add_argument("--blocks", default="64", help="comma-separated slots per block (1 .. --window)")
    parser.add_argument("--launches", default="default",
                        help="comma-separated launch shapes of our kernels, BLOCK_NxBLOCKSxSTAGESxWARPS (BLOCKS 0: "
                             "one program over the whole ring), or default (kernels.attention_launch); a table each")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if args.device == "cpu":  # tiny: the interpreter runs every program in numpy
        args.batches, args.heads, args.head_dim, args.window, args.blocks, args.iters = "2", 2, 16, 120, "20,32", 2
    args.blocks = [int(b) for b in args.blocks.split(",")]
    try:
        args.launches = [None if shape == "default" else tuple(int(x) for x in shape.split("x"))
                         for shape in args.launches.split(",")]
    except ValueError:
        parser.error(f"--launches {args.launches!r}: each default or BLOCK_NxBLOCKSxSTAGESxWARPS")
    if not all(shape is None or (len(shape) == 4 and shape[0] > 0) for shape in args.launches):
        parser.error(f"--launches {args.launches}: each default or four numbers BLOCK_NxBLOCKSxSTAGESxWARPS")
    if not all(0 < b <= args.window for b in args.blocks):
        parser.error(f"--blocks {args.blocks}: each must be 1 .. --window {args.window}")
    return args


def make_case(B: int, H: int, D: int, S: int, bs: int, fp8: bool, device: str) -> dict:
    """A dense ring, the same contents in shuffled pool blocks, a query and the step's own key."""
    from parley.models.transformer import quantize_kv, ring_slot_positions
    nb = -(-S // bs)  # the last block partly used unless bs divides S
    pos = torch.full((B,), 3 * S + 7, dtype=torch.long, device=device)  # wrapped: every slot in the window
    g = torch.Generator(device).manual_seed(0)
    rings = [torch.randn(B, H, S, D, device=device, generator=g, dtype=torch.bfloat16) for _ in range(2)]
    if fp8:
        (k8, ks), (v8, vs) = quantize_kv(rings[0]), quantize_kv(rings[1])
        rings = [k8, v8, ks, vs]
    table = (torch.randperm(B * nb, generator=g, device=device) + 1).int().view(B, nb)
    pools = []
    for ring in rings:
        raw = ring.view(torch.uint8) if ring.dtype == torch.float8_e4m3fn else ring
        pool = torch.zeros(B * nb + 1, H, bs, *raw.shape[3:], dtype=raw.dtype, device=device)
        padded = torch.zeros(B, H, nb * bs, *raw.shape[3:], dtype=raw.dtype, device=device)
        padded[:, :, :S] = raw
        pool[table.flatten().long()] = padded.view(B, H, nb, bs, *raw.shape[3:]).transpose(1, 2).reshape(
            B * nb, H, bs, *raw.shape[3:])
        pools.append(pool.view(ring.dtype))
    q, kn, vn = (torch.randn(B, H, D, device=device, generator=g, dtype=torch.bfloat16) for _ in range(3))
    return dict(rings=rings, pools=pools, table=table, pos=pos, sp=ring_slot_positions(pos, S), q=q, kn=kn, vn=vn,
                kv_bytes=sum(r.numel() * r.element_size() for r in rings))


def ours(case: dict, paged: bool, shape: tuple[int, ...] | None = None):
    """Our kernel over the dense ring or the pools, at a launch shape (None: the default launch)."""
    from parley.models import kernels
    c = case
    caches = c["pools"] if paged else c["rings"]
    table = c["table"] if paged else None
    S = c["sp"].shape[1]
    launch = None
    if shape is not None:
        block_n, blocks, stages, warps = shape
        launch = kernels.AttentionLaunch(block_n, blocks or -(-S // block_n), stages, warps)
    one_split = launch is None or launch.block_n * launch.blocks >= S  # only those take a row order
    order = (kernels.row_order(c["pos"], c["q"].shape[1], S, len(caches) == 4)
             if c["q"].is_cuda and one_split else None)
    return lambda: kernels.decode_attention(c["q"], c["kn"], c["vn"], *caches[:2], c["sp"], c["pos"], S, *caches[2:],
                                            launch=launch, order=order, block_table=table)


def flashinfer_call(case: dict, fp8: bool):
    """FlashInfer's paged decode over the same pools (HND: [blocks, H, block, D]), or None."""
    try:
        import flashinfer
    except ImportError:
        return None
    c = case
    B, nb = c["table"].shape
    k_pool, v_pool = c["pools"][:2]
    bs = k_pool.shape[2]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda"), "HND")
    indptr = torch.arange(0, (B + 1) * nb, nb, dtype=torch.int32, device="cuda")
    last = torch.full((B,), c["sp"].shape[1] - (nb - 1) * bs, dtype=torch.int32, device="cuda")
    wrapper.plan(indptr, c["table"].flatten(), last, c["q"].shape[1], c["q"].shape[1], c["q"].shape[2], bs,
                 q_data_type=torch.bfloat16, kv_data_type=k_pool.dtype)
    scales = dict(k_scale=float(c["pools"][2].mean()), v_scale=float(c["pools"][3].mean())) if fp8 else {}
    return lambda: wrapper.run(c["q"], (k_pool, v_pool), **scales)


def flashinfer_error(case: dict, fn) -> float:
    """FlashInfer's largest difference from torch's attention over the dense bf16 ring: the check
    that it read the pools as laid out (every slot, no step key: its sums, not ours)."""
    k, v = case["rings"][:2]
    want = torch.nn.functional.scaled_dot_product_attention(case["q"][:, :, None], k, v)[:, :, 0]
    return float((fn().float() - want.float()).abs().max())


def median_ms(fn, iters: int, cuda: bool) -> float:
    fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before the import below
    elif not torch.cuda.is_available():
        sys.exit("paged_attention needs a CUDA GPU (or --device cpu for the interpreter at tiny shapes)")
    cuda = args.device == "cuda"
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (Triton interpreter)'}  H={args.heads} "
          f"D={args.head_dim} window={args.window}")
    for shape in args.launches:
        print(f"\nlaunch: {'default' if shape is None else 'x'.join(map(str, shape))}")
        print("\n| B | KV | block | ours dense ms | ours paged ms | paged / dense | FlashInfer ms | dense TB/s | paged TB/s |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for B in (int(b) for b in args.batches.split(",")):
            for kv in args.kv.split(","):
                table_rows(args, B, kv, shape, cuda)


def table_rows(args: argparse.Namespace, B: int, kv: str, shape: tuple[int, ...] | None, cuda: bool) -> None:
    """One (B, KV dtype) of a launch's table: a row per block size."""
    fp8 = kv == "fp8"
    dense = None  # the same ring whatever the block: timed once
    for bs in args.blocks:
        case = make_case(B, args.heads, args.head_dim, args.window, bs, fp8, args.device)
        dense = dense or median_ms(ours(case, False, shape), args.iters, cuda)
        paged = median_ms(ours(case, True, shape), args.iters, cuda)
        fi = flashinfer_call(case, fp8) if cuda else None
        fi_ms = f"{median_ms(fi, args.iters, cuda):.3f}" if fi else "not installed"
        if fi and not fp8:
            fi_ms += f" (max diff {flashinfer_error(case, fi):.1e})"
        tbps = [case["kv_bytes"] / (ms * 1e-3) / 1e12 for ms in (dense, paged)]
        print(f"| {B} | {kv} | {bs} | {dense:.3f} | {paged:.3f} | {paged / dense:.2f} | {fi_ms} | "
              f"{tbps[0]:.2f} | {tbps[1]:.2f} |", flush=True)
        del case
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
