"""Python's full garbage collections, kept short while the engine ticks.

A full (generation 2) collection walks every tracked object while holding the GIL. A loaded
server holds hundreds of thousands of them (torch, diffusers, transformers, the models'
modules), so one full pass stalls every thread for a good part of a tick: an engine thread stalled
between a frame's launches makes the frame late. Objects alive once the server has loaded are
alive until it exits, so `freeze_loaded_objects` moves them to the permanent generation once:
later full collections walk only what serving created. `FullCollections` times the passes
that still happen (benchmarks print them; /metrics exposes them). At exit they are unfrozen:
the interpreter's last collection then frees them, and extensions that count their objects at
teardown (Triton's nanobind module) have nothing left to report as leaked.

What serving creates still takes a full pass every few seconds under load (benchmarks/capacity.py
prints them), and one that lands inside a tick makes that frame late. So while an engine thread
ticks, `SlackCollections` turns CPython's automatic full collections off and runs them itself
where the time left before the next tick holds the last pause: while the device computes a
queued step (the pass then lengthens the tick only by what it outlasts the device), else after
the tick. At most one every `min_interval_s`, and at the latest after `max_interval_s` whatever
the room (memory stays bounded). Younger generations still collect automatically: their passes
are short.
"""

from __future__ import annotations

import atexit
import gc
import threading
import time
from typing import Callable


def freeze_loaded_objects() -> int:
    """Collect once, then exempt every object alive now from later collections (gc.freeze).
    Call after loading, before serving; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)
    FULL_COLLECTIONS.install()
    return gc.get_freeze_count()


class FullCollections:
    """Counts full collections and their pause times, through `gc.callbacks`."""

    def __init__(self) -> None:
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self._started: float | None = None
        self._lock = threading.Lock()

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            pause = time.perf_counter() - self._started
            self._started = None
            with self._lock:
                self.count += 1
                self.total_s += pause
                self.max_s = max(self.max_s, pause)

    def install(self) -> "FullCollections":
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def snapshot(self) -> dict:
        with self._lock:
            return {"gc_full_collections": self.count, "gc_full_seconds": self.total_s,
                    "gc_full_max_seconds": self.max_s}


# The process's timer: installed by `freeze_loaded_objects`, read by /metrics.
FULL_COLLECTIONS = FullCollections()


_NEVER = 2 ** 30  # a generation-2 threshold the count never reaches: no automatic full pass


class SlackCollections:
    """Full collections moved into the engine's slack (module docstring). Process-wide, like the
    collector: `take_over` / `give_back` are counted, so engines may start and stop in any order."""

    def __init__(self, now: Callable[[], float] = time.monotonic, min_interval_s: float = 10.0,
                 max_interval_s: float = 60.0, margin: float = 1.25) -> None:
        self._now = now
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self._margin = margin  # the slack a pass needs, as a multiple of the last pass's pause
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: tuple[int, ...] | None = None
        self._last: float | None = None  # when the last pass ran (None: not since take_over)
        self.last_pause_s = 0.05  # until measured: a guess above a loaded server's passes, so the first waits for room
        self.in_slack = 0  # passes run in a slack that could hold them
        self.forced = 0  # passes run after max_interval_s without such a slack

    def take_over(self) -> None:
        with self._lock:
            self._holders += 1
            if self._holders == 1:
                self._saved = gc.get_threshold()
                gc.set_threshold(self._saved[0], self._saved[1], _NEVER)
                self._last = self._now()

    def give_back(self) -> None:
        with self._lock:
            if self._holders == 0:
                return
            self._holders -= 1
            if self._holders == 0 and self._saved is not None:
                gc.set_threshold(*self._saved)
                self._saved = None

    def maybe_collect(self, time_left_s: float | None) -> bool:
        """Run a full pass if one is due and fits: `time_left_s` is the slack before the next
        tick (None: nothing is due, any pause fits). True if a pass ran."""
        with self._lock:
            if self._holders == 0 or self._last is None:
                return False
            since = self._now() - self._last
            if since < self.min_interval_s:
                return False
            fits = time_left_s is None or time_left_s >= self._margin * self.last_pause_s
            if not fits and since < self.max_interval_s:
                return False
            start = time.perf_counter()
            gc.collect(2)
            self.last_pause_s = time.perf_counter() - start
            self._last = self._now()
            if fits:
                self.in_slack += 1
            else:
                self.forced += 1
            return True


# The engine thread's full collections (engine/engine.py): one collector per process.
SLACK_COLLECTIONS = SlackCollections()
