"""The Engine: slots, one thread on a clock, and a tick in three calls.

    plan = scheduler.plan(tick)          # which rows run, with which input frame
    host = backend.step(...).to_host()   # one batched step, one device->host copy
    output.route(plan, host)             # fan out to streams by request id

    slack.run_until(next boundary)       # prefill, TTS, ... : work items that fit (slack.py)

The tick itself, top to bottom, is engine/tick.py (`TickRunner`); the Engine runs it on its clock.

Everything besides the frame is slack work (engine/slack.py): new sessions' prompts
(prefill_source.py) and any source added with `add_slack_source`, run after the tick's outputs
are out and only when their estimated cost ends before the next boundary. With no session
live or starting, no frame is due at that boundary: the slack may then run one period past it
(a TTS- or image-only server would otherwise lose the end of every tick that the next item
does not fit), and stops early when a session opens; the next tick starts when it ends, on
the grid again, not counted late.

KV memory (engine/kv_blocks.py; `parley serve` always has one for a duplex model): a session is
admitted only when the KV block pool can hold it to the end of its window (else KvFull, an
EngineFull); the pool is the allocator of the backend's paged KV state: before each step it maps
the blocks live rows need (`map_kv_blocks`), and an ended row's blocks go back at the next tick.

Failure containment: an error in one request's work (its options, its prompt, its slack
item) fails that request only; an error in the shared frame step is fatal: every stream
fails, the engine turns unhealthy and `fatal_error` says why (the server then exits
non-zero so a supervisor restarts it).

Threads: the event loop calls `open`, `Session.push_audio`, `Session.close`,
`counters` and `shutdown`; everything that touches the backend runs on the engine
thread (or on the caller, in manual mode via `run_ticks`). The loop never waits on
model work: `open` awaits a future the engine thread resolves.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import uuid
from typing import Callable

from parley.models.config import FRAME_SAMPLES

from .prefill_source import PrefillSource
from .backend import FrameBackend, SessionRejected
from .clock import TickClock
from .config import EngineConfig, OptionsError, SessionOptions
from .frame_step import FrameStep
from .gc_pauses import SLACK_COLLECTIONS
from .input_buffer import InputBuffer
from .kv_binding import KvBinding
from .kv_blocks import KvBlockPool, KvFull
from .metrics import EngineMetrics
from .output import OutputProcessor
from .scheduler import Scheduler
from .session import Session
from .slack import SlackRunner, SlackSource
from .slots import SlotTable
from .stream import OutputStream, Status, Terminal
from .stt_paired import PairedTranscription
from .text_forcing import TextForcing
from .tick import TickRunner
from .translation import SourceEnds
from .tick_trace import TickTrace

log = logging.getLogger("parley.engine")

# In one process the engine thread shares the GIL with the event loop, and every torch call in a tick
# gives it up and takes it back. While the loop runs Python without a pause (hundreds of sessions'
# socket work), each take-back can wait out Python's switch interval, 5 ms by default, and a tick of
# a few dozen torch calls runs late (benchmarks/gil_tick.py; docs/benchmarks.md, "Capacity under real
# traffic"). A short interval bounds each wait, at a small cost in switches to the loop. The engine
# process of `--edge-workers` has no sockets beside the engine thread and keeps Python's interval
# (`start(beside_sockets=False)`): its capacity run held without the bound.
GIL_SWITCH_S = 0.0005


class EngineClosed(RuntimeError):
    """The engine is shut down or unhealthy and takes no new sessions."""


class Engine:
    def __init__(self, backend: FrameBackend, config: EngineConfig = EngineConfig(),
                 clock: TickClock | None = None, kv: KvBlockPool | None = None, trace: TickTrace | None = None) -> None:
        rows = backend.max_sessions
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise OptionsError(f"max_sessions must be a whole number of at least 1, got {rows!r}.")
        self.max_sessions = rows  # slots, fixed at start: the batch every tick runs (the backend's rows)
        self.config = config
        self.metrics = EngineMetrics()
        self._backend = backend
        self._slots = SlotTable(rows)
        self._scheduler = Scheduler(rows, FRAME_SAMPLES)
        self._output = OutputProcessor(backend.text_piece, self.metrics)
        self._clock = clock or TickClock(config.tick_seconds)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _sessions and the lifecycle flags
        self._sessions: dict[str, Session] = {}  # every open session, for fail-all and shutdown
        self._closed = False
        self._healthy = True
        self.fatal_error: str | None = None  # why the engine stopped serving, once it has
        # The tick's step, with paired transcription's STT rows beside the duplex rows (set_paired_transcription).
        self._frame = FrameStep(backend, rows, self._find_session, self.fail_session)
        # Called once on the engine thread after a fatal error: `parley serve` exits non-zero on it.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._slack = SlackRunner.for_backend(backend, self._clock.now, config)
        # The KV block pool (engine/kv_blocks.py; None: dense rows), mapped into the backend each step (kv_binding.py).
        self.kv = kv
        self._kv = KvBinding(kv, backend)
        self._prefill = PrefillSource(backend, self._scheduler, self.metrics,
                                      ready=lambda s: _settle(s.ready, result=s), failed=self._prefill_failed,
                                      now=self._clock.now, started=self._kv.start if kv is not None else None)
        self._slack.add_source(self._prefill)
        self.collections = SLACK_COLLECTIONS  # full GC passes, run between ticks once start()ed
        force = getattr(backend, "force_text", None)  # optional (FrameBackend): text a session's model says
        self._forcing = TextForcing(force, _settle) if force is not None else None
        translates = getattr(backend, "translates", False)  # Hibiki: a source can end (translation.py)
        self._source_ends = SourceEnds(backend, self._end_session) if translates else None
        # The engine thread's tick: plan -> step -> route, then a GC pass and slack (engine/tick.py);
        # `trace`: the opt-in tick timeline (engine/tick_trace.py), closed at shutdown.
        self._ticks = TickRunner(backend=backend, scheduler=self._scheduler, frame=self._frame, output=self._output,
                                 kv=self._kv, forcing=self._forcing, slack=self._slack, prefill=self._prefill,
                                 clock=self._clock, metrics=self.metrics, collections=lambda: self.collections,
                                 source_ends=self._source_ends, trace=trace)

    # ---- lifecycle ----

    def start(self, beside_sockets: bool = True) -> None:
        """Start the engine thread and its clock; `beside_sockets` (one process): GIL_SWITCH_S."""
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine was shut down; build a new one.")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._serve, name="parley-engine", daemon=True)
        if beside_sockets:
            sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self.collections.take_over()  # full GC passes in the ticks' slack (engine/gc_pauses.py)
        self._thread.start()

    healthy = property(lambda self: self._healthy)  # False once a fatal error stopped the engine

    @property
    def thread_id(self) -> int | None:
        """The engine thread's OS thread id once started (its CPU time: /proc/<id>/stat), else None."""
        return self._thread.native_id if self._thread is not None else None

    @property
    def running(self) -> bool:
        """The engine thread is alive: started and not stopped (it may still be warming up)."""
        return self._thread is not None and self._thread.is_alive()

    def counters(self) -> dict:
        return {**self.metrics.snapshot(self._slots.live, self._slots.free, self._healthy),
                **self._slack.counters(),  # its totals, then its sources'
                **(self._frame.paired.counters() if self._frame.paired is not None else {}),
                **self._kv.snapshot()}

    def add_slack_source(self, source: SlackSource) -> None:
        """Register slack work, asked after every tick (slack.py's rule 1). Call before `start`."""
        if self._thread is not None:
            raise RuntimeError("add slack sources before the engine starts.")
        self._slack.add_source(source)

    def set_paired_transcription(self, paired: PairedTranscription) -> None:
        """Transcribe sessions' audio in the frame (engine/stt_paired.py). Call before `start`."""
        if self._thread is not None:
            raise RuntimeError("set paired transcription before the engine starts.")
        self._frame.paired = paired

    @property
    def can_transcribe(self) -> bool:
        """Whether sessions can be transcribed (a paired STT model is loaded)."""
        return self._frame.paired is not None

    def enable_transcription(self, session: Session) -> OutputStream:
        """Start transcribing what this session's user says: an OutputStream of SttPartial that
        ends when the session does. OptionsError when no STT model is loaded."""
        if self._frame.paired is None:
            raise OptionsError("no speech-to-text model is loaded (parley serve --stt-model), so the "
                               "user's audio cannot be transcribed.")
        return self._frame.paired.enable(session.row, session.request_id, asyncio.get_running_loop())

    async def force_text(self, session: Session, text: str) -> int:
        """Have `session`'s model say `text`: its tokens replace the sampled text tokens from the
        model's next pause (models/forced_text.py) and come out in FrameOut.text; its speech follows
        if the model's speech follows its text stream. Returns the tokens queued, once they are
        (within a tick). OptionsError: the model cannot, the text has no tokens, or it does not fit."""
        if self._forcing is None:
            raise OptionsError("this model cannot be given text to say (its backend forces no text).")
        return await self._forcing.say(session, self._backend.text_tokens(text))  # type: ignore[attr-defined]

    translates = property(lambda self: self._source_ends is not None)  # Hibiki: sessions can `end_input`

    def end_input(self, session: Session, tail_frames: int | None = None) -> None:
        """`Session.end_input`: the session's source has ended (engine/translation.py's rules)."""
        if self._source_ends is None:
            raise OptionsError("this model does not translate, so a session's input cannot end; close the session.")
        self._source_ends.end_input(session, tail_frames)

    def slack_by_key(self) -> dict:
        """Slack items run and seconds spent per cost key so far (benchmarks: where the slack goes)."""
        return {key: tuple(tally) for key, tally in list(self._slack.stats.by_key.items())}

    @property
    def slack_costs(self):
        """The slack runner's cost model, for sources to seed their keys at start (warm-up)."""
        return self._slack.costs

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread (bounded), end every stream, free the backend. Idempotent.
        Blocks for at most `timeout` (default: config.shutdown_timeout_s); from async code
        prefer `await asyncio.to_thread(engine.shutdown)`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self.collections.give_back()
        joined = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.config.shutdown_timeout_s if timeout is None else timeout)
            joined = not self._thread.is_alive()
        for session in self._open_sessions():
            self._end_session(session, Terminal(Status.CANCELLED, "the engine is shutting down"),
                              EngineClosed("the engine is shutting down"))
        self._slack.stop_sources(Terminal(Status.CANCELLED, "the engine is shutting down"))
        if self._frame.paired is not None:  # its streams end on the engine thread, which has stopped
            self._frame.paired.stop(Terminal(Status.CANCELLED, "the engine is shutting down"))
        if not joined:
            # A step is stuck on the device; freeing its memory under it would be worse.
            self._healthy = False
            log.error("engine thread did not stop within the shutdown timeout; backend not freed")
            return
        if self._ticks.trace:  # its last ticks, once the thread that writes it has stopped
            self._ticks.trace.close()
        try:
            if self._frame.paired is not None:
                self._frame.paired.close()
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
            try:
                self._kv.admit(row, request_id)  # KvFull (an EngineFull): memory cannot hold it
            except KvFull:
                self._slots.release(row, request_id)
                raise
            session = Session(self, request_id, row, options,
                              OutputStream(request_id, loop, self.config.output_events),
                              InputBuffer(self.config.input_frames), loop.create_future())
            self._sessions[request_id] = session
        self._output.register(request_id, session.events)
        self._scheduler.submit_admit(session)
        self.metrics.inc("sessions_opened")
        return session

    def fail_session(self, session: Session, reason: str) -> None:
        """End one session with Terminal(failed, reason), from any thread. Idempotent."""
        self._end_session(session, Terminal(Status.FAILED, reason), EngineClosed(reason))

    def close_session(self, session: Session) -> None:
        """End one session at its client's request: Terminal(cancelled). Idempotent."""
        self._end_session(session, Terminal(Status.CANCELLED, "closed by the client"))

    def _end_session(self, session: Session, terminal: Terminal,
                     ready_error: Exception | None = None) -> None:
        """End one session from any thread: terminal event, slot, routing. Idempotent."""
        if session.events.finish(terminal) and terminal.status is Status.FAILED:
            self.metrics.inc("sessions_failed")
        with self._lock:
            self._sessions.pop(session.request_id, None)
        self._output.unregister(session.request_id)
        if self._frame.paired is not None:  # queued before the slot can be reused
            self._frame.paired.disable(session.row, session.request_id)
        self._scheduler.submit_close(session)  # the engine thread drops the row at its next plan
        self._kv.end(session.row, session.request_id)  # before the slot: its next session is admitted afresh
        self._slots.release(session.row, session.request_id)
        _settle(session.ready, error=ready_error)

    def _open_sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def _find_session(self, request_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(request_id)

    # ---- the engine thread ----

    def run_ticks(self, n: int) -> None:
        """Manual clock: run `n` ticks now on the calling thread, then every pending
        prefill. For tests and benchmarks; refused while the engine thread runs."""
        if self._thread is not None:
            raise RuntimeError("run_ticks is for an engine that was not start()ed.")
        for _ in range(n):
            if not self._healthy or self._closed:
                return
            self._guarded(self._ticks.run, deadline=None)

    def serve_ticks(self, n: int) -> None:
        """Run `n` clocked ticks on the calling thread (tests drive a fake clock with it)."""
        if self._thread is not None:
            raise RuntimeError("serve_ticks is for an engine that was not start()ed.")
        self._serve(max_ticks=n)

    def _serve(self, max_ticks: int | None = None) -> None:
        # Sources measure their work on this thread before the first tick (slack.py rule 2), once:
        # serve_ticks may resume a clock already running, whose next boundary would not wait.
        if self._clock.next_boundary() is None:
            self._guarded(self._slack.prepare_sources)
        ticks = 0
        late = self._clock.late_ticks
        while (max_ticks is None or ticks < max_ticks) and self._healthy and \
                self._clock.wait(self._stop, idle=self._ticks.idle_slack):
            self.metrics.observe_start_lag(self._clock.start_lag)
            if self._clock.late_ticks > late:
                late = self._clock.late_ticks
                self._ticks.log_late_start()
            self._guarded(self._ticks.run, deadline=self._clock.next_boundary())
            self.metrics.set("late_ticks", self._clock.late_ticks)
            self.metrics.set("skipped_ticks", self._clock.skipped_ticks)
            ticks += 1

    def _guarded(self, fn, **kwargs) -> None:
        try:
            fn(**kwargs)
        except Exception as exc:  # any escape from the backend is fatal for the whole batch
            self._fatal(exc)

    def _prefill_failed(self, session: Session, exc: Exception) -> None:
        """One session's options or prompt failed: that session ends, nothing else does."""
        if isinstance(exc, SessionRejected):
            reason, error = str(exc), SessionRejected(str(exc))
        else:
            ref = uuid.uuid4().hex[:8]
            log.error("session %s: prompt failed (error %s)", session.request_id, ref, exc_info=exc)
            reason = f"the session could not be started (error {ref}, see the server log)"
            error = EngineClosed(reason)
        self._end_session(session, Terminal(Status.FAILED, reason), error)

    def _fatal(self, exc: BaseException) -> None:
        log.error("fatal engine error; failing every session", exc_info=exc)
        self.fatal_error = f"{type(exc).__name__}: {exc}"
        self._healthy = False
        reason = "engine failure (see the server log)"
        for session in self._open_sessions():
            self.fail_session(session, reason)
        self._slack.stop_sources(Terminal(Status.FAILED, reason))
        self._stop.set()
        if self.on_fatal is not None:
            try:
                self.on_fatal(exc)
            except Exception:  # the engine is already down; the hook must not hide that
                log.exception("on_fatal hook failed")


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
