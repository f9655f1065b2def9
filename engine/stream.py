"""The generic per-request output stream: partial events, then exactly one Terminal.

Produced from the engine thread, consumed on the asyncio loop with `async for`. Duplex
sessions use it for frames; TTS or diffusion requests can use it for their own events.

Why this shape:
- The engine thread must never block on a slow consumer, so the buffer is bounded and a
  full buffer drops its *oldest* partial (counted): for realtime audio, stale is worse
  than missing.
- Items live in a locked deque, not in the loop's callback queue: the producer schedules
  at most one wake-up callback at a time, so a stalled loop cannot grow memory either.
- The Terminal is never dropped and always comes last; the first `finish` wins.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Generic, TypeVar

T = TypeVar("T")


class Status(str, enum.Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class Terminal:
    """The last event of every stream."""

    status: Status
    reason: str = ""


class OutputStream(Generic[T]):
    """Bounded stream of partial events for one request, keyed by `request_id`."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, max_partials: int) -> None:
        self.request_id = request_id
        self._loop = loop
        self._max = max_partials
        self._lock = threading.Lock()
        self._items: deque[T] = deque()
        self._terminal: Terminal | None = None
        self._terminal_taken = False
        self._wake_scheduled = False
        self._waiter: asyncio.Future[None] | None = None  # touched on the loop thread only
        self.dropped = 0

    # ---- producer side (any thread, never blocks) ----

    def push(self, item: T, wakes: "list[OutputStream] | None" = None) -> bool:
        """Add a partial event. Returns False when an older one was dropped to make room.
        `wakes`: the consumer's wake-up is appended there for the caller to schedule with others
        (`schedule_wakes`), instead of one by one: each scheduling writes to the loop's wake-up
        socket, and a thread's write gives the GIL up."""
        kept_all = True
        with self._lock:
            if self._terminal is not None:
                return True  # ended: late partials are discarded silently
            if len(self._items) >= self._max:
                self._items.popleft()
                self.dropped += 1
                kept_all = False
            self._items.append(item)
            wake = self._claim_wake()
        if wake and wakes is not None:
            wakes.append(self)
        elif wake:
            self._schedule_wake()
        return kept_all

    def finish(self, terminal: Terminal) -> bool:
        """End the stream. Returns True if this call ended it (the first terminal wins)."""
        with self._lock:
            if self._terminal is not None:
                return False
            self._terminal = terminal
            wake = self._claim_wake()
        if wake:
            self._schedule_wake()
        return True

    def room(self) -> int:
        """Partials that fit before the buffer is full. Producers that must not drop (transcripts,
        TTS audio) stop producing for a request while this is 0: back-pressure, bounded memory."""
        with self._lock:
            return self._max - len(self._items)

    @property
    def buffered(self) -> int:
        """Partials not yet taken by the consumer. A producer that must not drop (TTS, images)
        stops producing for this request while `buffered` is at its own cap (back-pressure)."""
        with self._lock:
            return len(self._items)

    @property
    def finished(self) -> bool:
        return self._terminal is not None

    @property
    def terminal(self) -> Terminal | None:
        return self._terminal

    def _claim_wake(self) -> bool:
        # Caller holds the lock. One scheduled wake-up at a time is enough: it wakes the
        # consumer, which then takes everything that is buffered.
        if self._wake_scheduled:
            return False
        self._wake_scheduled = True
        return True

    def _schedule_wake(self) -> None:
        schedule_wakes([self])

    def _wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ---- consumer side (the event loop) ----

    def drain(self) -> list[T | Terminal]:
        """Everything buffered now, without waiting (the Terminal last, once)."""
        with self._lock:
            out: list[T | Terminal] = list(self._items)
            self._items.clear()
            if self._terminal is not None and not self._terminal_taken:
                self._terminal_taken = True
                out.append(self._terminal)
        return out

    def __aiter__(self) -> AsyncIterator[T | Terminal]:
        return self

    async def __anext__(self) -> T | Terminal:
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                if self._terminal is not None:
                    if self._terminal_taken:
                        raise StopAsyncIteration
                    self._terminal_taken = True
                    return self._terminal
            # No lost wake-up: `_wake` runs on this loop, so it cannot run between the check
            # above and the await below.
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


def schedule_wakes(streams: "list[OutputStream]") -> None:
    """Wake the consumers of `streams` (claimed by `push(..., wakes=)`): one callback per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[OutputStream]] = {}
    for stream in streams:
        by_loop.setdefault(stream._loop, []).append(stream)
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_wake_all, group)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more


def _wake_all(streams: "list[OutputStream]") -> None:
    for stream in streams:
        stream._wake()
