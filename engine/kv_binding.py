"""The engine's KV block pool (engine/kv_blocks.py) bound to its backend's paged KV state: sessions
admitted by memory, and every change of the pool mapped into the backend (`map_kv_blocks`) before the
step that needs it. Without a pool (a backend with dense rows) every call here does nothing."""

from __future__ import annotations

from typing import Callable

from .backend import FrameBackend
from .config import OptionsError
from .kv_blocks import KvBlockPool, KvChanges
from .session import Session


class KvBinding:
    def __init__(self, pool: KvBlockPool | None, backend: FrameBackend) -> None:
        self.pool = pool
        self._map: Callable[[KvChanges], None] | None = getattr(backend, "map_kv_blocks", None)
        self._plan = getattr(backend, "plan_kv_step", None)  # page-list attention's positions, before each step
        paged = getattr(backend, "kv_paged", None)  # ModelBackend says; a fabricated backend may not
        if pool is not None and (self._map is None or paged is False):
            raise OptionsError("a KV block pool needs a backend with a paged KV state (ModelBackend(kv_blocks=)).")
        if pool is None and paged:
            raise OptionsError("a backend with a paged KV state needs the engine's KV block pool (kv=), "
                               "which gives its rows their blocks.")

    def admit(self, row: int, request_id: str) -> None:
        """KvFull (an EngineFull) when memory cannot hold the session to the end of its window."""
        if self.pool is not None:
            self.pool.admit(row, request_id)

    def start(self, session: Session, prompt_frames: int) -> None:
        """A row starts its prompt: the blocks the prompt fills, before it is written."""
        self._apply(self.pool.start(session.row, session.request_id, prompt_frames))

    def step(self, request_ids: list[str | None]) -> None:
        """Before a step: ended rows' blocks back, live rows' next blocks in (kv_blocks.py rule 1)."""
        if self.pool is not None:
            self._apply(self.pool.step(request_ids))
            if self._plan is not None:
                self._plan(*self.pool.decode_positions())

    def end(self, row: int, request_id: str) -> None:
        if self.pool is not None:
            self.pool.end(row, request_id)

    def snapshot(self) -> dict:
        return self.pool.snapshot() if self.pool is not None else {}

    def _apply(self, changes: KvChanges) -> None:
        if changes:
            self._map(changes)
