"""A translation session's settings, and `session.update` judged field by field.

The update request (openai `RealtimeTranslationSessionUpdateRequest`) has one tree:
`audio.output.language`, `audio.input.transcription` and `audio.input.noise_reduction`. Each field
is honoured or refused with its own error naming its path (`session.audio.output.language`), and
a refused field keeps its value; the rest of the update still applies. `type` and `model` are
fixed at creation: their current values are accepted, any other refused. Any other field is
refused as unknown. A `session` that is not an object refuses the whole event.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..realtime_api.settings import NO_STT, ClientError
from ..server.served_models import ModelNotFound

Event = dict[str, Any]


@dataclass(frozen=True)
class TranslationCaps:
    """What the served models can do with a client's settings."""

    languages: tuple[str, ...]  # the output languages the model speaks (model.Translator)
    transcription_models: tuple[str, ...] = ()  # the paired STT's served names; (): no paired STT


@dataclass(frozen=True)
class TranslationConfig:
    """One session's settings; `resource` is the SDK's `RealtimeTranslationSession`."""

    id: str
    model: str  # the served name the session was opened with
    language: str  # the output language
    transcription: str | None = None  # the STT model transcribing the source; None: off

    def resource(self) -> Event:
        transcription = None if self.transcription is None else {"model": self.transcription}
        return {"id": self.id, "type": "translation", "model": self.model, "expires_at": 0,
                "audio": {"input": {"transcription": transcription, "noise_reduction": None},
                          "output": {"language": self.language}}}


def apply_update(session: Any, config: TranslationConfig,
                 caps: TranslationCaps) -> tuple[TranslationConfig, list[ClientError]]:
    """The settings `session` asks for, and one error per refused field (ClientError raised: the
    whole event is refused)."""
    if not isinstance(session, dict):
        raise ClientError("session must be an object", "invalid_type", "session")
    refused: list[ClientError] = []
    for key, value in session.items():
        param = f"session.{key}"
        try:
            if key == "audio":
                config = _audio(value, config, caps, refused)
            elif key in ("type", "model"):
                _fixed(param, value, getattr(config, key) if key == "model" else "translation")
            else:
                raise _unknown(param)
        except ClientError as exc:
            refused.append(exc)
    return config, refused


def _audio(value: Any, config: TranslationConfig, caps: TranslationCaps,
           refused: list[ClientError]) -> TranslationConfig:
    for direction, fields in _branches("session.audio", value, ("input", "output"), refused):
        for key, field in fields.items():
            param = f"session.audio.{direction}.{key}"
            try:
                config = _field(direction, key, param, field, config, caps)
            except ClientError as exc:
                refused.append(exc)
    return config


def _branches(param: str, value: Any, names: tuple[str, ...],
              refused: list[ClientError]) -> list[tuple[str, dict]]:
    """An object's known sub-objects (null: none); an unknown key or a wrong type is refused by
    name, the other keys still count (ClientError: `value` itself is not an object)."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise ClientError(f"{param} must be an object", "invalid_type", param)
    out = []
    for key, sub in value.items():
        if key not in names:
            refused.append(_unknown(f"{param}.{key}"))
        elif sub is not None and not isinstance(sub, dict):
            refused.append(ClientError(f"{param}.{key} must be an object", "invalid_type", f"{param}.{key}"))
        else:
            out.append((key, sub or {}))
    return out


def _field(direction: str, key: str, param: str, value: Any, config: TranslationConfig,
           caps: TranslationCaps) -> TranslationConfig:
    if (direction, key) == ("output", "language"):
        return dataclasses.replace(config, language=_language(param, value, caps))
    if (direction, key) == ("input", "transcription"):
        return dataclasses.replace(config, transcription=_transcription(param, value, caps))
    if (direction, key) == ("input", "noise_reduction"):
        if value is not None:
            raise ClientError(f"{param}: no noise reduction is applied to input audio; only null",
                              "unsupported_parameter", param)
        return config
    raise _unknown(param)


def _language(param: str, value: Any, caps: TranslationCaps) -> str:
    """One of the model's output languages; null is its default (the first)."""
    if value is None:
        return caps.languages[0]
    if not isinstance(value, str):
        raise ClientError(f"{param} must be a language code such as {caps.languages[0]!r}", "invalid_type", param)
    if value.lower() not in caps.languages:
        spoken = ", ".join(repr(code) for code in caps.languages)
        raise ClientError(f"{param}: this model does not translate into {value!r:.40}; it speaks {spoken}",
                          "unsupported_parameter", param)
    return value.lower()


def _transcription(param: str, value: Any, caps: TranslationCaps) -> str | None:
    """The source transcribed by the paired STT (null: off); `model` must be one of its served names."""
    if value is None:
        return None
    if not caps.transcription_models:
        raise ClientError(f"{param}: {NO_STT}", "unsupported_parameter", param)
    for key in value:
        if key != "model":
            raise _unknown(f"{param}.{key}")
    model = value.get("model", caps.transcription_models[0])
    if not isinstance(model, str) or model not in caps.transcription_models:
        names = caps.transcription_models
        raise ClientError(str(ModelNotFound("stt", str(model), names)), "model_not_found", f"{param}.model")
    return model


def _fixed(param: str, value: Any, current: str) -> None:
    if value != current:
        raise ClientError(f"{param} is set when the session is created ({current!r}) and cannot be changed",
                          "unsupported_parameter", param)


def _unknown(param: str) -> ClientError:
    return ClientError(f"unknown parameter {param}", "unknown_parameter", param)
