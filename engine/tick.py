"""One tick of the engine thread, top to bottom (the Engine's clock calls `run` at each boundary).

    plan = scheduler.plan(tick)          # which rows run, with which input frame
    reset, forced text, KV blocks        # released rows back to empty, text queued, blocks mapped
    host = frame.run(plan)               # one batched step, one device->host copy
    output.route(plan, host)             # fan out to streams by request id
    a due GC pass, then slack work       # up to the next boundary (engine.py's docstring)

Rules it keeps:
1. An idle engine (no row live) runs no step at all; its slack may run one period past the boundary
   (`idle_slack`) and stops early when a session opens.
2. Each phase of a tick that steps is timed into the engine's metrics (metrics.TICK_PHASES), and
   what the engine thread did after the last step is kept for the late-tick line (`log_late_start`),
   at most one line per LATE_LOG_INTERVAL_S, the rest counted into the next.
3. Errors are not caught here: the Engine treats any escape as fatal for the whole batch.
4. With a tick trace (engine/tick_trace.py, opt-in), each phase's end and each slack item is marked in
   it; without one (None) no trace call is made.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

from .backend import FrameBackend, rows_mask
from .clock import TickClock
from .frame_step import FrameStep
from .gc_pauses import SlackCollections
from .kv_binding import KvBinding
from .metrics import EngineMetrics
from .output import OutputProcessor
from .prefill_source import PrefillSource
from .scheduler import Scheduler
from .slack import SlackRunner
from .text_forcing import TextForcing
from .translation import SourceEnds
from .tick_trace import TickTrace

log = logging.getLogger("parley.engine")

LATE_LOG_INTERVAL_S = 10.0  # a late tick is a log line, at most one this often (the rest are counted)


class TickRunner:
    """The engine thread's tick over the Engine's parts (each passed in, none owned)."""

    def __init__(self, *, backend: FrameBackend, scheduler: Scheduler, frame: FrameStep, output: OutputProcessor,
                 kv: KvBinding, forcing: TextForcing | None, slack: SlackRunner, prefill: PrefillSource,
                 clock: TickClock, metrics: EngineMetrics, collections: Callable[[], SlackCollections],
                 source_ends: SourceEnds | None = None, trace: TickTrace | None = None) -> None:
        self._backend, self._scheduler, self._frame, self._output = backend, scheduler, frame, output
        self._kv, self._forcing, self._slack, self._prefill = kv, forcing, slack, prefill
        self._clock, self._metrics = clock, metrics
        self._collections = collections  # the Engine's, read at each tick (tests replace it)
        self._source_ends = source_ends  # translation models: sources that ended (translation.py)
        self.ticks = 0  # ticks run so far
        self.idle_slack = False  # the last tick had no session live and its slack ran past the boundary
        self._route_s = 0.0  # the last tick's routing: what a full GC pass beside the device leaves room for
        self._after_step = (0.0, 0.0, 0.0)  # the last tick's step, GC pause, slack work (clock seconds)
        self._late_logged_at: float | None = None  # when the last late-tick line was logged
        self._late_unlogged = 0
        self.trace = trace  # the opt-in tick timeline (rule 4); the slack runner marks its items in it
        slack.trace = trace
        if trace is not None:
            trace.start(clock.period)

    def run(self, deadline: float | None) -> None:
        """One tick; `deadline`: the next boundary (None: a manual tick, run_ticks, with no GC pass
        and slack without a bound)."""
        trace = self.trace
        if trace is not None:
            trace.begin(self.ticks)
        tick_began = self._clock.now()
        start = time.perf_counter()
        plan = self._scheduler.plan(self.ticks)
        planned = time.perf_counter()
        if trace is not None:
            trace.phase("plan")
        self.ticks += 1
        if plan.released:  # an ended session's row goes back to empty: idle rows read no KV
            self._backend.reset_rows(rows_mask(self._backend.max_sessions, plan.released))
        if self._forcing is not None:  # after the reset: a released row's queue is gone, a live one's text joins it
            self._forcing.apply(plan)
        self._kv.step(plan.request_ids)  # ended rows' blocks back, live rows' next blocks in (kv_blocks.py rule 1)
        if plan.underruns:
            self._metrics.inc("underruns", plan.underruns)
        if trace is not None:
            trace.phase("rows")
        if self._source_ends is not None:  # ended sources: the end code goes into their rows' frames
            self._source_ends.before_step(plan)
        if plan.any_live:  # an idle engine runs no step at all
            stepping = time.perf_counter()
            beside = None if deadline is None else functools.partial(self._collect_beside_device, deadline)
            host = self._frame.run(plan, beside if trace is None else trace.step(beside))  # engine/frame_step.py
            routing = time.perf_counter()
            if trace is not None:
                trace.step_returned()
            if host is not None:
                if self._source_ends is not None:  # finished translations end before their last frame is routed
                    self._source_ends.after_step(plan, host)
                self._output.route(plan, host)
            self._route_s = time.perf_counter() - routing
            if trace is not None:
                trace.phase("route")
            launch = self._frame.launch_s
            self._metrics.observe_phases(plan=planned - start, rows=stepping - planned, launch=launch,
                                         device=routing - stepping - launch, route=self._route_s)
        self._metrics.inc("ticks")
        self._metrics.observe_tick(time.perf_counter() - start)
        self.idle_slack = deadline is not None and not plan.any_live and not self._prefill.busy
        self._after_step = self._collect_and_slack(deadline, tick_began)
        if trace is not None:
            trace.end()

    def _collect_and_slack(self, deadline: float | None, tick_began: float) -> tuple[float, float, float]:
        """After the step: a due GC pass (clocked ticks only, before the slack's own work, which
        fills what is left), then the slack. Returns (step, GC pause, slack) clock seconds."""
        stepped = self._clock.now()
        if deadline is not None:
            self._collections().maybe_collect(None if self.idle_slack else deadline - self._clock.now())
        collected = self._clock.now()
        if self.trace is not None:
            self.trace.phase("gc")
        if self.idle_slack:  # no frame due at the boundary: up to one period past it (rule 1)
            self._slack.run_until(deadline + self._clock.period, interrupt=self._scheduler.has_inbox)
        else:
            self._slack.run_until(deadline)
        if self.trace is not None:
            self.trace.phase("slack")
        return stepped - tick_began, collected - stepped, self._clock.now() - collected

    def _collect_beside_device(self, deadline: float) -> None:
        """A due full GC pass while the device runs the queued step: it lengthens the tick only by
        what it outlasts the device, where after the tick it would add its whole pause (at full
        load the tick's own slack may never hold one). Room: up to the boundary, less the routing."""
        self._collections().maybe_collect(deadline - self._clock.now() - self._route_s)

    def log_late_start(self) -> None:
        """A late tick in one line: how late, and what the engine thread did after the previous
        tick's step (its step, GC pause, slack work, clock seconds); rule 2 bounds the lines."""
        now = self._clock.now()
        self._late_unlogged += 1
        if self._late_logged_at is not None and now - self._late_logged_at < LATE_LOG_INTERVAL_S:
            return
        step, gc_s, slack = (1000 * v for v in self._after_step)
        more = f" ({self._late_unlogged - 1} more since the last line)" if self._late_unlogged > 1 else ""
        log.warning("tick %d started %.1f ms late: the tick before ran %.1f ms, then a GC pass %.1f ms and slack "
                    "work %.1f ms; %d late ticks so far%s", self.ticks, 1000 * self._clock.start_lag, step, gc_s,
                    slack, self._clock.late_ticks, more)
        self._late_logged_at, self._late_unlogged = now, 0
