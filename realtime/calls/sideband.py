"""Server-side control of a live call: a sideband, a second WebSocket that joins a session a
call holds (GPT-Live's `/v1/live/sessions/{session_id}/attach`, Realtime's `/v1/realtime?call_id=`).

Rules it keeps:
- A call is found through `LiveCalls`, the one registry of live sessions by id: a call is in it
  from the moment its id is answered until its session ends. An id not in it (unknown, or
  ended), or an attach that does not carry the call's own key (the one its request carried, on
  a server with keys), is OpenAI's 404 before the upgrade: another key's holder learns nothing.
- Each call admits at most `max_sidebands` attached connections (`--max-sidebands`); past it, 429
  before the upgrade. A draining or unhealthy server refuses an attach as it refuses every upgrade.
- Fan-out: every server event the session sends reaches every sideband, in order, through a
  queue per sideband bounded at MAX_QUEUED_EVENTS; a sideband that falls that far behind is
  closed (1008) and the call never waits for it.
- Control: a sideband's events are limited (rate, size, depth) as the client's are, then
  dispatched by the call's own handlers, one at a time with the client's (EventChannel.handle);
  the errors they cause go to that sideband only. Events that carry audio are refused by name:
  audio stays with the call. Until the session has started, an event is refused (`session_not_started`).
- End: when the call ends, each sideband gets the door's last event (GPT-Live: `session.closed`,
  unless the session already sent one; Realtime has none) and then a normal close (1000).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping

from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..http.not_found import openai_error
from ..realtime_api.settings import ClientError
from ..server.security import choose_subprotocol, offered_key
from ..server.state import app_state
from ..sessions.capacity import deny_upgrade
from ..sessions.limits import EdgeLimits, RateLimiter
from ..sessions.session import CLOSE_NORMAL, CLOSE_POLICY, close_reason
from .event_channel import EventChannel, SessionLost
from .event_reader import Event, client_event_id, event_type, parse_client_event
from .call_relay import CallRelay, relay

log = logging.getLogger("parley.sideband")

MAX_QUEUED_EVENTS = 1024  # server events waiting for one sideband; past it the sideband is closed


@dataclass(eq=False)
class AttachedCall:
    """What a sideband reaches: a live call's event channel and how its door ends a sideband."""

    id: str  # the session id (GPT-Live) or call id (Realtime) its client was answered
    protocol: str  # its door's metrics label (its channel's connection counts under it)
    channel: EventChannel
    key: str | None  # the key the call's request carried (None: none)
    refused: Mapping[str, str]  # client event types a sideband may not send -> why
    goodbye: Callable[[], Event | None]  # the last event a sideband gets when the call ends
    sidebands: set["Sideband"] = field(default_factory=set)
    closed_sent: bool = False  # the session sent its own session.closed

    def observe(self, event: Event, text: str) -> None:
        """EventChannel's observer: one server event, to every sideband."""
        if event.get("type") == "session.closed":
            self.closed_sent = True
        for sideband in list(self.sidebands):
            sideband.post_text(text)

    def end(self) -> None:
        """The call ended: each sideband gets the door's last event, then a normal close."""
        last = None if self.closed_sent else self.goodbye()
        for sideband in list(self.sidebands):
            if last is not None:
                sideband.post(last)
            sideband.finish(CLOSE_NORMAL, "the call ended")
        self.sidebands.clear()
        self.channel.observer = None


class LiveCalls:
    """The registry of live sessions a sideband may attach to, by id.

    One per app: with the edge in worker processes each worker holds its own calls, and an attach
    for a call another worker holds is relayed there (calls/call_relay.py), where fan-out and
    control stay. `find` is the only lookup the attach doors make.
    """

    def __init__(self) -> None:
        self._calls: dict[str, AttachedCall] = {}
        self.relay: CallRelay | None = None  # an edge worker's: the other workers' calls

    def hold(self, call: AttachedCall) -> None:
        self._calls[call.id] = call
        call.channel.observer = call.observe

    def release(self, call: AttachedCall) -> None:
        """The call's session ended: forget it and end its sidebands. Idempotent."""
        if self._calls.get(call.id) is call:
            del self._calls[call.id]
        call.end()

    def find(self, call_id: str) -> AttachedCall | None:
        return self._calls.get(call_id)

    def __len__(self) -> int:
        return len(self._calls)


class Sideband:
    """One attached WebSocket: the call's events out (queued), control events in."""

    def __init__(self, websocket: WebSocket, call: AttachedCall, limits: EdgeLimits) -> None:
        self.websocket = websocket
        self.call = call
        self.limits = limits
        self._rate = RateLimiter(limits)
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._close: tuple[int, str] | None = None  # set once the sideband is to close

    def post(self, event: Event) -> None:
        self.post_text(json.dumps(event, separators=(",", ":")))

    def post_text(self, text: str) -> None:
        """Queue one event; never blocks (a sideband too far behind is closed instead)."""
        if self._close is not None:
            return
        if self._queue.qsize() >= MAX_QUEUED_EVENTS:
            log.info("sideband of %s: %d events behind, closed", self.call.id, MAX_QUEUED_EVENTS)
            self.finish(CLOSE_POLICY, "the sideband read the session's events too slowly")
            return
        self._queue.put_nowait(text)

    def finish(self, code: int, reason: str) -> None:
        """Close after what is queued has been sent."""
        if self._close is None:
            self._close = (code, reason)
            self._queue.put_nowait(None)

    async def run(self) -> None:
        """Until the sideband leaves, or the call ends (what is queued is sent, then close)."""
        writer = asyncio.create_task(self._write(), name=f"sideband-out-{self.call.id}")
        reader = asyncio.create_task(self._read(), name=f"sideband-in-{self.call.id}")
        try:
            await asyncio.wait((writer, reader), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.call.sidebands.discard(self)
            reader.cancel()
            if not writer.done():  # the sideband left, or was over a limit: nothing more to send
                self.finish(*(self._close or (CLOSE_NORMAL, "")))
                writer.cancel()
            await asyncio.gather(writer, reader, return_exceptions=True)
            await self._close_socket()

    async def _write(self) -> None:
        while (text := await self._queue.get()) is not None:
            try:
                await self.websocket.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError):
                return

    async def _close_socket(self) -> None:
        code, reason = self._close or (CLOSE_NORMAL, "")
        try:
            await self.websocket.close(code, close_reason(reason))
        except Exception:  # already gone: nothing to tell it
            pass

    async def _read(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text")
            data = data if data is not None else (message.get("bytes") or b"")
            why = self._rate.admit(len(data))
            if why is not None:  # counted and logged as every door's flood is, on the call's counters
                counters = self.call.channel.edge.counters
                counters.rate_limited()
                counters.refusal(self.websocket.scope, "rate_limit", f"a sideband's rate limit: {why}")
                self.finish(CLOSE_POLICY, f"rate limit: {why}")
                return
            try:
                await self._control(data)
            except SessionLost:  # e.g. its session.close: the call's end closes this sideband
                return
            await asyncio.sleep(0)  # a flooding sideband never holds the loop for more than one message

    async def _control(self, data: str | bytes) -> None:
        """One control event: refused here, or handled by the call as its client's would be."""
        channel, event = self.call.channel, None
        try:
            event = parse_client_event(data, self.limits)
            kind = event_type(event)
            if kind in self.call.refused:
                raise ClientError(f"{kind:.60} cannot come from a sideband: {self.call.refused[kind]}",
                                  "invalid_value", "type")
            if channel.handlers is None:
                raise ClientError("the session has not started yet: wait for its first event",
                                  "session_not_started", "type")
        except ClientError as exc:
            channel.edge.counters.protocol_error()
            self.post(channel.error_event(str(exc), exc.code, param=exc.param,
                                          client_event_id=client_event_id(event) if event else None))
            return
        await channel.handle(event, errors_to=self.post)


# ---- the attach doors' shared part ----

def refuse(status: int, message: str, code: str, param: str | None = None) -> Response:
    return openai_error(status, message, param=param, code=code)


def find_for(websocket: WebSocket, registry: LiveCalls, call_id: str, param: str) -> AttachedCall | Response:
    """The call `call_id` names, if this connection may attach to it; else the HTTP refusal."""
    call = registry.find(call_id)
    defaults = app_state(websocket).sessions.defaults
    keys = defaults.api_keys
    if call is not None and keys and not hmac.compare_digest((offered_key(websocket.scope) or "").encode(),
                                                             (call.key or "").encode()):
        call = None  # another key's call: as unknown as one that never was
    if call is None:
        return refuse(404, f"no live session {call_id!r:.60} on this server (unknown, ended, or another key's)",
                      "session_not_found", param)
    limit = defaults.limits.max_sidebands
    if len(call.sidebands) >= limit:
        return refuse(429, f"session {call_id:.60} already has {limit} attached connections (--max-sidebands)",
                      "sideband_limit_reached")
    return call


async def attach(websocket: WebSocket, call_id: str, param: str, subprotocol: str | None = None) -> None:
    """Answer an attach upgrade: refused before it (404, 429, 503: draining), or joined to the call
    until either ends. `param`: how the door's URL names the id (its 404 names it)."""
    state = app_state(websocket)
    manager = state.sessions
    reservation = await manager.admission.reserve_or_deny(websocket, needs_slot=False)  # draining, unhealthy
    if reservation is None:
        return
    reservation.release()  # a sideband takes no slot
    assert state.live_calls is not None  # create_app always builds the registry
    found = find_for(websocket, state.live_calls, call_id, param)
    relay_to = state.live_calls.relay
    if isinstance(found, Response) and found.status_code == 404 and relay_to is not None \
            and not relay_to.relayed(websocket):  # another edge worker may hold the call
        opened = await relay_to.open(websocket)
        if isinstance(opened, Response):
            found = opened
        elif opened is not None:
            log.info("sideband for %s relayed to the edge worker holding the call", call_id)
            await relay(websocket, opened)
            return
    if isinstance(found, Response):
        reason = "session_not_found" if found.status_code == 404 else "sidebands"
        state.refusals.record(websocket.scope, reason, json.loads(found.body)["error"]["message"])
        await deny_upgrade(websocket, found, "sideband refused")
        return
    sideband = Sideband(websocket, found, manager.defaults.limits)
    found.sidebands.add(sideband)  # no await since find_for: the bound holds on the event loop
    try:
        await websocket.accept(subprotocol=choose_subprotocol(websocket.scope.get("subprotocols", []), subprotocol))
    except (WebSocketDisconnect, OSError):
        found.sidebands.discard(sideband)
        return
    log.info("sideband attached to %s (%d attached)", call_id, len(found.sidebands))
    await sideband.run()
