"""One layer's paged decode attention captured in a CUDA graph, as the frame runs it: our Triton
kernel (reading the block table inside the graph) against FlashInfer's decode through page lists
(`--kv-attention flashinfer`, `models/paged_decode.py`), and the host's cost of planning those
lists before each step (`paged_kv.decode_pages`, then FlashInfer's `plan()`). bf16 KV, Moshi's
heads (32 x 128) and 3000-slot ring, blocks shuffled over the pool. CUDA and flashinfer-python
(0.7.2.post1) only.

    python benchmarks/flashinfer_decode.py --cases 64:full,64:spread,128:spread

Windows: `full` (every row wrapped: all its blocks, full) or `spread` (rows evenly over the
window: each holds the blocks it has filled, the last partly). FlashInfer needs a block that
divides the ring (60 slots); ours runs at its default 64 as well.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from parley.models import kernels, paged_kv
from parley.models.paged_decode import FlashInferDecode, flashinfer_module
from parley.models.transformer import ring_slot_positions

HEADS, HEAD_DIM, RING = 32, 128, 3000


def graph_ms(fn, calls: int = 10, replays: int = 20) -> float:
    """Median ms of one call, `calls` of them captured in one graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def host_ms(fn, calls: int = 50) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def run_case(B: int, window: str, bs: int) -> str:
    nb = paged_kv.ring_blocks(RING, bs)
    pos = np.full(B, 10 * RING) if window == "full" else np.linspace(0, RING - 1, B).astype(np.int64)
    k_pool = torch.randn(B * nb + 1, HEADS, bs, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    table = (torch.randperm(B * nb) + 1).view(B, nb).int()
    taken_at = np.tile(np.arange(nb) * bs, (B, 1))  # block j first written at position j * bs
    q, k_new, v_new = (torch.randn(B, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    device_pos = torch.as_tensor(pos, device="cuda")
    slot_pos = ring_slot_positions(device_pos, RING)
    order = kernels.row_order(device_pos, HEADS, RING, False)
    device_table = table.cuda()
    ours = graph_ms(lambda: kernels.decode_attention(q, k_new, v_new, k_pool, v_pool, slot_pos, device_pos, RING,
                                                     order=order, block_table=device_table))
    line = f"| {B} | {window} | {bs} | {ours:.3f} |"
    if RING % bs:
        return line + "  |  |"
    decode = FlashInferDecode([B], HEADS, HEAD_DIM, bs, nb, torch.device("cuda"))
    lists = paged_kv.decode_pages(table.numpy(), pos, taken_at, RING, bs)
    decode.plan(B, *lists)
    planning = host_ms(lambda: paged_kv.decode_pages(table.numpy(), pos, taken_at, RING, bs))
    plan = host_ms(lambda: decode.plan(B, *lists))
    theirs = graph_ms(lambda: decode.run(q, k_pool, v_pool))
    return line + f" {theirs:.3f} | {planning:.3f} + {plan:.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="64:full,64:spread,128:spread", help="B:full|spread, comma-separated")
    parser.add_argument("--blocks", default="60,64", help="block sizes in slots (FlashInfer runs where one divides 3000)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or flashinfer_module() is None:
        sys.exit("flashinfer_decode needs a CUDA GPU and flashinfer-python installed")
    cases = []
    for case in args.cases.split(","):
        batch, _, window = case.partition(":")
        if not batch.isdigit() or window not in ("full", "spread"):
            sys.exit(f"--cases {case!r}: B:full or B:spread")
        cases.append((int(batch), window))
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 KV, H {HEADS}, D {HEAD_DIM}, "
          f"ring {RING}")
    print("\n| B | window | block | ours ms a layer (graph) | FlashInfer ms a layer (graph) "
          "| host: decode_pages + plan() ms |\n|---:|---|---:|---:|---:|---:|")
    for batch, window in cases:
        for bs in (int(b) for b in args.blocks.split(",")):
            print(run_case(batch, window, bs), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
