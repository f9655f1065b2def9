"""Admission as slack work: a new session's prompt (PersonaPlex voice + persona) is prefilled
in chunks sized to each tick's slack, so a long prompt never makes a tick late.

One session is prefilled at a time, in arrival order. Chunks come in size classes
(`PREFILL_CHUNKS`: 8, 16, ... 256 frames), each with its own cost key, seeded on the engine
thread before the first tick (`slack_prepare` runs one chunk of each class through the
backend's `warm_up_prefill`). A chunk is the largest class, up to what the prompt has left,
whose cost fits the time left. A chunk's cost is far from linear in its frames (every chunk
reads every weight; on CUDA a chunk is its class's graph, engine/prompt_prefill.py), so each
class is costed on its own (one per-frame estimate, taken from small chunks, planned ~10
frames a tick and spread each prompt over ~20 ticks). A class never measured runs on a
prediction scaled up linearly from a smaller measured class (an upper bound when cost grows
at most linearly). When no class fits, `MIN_PREFILL_FRAMES` still run as the tick's first
slack item (forced), so admissions always progress. Every chunk is realtime work (slack.py
rule 1): a caller waits on the session going live. A session whose options are refused,
or whose prompt raises, fails alone: the engine and every other session go on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .backend import FrameBackend, PrefillJob, rows_mask
from .metrics import EngineMetrics
from .prompt_prefill import PREFILL_CHUNKS, chunk_class
from .scheduler import Scheduler
from .session import Session
from .slack import CostModel, Priority, SlackSource, WorkItem, second_call_cost

MIN_PREFILL_FRAMES = 8  # prompt frames a tick runs at least, so admissions progress


def prefill_key(frames: int) -> tuple:
    return ("prefill", chunk_class(frames))


@dataclass
class _Prefilling:
    session: Session
    job: PrefillJob
    seconds: float  # prefill work so far (the prefill_seconds histogram)


class PrefillSource(SlackSource):
    """The highest-priority slack source: prompts of sessions waiting to go live."""

    priority = Priority.PREFILL

    def __init__(self, backend: FrameBackend, scheduler: Scheduler, metrics: EngineMetrics,
                 ready: Callable[[Session], None], failed: Callable[[Session, Exception], None],
                 now: Callable[[], float] = time.perf_counter,
                 started: Callable[[Session, int], None] | None = None) -> None:
        self._backend = backend
        self._now = now  # the engine clock's (the chunk costs it seeds are compared with its deadlines)
        self._scheduler = scheduler
        self._metrics = metrics
        self._ready = ready  # the session's prompt is done: it goes live at the next tick
        self._failed = failed  # the session's options or prompt failed: end it alone
        self._started = started  # (session, prompt frames): its row starts, before the prompt is written
        self._current: _Prefilling | None = None

    @property
    def busy(self) -> bool:
        """A prompt is being prefilled or waits for it: a session is about to go live."""
        return self._current is not None or self._scheduler.has_admissions()

    def warm_up(self, costs: CostModel) -> dict:
        """Nothing to warm before the engine starts: the backend captures its prefill graphs when
        it loads (engine/prompt_prefill.py), and every chunk class is measured on the engine
        thread, where it runs (`slack_prepare`)."""
        return {}

    def slack_prepare(self, costs: CostModel) -> None:
        """Seed every chunk class's cost (run twice on the engine thread, the second kept); a
        backend without prompts runs none."""
        for frames in PREFILL_CHUNKS:
            spent, ran = second_call_cost(lambda: self._backend.warm_up_prefill((frames,)),
                                          self._backend.synchronize, self._now)
            if ran:
                costs.seed(prefill_key(frames), spent)

    def offer(self, left_s: float | None, costs: CostModel) -> WorkItem | None:
        pending = self._pending()
        if pending is None:
            return None
        frames_left = pending.job.frames_left
        frames, forced, predicted = min(frames_left, PREFILL_CHUNKS[-1]), False, None
        if left_s is not None:
            frames, predicted = self._plan(frames_left, left_s, costs)
            if frames == 0:
                frames, forced = min(MIN_PREFILL_FRAMES, frames_left), True
        return WorkItem(key=prefill_key(frames), forced=forced, predicted_s=predicted, realtime=True,
                        run=lambda: self._run_chunk(pending, frames),
                        fail=lambda exc: self._fail(pending.session, exc))

    @staticmethod
    def _plan(frames_left: int, left_s: float, costs: CostModel) -> tuple[int, float | None]:
        """(frames, prediction): the largest class, up to the one holding `frames_left`, whose
        estimate (or, never measured, its prediction) fits in `left_s`; (0, None) if none does."""
        top = chunk_class(frames_left)
        classes = [c for c in PREFILL_CHUNKS if c <= top]
        known = {c: costs.estimate(("prefill", c)) for c in classes}
        for c in reversed(classes):
            estimate, predicted = known[c], None
            if estimate is None:  # scaled up from the smaller measured classes: take the tightest
                bounds = [e * c / k for k, e in known.items() if k < c and e is not None]
                predicted = min(bounds, default=None)
            cost = estimate if estimate is not None else predicted
            if cost is not None and cost <= left_s:
                return min(c, frames_left), predicted
        return 0, None

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
            if self._started is not None:
                self._started(session, job.frames_left)
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
