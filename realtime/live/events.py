"""GPT-Live server events, shaped as the openai SDK's `openai.types.live` models read them.

Every event has a fresh `event_id`; one caused by a client event also carries that event's
`event_id` as `client_event_id` (errors inside `error` too). Times (`start_ms`, `end_ms`,
`offset_ms`) are on the session's audio clock: 80 ms per model frame since session.started.
"""

from __future__ import annotations

from typing import Any

from ..realtime_api.events import new_id

Event = dict[str, Any]


def event(kind: str, client_event_id: str | None = None, **fields: Any) -> Event:
    out = {"type": kind, "event_id": new_id("event"), **fields}
    if client_event_id is not None:
        out["client_event_id"] = client_event_id
    return out


def session_event(kind: str, resource: Event, client_event_id: str | None = None) -> Event:
    """session.started / session.updated."""
    return event(kind, client_event_id, session=resource)


def session_closed(resource: Event, reason: str, seconds: float, client_event_id: str | None = None) -> Event:
    return event("session.closed", client_event_id, reason=reason, session=resource, usage={"seconds": seconds})


def usage_updated(seconds: float) -> Event:
    return event("session.usage.updated", usage={"seconds": seconds})


def output_audio(b64: str) -> Event:
    """No start_ms / end_ms: the primary WebSocket's audio is in delivery order."""
    return {"type": "session.output_audio.delta", "delta": b64}


def transcript(which: str, delta: str, start_ms: int, end_ms: int) -> Event:
    """session.output_transcript.delta / session.input_transcript.delta (`which`: output, input)."""
    return event(f"session.{which}_transcript.delta", delta=delta, start_ms=start_ms, end_ms=end_ms)


def delegation_created(delegation_id: str, offset_ms: int, response_id: str | None = None) -> Event:
    """A client delegation, or (with `response_id`) one Parley's Responses backend works on."""
    delegation = {"id": delegation_id, "type": "delegation", "target": "responses" if response_id else "client"}
    if response_id:
        delegation["response_id"] = response_id
    return event("session.delegation.created", offset_ms=offset_ms, delegation=delegation)


def appended(channel: str, start_ms: int, end_ms: int, client_event_id: str | None) -> Event:
    """session.commentary.appended / .thinking.appended / .instructions.appended: where it was placed."""
    return event(f"session.{channel}.appended", client_event_id, start_ms=start_ms, end_ms=end_ms)


def error(message: str, code: str, param: str | None = None, client_event_id: str | None = None,
          kind: str = "invalid_request_error") -> Event:
    return event("error", client_event_id, error={"type": kind, "code": code, "message": message, "param": param,
                                                  "client_event_id": client_event_id})
