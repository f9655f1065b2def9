"""`/v1/realtime/translations`' server events, shaped as the openai SDK's
`openai.types.realtime.realtime_translation_*` models (and `RealtimeErrorEvent`) read them, with
no field those models lack (tests/test_server_translation.py parses every event sent).

Only shapes live here: plain dicts, each with a fresh `event_id`. `elapsed_ms` is the session's
audio clock: the end of the model frame the event came from, 80 ms per frame since
`session.created` (OpenAI's own frames are 200 ms; the field is alignment metadata either way).
"""

from __future__ import annotations

from typing import Any

from ..realtime_api.events import new_id

Event = dict[str, Any]

# The output audio's shape: base64 PCM16 mono at 24 kHz (the model's own rate).
OUTPUT_FORMAT = {"format": "pcm16", "sample_rate": 24_000, "channels": 1}


def event(kind: str, **fields: Any) -> Event:
    return {"type": kind, "event_id": new_id("event"), **fields}


def session_created(resource: Event) -> Event:
    return event("session.created", session=resource)


def session_updated(resource: Event) -> Event:
    return event("session.updated", session=resource)


def session_closed() -> Event:
    return event("session.closed")


def output_audio(b64: str, elapsed_ms: int) -> Event:
    return event("session.output_audio.delta", delta=b64, elapsed_ms=elapsed_ms, **OUTPUT_FORMAT)


def output_transcript(text: str, elapsed_ms: int) -> Event:
    """The model's own text stream: what it says in the output language."""
    return event("session.output_transcript.delta", delta=text, elapsed_ms=elapsed_ms)


def input_transcript(text: str, elapsed_ms: int) -> Event:
    """What the paired STT heard in the source, when `audio.input.transcription` asks for it."""
    return event("session.input_transcript.delta", delta=text, elapsed_ms=elapsed_ms)


def error(message: str, code: str, *, kind: str = "invalid_request_error", param: str | None = None,
          client_event_id: str | None = None) -> Event:
    """OpenAI's `error` event (RealtimeErrorEvent); `event_id` inside it is the client event that caused it."""
    return event("error", error={"type": kind, "code": code, "message": message, "param": param,
                                 "event_id": client_event_id})
