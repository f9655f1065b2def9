"""The slot table: `max_sessions` rows, fixed at start, each owned by at most one request.

Admission never waits: a full table raises `EngineFull` at once (there is no waiting
list to grow). Acquire runs on the event loop, release on either thread, so one lock
guards the table. A reused row starts clean because the engine resets it in the backend
before prefill; the table only tracks ownership.
"""

from __future__ import annotations

import heapq
import threading


class EngineFull(Exception):
    """Every slot is taken; the caller should refuse the session now."""


class SlotTable:
    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._owners: list[str | None] = [None] * max_sessions
        # Lowest free row first, so runs are reproducible (tests compare batch layouts).
        self._free = list(range(max_sessions))
        heapq.heapify(self._free)

    def acquire(self, request_id: str) -> int:
        with self._lock:
            if not self._free:
                raise EngineFull(f"all {self.max_sessions} session slots are in use; try again later.")
            row = heapq.heappop(self._free)
            self._owners[row] = request_id
            return row

    def release(self, row: int, request_id: str) -> bool:
        """Free `row` if `request_id` still owns it. Idempotent: a second release is a no-op,
        so a client close racing an engine-side failure cannot free someone else's slot."""
        with self._lock:
            if self._owners[row] != request_id:
                return False
            self._owners[row] = None
            heapq.heappush(self._free, row)
            return True

    def owner(self, row: int) -> str | None:
        with self._lock:
            return self._owners[row]

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def live(self) -> int:
        return self.max_sessions - self.free
