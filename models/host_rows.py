"""One row of a per-row device tensor written from host values in one copy.

    write_row(dst[B, ...], row, values)   # values: a numpy array shaped like dst[row]

Admissions write a fresh row of state from the host between steps. Each eager op costs a
launch and a pageable host -> device copy waits for the stream, so the row is built on the host
and sent whole: from pinned memory without a stream sync on CUDA (the caching host allocator
keeps the pinned block until the copy has run), a plain copy elsewhere.
"""

from __future__ import annotations

import numpy as np
import torch


def write_row(dst: torch.Tensor, row: int, values: np.ndarray) -> None:
    src = torch.from_numpy(values)
    if src.dtype != dst.dtype or src.shape != dst.shape[1:]:
        raise ValueError(f"row of {src.dtype} {tuple(src.shape)} for a {dst.dtype} {tuple(dst.shape)} tensor")
    if dst.is_cuda:
        dst[row].copy_(src.pin_memory(), non_blocking=True)
    else:
        dst[row].copy_(src)
