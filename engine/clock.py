"""The engine's tick clock: a fixed 80 ms grid on a monotonic clock.

Why a grid and not "sleep 80 ms after each step": sleeping after the step drifts by the
step time every tick, and the engine would produce audio slower than real time.

When a step overruns its tick, the next tick starts at once (it is *late*, counted), and
any boundary that was missed entirely is *skipped* (counted), not replayed: running the
missed ticks back to back would burst frames at clients and steal the next tick's slack.
So there is never more than one tick started without waiting, and afterwards the clock
is back on its original grid.

`now` and `sleep` are injectable so tests can drive time explicitly.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class TickClock:
    def __init__(self, period: float, now: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.period = period
        self._now = now
        self._sleep = sleep  # None: wait on the stop event, so shutdown interrupts the sleep
        self._origin: float | None = None  # time of boundary 0
        self._index = 0  # the boundary the next tick belongs to (kept as an int: no float drift)
        self.late_ticks = 0
        self.skipped_ticks = 0
        self.start_lag = 0.0  # how far past its boundary the last tick started (woken late, or late)

    def wait(self, stop: threading.Event, idle: bool = False) -> bool:
        """Block until the next tick should start. False if `stop` was set meanwhile.
        `idle`: the last tick had no session live, and its slack work was allowed past this
        boundary (engine.py): no frame was due, so starting after it is not late (not counted)."""
        now = self._now()
        if self._origin is None:
            self._origin = now  # first tick: the grid starts here
        boundary = self._origin + self._index * self.period
        lag = now - boundary
        self.start_lag = max(0.0, lag)
        if lag < 0:
            if self._sleep is None:
                if stop.wait(-lag):
                    return False
            else:
                self._sleep(-lag)
            self.start_lag = max(0.0, self._now() - boundary)  # the wake-up's own lateness
        elif lag > 0 and idle:
            self.start_lag = 0.0  # no frame was due at the boundary
            self._index += int(lag // self.period)  # back on the grid, nothing counted
        elif lag > 0:
            # The previous step ran past this boundary: start now (late), and drop every
            # boundary we are a whole period or more behind instead of bursting through them.
            self.late_ticks += 1
            missed = int(lag // self.period)
            self.start_lag = lag - missed * self.period  # past the boundary this tick now serves
            self.skipped_ticks += missed
            self._index += missed
        self._index += 1
        return not stop.is_set()

    def now(self) -> float:
        return self._now()

    def next_boundary(self) -> float | None:
        """When the next tick is due (None before the first wait)."""
        if self._origin is None:
            return None
        return self._origin + self._index * self.period
