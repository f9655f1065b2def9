"""Engine counters for /metrics. Updated from the engine thread and the event loop, so a
lock guards them; `snapshot()` returns plain numbers (no live objects leak out)."""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from dataclasses import dataclass, field

# Bucket upper bounds in seconds. Ticks: around the 80 ms budget. Prefill: up to seconds.
TICK_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5)
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# How late ticks start: a woken thread's delay (sub-ms when the host is idle), up to a late tick's.
START_LAG_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08)
RECENT_TICKS = 256  # ~20 s of ticks: the window of /load's tick_ms_p50 / tick_ms_p99


@dataclass
class Histogram:
    """Cumulative-style histogram (Prometheus shape): counts per upper bound, plus +Inf."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def snapshot(self) -> dict:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        return {"buckets": dict(zip([*map(str, self.bounds), "+Inf"], cumulative)),
                "sum": self.total, "count": self.count}


TICK_PHASES = ("plan", "rows", "launch", "device", "route")

COUNTERS = (
    "ticks",            # ticks run
    "late_ticks",       # ticks that started past their boundary (the step before overran)
    "skipped_ticks",    # boundaries dropped entirely to catch up without bursting
    "underruns",        # frames of silence fed because a session's input was empty
    "overruns",         # input frames dropped because a session's buffer was full
    "dropped_events",   # output events dropped because a consumer was too slow
    "sessions_opened",
    "sessions_failed",
    # Seconds the ticks spent in each phase (engine.py `_run_one_tick`), summed: per tick, the plan (rows
    # and their input frames), the rows' changes before the step (resets, forced text, KV blocks),
    # launching it, waiting for the device and copying the outputs back, and routing them to the streams.
    *(f"tick_{phase}_seconds" for phase in TICK_PHASES),
)


class EngineMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self.tick_seconds = Histogram(TICK_BUCKETS)
        self.prefill_seconds = Histogram(PREFILL_BUCKETS)
        self.tick_start_lag_seconds = Histogram(START_LAG_BUCKETS)
        self._recent_ticks: deque[float] = deque(maxlen=RECENT_TICKS)
        self._last_tick_at: float | None = None  # time.monotonic() of the last tick's end

    def inc(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._counts[name] = value

    def observe_phases(self, **seconds: float) -> None:
        """Seconds of a stepping tick's phases (TICK_PHASES, by name) added to their counters."""
        with self._lock:
            for phase, value in seconds.items():
                self._counts[f"tick_{phase}_seconds"] += value

    def observe_tick(self, seconds: float) -> None:
        with self._lock:
            self.tick_seconds.observe(seconds)
            self._recent_ticks.append(seconds)
            self._last_tick_at = time.monotonic()

    def observe_prefill(self, seconds: float) -> None:
        with self._lock:
            self.prefill_seconds.observe(seconds)

    def observe_start_lag(self, seconds: float) -> None:
        with self._lock:
            self.tick_start_lag_seconds.observe(seconds)

    def snapshot(self, live_slots: int, free_slots: int, healthy: bool) -> dict:
        with self._lock:
            return {**self._counts, "live_slots": live_slots, "free_slots": free_slots,
                    "healthy": healthy, "tick_seconds": self.tick_seconds.snapshot(),
                    "prefill_seconds": self.prefill_seconds.snapshot(),
                    "tick_start_lag_seconds": self.tick_start_lag_seconds.snapshot(),
                    "tick_ms_p50": _quantile_ms(self._recent_ticks, 0.50),
                    "tick_ms_p99": _quantile_ms(self._recent_ticks, 0.99),
                    "seconds_since_tick": (None if self._last_tick_at is None
                                           else time.monotonic() - self._last_tick_at)}


def _quantile_ms(values: deque[float], q: float) -> float | None:
    """Nearest-rank quantile of recent tick durations, in ms (None before the first tick)."""
    if not values:
        return None
    ordered = sorted(values)
    return 1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]
