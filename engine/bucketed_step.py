"""A step over the lowest rows of per-row state, sized to a row bucket, one CUDA graph per bucket.

    step = BucketedStep(fn, (lm_state, mimi_state), bucket_sizes(max_rows))
    step.capture(lambda n: (torch.zeros(n, frame, device=dev), torch.zeros(n, dtype=torch.bool, device=dev)))
    outputs = step(step.bucket(busy_rows), *inputs)   # inputs hold that bucket's rows

Why: the engine takes rows lowest first, so a step over the lowest `n` rows that hold every busy
row costs what those rows cost: idle rows are free. `n` is the smallest bucket (1, 2, 4, ...,
max_rows) that fits, so there are few shapes, each with its own CUDA graph. Bucket `n` runs
`fn(*views, *inputs)`, `views` being `leading_rows(state, n)` of each state (models/row_views.py):
slices, so the step updates rows [0, n) in place and never reads or writes the rows above.
The duplex frame (backend.py), the TTS pool and both STT paths share this.

On CUDA `capture` records one graph per bucket (engine/cuda_graph.py), largest first on one
memory pool: one bucket runs at a time, so they can share memory, and the first capture sizes the
pool. Before `capture`, on CPU or with graphs off, the same functions run eagerly.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Sequence

import torch

from parley.models.row_views import leading_rows

from .cuda_graph import CUDAGraphRunner, GraphError


def bucket_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, ... below max_rows, then max_rows: the row counts a step may run."""
    buckets, n = [], 1
    while n < max_rows:
        buckets.append(n)
        n *= 2
    return buckets + [max_rows]


def bucket_for(buckets: list[int], rows: Iterable[int]) -> int:
    """The smallest of `buckets` (ascending row counts) holding every one of `rows` (indices)."""
    top = max(rows, default=0) + 1
    if top > buckets[-1]:
        raise ValueError(f"row {top - 1} is outside the {buckets[-1]} rows")
    return next(n for n in buckets if n >= top)


class BucketedStep:
    """`fn` over the lowest n rows of `states`, for each n in `buckets`: replayed or eager."""

    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], states: Sequence[Any],
                 buckets: Sequence[int]) -> None:
        self.buckets = list(buckets)
        self._eager = {n: partial(fn, *(leading_rows(state, n) for state in states)) for n in self.buckets}
        self._graphs: dict[int, CUDAGraphRunner] = {}
        self.pool: tuple | None = None  # the graphs' memory pool, once captured

    def bucket(self, rows: Iterable[int]) -> int:
        """The rows a step over `rows` (indices) runs: the smallest bucket holding every one."""
        return bucket_for(self.buckets, rows)

    def capture(self, inputs_of: Callable[[int], Sequence[torch.Tensor]], *, pool: tuple | None = None,
                generators: Sequence[torch.Generator] = ()) -> tuple:
        """Capture a CUDA graph of each bucket not captured yet, largest first. `inputs_of(n)`:
        example inputs of bucket n, whose shapes, dtypes and device every later call must match.
        `pool`: a memory pool shared with other graphs that never run at the same time (default
        this step's own); returned. `generators`: CUDAGraphRunner's (random streams of `fn`)."""
        for n in reversed(self.buckets):
            if n not in self._graphs:
                inputs = inputs_of(n)
                if self.pool is None:
                    if not all(t.is_cuda for t in inputs):
                        raise GraphError("CUDA graphs need every input on a CUDA device; off CUDA, "
                                         "leave the step uncaptured and it runs eagerly.")
                    self.pool = pool or torch.cuda.graph_pool_handle()
                self._graphs[n] = CUDAGraphRunner(self._eager[n], inputs, pool=self.pool, generators=generators)
        return self.pool

    def __call__(self, n: int, *inputs: torch.Tensor) -> Sequence[torch.Tensor]:
        """Bucket `n`'s step: its graph if captured (outputs are the graph's buffers, valid until
        its next replay), else eagerly."""
        graph = self._graphs.get(n)
        return graph(*inputs) if graph is not None else self.eager(n)(*inputs)

    def eager(self, n: int) -> Callable[..., Sequence[torch.Tensor]]:
        """Bucket `n`'s step as a plain function (e.g. to run inside another graph's capture)."""
        if n not in self._eager:
            raise ValueError(f"no step over {n} rows: the buckets are {self.buckets}")
        return self._eager[n]

    def graph(self, n: int) -> CUDAGraphRunner | None:
        """Bucket `n`'s graph, if captured (benchmarks time its replays)."""
        return self._graphs.get(n)

    @property
    def graphed(self) -> bool:
        """Whether the steps replay CUDA graphs (captured)."""
        return bool(self._graphs)

    def close(self) -> None:
        """Free the graphs; later calls run eagerly."""
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
