"""An opt-in timeline of the engine thread's ticks (`parley serve --tick-trace PATH`): where each tick's
period goes, one JSON line per tick, read by benchmarks/tick_timeline.py.

The file: a header line ({"trace": "parley tick timeline", "period_ms", "gpu"}), then one line per tick,
times in ms from the tick's start on the host's perf_counter:
- `phases`: the tick's host phases in order, each [name, start, end, cpu]: plan; rows (resets, forced
  text, KV blocks); launch (paired transcription's inputs and the frame's step queued; all of a step
  the host runs itself); beside (a GC pass while the device runs it, clocked ticks only); wait (until
  the frame's output is on the host, then paired transcription's publish); route; gc (metrics and a
  due GC pass); slack (the slack runner, its items included). A tick without a step has no launch,
  beside, wait or route.
- `slack`: each item run, in order: kind (its source's `Priority`), key, realtime, start, queued (its
  `run` returned), end (after the runner's device sync; an item queued on the device, slack.py rule 8:
  when its launch returned), cpu_run, cpu_sync, failed, and on CUDA gpu [start, end].
- `gpu` (CUDA): {"frame": [start, end], "end": the tick's end} on the device's timeline; null when
  the tick's events were never done (see rule 2) or off CUDA.
- `tick`, `wall` (time.time() at the tick's start, to cut a benchmark phase out of a trace) and
  `trace_ms`: host time this trace spent on its bookkeeping at the end of the tick before.

Rules it keeps:
1. Off costs nothing: the engine then holds None, no call reaches this module and no CUDA event is made.
2. It never synchronises the device: CUDA events recorded around the frame and each slack item are
   read back only once done (`Event.query`) and at least LAG_TICKS ticks later; a tick still not done
   after MAX_PENDING later ticks is written without GPU times. Events are pooled and reused.
3. Bounded: at most `max_ticks` tick lines, then tracing stops (one log line); memory holds at most
   MAX_PENDING ticks. Ticks with neither a step nor a slack item (an idle engine) are not written.
4. What the GPU times mean. A span runs from an event recorded before its first launch to one after
   its last, so device idle inside a span (the host launching slower than the device runs) counts in
   it, and device work the trace does not bracket (another thread's) reads as a gap. Times are from
   an anchor event recorded at the tick's start, when the tick before has waited for all its work
   (the frame's host copy, each slack item's sync), so the device is idle and the anchor runs at once;
   if the device was still busy, every time of that tick reads early by as much.
5. What `cpu` measures: the engine thread's CPU time (time.thread_time) in each phase. Wall minus cpu
   is time off the CPU: waiting for the GIL, for a core (runnable, not scheduled) and in blocking
   calls. Plan, rows, launch, route and gc make no device wait, so their off-CPU time is an upper
   bound on the GIL wait (on a box with a free core, it is the GIL wait). In wait and an item's sync
   it is mostly the device wait (a spinning CUDA wait counts as CPU), and the GIL wait after a device
   wait returns is inside it, not told apart. An item's `run` may wait on the device itself (a host
   copy), so its off-CPU time is no GIL figure.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Protocol

from .config import OptionsError

log = logging.getLogger("parley.engine.trace")

LAG_TICKS = 2  # a tick's events are read back once this many later ticks have ended (rule 2)
DEFAULT_MAX_TICKS = 20_000  # tick lines a trace writes unless told (27 minutes of 80 ms ticks)
MAX_PENDING = 32  # ticks held for their events at most; older ones are written without GPU times
HEADER = "parley tick timeline"


class GpuTimer(Protocol):
    """Timing events on the engine thread's device stream (CudaEvents; tests fabricate one)."""

    def record(self) -> Any: ...
    def done(self, event: Any) -> bool: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def release(self, events: list) -> None: ...


class CudaEvents:
    """CUDA timing events on the current stream, pooled (a tick records a few, every tick)."""

    def __init__(self) -> None:
        import torch  # only once a trace runs on CUDA

        self._event = lambda: torch.cuda.Event(enable_timing=True)
        self._free: list = []

    def record(self) -> Any:
        event = self._free.pop() if self._free else self._event()
        event.record()
        return event

    def done(self, event: Any) -> bool:
        return event.query()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end)

    def release(self, events: list) -> None:
        self._free.extend(events)


@dataclass
class _Item:
    kind: str
    key: Hashable
    realtime: bool
    start: float
    cpu_start: float
    queued: float | None = None
    cpu_queued: float | None = None
    end: float | None = None
    cpu_end: float | None = None
    failed: bool = False
    events: list = field(default_factory=list)  # [start, end] on CUDA


@dataclass
class _Tick:
    tick: int
    wall: float
    start: float
    cpu: float  # thread CPU time at the last phase's end
    last: float  # host time at the last phase's end
    trace_ms: float
    phases: list = field(default_factory=list)  # [name, start, end, cpu] (absolute host times)
    items: list[_Item] = field(default_factory=list)
    events: dict = field(default_factory=dict)  # anchor, frame_start, frame_end, end
    queued: bool = False  # the frame's step was queued (its launch phase ended)
    ended_at: int = 0  # ticks ended when this one ended


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _ms(value: float) -> float:
    return round(1000 * value, 4)


class TickTrace:
    """The engine thread's tick timeline (the module's rules). The engine thread makes every call but
    `close`, which the Engine makes once that thread has stopped."""

    def __init__(self, out, max_ticks: int, gpu: GpuTimer | None = None, *, name: str = "",
                 now: Callable[[], float] = time.perf_counter, cpu: Callable[[], float] = time.thread_time,
                 wall: Callable[[], float] = time.time) -> None:
        if isinstance(max_ticks, bool) or not isinstance(max_ticks, int) or max_ticks < 1:
            raise OptionsError(f"tick_trace_ticks must be a whole number of at least 1, got {max_ticks!r}.")
        self._out, self.max_ticks, self._gpu, self._name = out, max_ticks, gpu, name
        self._now, self._cpu, self._wall = now, cpu, wall
        self._tick: _Tick | None = None  # the tick being recorded
        self._pending: deque[_Tick] = deque()  # ended ticks waiting for their events (rule 2)
        self._accepted = 0  # ticks kept for writing, at most max_ticks (rule 3)
        self._ended = 0  # ticks ended (LAG_TICKS counts in them)
        self._trace_ms = 0.0  # this trace's bookkeeping at the end of the tick before
        self.written = 0  # tick lines written

    @classmethod
    def open(cls, path: str | Path, max_ticks: int, cuda: bool) -> "TickTrace":
        """A trace written to `path` (truncated), with CUDA events when `cuda`. OptionsError naming
        tick_trace when the file cannot be written."""
        try:
            out = open(path, "w", encoding="utf-8")
        except OSError as exc:
            raise OptionsError(f"tick_trace {str(path)!r} cannot be written: {exc.strerror or exc}") from exc
        return cls(out, max_ticks, CudaEvents() if cuda else None, name=str(path))

    def start(self, period_s: float) -> None:
        """The header line: the tick period and whether GPU times follow."""
        self._write({"trace": HEADER, "period_ms": _ms(period_s), "gpu": self._gpu is not None,
                     "max_ticks": self.max_ticks})

    def begin(self, tick: int) -> None:
        """A tick starts (its anchor event on CUDA); nothing once `max_ticks` were kept (rule 3)."""
        if self._accepted >= self.max_ticks or self._out is None:
            return
        now = self._now()
        self._tick = _Tick(tick, self._wall(), now, self._cpu(), now, self._trace_ms)
        if self._gpu is not None:
            self._tick.events["anchor"] = self._gpu.record()

    def phase(self, name: str) -> None:
        """The phase `name` ends now (it began where the one before ended)."""
        t = self._tick
        if t is None:
            return
        now, cpu = self._now(), self._cpu()
        t.phases.append([name, t.last, now, cpu - t.cpu])
        t.last, t.cpu = now, cpu

    def step(self, beside: Callable[[], None] | None) -> Callable[[], None] | None:
        """The frame's step is about to launch: its start event; returns `beside` (FrameStep's
        `while_queued`) wrapped to end the launch phase when the step is queued."""
        t = self._tick
        if t is None:
            return beside
        self._record(t, "frame_start")

        def queued() -> None:
            self._queued(t)
            if beside is not None:
                beside()
                self.phase("beside")

        return queued

    def step_returned(self) -> None:
        """The frame's output is on the host. A step that was never queued ran on the host: all launch."""
        t = self._tick
        if t is None:
            return
        if t.queued:
            self.phase("wait")
        else:
            self._queued(t)

    def _queued(self, t: _Tick) -> None:
        if not t.queued:  # once, should a refused row make FrameStep run the step again
            t.queued = True
            self._record(t, "frame_end")
            self.phase("launch")

    def _record(self, t: _Tick, name: str) -> None:
        if self._gpu is not None and name not in t.events:
            t.events[name] = self._gpu.record()

    def item_started(self, kind: str, key: Hashable, realtime: bool) -> None:
        """A slack item (engine/slack.py) starts: its host start, and its start event on CUDA."""
        t = self._tick
        if t is None:
            return
        item = _Item(kind, key, realtime, self._now(), self._cpu())
        if self._gpu is not None:
            item.events.append(self._gpu.record())
        t.items.append(item)

    def item_queued(self) -> None:
        """The item's `run` returned (before the runner waits for the device): its end event on CUDA."""
        t = self._tick
        if t is None or not t.items:
            return
        item = t.items[-1]
        if self._gpu is not None:
            item.events.append(self._gpu.record())
        item.queued, item.cpu_queued = self._now(), self._cpu()

    def item_ended(self, failed: bool) -> None:
        """The item is done and its device work waited for (or it failed)."""
        t = self._tick
        if t is None or not t.items:
            return
        item = t.items[-1]
        item.end, item.cpu_end, item.failed = self._now(), self._cpu(), failed

    def end(self) -> None:
        """The tick's work is done: its end event; ticks ended LAG_TICKS ago whose events are done are
        written (rule 2). The time this takes is the next line's `trace_ms`."""
        if self._out is None:
            return
        began = self._now()
        t, self._tick = self._tick, None
        self._ended += 1
        if t is not None:
            self._record(t, "end")
            t.ended_at = self._ended
            if t.queued or t.items:
                self._pending.append(t)
                self._accepted += 1
            else:  # an idle tick: not written (rule 3)
                self._release(t)
        self._read_back(final=False)
        self._trace_ms = _ms(self._now() - began)
        if self._accepted >= self.max_ticks and not self._pending:
            log.info("tick trace: %d ticks written to %s; tracing stopped (max %d)", self.written, self._name,
                     self.max_ticks)
            self._close_file()

    def close(self) -> None:
        """Write every tick still held (GPU times where their events are done) and close the file.
        Call once the engine thread has stopped; idempotent."""
        self._read_back(final=True)
        self._close_file()

    def _read_back(self, final: bool) -> None:
        """Write held ticks, oldest first, while they are LAG_TICKS old and done (all of them when
        `final`); one not done holds the rest until MAX_PENDING are held (rule 2)."""
        while self._pending:
            t = self._pending[0]
            done = self._gpu is None or self._gpu.done(t.events["end"])
            if not final and (self._ended - t.ended_at < LAG_TICKS or
                              (not done and len(self._pending) <= MAX_PENDING)):
                return
            self._pending.popleft()
            self._write(self._line(t, self._gpu_times(t) if done and self._gpu is not None else None))
            self.written += 1
            self._release(t)

    def _gpu_times(self, t: _Tick) -> dict:
        """The tick's device times, ms from its anchor: frame [start, end], end, and per item [start, end]."""
        gpu, events = self._gpu, t.events
        assert gpu is not None

        def at(event: Any) -> float:
            return round(gpu.elapsed_ms(events["anchor"], event), 4)

        frame = [at(events["frame_start"]), at(events["frame_end"])] if "frame_end" in events else None
        items = [[at(i.events[0]), at(i.events[1])] if len(i.events) == 2 else None for i in t.items]
        return {"frame": frame, "end": at(events["end"]), "items": items}

    def _line(self, t: _Tick, gpu: dict | None) -> dict:
        def rel(x: float | None) -> float | None:
            return None if x is None else _ms(x - t.start)

        slack = []
        for i, item in enumerate(t.items):
            queued = item.queued if item.queued is not None else item.end
            cpu_queued = item.cpu_queued if item.cpu_queued is not None else item.cpu_end
            entry = {"kind": item.kind, "key": _jsonable(item.key), "realtime": item.realtime,
                     "start": rel(item.start), "queued": rel(queued), "end": rel(item.end),
                     "cpu_run": _ms(cpu_queued - item.cpu_start), "cpu_sync": _ms(item.cpu_end - cpu_queued),
                     "failed": item.failed}
            if gpu is not None:
                entry["gpu"] = gpu["items"][i]
            slack.append(entry)
        return {"tick": t.tick, "wall": round(t.wall, 6), "trace_ms": t.trace_ms,
                "phases": [[name, rel(s), rel(e), _ms(c)] for name, s, e, c in t.phases], "slack": slack,
                "gpu": None if gpu is None else {"frame": gpu["frame"], "end": gpu["end"]}}

    def _release(self, t: _Tick) -> None:
        if self._gpu is not None:
            self._gpu.release([*t.events.values(), *(e for item in t.items for e in item.events)])

    def _write(self, line: dict) -> None:
        if self._out is not None:
            self._out.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._out.flush()

    def _close_file(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
