"""Paged KV rings: per-layer pools of fixed-size blocks that every row draws from, and a block table.

    bs = block_size_for(capacity, None)          # the default: 64 slots (the whole ring when shorter)
    view = gather_ring(pool, table, capacity)    # [B, H, capacity(, D)]: each row's ring as a dense copy
    scatter_slots(pool, table, view, slots, keep)   # view[b, :, slots[b, t]] back to the pool, rows where keep[b]
    indptr, indices, last = decode_pages(table_host, pos, taken_at, capacity, bs)   # page lists (FlashInfer's)
    write_prefix(pool, table_row, prefix)        # slots 0 .. F - 1 of one row = prefix [H, F(, D)]

Layout: a pool is [num_blocks, H, block_size, D] (fp8 scales [num_blocks, H, block_size]); the
table [B, ring_blocks(capacity, bs)] int32 maps logical ring block j of row b to physical block
table[b, j], so ring slot s of row b lives at pool[table[b, s // bs], :, s % bs]. The ring itself
is unchanged (slot = position % capacity, TransformerState.slot_pos): only where a slot is stored.
A block need not divide the ring: its last block is then partly used (Moshi's 3000 slots in 64s:
47 blocks, the last holding 56). A power-of-two block is what the kernels' tiles walk without
padding (a 60-slot block costs them a 64-slot tile: 7 % more reads, benchmarks/paged_attention.py).

Physical block 0 is the null block: table entries no row owns point at it. It is never attended
(its slots' slot_pos is -1) and every write to it is dropped, here and in the kernels
(models/kernels.py), so it keeps its zeros whatever a row without blocks does: idle rows of a
bucket step, or a row the engine forgot, can never write into another row's memory.

Which blocks a row holds is the engine's business (its allocator), written through
TransformerState.assign_blocks / release_row between steps.
"""

from __future__ import annotations

import numpy as np
import torch

NULL_BLOCK = 0
DEFAULT_BLOCK = 64  # slots: a whole number of the attention kernels' tiles (16 fp8, 64 bf16)


def block_size_for(capacity: int, block_size: int | None, divides: bool = False) -> int:
    """`block_size` checked against the ring (1 .. capacity slots), or the default: 64 slots, the
    whole ring when it is shorter; `divides` (page lists, `decode_pages`): the largest divisor of
    the ring up to 64 (60 for Moshi's 3000)."""
    if block_size is None:
        top = min(capacity, DEFAULT_BLOCK)
        return next(d for d in range(top, 0, -1) if capacity % d == 0) if divides else top
    if not 0 < block_size <= capacity:
        raise ValueError(f"block_size {block_size} must be 1 .. the KV ring's capacity {capacity}")
    return block_size


def ring_blocks(capacity: int, block_size: int) -> int:
    """Logical blocks in a ring of `capacity` slots (the last one partly used unless they divide)."""
    return -(-capacity // block_size)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 as its bytes: index ops on the raw bytes (fp8 lacks some kernels)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather_ring(pool: torch.Tensor, table: torch.Tensor, capacity: int) -> torch.Tensor:
    """Each row's ring in slot order, [B, H, capacity(, D)], dense (a copy: writes to it stay there)."""
    B, nb = table.shape
    blocks = _raw(pool)[table.long().flatten()]  # [B * nb, H, bs(, D)]
    H, bs = blocks.shape[1], blocks.shape[2]
    ring = blocks.view(B, nb, H, bs, *blocks.shape[3:]).transpose(1, 2)
    return ring.reshape(B, H, nb * bs, *blocks.shape[3:])[:, :, :capacity].view(pool.dtype)


def _addresses(table: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical block, offset in it) of ring slots [B, T] of each row: long [B, T] each."""
    return table.long().gather(1, torch.div(slots, block_size, rounding_mode="floor")), slots % block_size


def scatter_slots(pool: torch.Tensor, table: torch.Tensor, view: torch.Tensor, slots: torch.Tensor,
                  keep: torch.Tensor | None) -> None:
    """pool <- view[b, :, slots[b, t]] for the rows where keep[b] (None: all), never into the null
    block. Dropped writes store the slot's own old value (no host sync, fixed shapes: graphable)."""
    B, T = slots.shape
    phys, off = _addresses(table, slots, pool.shape[2])
    rows = torch.arange(B, device=slots.device)[:, None]
    raw, new = _raw(pool), _raw(view)[rows, :, slots]  # [B, T, H(, D)]
    old = raw[phys, :, off]
    write = phys != NULL_BLOCK
    if keep is not None:
        write = write & keep[:, None]
    write = write.view(B, T, *[1] * (new.dim() - 2))
    raw[phys, :, off] = torch.where(write, new, old)


def write_prefix(pool: torch.Tensor, table_row: torch.Tensor, prefix: torch.Tensor) -> None:
    """Slots 0 .. F - 1 of one row (its table row [nb]) take prefix [H, F(, D)]. The caller has
    checked that those slots' blocks are assigned."""
    frames = prefix.shape[1]
    slots = torch.arange(frames, device=table_row.device)
    phys, off = _addresses(table_row[None], slots[None], pool.shape[2])
    _raw(pool)[phys[0], :, off[0]] = _raw(prefix).transpose(0, 1).to(pool.device)


def decode_pages(table: np.ndarray, pos: np.ndarray, taken_at: np.ndarray, capacity: int,
                 block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One decode step's page lists in the layout of FlashInfer's paged decode (`indptr` [B + 1],
    `indices`, `last_page_len` [B], int32): for each row the slots its attention reads once the
    step has written position pos[b]. Host arrays: `table` [B, nb] (the host copy of the block
    table), `pos` [B] (the position the step writes; -1: the row does not step, and reads the
    null block's first slot, its output unused), `taken_at` [B, nb] (the position at which the
    row took each of its held logical blocks, or will first write it: a later one is not read yet;
    -1 for a block written before position 0, as a ring placed already wrapped).

    A row's valid slots are its held blocks, all full but one: the block being written, when the
    row took it in this lap of the ring (before the first wrap, or after the `shrink` policy took
    it), holds only the slots up to pos % capacity; a block the row kept from its last lap is
    full (its later slots hold the window's oldest positions). That block goes last, the one
    page the list lets be partial, so the block must divide the ring (no second partial page)."""
    if capacity % block_size:
        raise ValueError(f"page lists need a block that divides the {capacity}-slot ring, not {block_size}")
    B, nb = table.shape
    rows = np.arange(B)
    stepping = pos >= 0
    slot = np.where(stepping, pos % capacity, 0)
    current = slot // block_size  # (row 0's null block for a row that does not step)
    kept = stepping & (taken_at[rows, current] <= pos - capacity + 1)  # its later slots written since it was taken
    last = np.where(kept, block_size, np.where(stepping, slot - current * block_size + 1, 1))
    # A block taken for a later position (a benchmark's rows get their run's blocks at once) holds nothing yet.
    blocks = np.where(stepping[:, None] & (taken_at <= pos[:, None]), table, NULL_BLOCK)
    # Each row's held blocks in ring order, then its current block: sort by rank, keep ranks <= nb.
    rank = np.where(blocks != NULL_BLOCK, np.arange(nb), nb + 1)
    rank[rows, current] = nb
    order = np.argsort(rank, axis=1, kind="stable")
    chosen = np.take_along_axis(rank, order, axis=1) <= nb
    indptr = np.zeros(B + 1, dtype=np.int32)
    np.cumsum(chosen.sum(axis=1), out=indptr[1:])
    return indptr, np.take_along_axis(blocks, order, axis=1)[chosen].astype(np.int32), last.astype(np.int32)
