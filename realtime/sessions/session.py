"""The session manager (admission, the live connections) and each connection's parts.

Rules this module keeps:
1. One `EdgeSession` per connection, whatever the protocol and transport (a WebSocket, or a WebRTC
   call: calls/transport.py). It is made of parts a door talks to directly, never through another:
   `slot` (the engine session: sessions/slot.py), `outbox` (the single-writer send, lag, rate
   limits: sessions/outbox.py) and `counters` (its metrics: sessions/counters.py); and it carries
   the server's `defaults` and served `models`, and the `/api/chat` Opus `codec`.
2. Cleanup within one tick: `EdgeSession.close()` is idempotent and is called from the `finally`
   of every handler, so a disconnect (clean or not) closes the engine session immediately; the
   engine frees the slot at once and drops the row at its next plan.
3. The manager reaches the engine through the engine client only (realtime/engine_client.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..engine_client import DuplexSession, EngineClient, OptionsError, SessionOptions

from .capacity import Admission, Reservation
from ..http.metrics import EdgeMetrics
from .counters import Counters
from .limits import EdgeLimits
from .outbox import (  # noqa: F401 (the close codes: re-exported for the doors)
    CLOSE_GOING_AWAY, CLOSE_INTERNAL, CLOSE_INVALID_PAYLOAD, CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG,
    CLOSE_TRY_AGAIN_LATER, CLOSE_UNSUPPORTED_DATA, MAX_CLOSE_REASON_BYTES, Outbox, close_reason,
)
from .slot import Slot
from ..live.policy import DelegateBackend, DelegationPolicy
from ..media.opus import CodecRunner, CodecStream
from ..server.security import choose_subprotocol
from ..server.served_models import ServedModels
from ..calls.transport import SEND_BACKLOG_EXTENSION, IceServer, Transport, WebSocketTransport  # noqa: F401 (re-export)

log = logging.getLogger("parley.sessions")


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

    def __init__(self, client: EngineClient, defaults: ServerDefaults, codec: CodecRunner,
                 metrics: EdgeMetrics, admission: Admission | None = None,
                 models: ServedModels | None = None) -> None:
        self.client = client
        self.defaults = defaults
        # What `model` may name, each modality's served names (server/served_models.py): the sessions'
        # settings read the STT model's (audio.input.transcription.model) from here, on every door.
        self.models = models or ServedModels()
        self.codec = codec
        self.metrics = metrics
        self.admission = admission or Admission(client, metrics.registry, refusals=metrics.refusals)
        self._live: set[EdgeSession] = set()
        self._ids = itertools.count(1)

    @property
    def engine(self):
        """The in-process engine behind the client: for the server that built it and for tests.
        No door reads it; doors go through `client`."""
        return self.client.engine  # type: ignore[attr-defined]

    @property
    def live_count(self) -> int:
        return len(self._live)

    def counters(self, protocol: str) -> Counters:
        """The counters of `protocol`'s connections, for a refusal made before a connection exists."""
        return Counters(self.metrics, protocol)

    def attach(self, connection: WebSocket | Transport, protocol: str,
               reservation: Reservation | None = None) -> "EdgeSession":
        """Per-connection state for a WebSocket or another transport (no engine session yet),
        holding the slot `reservation` made before the upgrade was accepted (or the call answered)."""
        transport = WebSocketTransport(connection) if isinstance(connection, WebSocket) else connection
        counters = Counters(self.metrics, protocol)
        slot = Slot(self.client, self.defaults, counters, reservation)
        outbox = Outbox(transport, self.defaults.limits, counters)
        edge = EdgeSession(transport, protocol, next(self._ids), slot, outbox, counters, self.defaults, self.models,
                           self.detach)
        self._live.add(edge)
        self.metrics.connections.labels(protocol).inc()
        self.metrics.live_sessions.labels(protocol).inc()
        return edge

    async def serve_websocket(self, websocket: WebSocket, protocol: str, reservation: Reservation,
                              run: Callable[["EdgeSession"], Awaitable[None]]) -> None:
        """Accept `websocket`'s upgrade and run `protocol`'s
        connection on it; a client that leaves is logged, and the connection is closed either way."""
        edge = self.attach(websocket, protocol, reservation)
        try:
            await websocket.accept(subprotocol=choose_subprotocol(websocket.scope.get("subprotocols", [])))
            await run(edge)
        except (WebSocketDisconnect, OSError):
            log.info("%s session %d: the client left", protocol, edge.number)
        finally:
            edge.close()

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
    """One connection: its parts (rule 1), its codec and its protocol's going-away notice."""

    def __init__(self, transport: Transport, protocol: str, number: int, slot: Slot, outbox: Outbox,
                 counters: Counters, defaults: ServerDefaults, models: ServedModels,
                 on_close: Callable[["EdgeSession"], None]) -> None:
        self.transport = transport
        self.protocol = protocol
        self.number = number  # for logs only; never a metrics label
        self.slot, self.outbox, self.counters = slot, outbox, counters
        self.defaults = defaults  # what `parley serve` was started with
        self.models = models  # each modality's served names (server/served_models.py)
        self.codec: CodecStream | None = None  # /api/chat: this connection's Ogg streams
        # The protocol's "server going away" message, sent before close 1001 (drain, shutdown).
        self.notice: Callable[[str], Awaitable[None]] | None = None
        self._on_close = on_close
        self._closed = False

    @property
    def websocket(self) -> WebSocket:
        """The connection's WebSocket (`/api/chat` reads its query and binary messages itself)."""
        assert isinstance(self.transport, WebSocketTransport), "not a WebSocket connection"
        return self.transport.websocket

    @property
    def engine_session(self) -> DuplexSession | None:
        """The duplex session holding this connection's slot (`slot.session`)."""
        return self.slot.session

    async def going_away(self, reason: str) -> None:
        """The protocol's notice (if it has one and the socket is open), then close 1001."""
        await self.outbox.going_away(reason, self.notice)

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
        """End the engine session and forget this connection (rule 2). Idempotent, never blocks."""
        if self._closed:
            return
        self._closed = True
        self.slot.close()
        if self.codec is not None:
            self.codec.close()
        self._on_close(self)

    @property
    def closed(self) -> bool:
        return self._closed
