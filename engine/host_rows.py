"""Audio rows moved on the engine thread without numpy copies.

numpy gives the GIL up for any copy of more than a few hundred elements, and a frame is 1920
samples. Each give-up lets a waiting thread (the event loop of hundreds of sockets) take the GIL,
and taking it back can wait out the switch interval: a copy per row risks a wait per row. How often
the loop wins that race depends on the machine (`benchmarks/row_copies.py` measures it). Copies of
bytes and bytearrays are memcpy calls that keep the GIL, so the engine's per-row audio goes
through them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def row_copy(row: np.ndarray) -> np.ndarray:
    """A writable copy of one row (C-contiguous), made while holding the GIL."""
    return np.frombuffer(bytearray(row), dtype=row.dtype).reshape(row.shape)


def join_rows(parts: Sequence[object], samples: int) -> np.ndarray:
    """[len(parts), samples] float32, writable: row i is parts[i]'s float32 samples (an array or
    bytes, exactly `samples` long), silence where it is None. One join, whatever the rows."""
    silence = bytes(4 * samples)
    rows = [silence if part is None else part for part in parts]
    return np.frombuffer(bytearray().join(rows), dtype=np.float32).reshape(len(rows), samples)
