"""Rows back to a fresh session: every per-row state's masked reset as one program, replayed as one
CUDA graph on CUDA.

Why a graph: a reset is a masked fill of each per-row state tensor (hundreds, over Mimi's and the
LM's layers), and every torch call the engine thread makes gives the GIL up; taking it back waits
while the event loop runs Python, a wait per call beside a busy loop (docs/architecture.md).
Replayed, a reset is two calls (the mask's upload and the replay) whatever the model.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cuda_graph import CUDAGraphRunner


class RowReset:
    """`reset(mask)` (device work only: no host sync, fixed shapes) over `rows` rows. On CUDA with
    `graph`, captured once here with no row masked (a reset of no row changes nothing)."""

    def __init__(self, reset: Callable[[torch.Tensor], None], rows: int, device: torch.device,
                 graph: bool) -> None:
        self._reset = reset
        self._device = device
        self._graph: CUDAGraphRunner | None = None
        if graph and device.type == "cuda":
            self._graph = CUDAGraphRunner(self._program, [torch.zeros(rows, dtype=torch.bool, device=device)])

    def _program(self, mask: torch.Tensor) -> tuple:
        self._reset(mask)
        return ()

    def __call__(self, mask: torch.Tensor) -> None:
        """Reset the rows of `mask` ([rows] bool, host), leaving the others untouched."""
        if self._graph is not None:
            self._graph(mask)
        else:
            self._program(mask.to(self._device))

    def close(self) -> None:
        if self._graph is not None:
            self._graph.close()
            self._graph = None
