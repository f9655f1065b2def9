"""A watchdog thread that notes when it could not run for a while, with every thread's stack.

In a server process the engine thread shares the GIL with the HTTP edge: when some Python work
holds it (an import, a long pure-Python loop), the engine thread waits, and so does this thread.
It wakes every millisecond, samples all stacks every few wakes, and when a wake comes more than
`threshold_s` late it records the stacks from just before and at the end of the stall: the
thread whose frames say what it held the GIL for is usually plain (this found the first TTS
request's imports: benchmarks/NOTES.md, "TTS beside duplex").

    watch = StallWatch(0.008).start()
    ...
    for stall in watch.stalls_since(t0): print(stall.describe())
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from dataclasses import dataclass

Stack = list[tuple[str, int, str]]  # (file name, line, function), innermost first


def thread_stacks(depth: int = 6) -> dict[str, Stack]:
    """The top `depth` frames of every other thread, by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    return {names.get(tid, str(tid)): [(f.f_code.co_filename.rsplit("/", 1)[-1], line, f.f_code.co_name)
                                       for f, line in traceback.walk_stack(frame)][:depth]
            for tid, frame in sys._current_frames().items() if tid != me}


@dataclass
class Stall:
    start: float  # perf_counter when the watchdog last ran before it
    seconds: float
    before: dict[str, Stack]
    after: dict[str, Stack]

    def describe(self, origin: float = 0.0) -> str:
        lines = [f"stall at {self.start - origin:+.3f} s for {self.seconds * 1000:.1f} ms"]
        for name, stack in self.after.items():
            lines.append(f"  {name}: {_frames(stack)}")
            earlier = self.before.get(name)
            if earlier and earlier[:3] != stack[:3]:
                lines.append(f"  {name} before: {_frames(earlier)}")
        return "\n".join(lines)


def _frames(stack: Stack) -> str:
    return " < ".join(f"{file}:{line} {function}" for file, line, function in stack[:4])


class StallWatch:
    def __init__(self, threshold_s: float, sample_every: int = 4) -> None:
        self.threshold_s = threshold_s
        self.sample_every = sample_every
        self.stalls: list[Stall] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def start(self) -> "StallWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1)

    def stalls_since(self, t0: float) -> list[Stall]:
        """The stalls still going on at `t0` or later (one that began just before it counts)."""
        return [s for s in list(self.stalls) if s.start + s.seconds >= t0]

    def _run(self) -> None:
        before = thread_stacks()
        last = time.perf_counter()
        wakes = 0
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            if now - last > self.threshold_s:
                self.stalls.append(Stall(last, now - last, before, thread_stacks()))
            wakes += 1
            if wakes % self.sample_every == 0:
                before = thread_stacks()
            last = time.perf_counter()
