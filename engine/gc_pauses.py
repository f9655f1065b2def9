"""Python's full garbage collections, kept short while the engine ticks.

A full (generation 2) collection walks every tracked object while holding the GIL. A loaded
server holds ~4e5 of them (torch, diffusers, transformers, the models' modules), so one full
pass stalls every thread for tens of ms (200 ms on a slow CPU): an engine thread stalled
between a frame's launches makes the frame late. Objects alive once the server has loaded are
alive until it exits, so `freeze_loaded_objects` moves them to the permanent generation once:
later full collections walk only what serving created. `FullCollections` times the passes
that still happen (benchmarks print them; /metrics exposes them). At exit they are unfrozen:
the interpreter's last collection then frees them, and extensions that count their objects at
teardown (Triton's nanobind module) have nothing left to report as leaked.
"""

from __future__ import annotations

import atexit
import gc
import threading
import time


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
