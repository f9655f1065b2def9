"""Where the duplex LM keeps its temporal KV ring: one object, chosen once when the backend is built.

Three layouts (`kv_storage` picks one from ModelBackend's options and refuses what cannot run):
- `DenseKv`: each row owns its whole ring (the default). Nothing is planned.
- `PagedKv`: the rows' rings are blocks of a shared pool (models/paged_kv.py) that the engine's
  KvBlockPool hands out (`map_blocks`); our Triton kernel reads them through the block table.
- `PageListKv`: a paged bf16 ring read by FlashInfer's decode (models/paged_decode.py), through
  page lists built on the host from the positions the engine's pool gives before each step.

Rules each layout keeps:
1. `init_state` makes the LM state once; its addresses never change (CUDA graphs read them).
2. The step planning is the layout's own: `plan_step` takes the next step's positions (the engine's
   KV pool, engine/kv_binding.py), `before_step(n)` readies the n rows the step runs, and
   `before_capture(n)` readies a bucket's graph capture (no row steps). Dense and paged rings
   plan nothing: the model reads its positions on the device.
3. Changes of the pool reach the state in their order through `map_blocks` (engine thread,
   between ticks).
"""

from __future__ import annotations

import numpy as np
import torch

from parley.models.lm_gen import LMGen, LMGenState
from parley.models.paged_decode import GROUP_SIZES, FlashInferDecode, flashinfer_module
from parley.models.paged_kv import decode_pages, ring_blocks

from .config import OptionsError
from .kv_blocks import ATTENTION, KvChanges


class DenseKv:
    """Each row's whole KV ring its own, in `dtype` (None: the model's; float8_e4m3fn halves it)."""

    paged = False  # the engine's KV block pool must drive a paged state's block table (kv_binding.py)

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self.state: LMGenState | None = None

    def init_state(self, gen: LMGen, rows: int) -> LMGenState:
        self.state = gen.init_state(rows, kv_dtype=self.dtype)
        return self.state

    def attach(self, buckets: list[int], device: torch.device) -> None:
        """The frame's row buckets are known (after `init_state`): set up what reads the ring."""

    def map_blocks(self, changes: KvChanges) -> None:
        """The pool's changes, in order, batched (TransformerState.map_blocks; a dense state refuses)."""
        self.state.transformer.map_blocks(changes.released, changes.forgotten, changes.assigned)

    def plan_step(self, positions: np.ndarray, taken_at: np.ndarray) -> None:
        """The next step's positions (-1: a row that does not step) and when each row took each
        block (`KvBlockPool.decode_positions`); only page lists need them."""

    def before_step(self, n: int) -> None:
        """Ready the ring for a step over the lowest `n` rows."""

    def before_capture(self, n: int) -> None:
        """Ready the ring for capturing a bucket of `n` rows, no row stepping."""


class PagedKv(DenseKv):
    """Rows' rings in blocks of `block_frames` from a pool of `blocks` (plus the null block, 0,
    which no row holds), handed out by the engine's KvBlockPool."""

    paged = True

    def __init__(self, dtype: torch.dtype | None, blocks: int, block_frames: int | None) -> None:
        super().__init__(dtype)
        self.blocks, self.block_frames = blocks, block_frames

    def init_state(self, gen: LMGen, rows: int) -> LMGenState:
        self.state = gen.init_state(rows, kv_dtype=self.dtype, kv_blocks=self.blocks + 1,
                                    block_size=self.block_frames)
        return self.state


class PageListKv(PagedKv):
    """A paged ring read by FlashInfer's decode (bf16, CUDA, installed), through page lists planned
    for each step's rows from the engine's positions."""

    def __init__(self, dtype: torch.dtype | None, blocks: int, block_frames: int | None) -> None:
        super().__init__(dtype, blocks, block_frames)
        self._decode: FlashInferDecode | None = None
        self._positions: tuple[np.ndarray, np.ndarray] | None = None  # the next step's (plan_step)
        self._heads = 0  # the LM's query heads (init_state)

    def init_state(self, gen: LMGen, rows: int) -> LMGenState:
        # Our rope_write rotates keys (pairs or rope_concat's halves alike) before FlashInfer reads the
        # pages; grouped KV heads are its GQA decode, for the group sizes it dispatches.
        if gen.cfg.kv_repeat not in GROUP_SIZES:
            raise OptionsError(f"paged_attention flashinfer: this model's kv_repeat {gen.cfg.kv_repeat} (query heads "
                               f"per KV head) is not one FlashInfer's decode takes "
                               f"({', '.join(map(str, GROUP_SIZES))}); use parley.")
        self._heads = gen.cfg.num_heads
        return super().init_state(gen, rows)

    def attach(self, buckets: list[int], device: torch.device) -> None:
        tr = self.state.transformer
        why = ("it runs on CUDA" if device.type != "cuda" else
               "it reads bf16 KV caches" if tr.keys[0].dtype != torch.bfloat16 else
               f"its page lists need a block that divides the {tr.capacity}-frame window, not "
               f"{tr.block_size}" if tr.capacity % tr.block_size else
               "it is not installed (pip install flashinfer-python==0.7.2.post1)" if flashinfer_module() is None
               else None)
        if why is not None:
            raise OptionsError(f"paged_attention flashinfer: {why}.")
        self._decode = FlashInferDecode(buckets, self._heads, tr.keys[0].shape[-1], tr.block_size,
                                        ring_blocks(tr.capacity, tr.block_size), device, kv_heads=tr.keys[0].shape[1])
        tr.page_decode = self._decode

    def plan_step(self, positions: np.ndarray, taken_at: np.ndarray) -> None:
        self._positions = positions, taken_at

    def before_step(self, n: int) -> None:
        if self._positions is None:
            raise RuntimeError("page-list attention needs plan_kv_step (the engine's KV pool) before each step")
        self._plan(n, *self._positions)
        self._positions = None

    def before_capture(self, n: int) -> None:
        nb = self.state.transformer.block_table.shape[1]
        self._plan(n, np.full(n, -1, dtype=np.int64), np.full((n, nb), -1, dtype=np.int64))

    def _plan(self, n: int, positions: np.ndarray, taken_at: np.ndarray) -> None:
        tr = self.state.transformer
        if tr.table_host is None:
            tr.table_host = tr.block_table.cpu().numpy().copy()
        self._decode.plan(n, *decode_pages(tr.table_host[:n], positions[:n], taken_at[:n], tr.capacity,
                                           tr.block_size))


def kv_storage(dtype: torch.dtype | None = None, blocks: int | None = None, block_frames: int | None = None,
               attention: str = "parley") -> DenseKv:
    """The layout ModelBackend's options ask for: dense without `blocks`, else paged, read by our
    kernel ("parley") or FlashInfer's ("flashinfer"). OptionsError names an option that cannot apply."""
    if attention not in ATTENTION:
        raise OptionsError(f"paged_attention must be one of {', '.join(ATTENTION)}, got {attention!r}.")
    if blocks is None:
        if attention == "flashinfer":
            raise OptionsError("paged_attention flashinfer: it reads a paged KV cache (--kv-blocks / --kv-memory).")
        if block_frames is not None:
            raise OptionsError("kv_block_frames sizes the blocks of a paged KV state; give kv_blocks too.")
        return DenseKv(dtype)
    return (PageListKv if attention == "flashinfer" else PagedKv)(dtype, blocks, block_frames)
