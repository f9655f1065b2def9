"""The JSON-event side of a connection on both OpenAI doors (`/v1/realtime`, GPT-Live's
`/v1/live/sessions`), over any Transport: events out (one JSON text message each), errors that
carry the client's `event_id`, and the receive loop that reads, parses and dispatches the
client's events one at a time (calls/event_reader.py). A bad event is an `error`; the session goes on.
"""

from __future__ import annotations

import json
from typing import Awaitable, Callable, Mapping, Protocol

from starlette.websockets import WebSocketDisconnect

from ..sessions.session import EdgeSession
from .event_reader import Event, client_event_id, event_type, next_message, parse_client_event
from ..realtime_api.settings import ClientError

Handler = Callable[[Event], Awaitable[None]]


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

    async def send(self, event: Event) -> int:
        """Send one event; returns its size (0 if the client has left)."""
        text = json.dumps(event, separators=(",", ":"))
        try:
            await self.edge.send_text(text)
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
        self.edge.manager.metrics.protocol_errors.labels(self.protocol).inc()
        await self.send(self.error_event(str(exc), exc.code, param=exc.param, client_event_id=self.client_event_id))

    async def server_error(self, message: str, code: str) -> None:
        """The server's side failed (a full server, a lost slot): an `error` of type server_error."""
        await self.send(self.error_event(message, code, kind="server_error"))

    async def read(self, data: str | bytes) -> Event | None:
        """One message as an event with a type (None: it was bad, and the client was told)."""
        self.client_event_id = None
        try:
            event = parse_client_event(data, self.edge.manager.defaults.limits)
            self.client_event_id = client_event_id(event)
            event_type(event)
            return event
        except ClientError as exc:
            await self.error(exc)
            return None

    async def serve(self, handlers: Mapping[str, Handler], unknown: Callable[[str], ClientError]) -> None:
        """Read and dispatch the client's events until it leaves or the session is lost. `unknown`:
        the error for a type without a handler."""
        while (data := await next_message(self.edge)) is not None:
            event = await self.read(data)
            if event is None:
                continue
            try:
                handler = handlers.get(event["type"])
                if handler is None:
                    raise unknown(event["type"])
                await handler(event)
            except ClientError as exc:
                await self.error(exc)
            except SessionLost:
                return
