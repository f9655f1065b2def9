"""Host values sent to the device without waiting for it.

    copy_from_host(state[row], values)   # values: a numpy array shaped like the slice
    to_device(tensor, device)            # a host tensor, as a new tensor on `device`

Admissions write a fresh row of state from the host between steps. Each eager op costs a
launch and a pageable host -> device copy waits for the stream, so the row is built on the host
and sent whole: from pinned memory without a stream sync on CUDA (the caching host allocator
keeps the pinned block until the copy has run), a plain copy elsewhere.
"""

from __future__ import annotations

import numpy as np
import torch


def copy_from_host(dst: torch.Tensor, values: np.ndarray) -> None:
    src = torch.from_numpy(values)
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise ValueError(f"{src.dtype} {tuple(src.shape)} values for a {dst.dtype} {tuple(dst.shape)} slice")
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def to_device(src: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`src` (a host tensor) on `device`. On CUDA from pinned memory, queued on the stream without
    a sync: a pageable copy would first wait for everything queued before it."""
    device = torch.device(device)
    if device.type == "cuda" and src.device.type == "cpu":
        return src.pin_memory().to(device, non_blocking=True)
    return src.to(device)
