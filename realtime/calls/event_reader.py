"""The receive side of the JSON-event doors (`/v1/realtime`, GPT-Live's `/v1/live/sessions`, over
a WebSocket or a WebRTC call's `oai-events` data channel): one message at a time, counted against the connection's rate limits, then
parsed within the size and depth limits into an event with a `type`. Bad input is a ClientError
for that message only; the connection goes on.
"""

from __future__ import annotations

import json
from typing import Any

from ..sessions.limits import EdgeLimits, JSONLimitError, parse_json_event
from ..realtime_api.settings import ClientError
from ..sessions.session import EdgeSession

Event = dict[str, Any]


async def next_message(edge: EdgeSession) -> str | bytes | None:
    """The connection's next message (bytes for a binary one). None: the client left, or went over
    the rate limits (then the socket is closed, 1008)."""
    data = await edge.transport.receive()
    if data is None:
        return None
    if not await edge.outbox.admit_message(len(data)):
        return None
    return data


def parse_client_event(data: str | bytes, limits: EdgeLimits) -> Event:
    """One message -> a JSON object (ClientError: not UTF-8, not JSON, over a limit, not an object)."""
    if isinstance(data, bytes):
        try:
            data = data.decode()
        except UnicodeDecodeError:
            raise ClientError("binary messages must be UTF-8 JSON events", "invalid_json") from None
    try:
        event = parse_json_event(data, limits)
    except JSONLimitError as exc:
        raise ClientError(str(exc), exc.code) from None
    except json.JSONDecodeError as exc:
        raise ClientError(f"invalid JSON: {exc}", "invalid_json") from None
    if not isinstance(event, dict):
        raise ClientError("an event must be a JSON object", "invalid_json")
    return event


def client_event_id(event: Event) -> str | None:
    """The client's `event_id`, echoed on the errors and acknowledgements its event causes."""
    value = event.get("event_id")
    return value if isinstance(value, str) else None


def event_type(event: Event) -> str:
    kind = event.get("type")
    if not isinstance(kind, str):
        raise ClientError("the event has no 'type'", "missing_required_parameter", "type")
    return kind
