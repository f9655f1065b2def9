"""The KV block pool: which blocks of the temporal LM's KV memory each row holds, and whether
one more session fits. Host-side bookkeeping only (no torch): the model's paged state
(models/paged_kv.py) stores what the blocks hold, this decides who holds which.

Terms. A row's KV ring has `window` slots (the model's capacity: 3000 frames, 240 s, for
Moshi); position p lives in slot p % window. The ring is cut into logical blocks of `block`
frames; the pool has `total` physical blocks, numbered 1 .. total (0 is the model's null block,
which no row holds). The step that writes position p writes logical block (p % window) // block,
so a row at position p holds blocks_for(p) blocks, never more than a full window's; once its ring
wraps it reuses its own blocks.

Rules, each kept by one method:
1. `step` runs on the engine thread before each tick's step and, for every live row, maps the
   logical block of the position that step writes if the row does not hold it yet (a row needs a
   block once every `block` frames; otherwise nothing changes).
2. Admission (`admittable`, `admit`; any thread). A session is admitted only if the pool can hold
   it to the end of its window under the policy:
   - `reserve` (the default, never overcommits): every admitted session is promised a full
     window, so Σ over sessions of full-window blocks <= total. No row can then ever find the
     pool empty: the sessions' promises cover every block they will ever hold.
   - `shrink` (opt-in, overcommits): a session is promised its *expected* share, half a window
     (SHRINK_EXPECTED: the issue's traffic has a median of 2 min against a 4-min window). Admitted
     when the free blocks, less what the live sessions still need to reach their expected share,
     cover the newcomer's expected share, and when every session, the newcomer included, can
     keep at least a quarter window (SHRINK_FLOOR) however short memory runs. Why overcommit:
     most sessions end long before their window fills, so promising each a full window leaves
     most of the memory promised and empty.
3. Running short (`_take`). A row that needs a block while none is free: under `shrink`, the row
   holding the most blocks (the longest conversation; ties: the furthest position, then the
   lowest row) gives up its oldest logical block, and its window shrinks by one block for the
   rest of the session. A row at its (shrunk) window reuses its own oldest block. Rule 2's floor
   guarantees a row above the floor, or the requester's own block, exists. Under `reserve` this
   cannot happen (rule 2); were it to, the same steal runs, counted as a shortfall and logged.
   Never an exception on the engine thread, never a late tick: each step is O(live rows).
4. Ends (`end`, any thread) drop the session's promise at once; its blocks go back to the free
   list on the engine thread at the next `start` or `step` (`_collect`), with the row's release
   first among that call's changes, so a row the tick still runs never writes a reused block.

Changes go to the model as `KvChanges`, applied in order: releases, forgotten blocks, assigned
blocks (`map_kv_blocks` of the backend, through the model state's own methods: models/paged_kv.py).
The pool is the allocator of a paged state: an engine with a pool needs a backend that takes its
changes, and the block size is the model's rule (`paged_kv.block_size_for`).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field

from .config import OptionsError
from .slots import EngineFull

log = logging.getLogger("parley.engine.kv")

POLICIES = ("reserve", "shrink")
ATTENTION = ("parley", "flashinfer")  # who reads the paged ring: our Triton kernel, or FlashInfer's decode (bf16, CUDA)
SHRINK_EXPECTED = 0.5  # shrink: the window share a session is promised (2 min of Moshi's 4)
SHRINK_FLOOR = 0.25  # shrink: no session's window shrinks below this share (60 s of Moshi's 240 s)


class KvFull(EngineFull):
    """The KV memory cannot hold one more session to the end of its window; refuse it now (a
    full engine, as far as callers go: no waiting list)."""


@dataclass(frozen=True)
class KvLayout:
    """The model's KV ring, as the pool needs it."""

    window_frames: int  # ring slots per row (the model's capacity)
    block_frames: int  # slots per block (the window's last block is partly used unless it divides)
    block_bytes: int  # bytes one block takes over every layer (keys, values, fp8 scales)

    def __post_init__(self) -> None:
        if not 0 < self.block_frames <= self.window_frames:
            raise OptionsError(f"a KV block of {self.block_frames} frames must be 1 .. the "
                               f"{self.window_frames}-frame window.")

    @property
    def window_blocks(self) -> int:
        return -(-self.window_frames // self.block_frames)


@dataclass(frozen=True)
class KvSettings:
    """`parley serve --kv-policy / --kv-blocks / --kv-memory / --kv-block-frames / --kv-attention`,
    checked once."""

    policy: str = "reserve"
    blocks: int | None = None  # the pool's size in blocks
    memory_gib: float | None = None  # or in GiB of KV memory; neither: every row a full window
    block_frames: int | None = None  # None: the model's default block (paged_kv.block_size_for)
    attention: str = "parley"  # ATTENTION; flashinfer's default block divides the window

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise OptionsError(f"kv_policy must be one of {', '.join(POLICIES)}, got {self.policy!r}.")
        if self.attention not in ATTENTION:
            raise OptionsError(f"kv_attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}.")
        if self.blocks is not None and self.memory_gib is not None:
            raise OptionsError("kv_blocks and kv_memory size the same pool; give one of them.")
        if self.blocks is not None and (isinstance(self.blocks, bool) or not isinstance(self.blocks, int)
                                        or self.blocks < 1):
            raise OptionsError(f"kv_blocks must be a whole number of at least 1, got {self.blocks!r}.")
        if self.memory_gib is not None and not (isinstance(self.memory_gib, (int, float))
                                                and math.isfinite(self.memory_gib) and self.memory_gib > 0):
            raise OptionsError(f"kv_memory must be a positive number of GiB, got {self.memory_gib!r}.")
        if self.block_frames is not None and (isinstance(self.block_frames, bool)
                                              or not isinstance(self.block_frames, int) or self.block_frames < 1):
            raise OptionsError(f"kv_block_frames must be a whole number of at least 1, got {self.block_frames!r}.")

    def budget(self, layout: KvLayout, rows: int) -> int:
        """The pool's blocks: the budget asked for, capped at `rows` full windows (no row holds
        more, so memory past that would never be used); OptionsError if it holds no session."""
        full = rows * layout.window_blocks
        if self.blocks is not None:
            asked = self.blocks
        elif self.memory_gib is not None:
            asked = int(self.memory_gib * 2**30 // layout.block_bytes)
        else:
            asked = full
        smallest = layout.window_blocks if self.policy == "reserve" else _share(layout.window_blocks, SHRINK_FLOOR)
        if asked < smallest:
            raise OptionsError(f"a KV pool of {asked} blocks ({asked * layout.block_bytes / 2**30:.2f} GiB) cannot hold "
                               f"one session: the {self.policy} policy needs {smallest} blocks of "
                               f"{layout.block_frames} frames for one.")
        if asked > full:
            log.info("KV pool: %d blocks asked, %d used (--max-sessions %d full windows)", asked, full, rows)
        return min(asked, full)


def _share(blocks: int, fraction: float) -> int:
    return max(1, math.ceil(blocks * fraction))


@dataclass
class KvChanges:
    """What the model's block table must do before the next step, in this order."""

    released: list[int] = field(default_factory=list)  # rows: every block back to the null block, ring emptied
    forgotten: list[tuple[int, int]] = field(default_factory=list)  # (row, logical): slots now empty, null block
    assigned: list[tuple[int, int, int]] = field(default_factory=list)  # (row, logical, physical)

    def __bool__(self) -> bool:
        return bool(self.released or self.forgotten or self.assigned)

    def extend(self, other: "KvChanges") -> None:
        self.released += other.released
        self.forgotten += other.forgotten
        self.assigned += other.assigned


@dataclass(frozen=True)
class KvCounters:
    total: int  # blocks in the pool (the null block not counted)
    used: int  # held by rows (ended rows' blocks until the engine thread frees them included)
    free: int
    high_water: int  # the most ever used at once
    promised: int  # blocks promised to the admitted sessions (rule 2)
    block_frames: int
    window_blocks: int
    sessions_admittable: int  # more sessions the pool would admit now
    shrinks: int  # blocks taken from a row by the shrink policy
    shortfalls: int  # rows that found the pool empty under `reserve` (a bug if ever > 0)


@dataclass
class _Holder:
    """One admitted session's blocks."""

    request_id: str
    row: int
    window: int  # logical blocks it may hold: a full window, less what shrink took
    blocks: dict[int, int] = field(default_factory=dict)  # logical -> physical
    next_pos: int = 0  # the position its next step writes (engine thread)


class KvBlockPool:
    def __init__(self, layout: KvLayout, rows: int, total: int, policy: str = "reserve") -> None:
        if policy not in POLICIES:
            raise OptionsError(f"kv_policy must be one of {', '.join(POLICIES)}, got {policy!r}.")
        self.layout = layout
        self.policy = policy
        self.total = total
        nb = layout.window_blocks
        self._full = nb
        self._expected = _share(nb, SHRINK_EXPECTED)
        self._floor = _share(nb, SHRINK_FLOOR)
        self._lock = threading.Lock()  # admission runs on the event loop, blocks move on the engine thread
        # For page-list attention (`decode_positions`; engine thread): the position each row's
        # last `step` wrote (-1: it did not step), and the position at which it took each block.
        import numpy as np  # (here, not at the top: `parley --help` reads this module's POLICIES, numpy-free)
        self._stepped = np.full(rows, -1, dtype=np.int64)
        self._taken_at = np.full((rows, nb), -1, dtype=np.int64)
        self._free = list(range(total, 0, -1))  # a stack: block 1 is taken first
        self._rows: list[_Holder | None] = [None] * rows  # admitted sessions by row
        self._ending: list[_Holder] = []  # ended, blocks not yet freed (engine thread frees them)
        self._high_water = 0
        self._shrinks = 0
        self._shortfalls = 0

    def blocks_for(self, frames: int) -> int:
        """Blocks a row holds once it has written `frames` positions (a window's at most)."""
        return -(-min(frames, self.layout.window_frames) // self.layout.block_frames)

    # ---- admission (any thread) ----

    def admittable(self, pending: int = 0) -> int:
        """How many more sessions rule 2 admits now, beyond `pending` already on their way (the
        edge's reservations). 0 or more."""
        with self._lock:
            return max(0, self._admittable_locked() - pending)

    def _admittable_locked(self) -> int:
        live = [h for h in self._rows if h is not None]
        if self.policy == "reserve":
            return (self.total - sum(h.window for h in live)) // self._full
        room = len(self._free) + sum(len(h.blocks) for h in self._ending)
        growth = sum(max(0, self._expected - len(h.blocks)) for h in live)
        by_floor = self.total // self._floor - len(live)
        return max(0, min(by_floor, (room - growth) // self._expected))

    def admit(self, row: int, request_id: str) -> None:
        """Promise `row`'s new session its share (rule 2), or raise KvFull."""
        with self._lock:
            if self._rows[row] is not None:
                raise RuntimeError(f"row {row} already holds a session's blocks")
            if self._admittable_locked() < 1:
                raise KvFull(f"the KV memory cannot hold another session to the end of its "
                             f"{self.layout.window_frames}-frame window ({self.policy} policy, "
                             f"{len(self._free)} of {self.total} blocks free); try again later.")
            self._rows[row] = _Holder(request_id, row, self._full)

    def end(self, row: int, request_id: str) -> None:
        """The session left: its promise goes now, its blocks at the engine thread's next call.
        Idempotent; a row since given to another session is left alone."""
        with self._lock:
            holder = self._rows[row]
            if holder is not None and holder.request_id == request_id:
                self._rows[row] = None
                self._ending.append(holder)

    def snapshot(self) -> dict:
        """The counters as `Engine.counters()` keys (kv_*), for /load and /metrics."""
        c = self.counters()
        return {"kv_blocks_total": c.total, "kv_blocks_used": c.used, "kv_blocks_free": c.free,
                "kv_blocks_high_water": c.high_water, "kv_blocks_promised": c.promised,
                "kv_block_frames": c.block_frames, "kv_sessions_admittable": c.sessions_admittable,
                "kv_shrinks": c.shrinks, "kv_shortfalls": c.shortfalls}

    def counters(self) -> KvCounters:
        with self._lock:
            used = self.total - len(self._free)
            promised = sum(h.window if self.policy == "reserve" else max(self._expected, len(h.blocks))
                           for h in self._rows if h is not None)
            return KvCounters(total=self.total, used=used, free=len(self._free), high_water=self._high_water,
                              promised=promised, block_frames=self.layout.block_frames,
                              window_blocks=self._full, sessions_admittable=max(0, self._admittable_locked()),
                              shrinks=self._shrinks, shortfalls=self._shortfalls)

    # ---- blocks (engine thread) ----

    def start(self, row: int, request_id: str, prompt_frames: int) -> KvChanges:
        """The session's row starts (before its prompt is written): blocks for positions
        0 .. prompt_frames - 1, and its steps go on from position `prompt_frames`."""
        with self._lock:
            changes = self._collect()
            holder = self._rows[row]
            if holder is None or holder.request_id != request_id:
                return changes  # ended already: nothing to hold
            for pos in range(0, min(prompt_frames, self.layout.window_frames), self.layout.block_frames):
                self._ensure(holder, pos, changes)
            holder.next_pos = prompt_frames
            return changes

    def step(self, request_ids: list[str | None]) -> KvChanges:
        """Before a tick's step: every live row (request_ids[row] not None) gets the block its
        next position needs (rule 1), and moves on one position."""
        with self._lock:
            changes = self._collect()
            self._stepped.fill(-1)
            for row, request_id in enumerate(request_ids):
                holder = self._rows[row] if request_id is not None else None
                if holder is not None and holder.request_id == request_id:
                    self._ensure(holder, holder.next_pos, changes)
                    self._stepped[row] = holder.next_pos
                    holder.next_pos += 1
            return changes

    def decode_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """After `step` (engine thread): the position each row's step writes (-1: none) and the
        position at which each row took each logical block: `paged_kv.decode_pages`' inputs."""
        return self._stepped, self._taken_at

    def held(self, row: int) -> dict[int, int]:
        """The row's logical -> physical blocks (tests, debugging)."""
        with self._lock:
            holder = self._rows[row]
            return dict(holder.blocks) if holder is not None else {}

    def window(self, row: int) -> int:
        """The row's window in blocks (a full window unless shrink took some)."""
        with self._lock:
            holder = self._rows[row]
            return holder.window if holder is not None else 0

    def _collect(self) -> KvChanges:
        changes = KvChanges()
        for holder in self._ending:
            self._free.extend(reversed(sorted(holder.blocks.values())))
            changes.released.append(holder.row)
        self._ending.clear()
        return changes

    def _ensure(self, holder: _Holder, pos: int, changes: KvChanges) -> None:
        logical = (pos % self.layout.window_frames) // self.layout.block_frames
        if logical in holder.blocks:
            return
        if len(holder.blocks) >= holder.window:  # at its window: reuse its own oldest block (rule 3)
            physical = self._forget_oldest(holder, logical, changes)
        elif self._free:
            physical = self._free.pop()
        else:
            physical = self._take(holder, logical, changes)
        holder.blocks[logical] = physical
        self._taken_at[holder.row, logical] = pos
        changes.assigned.append((holder.row, logical, physical))
        self._high_water = max(self._high_water, self.total - len(self._free))

    def _take(self, requester: _Holder, logical: int, changes: KvChanges) -> int:
        """No block is free (rule 3): the longest row above the floor gives its oldest block."""
        if self.policy == "reserve":
            self._shortfalls += 1
            log.error("KV pool empty under the reserve policy (row %d); taking the longest row's oldest block",
                      requester.row)
        candidates = [h for h in self._rows if h is not None and h.blocks and
                      (len(h.blocks) > self._floor or h is requester)]
        victim = max(candidates, key=lambda h: (len(h.blocks), h.next_pos, -h.row), default=requester)
        if not victim.blocks:  # cannot happen under rule 2's floor; never raise on the engine thread
            log.error("KV pool empty and no row holds a block to give; row %d runs on the null block", requester.row)
            return 0
        self._shrinks += 1
        victim.window = len(victim.blocks) - 1 if victim is not requester else len(victim.blocks)
        return self._forget_oldest(victim, logical if victim is requester else None, changes)

    def _forget_oldest(self, holder: _Holder, current: int | None, changes: KvChanges) -> int:
        """Drop the holder's oldest logical block (the first held after its current one, going
        round the ring) and return its physical block."""
        nb = self._full
        here = current if current is not None else (holder.next_pos % self.layout.window_frames) // self.layout.block_frames
        for k in range(1, nb + 1):
            oldest = (here + k) % nb
            if oldest in holder.blocks:
                changes.forgotten.append((holder.row, oldest))
                return holder.blocks.pop(oldest)
        raise AssertionError("a holder at its window holds a block")
