"""What per-row seeds cost the sampler: one step's text + audio sampling (1 text draw over the
text vocabulary, `--codebooks` draws over the audio vocabulary) captured in a CUDA graph, with
no seeds (the old path), with the seed tensors passed but every row unseeded (the default
serving path now), and with every row seeded.

    python benchmarks/seeded_sampling.py [--batch 64] [--codebooks 8]

Prints microseconds per step for each; needs CUDA (Triton's fused sampler).
"""

from __future__ import annotations

import argparse

import torch

from parley.models.sampling import UNSEEDED, sample_tokens


def step_graph(batch: int, codebooks: int, seeded: bool | None) -> float:
    text = torch.randn(batch, 32000, device="cuda")
    audio = torch.randn(batch, 2048, device="cuda")
    temp = torch.full((batch,), 0.8, device="cuda")
    top_k = torch.full((batch,), 250, dtype=torch.long, device="cuda")
    seeds = torch.full((batch,), 7 if seeded else UNSEEDED, dtype=torch.long, device="cuda")
    counter = torch.zeros(batch, dtype=torch.long, device="cuda")
    kwargs = {} if seeded is None else {"seeds": seeds, "counter": counter}

    def step():
        out = [sample_tokens(text, temp, top_k, **kwargs, **({} if seeded is None else {"stream": 0}))]
        for k in range(codebooks):
            out.append(sample_tokens(audio, temp, top_k, **kwargs, **({} if seeded is None else {"stream": 1 + k})))
        return out

    for _ in range(3):
        step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    n = 500
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--codebooks", type=int, default=8)
    args = parser.parse_args()
    print(f"GPU {torch.cuda.get_device_name(0)}, batch {args.batch}, 1 text + {args.codebooks} audio draws per step")
    for name, seeded in (("no seed tensors (before)", None), ("seed tensors, all rows unseeded", False),
                         ("every row seeded", True)):
        times = sorted(step_graph(args.batch, args.codebooks, seeded) for _ in range(3))
        print(f"  {name:34s} {times[1]:8.1f} us/step (median of 3)")


if __name__ == "__main__":
    main()
