"""The JSON-event side of a connection on both OpenAI doors (`/v1/realtime`, GPT-Live's
`/v1/live/sessions`), over any Transport: events out (one JSON text message each), errors that
carry the client's `event_id`, and the receive loop that reads, parses and dispatches the
client's events one at a time (calls/event_reader.py). A bad event is an `error`; the session goes on.

Sidebands (calls/sideband.py) share the channel: every event sent also goes to `observer` (the
call's attached sidebands), and a sideband's events are dispatched by `handle` with the client's
own handlers, one event at a time with the client's (a lock), its errors to that sideband only.
An `error` about one connection's event goes to that connection alone; everything else to all.
"""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable, Mapping, Protocol

from starlette.websockets import WebSocketDisconnect

from ..sessions.session import EdgeSession
from .event_reader import Event, client_event_id, event_type, next_message, parse_client_event
from ..realtime_api.settings import ClientError

Handler = Callable[[Event], Awaitable[None]]
Observer = Callable[[Event, str], None]  # an event sent, and its JSON text (never blocks)


class ErrorEvent(Protocol):
    """A door's `error` event builder (openai_events.Events.error, live_events.error)."""

    def __call__(self, message: str, code: str, *, kind: str = ..., param: str | None = ...,
                 client_event_id: str | None = ...) -> Event: ...


class SessionLost(Exception):
    """The engine session could not be re-established (or the client closed it): the receive side ends."""


class EventChannel:
    """One connection's events: sent in order through its EdgeSession (the single writer), read
    and dispatched by `serve`."""

    def __init__(self, edge: EdgeSession, protocol: str, error_event: ErrorEvent) -> None:
        self.edge = edge
        self.protocol = protocol  # the metrics label
        self.error_event = error_event
        self.client_event_id: str | None = None  # of the event being handled: its errors echo it
        self.observer: Observer | None = None  # the call's sidebands (calls/sideband.py), once it has any
        self.handlers: Mapping[str, Handler] | None = None  # set by serve: what a sideband's events reach
        self.unknown: Callable[[str], ClientError] | None = None
        self._handling = asyncio.Lock()  # one event at a time, the client's or a sideband's
        self._errors_to: Callable[[Event], None] | None = None  # a sideband's, while its event is handled

    async def send(self, event: Event) -> int:
        """Send one event; returns its size (0 if the client has left)."""
        text = json.dumps(event, separators=(",", ":"))
        if self.observer is not None:
            self.observer(event, text)
        return await self._send_text(text)

    async def _send_text(self, text: str) -> int:
        try:
            await self.edge.outbox.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError):
            return 0  # the client left; the receive loop sees the disconnect and ends the session
        return len(text)

    async def send_all(self, events: list[Event]) -> int:
        """Send events in order; returns the bytes sent (0: none, or the client has left)."""
        sent = 0
        for event in events:
            sent += await self.send(event)
        return sent

    async def error(self, exc: ClientError) -> None:
        """The client's mistake, counted, as an `error` naming its event."""
        self.edge.counters.protocol_error()
        event = self.error_event(str(exc), exc.code, param=exc.param, client_event_id=self.client_event_id)
        if self._errors_to is not None:  # a sideband's event: its error is that sideband's alone
            self._errors_to(event)
        else:
            await self._send_text(json.dumps(event, separators=(",", ":")))

    async def server_error(self, message: str, code: str) -> None:
        """The server's side failed (a full server, a lost slot): an `error` of type server_error."""
        await self.send(self.error_event(message, code, kind="server_error"))

    async def read(self, data: str | bytes) -> Event | None:
        """One message as an event with a type (None: it was bad, and the client was told)."""
        event_id = None
        try:
            event = parse_client_event(data, self.edge.defaults.limits)
            event_id = client_event_id(event)
            event_type(event)
        except ClientError as exc:
            self.edge.counters.protocol_error()
            await self._send_text(json.dumps(self.error_event(str(exc), exc.code, param=exc.param,
                                                              client_event_id=event_id), separators=(",", ":")))
            return None
        if not self._handling.locked():  # (while a sideband's event is handled, handle sets it)
            self.client_event_id = event_id
        return event

    async def serve(self, handlers: Mapping[str, Handler], unknown: Callable[[str], ClientError]) -> None:
        """Read and dispatch the client's events until it leaves or the session is lost. `unknown`:
        the error for a type without a handler."""
        self.handlers, self.unknown = handlers, unknown
        while (data := await next_message(self.edge)) is not None:
            event = await self.read(data)
            if event is None:
                continue
            try:
                await self.handle(event)
            except SessionLost:
                return

    async def handle(self, event: Event, errors_to: Callable[[Event], None] | None = None) -> None:
        """Dispatch one event with the handlers `serve` took (`errors_to`: a sideband's, which takes
        the errors it causes). SessionLost: the session ended on it."""
        async with self._handling:
            self.client_event_id, self._errors_to = client_event_id(event), errors_to
            try:
                handler = self.handlers.get(event["type"])
                if handler is None:
                    raise self.unknown(event["type"])
                await handler(event)
            except ClientError as exc:
                await self.error(exc)
            finally:
                self._errors_to = None
