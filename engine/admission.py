"""Admission as slack work: a new session's prompt (PersonaPlex voice + persona) is prefilled
in chunks sized to each tick's slack, so a long prompt never makes a tick late.

One session is prefilled at a time, in arrival order. A chunk's size comes from the cost
model's per-frame estimate and the time left; when even `MIN_PREFILL_FRAMES` do not fit,
that many still run as the tick's first slack item (forced), so admissions always progress.
A session whose options are refused, or whose prompt raises, fails alone: the engine and
every other session go on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .backend import FrameBackend, PrefillJob, rows_mask
from .metrics import EngineMetrics
from .scheduler import Scheduler
from .session import Session
from .slack import CostModel, Priority, SlackSource, WorkItem

MIN_PREFILL_FRAMES = 8  # prompt frames a tick runs at least, so admissions progress
PREFILL_KEY = ("prefill",)  # one per-frame cost for every chunk size (a conservative maximum)


@dataclass
class _Prefilling:
    session: Session
    job: PrefillJob
    seconds: float  # prefill work so far (the prefill_seconds histogram)


class PrefillSource(SlackSource):
    """The highest-priority slack source: prompts of sessions waiting to go live."""

    priority = Priority.PREFILL

    def __init__(self, backend: FrameBackend, scheduler: Scheduler, metrics: EngineMetrics,
                 ready: Callable[[Session], None], failed: Callable[[Session, Exception], None]) -> None:
        self._backend = backend
        self._scheduler = scheduler
        self._metrics = metrics
        self._ready = ready  # the session's prompt is done: it goes live at the next tick
        self._failed = failed  # the session's options or prompt failed: end it alone
        self._current: _Prefilling | None = None

    @property
    def busy(self) -> bool:
        """A prompt is being prefilled or waits for it: a session is about to go live."""
        return self._current is not None or self._scheduler.has_admissions()

    def offer(self, left_s: float | None, costs: CostModel) -> WorkItem | None:
        pending = self._pending()
        if pending is None:
            return None
        frames_left = pending.job.frames_left
        forced = False
        if left_s is None:
            frames = frames_left
        else:
            per_frame = costs.estimate(PREFILL_KEY)
            frames = 0 if per_frame is None else int(left_s / max(per_frame, 1e-9))
            if frames < MIN_PREFILL_FRAMES:
                frames, forced = MIN_PREFILL_FRAMES, True
            frames = min(frames, frames_left)
        return WorkItem(key=PREFILL_KEY, units=frames, forced=forced,
                        run=lambda: self._run_chunk(pending, frames),
                        fail=lambda exc: self._fail(pending.session, exc))

    def _pending(self) -> _Prefilling | None:
        """The prompt to work on next; sessions with nothing (left) to prefill go live here."""
        while True:
            if self._current is None:
                session = self._scheduler.next_admission()
                if session is None:
                    return None
                self._current = self._start(session)
                continue
            current = self._current
            if current.session.events.finished:  # closed while prefilling; its slot is already free
                self._current = None
            elif current.job.frames_left == 0:
                self._finish(current)
            else:
                return current

    def _start(self, session: Session) -> _Prefilling | None:
        if session.events.finished:
            return None  # closed before it was prefilled; its slot is already free
        start = time.perf_counter()
        try:
            self._backend.reset_rows(rows_mask(self._backend.max_sessions, [session.row]))  # a reused slot starts clean
            if session.options.sampling is not None:  # else reset left the model's defaults
                self._backend.set_sampling(session.row, session.options.sampling)
            job = self._backend.start_prefill(session.row, session.options)
        except Exception as exc:  # this session's options or prompt: its failure alone
            self._fail(session, exc)
            return None
        return _Prefilling(session, job, time.perf_counter() - start)

    def _run_chunk(self, pending: _Prefilling, frames: int) -> None:
        start = time.perf_counter()
        pending.job.run(frames)
        pending.seconds += time.perf_counter() - start
        if pending.job.frames_left == 0:
            self._finish(pending)

    def _finish(self, pending: _Prefilling) -> None:
        self._current = None
        self._metrics.observe_prefill(pending.seconds)
        self._scheduler.activate(pending.session)
        self._ready(pending.session)

    def _fail(self, session: Session, exc: Exception) -> None:
        if self._current is not None and self._current.session is session:
            self._current = None
        self._failed(session, exc)
