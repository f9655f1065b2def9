"""The Engine: slots, one thread on a clock, and a tick in three calls.

    plan = scheduler.plan(tick)          # which rows run, with which input frame
    host = backend.step(...).to_host()   # one batched step, one device->host copy
    output.route(plan, host)             # fan out to streams by request id

New sessions are prefilled after the tick's outputs are out, in the slack before the
next boundary, a chunk of the prompt at a time, so a prefill never delays the frame other
sessions are waiting for.

Threads: the event loop calls `open`, `Session.push_audio`, `Session.close`,
`counters` and `shutdown`; everything that touches the backend runs on the engine
thread (or on the caller, in manual mode via `run_ticks`). The loop never waits on
model work: `open` awaits a future the engine thread resolves.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from parley.models.config import FRAME_SAMPLES

from .backend import FrameBackend, HostOutput, PrefillJob, RowFailure, SessionRejected, rows_mask
from .clock import TickClock
from .config import EngineConfig, OptionsError, SessionOptions
from .input_buffer import InputBuffer
from .metrics import EngineMetrics
from .output import OutputProcessor
from .scheduler import Scheduler, TickPlan
from .session import Session
from .slots import SlotTable
from .stream import OutputStream, Status, Terminal

log = logging.getLogger("parley.engine")

MIN_PREFILL_FRAMES = 8  # prompt frames every tick runs at least, so admissions progress
PREFILL_SLACK_SHARE = 0.8  # of the time left before the next boundary, a margin for the estimate


class EngineClosed(RuntimeError):
    """The engine is shut down or unhealthy and takes no new sessions."""


class RequestFailed(RuntimeError):
    """One request's own work raised (its options, prefill start or a prompt chunk): that
    request ended with Terminal(FAILED); the engine serves on. The message carries the
    request id to look up in the server log, never the exception text."""


def request_failure(request_id: str) -> str:
    return f"internal error; request id {request_id} in the server log"


class Engine:
    def __init__(self, backend: FrameBackend, config: EngineConfig = EngineConfig(),
                 clock: TickClock | None = None) -> None:
        if backend.max_sessions != config.max_sessions:
            raise OptionsError(f"the backend holds {backend.max_sessions} rows but max_sessions is "
                               f"{config.max_sessions}; build both with the same number.")
        self.config = config
        self.metrics = EngineMetrics()
        self._backend = backend
        self._slots = SlotTable(config.max_sessions)
        self._scheduler = Scheduler(config.max_sessions, FRAME_SAMPLES)
        self._output = OutputProcessor(backend.text_piece, self.metrics)
        self._clock = clock or TickClock(config.tick_seconds)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _sessions and the lifecycle flags
        self._sessions: dict[str, Session] = {}  # every open session, for fail-all and shutdown
        self._closed = False
        self._healthy = True
        self._tick = 0
        self._prefilling: _Prefilling | None = None  # the session whose prompt is running
        self._prefill_frame_s: float | None = None  # last chunk's cost per prompt frame
        # Called once, on the engine thread, after a fatal error: `parley serve` uses it to exit
        # non-zero so a supervisor restarts the process instead of it staying up and dead.
        self.on_fatal: Callable[[BaseException], None] | None = None

    # ---- lifecycle ----

    def start(self) -> None:
        """Start the engine thread and its clock."""
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine was shut down; build a new one.")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._serve, name="parley-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._healthy

    def counters(self) -> dict:
        return self.metrics.snapshot(self._slots.live, self._slots.free, self._healthy)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread (bounded), end every stream, free the backend. Idempotent.
        Blocks for at most `timeout` (default: config.shutdown_timeout_s); from async code
        prefer `await asyncio.to_thread(engine.shutdown)`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        joined = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.config.shutdown_timeout_s if timeout is None else timeout)
            joined = not self._thread.is_alive()
        for session in self._open_sessions():
            self._end_session(session, Terminal(Status.CANCELLED, "the engine is shutting down"),
                              EngineClosed("the engine is shutting down"))
        if not joined:
            # A step is stuck on the device; freeing its memory under it would be worse.
            self._healthy = False
            log.error("engine thread did not stop within the shutdown timeout; backend not freed")
            return
        try:
            self._backend.close()
        except Exception:  # shutdown must finish; the error is still reported
            log.exception("backend close failed")

    # ---- sessions (event loop) ----

    async def open(self, options: SessionOptions = SessionOptions()) -> Session:
        """Take a slot and wait (without blocking the loop) until the row is prefilled.
        Raises EngineFull at once when no slot is free, SessionRejected for options the
        model cannot serve, EngineClosed when the engine is down."""
        session = self.open_nowait(options)
        try:
            return await session.ready
        except asyncio.CancelledError:
            session.close()  # the caller went away while we prefilled: give the slot back
            raise

    def open_nowait(self, options: SessionOptions = SessionOptions()) -> Session:
        """Admit a session without waiting for its prefill; `session.ready` resolves later.
        Must be called on the event loop that will consume the session's events."""
        if not isinstance(options, SessionOptions):
            raise OptionsError("options must be a SessionOptions.")
        loop = asyncio.get_running_loop()
        request_id = uuid.uuid4().hex
        with self._lock:
            if self._closed or not self._healthy:
                raise EngineClosed("the engine is not serving (shut down or failed).")
            row = self._slots.acquire(request_id)  # raises EngineFull at once
            session = Session(self, request_id, row, options,
                              OutputStream(request_id, loop, self.config.output_events),
                              InputBuffer(self.config.input_frames), loop.create_future())
            self._sessions[request_id] = session
        self._output.register(request_id, session.events)
        self._scheduler.submit_admit(session)
        self.metrics.inc("sessions_opened")
        return session

    def _fail_session(self, session: Session, reason: str) -> None:
        self._end_session(session, Terminal(Status.FAILED, reason), EngineClosed(reason))

    def _end_session(self, session: Session, terminal: Terminal,
                     ready_error: Exception | None = None) -> None:
        """End one session from any thread: terminal event, slot, routing. Idempotent."""
        if session.events.finish(terminal) and terminal.status is Status.FAILED:
            self.metrics.inc("sessions_failed")
        with self._lock:
            self._sessions.pop(session.request_id, None)
        self._output.unregister(session.request_id)
        self._scheduler.submit_close(session)  # the engine thread drops the row at its next plan
        self._slots.release(session.row, session.request_id)
        _settle(session.ready, error=ready_error)

    def _open_sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    # ---- the engine thread ----

    def run_ticks(self, n: int) -> None:
        """Manual clock: run `n` ticks now on the calling thread, then every pending
        prefill. For tests and benchmarks; refused while the engine thread runs."""
        if self._thread is not None:
            raise RuntimeError("run_ticks is for an engine that was not start()ed.")
        for _ in range(n):
            if not self._healthy or self._closed:
                return
            self._guarded(self._run_one_tick, deadline=None)

    def serve_ticks(self, n: int) -> None:
        """Run `n` clocked ticks on the calling thread (tests drive a fake clock with it)."""
        if self._thread is not None:
            raise RuntimeError("serve_ticks is for an engine that was not start()ed.")
        self._serve(max_ticks=n)

    def _serve(self, max_ticks: int | None = None) -> None:
        ticks = 0
        while (max_ticks is None or ticks < max_ticks) and self._healthy and self._clock.wait(self._stop):
            self._guarded(self._run_one_tick, deadline=self._clock.next_boundary())
            self.metrics.set("late_ticks", self._clock.late_ticks)
            self.metrics.set("skipped_ticks", self._clock.skipped_ticks)
            ticks += 1

    def _guarded(self, fn, **kwargs) -> None:
        try:
            fn(**kwargs)
        except Exception as exc:  # any escape from the backend is fatal for the whole batch
            self._fatal(exc)

    def _run_one_tick(self, deadline: float | None) -> None:
        start = time.perf_counter()
        plan = self._scheduler.plan(self._tick)
        self._tick += 1
        if plan.released:  # an ended session's row goes back to empty: idle rows read no KV
            self._backend.reset_rows(rows_mask(self.config.max_sessions, plan.released))
        if plan.underruns:
            self.metrics.inc("underruns", plan.underruns)
        if plan.any_live:  # an idle engine runs no step at all
            host = self._execute(plan)
            if host is not None:
                self._output.route(plan, host)
        self.metrics.inc("ticks")
        self.metrics.observe_tick(time.perf_counter() - start)
        self._admit_pending(deadline)

    def _execute(self, plan: TickPlan) -> HostOutput | None:
        # A RowFailure means those rows were refused before any state changed: end those
        # sessions only and rerun the step for the rest (bounded: each retry removes a row).
        for _ in range(self.config.max_sessions + 1):
            try:
                return self._backend.step(plan.frames, plan.live_mask).to_host()
            except RowFailure as failure:
                for row, reason in failure.reasons.items():
                    rid = plan.request_ids[row]
                    session = self._sessions.get(rid) if rid is not None else None
                    if session is None or not plan.live_mask[row]:
                        raise RuntimeError(f"backend refused row {row}, which is not live") from failure
                    self._fail_session(session, f"input rejected: {reason}")
                    plan.live_mask[row] = False
                    plan.request_ids[row] = None
                if not plan.any_live:
                    return None
        raise RuntimeError("backend kept refusing rows")

    def _admit_pending(self, deadline: float | None) -> None:
        """Prefill queued sessions in the slack before the next boundary, a chunk at a time.
        Chunks are sized to the time left from the last chunk's cost per frame (with a
        margin); at least MIN_PREFILL_FRAMES run per tick, so admissions always progress, and a
        long prompt spreads over several ticks instead of making the next one late. Manual
        mode (no deadline): every prompt at once."""
        ran_this_tick = False
        while True:
            if self._prefilling is None:
                session = self._scheduler.next_admission()
                if session is None:
                    return
                self._prefilling = self._start_prefill(session)
                continue
            pending = self._prefilling
            if pending.session.events.finished:  # closed while prefilling; its slot is already free
                self._prefilling = None
                continue
            if pending.job.frames_left > 0:
                frames = self._chunk_frames(pending.job.frames_left, deadline, ran_this_tick)
                if frames == 0:
                    return
                start = self._clock.now()
                try:
                    pending.job.run(frames)
                except Exception as exc:  # this row's prompt only: the shared frame is untouched
                    self._prefilling = None
                    self._request_failed(pending.session, "prefill chunk", exc)
                    continue
                spent = self._clock.now() - start
                pending.seconds += spent
                self._prefill_frame_s = spent / frames
                ran_this_tick = True
            if pending.job.frames_left == 0:
                self._prefilling = None
                self.metrics.observe_prefill(pending.seconds)
                self._scheduler.activate(pending.session)
                _settle(pending.session.ready, result=pending.session)

    def _chunk_frames(self, frames_left: int, deadline: float | None, ran_this_tick: bool) -> int:
        if deadline is None:
            return frames_left
        fit = 0
        if self._prefill_frame_s is not None:
            fit = int(PREFILL_SLACK_SHARE * (deadline - self._clock.now()) / max(self._prefill_frame_s, 1e-6))
        if not ran_this_tick:
            fit = max(fit, MIN_PREFILL_FRAMES)
        return max(0, min(fit, frames_left))

    def _start_prefill(self, session: Session) -> "_Prefilling | None":
        if session.events.finished:
            return None  # closed before it was prefilled; its slot is already free
        start = self._clock.now()
        try:
            self._backend.reset_rows(rows_mask(self.config.max_sessions, [session.row]))  # a reused slot starts clean
            if session.options.sampling is not None:  # else reset left the model's defaults
                self._backend.set_sampling(session.row, session.options.sampling)
            job = self._backend.start_prefill(session.row, session.options)
        except SessionRejected as exc:
            reason = str(exc)
            self._end_session(session, Terminal(Status.FAILED, reason), SessionRejected(reason))
            return None
        except Exception as exc:  # request-scoped: the row is reset when its slot is reused
            self._request_failed(session, "prefill start", exc)
            return None
        return _Prefilling(session, job, self._clock.now() - start)

    def _request_failed(self, session: Session, phase: str, exc: Exception) -> None:
        """One request's work raised: end that request only (its row is reset on reuse)."""
        log.error("request %s failed in %s; other sessions unaffected", session.request_id, phase, exc_info=exc)
        self.metrics.inc("request_failures")
        reason = request_failure(session.request_id)
        self._end_session(session, Terminal(Status.FAILED, reason), RequestFailed(reason))

    def _fatal(self, exc: BaseException) -> None:
        log.error("fatal engine error in the shared frame step; failing every session", exc_info=exc)
        self._healthy = False
        for session in self._open_sessions():
            self._fail_session(session, "engine failure; " + request_failure(session.request_id))
        self._stop.set()
        if self.on_fatal is not None:
            try:
                self.on_fatal(exc)
            except Exception:  # the engine is already down; the hook must not hide that
                log.exception("on_fatal hook failed")


@dataclass
class _Prefilling:
    session: Session
    job: PrefillJob
    seconds: float  # prefill work so far (the prefill_seconds counter)


def _settle(future: asyncio.Future, result: object = None, error: Exception | None = None) -> None:
    """Resolve an open() future from any thread (futures are not thread-safe)."""

    def settle() -> None:
        if future.done():
            return  # the caller gave up (cancelled) or it was already settled
        if error is not None:
            future.set_exception(error)
        elif result is not None:
            future.set_result(result)
        else:
            future.cancel()

    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the loop is closed: nobody is waiting
