"""`/v1/realtime` client settings, judged without sockets: `session.update`, `response.create`'s
`response` object and `conversation.item.create`'s item.

Rules this module keeps (docs/protocols.md has the full table):
- Every field of the GA and beta references is either honoured or refused with a
  `ClientError` that names it (`param`, dotted from the event: `session.audio.input.format`).
  Unknown fields are refused too: nothing is accepted and then ignored.
- `session.update` is judged field by field: good fields take effect, each bad one gets its
  own error, and `session.updated` shows what is in effect. `response.create` is judged as a
  whole: one refused option and that response is not started.
- Type and range are checked here, so nothing downstream (the energy detector, the engine)
  ever sees a string where it wants milliseconds.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..media.audio_formats import AudioFormat, FormatError, decode_audio
from .events import SessionConfig, TurnDetection, new_id
from ..server.served_models import ModelNotFound

Event = dict[str, Any]

# OpenAI's built-in voice names: on Parley they mean "the model's default voice".
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar"})
MAX_OUTPUT_TOKENS = 4096  # OpenAI's upper bound for max_output_tokens
MAX_TURN_MS = 10_000  # prefix padding / silence duration beyond 10 s are mistakes, not settings
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's metadata limits
TEMPERATURE_RANGE = (0.0, 2.0)
# semantic_vad eagerness -> (the STT's end-of-turn probability that ends the turn, timeout in ms).
# The timeouts are OpenAI's (low 8 s, medium 4 s, high 2 s); the thresholds are Parley's choice.
EAGERNESS = {"low": (0.8, 8000), "medium": (0.5, 4000), "auto": (0.5, 4000), "high": (0.25, 2000)}
NO_STT = ("this server has no speech-to-text model loaded (parley serve --stt-model), so it cannot "
          "transcribe the input or run semantic_vad")


class ClientError(Exception):
    """A bad client event or field: becomes an `error` event; the session goes on."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(frozen=True)
class ModelCaps:
    """What the served model can do with a client's settings."""

    prompts: bool  # takes a persona (instructions) and voice prompt: PersonaPlex yes, Moshi no
    transcribe: bool = False  # a paired STT row: input transcription and semantic_vad
    transcribe_sessions: bool = False  # standalone STT rows: transcription-only sessions
    # The names `session.model` may take: the duplex model's served names (server/served_models.py).
    # Another is refused as model_not_found; none given: every name is.
    models: tuple[str, ...] = ()
    # The names `audio.input.transcription.model` may take: the STT model's served names (its rows
    # transcribe: paired ones in a conversation, a standalone one in a transcription session).
    transcription_models: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResponseOptions:
    """One response's options (`response.create`), or the session's for responses the model starts."""

    audio: bool = True  # False: text only, the response's audio is not sent
    max_output_tokens: int | None = None  # None: "inf"
    metadata: dict[str, str] | None = None
    in_conversation: bool = True  # conversation "none": an out-of-band response, not remembered

    @classmethod
    def of_session(cls, config: SessionConfig) -> "ResponseOptions":
        return cls(audio="audio" in config.output_modalities, max_output_tokens=config.max_output_tokens)


# ---- small typed readers: each raises ClientError naming the param ------------------------------


def _unsupported(param: str, why: str) -> ClientError:
    return ClientError(f"{param}: {why}", "unsupported_parameter", param)


def _type_error(param: str, expected: str, value: Any) -> ClientError:
    return ClientError(f"{param} must be {expected}, got {value!r:.60}", "invalid_type", param)


def _dict(param: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise _type_error(param, "an object", value)
    return value


def _bool(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(param, "true or false", value)
    return value


def _int(param: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise _type_error(param, "a whole number", value)
    if not low <= value <= high:
        raise ClientError(f"{param} must be between {low} and {high}, got {value}", "invalid_value", param)
    return int(value)


def _number(param: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(param, "a number", value)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ClientError(f"{param} must be in {bracket}{low}, {high}], got {value}", "invalid_value", param)
    return float(value)


def _choice(param: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ClientError(f"{param} must be one of {', '.join(choices)}; got {value!r:.60}", "invalid_value", param)
    return value


def _only_empty(param: str, value: Any, why: str) -> None:
    """Fields Parley can only take as 'none' (null, empty list/object, False)."""
    if value not in (None, [], {}, False):
        raise _unsupported(param, why)


def _max_tokens(param: str, value: Any) -> int | None:
    if value == "inf":
        return None
    return _int(param, value, 1, MAX_OUTPUT_TOKENS)


def _modalities(param: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise _type_error(param, "a non-empty list of 'text' and/or 'audio'", value)
    if not set(value) <= {"text", "audio"}:
        raise ClientError(f"{param} may hold only 'text' and 'audio', got {value!r:.60}", "invalid_value", param)
    return ["audio"] if "audio" in value else ["text"]


def _voice(param: str, value: Any, caps: ModelCaps) -> str:
    if isinstance(value, dict):  # GA custom voice object {"id": ...}
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise _type_error(param, "a voice name", value)
    if not caps.prompts and value not in OPENAI_VOICES:
        raise _unsupported(param, f"this model has one voice and takes no voice prompt; {value!r:.60} "
                                  f"is not available (OpenAI's built-in names mean the model's own voice)")
    return value


def _format(param: str, value: Any) -> AudioFormat:
    try:
        return AudioFormat.parse(value)
    except FormatError as exc:
        raise ClientError(f"{param}: {exc}", "invalid_value", param) from None


def _instructions(param: str, value: Any, caps: ModelCaps) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _type_error(param, "a string", value)
    if value and not caps.prompts:
        raise _unsupported(param, "this model takes no instructions (a Moshi checkpoint has no persona "
                                  "prompt); send an empty string or leave it out")
    return value


def _tools(param: str, value: Any) -> None:
    if not isinstance(value, list):
        raise _type_error(param, "a list", value)
    if value:
        raise _unsupported(param, "this speech-to-speech model cannot call tools; send an empty list")


def _tool_choice(param: str, value: Any) -> None:
    if value not in ("auto", "none"):
        raise _unsupported(param, "with no tools only 'auto' and 'none' mean anything")


def _speed(param: str, value: Any) -> None:
    if _number(param, value, 0.25, 1.5) != 1.0:
        raise _unsupported(param, "the model speaks at its own pace; only 1.0 is possible")


def _tracing(param: str, value: Any) -> Any:
    """Honoured as log lines: the workflow name / group id are logged with the session id."""
    if value is None or value == "auto":
        return value
    tracing = _dict(param, value)
    for key, item in tracing.items():
        if key not in ("workflow_name", "group_id", "metadata"):
            raise ClientError(f"unknown parameter {param}.{key}", "unknown_parameter", f"{param}.{key}")
        if key != "metadata" and not isinstance(item, str):
            raise _type_error(f"{param}.{key}", "a string", item)
    return tracing


# ---- turn detection -----------------------------------------------------------------------------


def parse_turn_detection(param: str, raw: Any, caps: ModelCaps, responses: bool = True) -> TurnDetection | None:
    """`turn_detection`: null/false turns the detector off; numbers are checked by type and range.
    `responses` False (a transcription session): there are no responses to create or interrupt,
    so those two flags are off and may only be sent as false."""
    if raw is None or raw is False:
        return None
    raw = _dict(param, raw)
    if not responses:
        for key in ("create_response", "interrupt_response"):
            if raw.get(key):
                raise _unsupported(f"{param}.{key}", "a transcription session has no responses; send false "
                                                     "or leave it out")
        raw = {**raw, "create_response": False, "interrupt_response": False}
    kind = _choice(f"{param}.type", raw.get("type", "server_vad"), ("server_vad", "semantic_vad"))
    if kind == "semantic_vad" and not caps.transcribe:
        raise _unsupported(f"{param}.type", NO_STT)
    allowed = {"type", "create_response", "interrupt_response"} | (
        {"threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"} if kind == "server_vad"
        else {"eagerness"})
    for key in raw:
        if key not in allowed:
            raise ClientError(f"unknown parameter {param}.{key} for {kind}", "unknown_parameter", f"{param}.{key}")
    td = TurnDetection(type=kind)
    if raw.get("create_response") is not None:
        td.create_response = _bool(f"{param}.create_response", raw["create_response"])
    if raw.get("interrupt_response") is not None:
        td.interrupt_response = _bool(f"{param}.interrupt_response", raw["interrupt_response"])
    if kind == "semantic_vad":
        if raw.get("eagerness") is not None:
            td.eagerness = _choice(f"{param}.eagerness", raw["eagerness"], tuple(EAGERNESS))
        return td
    if raw.get("threshold") is not None:
        td.threshold = _number(f"{param}.threshold", raw["threshold"], 0.0, 1.0, low_open=True)
    if raw.get("prefix_padding_ms") is not None:
        td.prefix_padding_ms = _int(f"{param}.prefix_padding_ms", raw["prefix_padding_ms"], 0, MAX_TURN_MS)
    if raw.get("silence_duration_ms") is not None:
        td.silence_duration_ms = _int(f"{param}.silence_duration_ms", raw["silence_duration_ms"], 0, MAX_TURN_MS)
    if raw.get("idle_timeout_ms") is not None:
        raise _unsupported(f"{param}.idle_timeout_ms", "the model decides for itself when to speak; "
                                                         "an idle timeout cannot prompt it")
    return td


# ---- session.update -----------------------------------------------------------------------------

# Each session field: (config, value, caps) -> None, mutating the copy of the config; or raising.
_Setter = Callable[[SessionConfig, Any, ModelCaps], None]


def _set(name: str, parse: Callable[[str, Any], Any]) -> Callable[[str], _Setter]:
    def bind(param: str) -> _Setter:
        def setter(config: SessionConfig, value: Any, caps: ModelCaps) -> None:
            setattr(config, name, parse(param, value))
        return setter
    return bind


def _check(check: Callable[[str, Any], Any]) -> Callable[[str], _Setter]:
    def bind(param: str) -> _Setter:
        return lambda config, value, caps: check(param, value) and None
    return bind


def _with_caps(name: str, parse: Callable[[str, Any, ModelCaps], Any]) -> Callable[[str], _Setter]:
    def bind(param: str) -> _Setter:
        def setter(config: SessionConfig, value: Any, caps: ModelCaps) -> None:
            setattr(config, name, parse(param, value, caps))
        return setter
    return bind


def _with_caps_check(check: Callable[[str, Any, ModelCaps], None]) -> Callable[[str], _Setter]:
    def bind(param: str) -> _Setter:
        return lambda config, value, caps: check(param, value, caps)
    return bind


def _refuse(why: str) -> Callable[[str], _Setter]:
    return _check(lambda param, value: _only_empty(param, value, why))


TRANSCRIPTION_INTENT = ("a transcription session is opened as one: connect with ?intent=transcription "
                        "in the URL (this connection is a realtime conversation)")


def _session_type(param: str, value: Any, caps: ModelCaps) -> None:
    if value == "transcription":
        raise _unsupported(param, TRANSCRIPTION_INTENT if caps.transcribe_sessions else NO_STT)
    if value != "realtime":
        raise ClientError(f"{param} must be 'realtime' or 'transcription', got {value!r:.60}", "invalid_value", param)


def _transcription_type(param: str, value: Any) -> None:
    if value != "transcription":
        raise _unsupported(param, "this connection is a transcription session (opened with ?intent=transcription); "
                                  "it cannot become a realtime conversation")


def _transcription_modalities(param: str, value: Any) -> None:
    """The input is audio and the output text whatever the list says, so it must include 'text'."""
    if not isinstance(value, list) or not all(m in ("text", "audio") for m in value):
        raise _type_error(param, "a list of 'text' and/or 'audio'", value)
    if "text" not in value:
        raise _unsupported(param, "a transcription session's output is text; include 'text'")


def _served_name(param: str, value: Any, modality: str, names: tuple[str, ...]) -> str:
    """One of `modality`'s served names (server/served_models.py), else OpenAI's model_not_found naming `param`."""
    if not isinstance(value, str) or not value:
        raise _type_error(param, "a model name", value)
    if value not in names:
        raise ClientError(str(ModelNotFound(modality, value, names)), "model_not_found", param)
    return value


def served_model(param: str, value: Any, caps: ModelCaps) -> str:
    """`model` in a session's settings: one of the duplex model's served names."""
    return _served_name(param, value, "duplex", caps.models)


def _include(param: str, value: Any) -> None:
    if value is not None and not isinstance(value, list):
        raise _type_error(param, "a list", value)
    _only_empty(param, value, "the speech-to-text model gives no log-probabilities to include")


def _truncation(param: str, value: Any) -> None:
    if value != "auto":
        raise _unsupported(param, "the model's context is a sliding window that always drops the oldest "
                                  "audio; only 'auto' describes it")


def _transcription(param: str, value: Any, caps: ModelCaps) -> Any:
    """On (an object) or off (null). The STT model transcribes, so `model` must be one of its
    served names (as on every door); left out, it is filled in with the first, the one in effect."""
    if value is None:
        return None
    value = _dict(param, value)
    if not caps.transcribe:
        raise _unsupported(param, NO_STT)
    if value.get("model") is None:
        return {**value, "model": caps.transcription_models[0]} if caps.transcription_models else value
    _served_name(f"{param}.model", value["model"], "stt", caps.transcription_models)
    return value


_NO_NOISE_REDUCTION = "no noise reduction is applied to input audio"

SESSION_FIELDS: dict[str, Callable[[str], _Setter]] = {
    "type": _with_caps_check(_session_type),
    "model": _with_caps("model", served_model),
    "instructions": _with_caps("instructions", _instructions),
    "voice": _with_caps("voice", _voice),  # beta
    "modalities": _set("output_modalities", _modalities),  # beta
    "output_modalities": _set("output_modalities", _modalities),
    "input_audio_format": _set("input_format", _format),  # beta
    "output_audio_format": _set("output_format", _format),  # beta
    "turn_detection": _with_caps("turn_detection", parse_turn_detection),  # beta
    "input_audio_transcription": _with_caps("transcription", _transcription),  # beta
    "input_audio_noise_reduction": _refuse(_NO_NOISE_REDUCTION),  # beta
    "temperature": _set("temperature", lambda p, v: _number(p, v, *TEMPERATURE_RANGE)),  # beta
    "max_response_output_tokens": _set("max_output_tokens", _max_tokens),  # beta
    "max_output_tokens": _set("max_output_tokens", _max_tokens),
    "speed": _check(_speed),  # beta
    "tools": _check(_tools),
    "tool_choice": _check(_tool_choice),
    "parallel_tool_calls": _refuse("this model cannot call tools"),
    "tracing": _set("tracing", _tracing),
    "include": _check(_include),
    "prompt": _refuse("stored prompts are an OpenAI platform feature; send instructions instead"),
    "truncation": _check(_truncation),
    "reasoning": _refuse("the model does not reason before speaking"),
    "client_secret": _refuse("ephemeral keys are not issued; use --api-key"),  # beta
}
AUDIO_INPUT_FIELDS: dict[str, Callable[[str], _Setter]] = {
    "format": _set("input_format", _format),
    "turn_detection": _with_caps("turn_detection", parse_turn_detection),
    "transcription": _with_caps("transcription", _transcription),
    "noise_reduction": _refuse(_NO_NOISE_REDUCTION),
}
AUDIO_OUTPUT_FIELDS: dict[str, Callable[[str], _Setter]] = {
    "format": _set("output_format", _format),
    "voice": _with_caps("voice", _voice),
    "speed": _check(_speed),
}


def _transcription_turn_detection(param: str, value: Any, caps: ModelCaps) -> TurnDetection | None:
    return parse_turn_detection(param, value, caps, responses=False)


# A transcription session (?intent=transcription): GA `session.update` with type "transcription",
# beta `transcription_session.update`.
TRANSCRIPTION_FIELDS: dict[str, Callable[[str], _Setter]] = {
    "type": _check(_transcription_type),
    "include": _check(_include),
}
TRANSCRIPTION_INPUT_FIELDS: dict[str, Callable[[str], _Setter]] = {
    **AUDIO_INPUT_FIELDS,
    "turn_detection": _with_caps("turn_detection", _transcription_turn_detection),
}
BETA_TRANSCRIPTION_FIELDS: dict[str, Callable[[str], _Setter]] = {
    "input_audio_format": _set("input_format", _format),
    "input_audio_transcription": _with_caps("transcription", _transcription),
    "turn_detection": _with_caps("turn_detection", _transcription_turn_detection),
    "input_audio_noise_reduction": _refuse(_NO_NOISE_REDUCTION),
    "include": _check(_include),
    "modalities": _check(_transcription_modalities),
    "client_secret": _refuse("ephemeral keys are not issued; use --api-key"),
}


def _apply(fields: dict[str, Callable[[str], _Setter]], prefix: str, raw: dict, config: SessionConfig,
           caps: ModelCaps, errors: list[ClientError]) -> None:
    for key, value in raw.items():
        param = f"{prefix}.{key}"
        bind = fields.get(key)
        if bind is None:
            errors.append(ClientError(f"unknown parameter {param}", "unknown_parameter", param))
            continue
        trial = dataclasses.replace(config)
        try:
            bind(param)(trial, value, caps)
        except ClientError as exc:
            errors.append(exc)
            continue
        for name in dataclasses.fields(config):
            setattr(config, name.name, getattr(trial, name.name))


def apply_session_update(session: Any, config: SessionConfig, caps: ModelCaps,
                         beta_transcription: bool = False) -> tuple[SessionConfig, list[ClientError]]:
    """`config` with the update's good fields applied, and one error per refused field. The fields
    are those of `config.type`'s session: realtime, or transcription (GA `session.update`, or beta
    `transcription_session.update` with `beta_transcription`)."""
    if not isinstance(session, dict):
        raise ClientError("the update needs a 'session' object", "missing_required_parameter", "session")
    updated = dataclasses.replace(config)
    errors: list[ClientError] = []
    if beta_transcription:
        _apply(BETA_TRANSCRIPTION_FIELDS, "session", session, updated, caps, errors)
        return updated, errors
    transcription = config.type == "transcription"
    top = {k: v for k, v in session.items() if k != "audio"}
    _apply(TRANSCRIPTION_FIELDS if transcription else SESSION_FIELDS, "session", top, updated, caps, errors)
    input_fields, output_fields = ((TRANSCRIPTION_INPUT_FIELDS, {}) if transcription
                                   else (AUDIO_INPUT_FIELDS, AUDIO_OUTPUT_FIELDS))
    if "audio" in session:
        try:
            audio = _dict("session.audio", session["audio"] or {})
            for key in audio:
                if key not in ("input", "output"):
                    raise ClientError(f"unknown parameter session.audio.{key}", "unknown_parameter",
                                      f"session.audio.{key}")
            _apply(input_fields, "session.audio.input",
                   _dict("session.audio.input", audio.get("input") or {}), updated, caps, errors)
            _apply(output_fields, "session.audio.output",
                   _dict("session.audio.output", audio.get("output") or {}), updated, caps, errors)
        except ClientError as exc:
            errors.append(exc)
    return updated, errors


# ---- response.create ----------------------------------------------------------------------------


def _metadata(param: str, value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    value = _dict(param, value)
    if len(value) > MAX_METADATA_KEYS:
        raise ClientError(f"{param} holds at most {MAX_METADATA_KEYS} keys", "invalid_value", param)
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise ClientError(f"{param}: keys are strings of at most {MAX_METADATA_KEY} characters and values "
                              f"strings of at most {MAX_METADATA_VALUE}", "invalid_value", f"{param}.{key}")
    return dict(value)


def _same_as_session(param: str, value: Any, current: Any, what: str) -> None:
    if value is not None and value != current:
        raise _unsupported(param, f"{what} is set per session (a change re-prefills the model); "
                                  f"send it in session.update")


def parse_response_options(raw: Any, config: SessionConfig, caps: ModelCaps) -> ResponseOptions:
    """`response.create`'s `response` object, judged as a whole (the first refused option refuses it)."""
    options = ResponseOptions.of_session(config)
    if raw is None:
        return options
    raw = _dict("response", raw)
    for key, value in raw.items():
        param = f"response.{key}"
        if key in ("output_modalities", "modalities"):
            options = dataclasses.replace(options, audio="audio" in _modalities(param, value))
        elif key in ("max_output_tokens", "max_response_output_tokens"):
            options = dataclasses.replace(options, max_output_tokens=_max_tokens(param, value))
        elif key == "metadata":
            options = dataclasses.replace(options, metadata=_metadata(param, value))
        elif key == "conversation":
            if value not in ("auto", "none"):
                raise _unsupported(param, "only 'auto' (the session's conversation) and 'none' (out of band) exist")
            options = dataclasses.replace(options, in_conversation=value == "auto")
        elif key == "instructions":
            _same_as_session(param, value or "", config.instructions, "instructions (the persona)")
        elif key == "voice":
            _same_as_session(param, _voice(param, value, caps), config.voice, "voice")
        elif key == "temperature":
            _same_as_session(param, _number(param, value, *TEMPERATURE_RANGE), config.temperature, "temperature")
        elif key == "output_audio_format":
            _same_as_session(param, _format(param, value), config.output_format, "the output audio format")
        elif key == "audio":
            output = _dict(f"{param}.output", _dict(param, value).get("output") or {})
            for sub, item in output.items():
                if sub == "voice":
                    _same_as_session(f"{param}.output.voice", _voice(f"{param}.output.voice", item, caps),
                                     config.voice, "voice")
                elif sub == "format":
                    _same_as_session(f"{param}.output.format", _format(f"{param}.output.format", item),
                                     config.output_format, "the output audio format")
                else:
                    raise ClientError(f"unknown parameter {param}.output.{sub}", "unknown_parameter",
                                      f"{param}.output.{sub}")
        elif key == "tools":
            _tools(param, value)
        elif key == "tool_choice":
            _tool_choice(param, value)
        elif key == "input":
            _only_empty(param, value, "a response's input is the live conversation: the model cannot be given a "
                                      "different context for one response")
        elif key in ("prompt", "parallel_tool_calls", "reasoning"):
            _only_empty(param, value, "not available on this model")
        else:
            raise ClientError(f"unknown parameter {param}", "unknown_parameter", param)
    return options


# ---- conversation.item.create -------------------------------------------------------------------


@dataclass
class ParsedItem:
    item: Event  # as stored and echoed
    audio: np.ndarray | None  # input_audio content, decoded to 24 kHz float32, to feed the model


def parse_item(raw: Any, input_format: AudioFormat) -> ParsedItem:
    """A client item. Only user audio can reach the model: it hears audio, it cannot read text."""
    item = _dict("item", raw)
    kind = item.get("type")
    if kind != "message":
        raise _unsupported("item.type", f"{kind!r:.40} items cannot be used: this model has no tools, and "
                                        "only user audio messages reach it")
    for key in item:
        if key not in ("type", "id", "object", "role", "content", "status"):
            raise ClientError(f"unknown parameter item.{key}", "unknown_parameter", f"item.{key}")
    if item.get("role") != "user":
        raise _unsupported("item.role", f"role {item.get('role')!r:.40}: only the user's audio can be "
                                         "given to the model (it cannot read system or assistant text)")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise _type_error("item.content", "a non-empty list of content parts", content)
    pieces = []
    for i, part in enumerate(content):
        param = f"item.content[{i}]"
        part = _dict(param, part)
        if part.get("type") != "input_audio":
            raise _unsupported(f"{param}.type", f"{part.get('type')!r:.40}: this model cannot read text; "
                                                 "send input_audio")
        audio = part.get("audio")
        if not isinstance(audio, str):
            raise ClientError(f"{param}.audio must be base64 audio", "missing_required_parameter", f"{param}.audio")
        pieces.append(decode_b64_audio(f"{param}.audio", audio, input_format))
    item_id = item.get("id") or new_id("item")
    if not isinstance(item_id, str):
        raise _type_error("item.id", "a string", item_id)
    stored = {"id": item_id, "object": "realtime.item", "type": "message", "status": "completed", "role": "user",
              "content": [{"type": "input_audio", "transcript": None} for _ in content]}
    return ParsedItem(stored, np.concatenate(pieces))


def decode_b64_audio(param: str, audio: str, fmt: AudioFormat) -> np.ndarray:
    """Base64 audio in the session's input format -> 24 kHz float32 (a one-off: items, not streams)."""
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise ClientError(f"{param} is not valid base64", "invalid_value", param) from None
    try:
        return decode_audio(raw, fmt)
    except FormatError as exc:
        raise ClientError(f"{param}: {exc}", "invalid_value", param) from None
