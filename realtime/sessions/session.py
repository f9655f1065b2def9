"""The session manager: admission through the engine's slots, and per-connection state.

One `EdgeSession` per connection, whatever the protocol and transport (a WebSocket, or a WebRTC
call: calls/transport.py). It owns the engine session, the connection's Opus codec (for `/api/chat`),
the connection's counters, and the single-writer rule for the transport (`send_*` take one lock,
so the frame sender and the receive loop's replies never interleave bytes of two messages).

Cleanup within one tick: `EdgeSession.close()` is idempotent and is called from the
`finally` of every handler, so a disconnect (clean or not) closes the engine session
immediately; the engine frees the slot at once and drops the row at its next plan.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine

from starlette.websockets import WebSocket, WebSocketDisconnect

from parley.engine import (
    TICK_SECONDS, Engine, EngineClosed, EngineFull, FrameOut, OptionsError, Session, SessionOptions,
    SessionRejected, Status, Terminal,
)

from .capacity import Admission, Reservation
from ..http.metrics import EdgeMetrics
from .limits import EdgeLimits, LagMeter, RateLimiter
from ..live.policy import DelegateBackend, DelegationPolicy
from ..media.opus import CodecRunner, CodecStream
from ..server.served_models import ServedModels
from ..calls.transport import SEND_BACKLOG_EXTENSION, IceServer, Transport, WebSocketTransport  # noqa: F401 (re-export)

log = logging.getLogger("parley.sessions")

# WebSocket close codes (RFC 6455 and the IANA registry).
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_INVALID_PAYLOAD = 1007
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN_LATER = 1013
MAX_CLOSE_REASON_BYTES = 123  # a close frame's reason is at most 123 bytes of UTF-8


def close_reason(text: str) -> str:
    """Trim a reason to what a close frame can carry, without splitting a UTF-8 character."""
    data = text.encode()[:MAX_CLOSE_REASON_BYTES]
    return data.decode(errors="ignore")


@dataclass(frozen=True)
class ServerDefaults:
    """What `parley serve` was started with; a client's choices override them per session."""

    options: SessionOptions = field(default_factory=SessionOptions)
    model_name: str = "parley"  # reported to OpenAI clients as the session's model
    api_key: str | tuple[str, ...] | None = None  # when set, every door but the page and health needs one
    protect_metrics: bool = False  # /metrics needs the key too
    allowed_origins: tuple[str, ...] | None = None  # browser Origins allowed; None: same origin; ("*",): any
    limits: EdgeLimits = field(default_factory=EdgeLimits)  # per-connection limits (sessions/limits.py)
    # Whether the model takes a persona / voice prompt (PersonaPlex). Moshi does not: a client's
    # persona or voice is then refused, never dropped.
    prompts: bool = True
    live_delegation: DelegationPolicy = DelegationPolicy()  # GPT-Live: when a session delegates (live/policy.py)
    live_delegate: DelegateBackend | None = None  # GPT-Live: the Responses delegation backend (--delegate-url)
    ice_servers: tuple[IceServer, ...] = ()  # WebRTC calls' STUN/TURN servers (--ice-servers); none: host candidates

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted keys (several: rotation); empty when the server is open (server/security.py)."""
        if self.api_key is None:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)

    def client_options(self, options: SessionOptions) -> SessionOptions:
        """What the engine is asked for, given what a client chose; OptionsError for what this
        model cannot take."""
        if not self.prompts and options.voice is not None:
            raise OptionsError(f"voice {options.voice!r} is not available: this model has one voice and takes "
                               "no voice prompt.")
        if not self.prompts and options.persona:
            raise OptionsError("this model takes no persona (text prompt); leave it empty.")
        return options


class SessionManager:
    """Admits connections through the engine and keeps the edge's books."""

    def __init__(self, engine: Engine, defaults: ServerDefaults, codec: CodecRunner,
                 metrics: EdgeMetrics, admission: Admission | None = None,
                 models: ServedModels | None = None) -> None:
        self.engine = engine
        self.defaults = defaults
        # What `model` may name, each modality's served names (server/served_models.py): the sessions'
        # settings read the STT model's (audio.input.transcription.model) from here, on every door.
        self.models = models or ServedModels()
        self.codec = codec
        self.metrics = metrics
        self.admission = admission or Admission(engine, metrics.registry, refusals=metrics.refusals)
        self._live: set[EdgeSession] = set()
        self._ids = itertools.count(1)

    @property
    def live_count(self) -> int:
        return len(self._live)

    def attach(self, connection: WebSocket | Transport, protocol: str,
               reservation: Reservation | None = None) -> "EdgeSession":
        """Per-connection state for a WebSocket or another transport (no engine session yet),
        holding the slot `reservation` made before the upgrade was accepted (or the call answered)."""
        transport = WebSocketTransport(connection) if isinstance(connection, WebSocket) else connection
        edge = EdgeSession(self, transport, protocol, next(self._ids), reservation)
        self._live.add(edge)
        self.metrics.connections.labels(protocol).inc()
        self.metrics.live_sessions.labels(protocol).inc()
        return edge

    def detach(self, edge: "EdgeSession") -> None:
        """Forget a closed connection (its `close()` calls this). Idempotent."""
        if edge in self._live:
            self._live.discard(edge)
            self.metrics.live_sessions.labels(edge.protocol).dec()

    async def shutdown(self, reason: str = "the server is shutting down") -> None:
        """Close every connection: its protocol's notice, then close 1001 (going away); the
        engine ends their streams itself."""
        for edge in list(self._live):
            await edge.going_away(reason)
            edge.close()


class EdgeSession:
    """One connection: its engine session (replaceable, for re-prefill), codec and counters."""

    def __init__(self, manager: SessionManager, transport: Transport, protocol: str, number: int,
                 reservation: Reservation | None = None) -> None:
        self.manager = manager
        self.transport = transport
        self.protocol = protocol
        self.number = number  # for logs only; never a metrics label
        self.engine_session: Session | None = None
        self.codec: CodecStream | None = None  # /api/chat: this connection's Ogg streams
        self.reservation = reservation  # the slot held since before the upgrade was accepted
        # The protocol's "server going away" message, sent before close 1001 (drain, shutdown).
        self.notice: Callable[[str], Awaitable[None]] | None = None
        self._send_lock = asyncio.Lock()
        self._reopen_lock = asyncio.Lock()
        self._closed = False
        limits = manager.defaults.limits
        self._rate = RateLimiter(limits)
        self.lag = LagMeter(limits.max_lag_s, TICK_SECONDS, lambda: transport.backlog() or 0)
        # The per-message counters' children, looked up once (labels() costs ~10 us a call, per frame).
        self._bytes_in = manager.metrics.bytes_in.labels(protocol)
        self._bytes_out = manager.metrics.bytes_out.labels(protocol)
        self._frames_out = manager.metrics.frames_out.labels(protocol)

    @property
    def websocket(self) -> WebSocket:
        """The connection's WebSocket (`/api/chat` reads its query and binary messages itself)."""
        assert isinstance(self.transport, WebSocketTransport), "not a WebSocket connection"
        return self.transport.websocket

    # ---- admission ----

    async def open_engine_session(self, options: SessionOptions) -> Session:
        """Admit through the engine and wait for the prefill. Raises EngineFull (no slot),
        SessionRejected / OptionsError (bad options) or EngineClosed (engine down)."""
        options = self.manager.defaults.client_options(options)
        try:
            if self.reservation is not None:
                self.reservation.opening()  # the engine takes the slot synchronously inside open()
            session = await self.manager.engine.open(options)
        except EngineFull:
            self.manager.metrics.refused.labels(self.protocol).inc()
            raise
        finally:
            if self.reservation is not None:
                self.reservation.release()
        if self._closed:  # the client left while we prefilled
            session.close()
            raise EngineClosed("the connection closed during prefill")
        self.engine_session = session
        return session

    async def reopen(self, options: SessionOptions) -> Session:
        """Re-prefill: hand this connection's slot to a new engine session with `options`.

        The old session is closed and the new one admitted with no await in between, so on
        this event loop no other connection can take the freed slot. If the model rejects
        the new options (SessionRejected), the previous options are restored the same way
        and the error is re-raised; EngineFull / EngineClosed mean the slot was lost.
        """
        async with self._reopen_lock:
            old = self.engine_session
            assert old is not None, "reopen needs an open session"
            engine = self.manager.engine
            options = self.manager.defaults.client_options(options)
            old.close()
            self.engine_session = engine.open_nowait(options)
            try:
                await self.engine_session.ready
            except SessionRejected:
                self.engine_session = engine.open_nowait(old.options)
                await self.engine_session.ready
                raise
            return self.engine_session

    async def wait_reopen(self) -> None:
        """Return once no re-prefill is in flight (the send loop calls this when a stream
        ends, to tell a replaced session from a finished one)."""
        async with self._reopen_lock:
            return

    async def follow_frames(self, on_frame: Callable[[FrameOut], Awaitable[None]]) -> Terminal | None:
        """Hand every output frame of this connection's engine session to `on_frame` (its handling
        time observed), following the session a re-prefill hands the slot to; returns how the
        last one ended (None: its stream ended without a terminal)."""
        while True:
            session = self.engine_session
            assert session is not None
            terminal: Terminal | None = None
            async for event in session.events:
                if isinstance(event, Terminal):
                    terminal = event
                    break
                start = now()
                await on_frame(event)
                self.observe_frame_delay(now() - start)
            await self.wait_reopen()
            if session is self.engine_session:
                return terminal

    async def follow_transcript(self, on_partial: Callable[[Any], Awaitable[bool]],
                                on_failed: Callable[[str], Awaitable[None]]) -> None:
        """Follow what the paired STT hears on this connection's engine session (SttPartial to
        `on_partial`, which says whether it sent something: its delay is observed), and after a
        re-prefill on the new session's; a failed transcript's reason goes to `on_failed`."""
        while True:
            session = self.engine_session
            if session is None or session.closed:
                return
            try:
                stream = self.manager.engine.enable_transcription(session)
            except OptionsError:
                return
            async for event in stream:
                if isinstance(event, Terminal):
                    if event.status is Status.FAILED:
                        await on_failed(event.reason)
                    break
                if await on_partial(event):
                    self.observe_transcript_sent("paired", event.input_at)
            await asyncio.sleep(0.05)
            if self.engine_session is session:
                return

    # ---- the socket (single writer) ----

    async def send_bytes(self, data: bytes) -> None:
        async with self._send_lock:
            await self.transport.send_bytes(data)
        self._bytes_out.inc(len(data))

    async def send_text(self, data: str) -> None:
        async with self._send_lock:
            await self.transport.send_text(data)
        self._bytes_out.inc(len(data))

    def count_in(self, n: int) -> None:
        self._bytes_in.inc(n)

    async def admit_message(self, n_bytes: int) -> bool:
        """Count one received message against the connection's rate limits. False: it was over,
        and the socket is closed (1008). Yields once per message, so a flooding connection
        never holds the event loop for more than one message at a time."""
        self.count_in(n_bytes)
        why = self._rate.admit(n_bytes)
        if why is not None:
            self.manager.metrics.rate_limited.labels(self.protocol).inc()
            await self.refuse(CLOSE_POLICY, "rate_limit", f"rate limit: {why}")
            return False
        await asyncio.sleep(0)
        return True

    def drop_if_lagging(self, produced_at: float) -> bool:
        """True when this frame (FrameOut.produced_at) would reach the client more than the lag
        limit late: the caller drops its audio (the oldest unsent), counted, rather than queue
        it behind stale audio."""
        if not self.lag.should_drop(produced_at):
            return False
        self.manager.metrics.lag_dropped.labels(self.protocol).inc()
        return True

    def play(self, pcm) -> None:
        """A WebRTC call's output audio: onto its track, whose queue is bounded by the lag limit
        (the oldest audio dropped past it, counted as a slow WebSocket client's frames are)."""
        dropped = self.transport.media.play(pcm)
        if dropped:
            self.manager.metrics.lag_dropped.labels(self.protocol).inc(dropped)

    def observe_frame_delay(self, seconds: float) -> None:
        self.manager.metrics.frame_send_delay.observe(seconds)

    def observe_frame_sent(self, produced_at: float) -> None:
        """One output frame out (counted), and its end-to-end delay: from the end of the engine tick
        that produced it (FrameOut.produced_at, time.monotonic()) to its bytes having been written."""
        self._frames_out.inc()
        self.manager.metrics.frame_delay.observe(max(0.0, time.monotonic() - produced_at))

    def observe_transcript_sent(self, path: str, input_at: float | None) -> None:
        """Delay of one transcript delta just written: from the arrival of the input frame its
        STT step read (SttPartial.input_at, time.monotonic()). `path`: "paired" or "standalone"."""
        if input_at is not None:
            self.manager.metrics.transcript_delay.labels(path).observe(max(0.0, time.monotonic() - input_at))

    async def refuse(self, code: int, reason: str, message: str) -> None:
        """Close this connection for a refusal: logged and counted once (sessions/refusals.py), then
        `code` with `message` as the close reason. `reason`: a refusals.REASONS code."""
        self.manager.metrics.refusals.record(self.transport.scope, reason, message)
        await self.close_socket(code, message)

    async def close_socket(self, code: int, reason: str = "") -> None:
        """Close the transport if it is still open: a close frame, or a WebRTC hang-up (never raises)."""
        if not self.transport.open:
            return
        async with self._send_lock:
            await self.transport.close(code, close_reason(reason))

    async def going_away(self, reason: str) -> None:
        """The protocol's notice (if it has one and the socket is open), then close 1001."""
        if self.notice is not None and self.transport.open:
            try:
                await self.notice(reason)
            except Exception:  # the client left meanwhile: the close below is all that is left
                pass
        await self.close_socket(CLOSE_GOING_AWAY, reason)

    # ---- cleanup ----

    async def run_duplex(self, send: Coroutine[Any, Any, None], receive: Coroutine[Any, Any, None]) -> None:
        """Run the connection's two directions until either ends, then end the session:
        whichever side stopped first (client gone, engine stream over), the slot is back
        within this tick and the other side is cancelled."""
        tasks = (asyncio.create_task(send, name=f"{self.protocol}-send-{self.number}"),
                 asyncio.create_task(receive, name=f"{self.protocol}-recv-{self.number}"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            exc = None if task.cancelled() else task.exception()
            if isinstance(exc, (WebSocketDisconnect, OSError)):
                log.info("%s session %d: the client left mid-send", self.protocol, self.number)
            elif exc is not None:
                log.error("%s session %d failed", self.protocol, self.number, exc_info=exc)

    def close(self) -> None:
        """End the engine session and forget this connection. Idempotent, never blocks."""
        if self._closed:
            return
        self._closed = True
        if self.reservation is not None:
            self.reservation.release()
        if self.engine_session is not None:
            self.engine_session.close()
        if self.codec is not None:
            self.codec.close()
        self.manager.detach(self)

    @property
    def closed(self) -> bool:
        return self._closed


def now() -> float:
    return time.perf_counter()
