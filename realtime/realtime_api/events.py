"""OpenAI Realtime API event shapes, in both dialects (GA and beta).

Only shapes live here: plain dicts built from typed arguments, each with a fresh
`event_id`. What to send when is `realtime_api/connection.py`'s business. The shapes are checked
in tests against the `openai` SDK's pydantic models (GA and beta), `openai-agents`' GA
server-event adapter and pipecat's parser.

Dialect differences handled here (see ../shared/reference/protocols.md):
- session object: GA `{type:"realtime", audio:{input, output}, output_modalities}`,
  beta `{modalities, voice, input_audio_format:"pcm16", turn_detection, ...}`;
- an item entering the conversation: GA `conversation.item.added` then `.done`,
  beta `conversation.item.created`;
- delta names: GA `response.output_audio.delta`, beta `response.audio.delta` (and so on);
- assistant content part type: GA item content `output_audio` / `output_text`, beta `audio` / `text`.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import Any

from ..media.audio_formats import AudioFormat

Event = dict[str, Any]


class Dialect(str, enum.Enum):
    GA = "ga"
    BETA = "beta"


def new_id(prefix: str) -> str:
    """OpenAI-style ids: `event_`, `sess_`, `item_`, `resp_`, `conv_` + 22 random characters."""
    return f"{prefix}_{secrets.token_urlsafe(16)[:22]}"


# ---- session -------------------------------------------------------------------------------


@dataclass
class TurnDetection:
    """The client's turn-detection settings. Parley's model decides for itself when to speak;
    these only drive the `input_audio_buffer.speech_*` events (an energy detector)."""

    type: str = "server_vad"  # or semantic_vad: the same detector, its pause length from eagerness
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True  # False: the model's speech is sent only inside response.create's responses
    interrupt_response: bool = True  # the user's speech cancels the open response
    eagerness: str = "auto"  # semantic_vad only

    def to_dict(self) -> Event:
        common = {"type": self.type, "create_response": self.create_response,
                  "interrupt_response": self.interrupt_response}
        if self.type == "semantic_vad":
            return {**common, "eagerness": self.eagerness}
        return {**common, "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "idle_timeout_ms": None}


@dataclass
class SessionConfig:
    """What a `/v1/realtime` session is set to; emitted in the connection's dialect."""

    id: str
    model: str
    instructions: str = ""  # the persona
    voice: str | None = None  # the voice prompt name
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    temperature: float = 0.8  # the audio sampling temperature
    input_format: AudioFormat = AudioFormat()
    output_format: AudioFormat = AudioFormat()
    max_output_tokens: int | None = None  # per response; None is "inf"
    tracing: Any = None  # None, "auto" or {workflow_name, group_id, metadata}: logged with the session
    transcription: Event | None = None  # input audio transcription settings, as the client gave them
    type: str = "realtime"  # or "transcription": a transcription-only session (no responses)

    @property
    def needs_stt(self) -> bool:
        """Input transcription and semantic_vad read the session's paired STT row."""
        return self.transcription is not None or (
            self.turn_detection is not None and self.turn_detection.type == "semantic_vad")

    def to_dict(self, dialect: Dialect) -> Event:
        td = self.turn_detection.to_dict() if self.turn_detection is not None else None
        if self.type == "transcription":
            return self._transcription_dict(dialect, td)
        max_tokens = "inf" if self.max_output_tokens is None else self.max_output_tokens
        if dialect is Dialect.BETA:
            modalities = ["text", "audio"] if "audio" in self.output_modalities else ["text"]
            return {"id": self.id, "object": "realtime.session", "model": self.model,
                    "modalities": modalities, "instructions": self.instructions, "voice": self.voice,
                    "input_audio_format": self.input_format.to_beta(),
                    "output_audio_format": self.output_format.to_beta(),
                    "input_audio_transcription": self.transcription, "turn_detection": td, "tools": [],
                    "tool_choice": "auto", "temperature": self.temperature,
                    "max_response_output_tokens": max_tokens, "speed": 1.0, "tracing": self.tracing}
        return {"type": "realtime", "object": "realtime.session", "id": self.id, "model": self.model,
                "output_modalities": list(self.output_modalities), "instructions": self.instructions,
                "audio": {"input": {"format": self.input_format.to_ga(), "transcription": self.transcription,
                                    "noise_reduction": None, "turn_detection": td},
                          "output": {"format": self.output_format.to_ga(), "voice": self.voice, "speed": 1.0}},
                "tools": [], "tool_choice": "auto", "max_output_tokens": max_tokens, "tracing": self.tracing,
                "prompt": None, "expires_at": 0, "include": None}


    def _transcription_dict(self, dialect: Dialect, td: Event | None) -> Event:
        """A transcription session (GA `type: "transcription"`, beta `realtime.transcription_session`)."""
        if dialect is Dialect.BETA:
            # The beta object names an ephemeral key; Parley issues none (its keys are --api-key).
            return {"id": self.id, "object": "realtime.transcription_session", "modalities": ["text"],
                    "input_audio_format": self.input_format.to_beta(),
                    "input_audio_transcription": self.transcription, "turn_detection": td,
                    "input_audio_noise_reduction": None, "include": None,
                    "client_secret": {"value": "", "expires_at": 0}}
        return {"type": "transcription", "object": "realtime.transcription_session", "id": self.id,
                "audio": {"input": {"format": self.input_format.to_ga(), "transcription": self.transcription,
                                    "noise_reduction": None, "turn_detection": td}},
                "include": None}


# ---- items and responses -------------------------------------------------------------------


@dataclass
class AssistantItem:
    """One spoken (or written) reply: one message item with one content part."""

    id: str
    audio: bool  # audio + transcript (True) or text only (False)
    status: str = "in_progress"
    transcript: str = ""

    def to_dict(self, dialect: Dialect) -> Event:
        if self.audio:
            kind = "output_audio" if dialect is Dialect.GA else "audio"
            content = {"type": kind, "transcript": self.transcript}
        else:
            kind = "output_text" if dialect is Dialect.GA else "text"
            content = {"type": kind, "text": self.transcript}
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status,
                "role": "assistant", "content": [content]}

    def part(self) -> Event:
        if self.audio:
            return {"type": "audio", "transcript": self.transcript}
        return {"type": "text", "text": self.transcript}


@dataclass
class UserItem:
    """A user turn: committed audio (no transcript: the model hears audio directly) or text."""

    id: str
    text: str | None = None
    role: str = "user"

    def to_dict(self, dialect: Dialect) -> Event:
        if self.text is not None:
            content = {"type": "input_text", "text": self.text}
        else:
            content = {"type": "input_audio", "transcript": None}
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": "completed",
                "role": self.role, "content": [content]}


@dataclass
class ResponseState:
    id: str
    conversation_id: str
    item: AssistantItem
    previous_item_id: str | None = None  # the conversation item before this response's item
    status: str = "in_progress"
    status_details: Event | None = None
    audio_frames: int = 0  # 80 ms frames sent in this response
    text_pieces: int = 0
    input_frames: int = 0  # user frames heard while this response was open
    max_output_tokens: int | None = None  # None: "inf"
    metadata: dict[str, str] | None = None
    in_conversation: bool = True  # False: conversation "none" (out of band)

    @property
    def output_tokens(self) -> int:
        """One per 80 ms audio frame sent and one per text piece (the `usage` figures)."""
        return self.audio_frames + self.text_pieces

    def to_dict(self, dialect: Dialect, config: SessionConfig) -> Event:
        output = [self.item.to_dict(dialect)] if self.status != "in_progress" or self.audio_frames else []
        usage = None
        if self.status != "in_progress":
            out_tokens = self.output_tokens
            usage = {"total_tokens": out_tokens + self.input_frames, "input_tokens": self.input_frames,
                     "output_tokens": out_tokens,
                     "input_token_details": {"cached_tokens": 0, "text_tokens": 0, "audio_tokens": self.input_frames},
                     "output_token_details": {"text_tokens": self.text_pieces, "audio_tokens": self.audio_frames}}
        common = {"object": "realtime.response", "id": self.id, "status": self.status,
                  "status_details": self.status_details, "output": output,
                  "conversation_id": self.conversation_id if self.in_conversation else None,
                  "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
                  "usage": usage, "metadata": self.metadata}
        if dialect is Dialect.BETA:
            modalities = ["text", "audio"] if self.item.audio else ["text"]
            return {**common, "modalities": modalities, "voice": config.voice,
                    "output_audio_format": config.output_format.to_beta(), "temperature": config.temperature}
        return {**common, "output_modalities": ["audio"] if self.item.audio else ["text"],
                "audio": {"output": {"format": config.output_format.to_ga(), "voice": config.voice}}}


# ---- the event factory ---------------------------------------------------------------------


class Events:
    """Builds server events in one connection's dialect."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        ga = dialect is Dialect.GA
        self._audio_delta = "response.output_audio.delta" if ga else "response.audio.delta"
        self._audio_done = "response.output_audio.done" if ga else "response.audio.done"
        self._transcript_delta = ("response.output_audio_transcript.delta" if ga
                                  else "response.audio_transcript.delta")
        self._transcript_done = ("response.output_audio_transcript.done" if ga
                                 else "response.audio_transcript.done")
        self._text_delta = "response.output_text.delta" if ga else "response.text.delta"
        self._text_done = "response.output_text.done" if ga else "response.text.done"

    @staticmethod
    def _event(type_: str, **fields: Any) -> Event:
        return {"type": type_, "event_id": new_id("event"), **fields}

    # session
    def session_created(self, config: SessionConfig) -> Event:
        return self._event(self._session_event(config, "created"), session=config.to_dict(self.dialect))

    def session_updated(self, config: SessionConfig) -> Event:
        return self._event(self._session_event(config, "updated"), session=config.to_dict(self.dialect))

    def _session_event(self, config: SessionConfig, what: str) -> str:
        """Beta names a transcription session's events `transcription_session.*`; GA says `session.*`."""
        beta = self.dialect is Dialect.BETA and config.type == "transcription"
        return f"{'transcription_session' if beta else 'session'}.{what}"

    # errors: never close the session
    def error(self, message: str, code: str, *, kind: str = "invalid_request_error",
              param: str | None = None, client_event_id: str | None = None) -> Event:
        return self._event("error", error={"type": kind, "code": code, "message": message,
                                           "param": param, "event_id": client_event_id})

    # conversation items entering the conversation (GA: added + done; beta: created)
    def item_entered(self, item: Event, previous_item_id: str | None) -> list[Event]:
        if self.dialect is Dialect.BETA:
            return [self._event("conversation.item.created", previous_item_id=previous_item_id, item=item)]
        return [self._event("conversation.item.added", previous_item_id=previous_item_id, item=item),
                self._event("conversation.item.done", previous_item_id=previous_item_id, item=item)]

    def item_added(self, item: Event, previous_item_id: str | None) -> list[Event]:
        """An item the model starts generating (GA `conversation.item.added`; beta `.created`)."""
        if self.dialect is Dialect.BETA:
            return [self._event("conversation.item.created", previous_item_id=previous_item_id, item=item)]
        return [self._event("conversation.item.added", previous_item_id=previous_item_id, item=item)]

    def item_done(self, item: Event, previous_item_id: str | None) -> list[Event]:
        """GA only: `conversation.item.done` when the model finished an item."""
        if self.dialect is Dialect.BETA:
            return []
        return [self._event("conversation.item.done", previous_item_id=previous_item_id, item=item)]

    def item_retrieved(self, item: Event) -> Event:
        return self._event("conversation.item.retrieved", item=item)

    def item_truncated(self, item_id: str, content_index: int, audio_end_ms: int) -> Event:
        return self._event("conversation.item.truncated", item_id=item_id, content_index=content_index,
                           audio_end_ms=audio_end_ms)

    def item_deleted(self, item_id: str) -> Event:
        return self._event("conversation.item.deleted", item_id=item_id)

    # input audio buffer
    def speech_started(self, audio_start_ms: int, item_id: str) -> Event:
        return self._event("input_audio_buffer.speech_started", audio_start_ms=audio_start_ms, item_id=item_id)

    def speech_stopped(self, audio_end_ms: int, item_id: str) -> Event:
        return self._event("input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id)

    # Input transcription (the paired STT row): same names in both dialects.
    def transcription_delta(self, item_id: str, delta: str) -> Event:
        return self._event("conversation.item.input_audio_transcription.delta", item_id=item_id,
                           content_index=0, delta=delta)

    def transcription_completed(self, item_id: str, transcript: str, seconds: float) -> Event:
        return self._event("conversation.item.input_audio_transcription.completed", item_id=item_id,
                           content_index=0, transcript=transcript,
                           usage={"type": "duration", "seconds": round(seconds, 3)})

    def transcription_failed(self, item_id: str, message: str) -> Event:
        return self._event("conversation.item.input_audio_transcription.failed", item_id=item_id, content_index=0,
                           error={"type": "server_error", "code": "transcription_failed", "message": message,
                                  "param": None})

    def committed(self, item_id: str, previous_item_id: str | None) -> Event:
        return self._event("input_audio_buffer.committed", previous_item_id=previous_item_id, item_id=item_id)

    def cleared(self) -> Event:
        return self._event("input_audio_buffer.cleared")

    # responses
    def response_created(self, response: ResponseState, config: SessionConfig) -> Event:
        return self._event("response.created", response=response.to_dict(self.dialect, config))

    def response_done(self, response: ResponseState, config: SessionConfig) -> Event:
        return self._event("response.done", response=response.to_dict(self.dialect, config))

    def output_item_added(self, response: ResponseState) -> Event:
        return self._event("response.output_item.added", response_id=response.id, output_index=0,
                           item=response.item.to_dict(self.dialect))

    def output_item_done(self, response: ResponseState) -> Event:
        return self._event("response.output_item.done", response_id=response.id, output_index=0,
                           item=response.item.to_dict(self.dialect))

    def _part_fields(self, response: ResponseState) -> dict[str, Any]:
        return {"response_id": response.id, "item_id": response.item.id, "output_index": 0, "content_index": 0}

    def content_part_added(self, response: ResponseState) -> Event:
        part = AssistantItem(response.item.id, response.item.audio).part()  # empty at the start
        return self._event("response.content_part.added", **self._part_fields(response), part=part)

    def content_part_done(self, response: ResponseState) -> Event:
        return self._event("response.content_part.done", **self._part_fields(response), part=response.item.part())

    def output_audio_buffer(self, what: str, response_id: str) -> Event:
        """WebRTC only: output_audio_buffer.started / .stopped / .cleared (frame_output.PlayingResponse)."""
        return self._event(f"output_audio_buffer.{what}", response_id=response_id)

    def is_audio_delta(self, event: Event) -> bool:
        return event["type"] == self._audio_delta

    def audio_delta(self, response: ResponseState, b64_pcm16: str) -> Event:
        return self._event(self._audio_delta, **self._part_fields(response), delta=b64_pcm16)

    def audio_done(self, response: ResponseState) -> Event:
        return self._event(self._audio_done, **self._part_fields(response))

    def transcript_delta(self, response: ResponseState, text: str) -> Event:
        return self._event(self._transcript_delta, **self._part_fields(response), delta=text)

    def transcript_done(self, response: ResponseState) -> Event:
        return self._event(self._transcript_done, **self._part_fields(response), transcript=response.item.transcript)

    def text_delta(self, response: ResponseState, text: str) -> Event:
        return self._event(self._text_delta, **self._part_fields(response), delta=text)

    def text_done(self, response: ResponseState) -> Event:
        return self._event(self._text_done, **self._part_fields(response), text=response.item.transcript)
