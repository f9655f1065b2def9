"""GPT-Live session settings, judged without sockets: `session.start`'s and `session.update`'s
`session` objects, and the session resource the server shows back.

Every field is honoured or refused with a ClientError naming it (`session.audio.format.rate`);
unknown fields are refused too. `session.start` is judged as a whole: one refused field and the
session does not start (each refusal gets its own error; the client may start again), so a
session never runs on settings its client did not ask for. What Parley makes of each field is
in docs/protocols.md (GPT-Live).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from parley.models import SAMPLE_RATE

from ..media.audio_formats import G711_RATE, AudioFormat
from .responses import ResponsesSettings, parse_settings
from ..realtime_api.events import new_id
from ..realtime_api.settings import ClientError, ModelCaps, served_model

Event = dict[str, Any]

# The SDK's BuiltInVoice names: on Parley they mean the model's own (the server's default) voice.
BUILT_IN_VOICES = frozenset({
    "alloy", "ash", "ballad", "beacon", "bossa", "cedar", "cinder", "coral", "delta", "echo", "gleam", "marin",
    "meridian", "quartz", "ripple", "sage", "shida", "shimmer", "stone", "tempo", "verse", "vesper", "willow"})
PCM_RATES = (16000, SAMPLE_RATE)
MAX_INPUT_ITEMS = 128  # OpenAI's limit on `input`
ROLES = {"developer": "Developer", "user": "User", "assistant": "Assistant"}


@dataclass(frozen=True)
class LiveConfig:
    """A started session's settings (all fixed at start)."""

    model: str
    id: str = dataclasses.field(default_factory=lambda: new_id("sess"))
    instructions: str = ""  # as sent ("" or absent: the server's persona)
    voice: Any = None  # as sent: a name, {"id": name} or None
    voice_prompt: str | None = None  # the voice prompt asked of the model (None: its default)
    format: AudioFormat = AudioFormat()
    input: tuple[Event, ...] | None = None  # prior messages, as sent
    store: bool | None = None
    safety_identifier: str | None = None
    responses: ResponsesSettings | None = None  # Responses delegation (None: client delegation)

    def persona(self, default: str, context: tuple[str, ...] = ()) -> str:
        """The PersonaPlex persona: the instructions (or the server's), the prior messages one line
        each (`User: ...`), then what the session appended since (instructions, thinking)."""
        lines = [self.instructions or default]
        lines += [f"{ROLES[item['role']]}: {item['content'][0]['text']}" for item in self.input or ()]
        return "\n".join(line for line in (*lines, *context) if line)

    def resource(self, default_instructions: str = "") -> Event:
        """The session resource of session.started / .updated / .closed (blank instructions: the
        server's, which the model runs on)."""
        fmt = {"type": "audio/pcm" if self.format.kind == "pcm16" else f"audio/{self.format.kind}",
               "rate": self.format.rate}
        return {"id": self.id, "model": self.model, "status": "active", "expires_at": 0,
                "instructions": self.instructions or default_instructions, "audio": {"format": fmt, "output": {"voice": self.voice}},
                "delegation": {"type": "responses", "responses": self.responses.sent} if self.responses
                else {"type": "client"}, "input": list(self.input) if self.input is not None else None,
                "store": self.store, "safety_identifier": self.safety_identifier}


def _refuse(param: str, why: str) -> ClientError:
    return ClientError(f"{param}: {why}", "unsupported_parameter", param)


def _wrong(param: str, expected: str, value: Any) -> ClientError:
    return ClientError(f"{param} must be {expected}, got {value!r:.60}", "invalid_value", param)


def _fields(param: str, value: Any, known: tuple[str, ...]) -> dict:
    """`value` as an object with only `known` keys (unknown ones refused by name)."""
    if not isinstance(value, dict):
        raise _wrong(param, "an object", value)
    for key in value:
        if key not in known:
            raise ClientError(f"unknown field {param}.{key!s:.40}", "unknown_parameter", f"{param}.{key!s:.40}")
    return value


def _instructions(param: str, value: Any, caps: ModelCaps) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _wrong(param, "a string", value)
    if value.strip() and not caps.prompts:
        raise _refuse(param, "this model takes no instructions (a Moshi checkpoint has no persona prompt); "
                             "leave them out")
    return value


def _format(param: str, value: Any) -> AudioFormat:
    fmt = _fields(param, value, ("type", "rate"))
    kinds = {"audio/pcm": ("pcm16", PCM_RATES), "audio/pcmu": ("pcmu", (G711_RATE,)),
             "audio/pcma": ("pcma", (G711_RATE,))}
    if fmt.get("type") not in kinds:
        raise _wrong(f"{param}.type", "audio/pcm, audio/pcmu or audio/pcma", fmt.get("type"))
    kind, rates = kinds[fmt["type"]]
    rate = fmt.get("rate", rates[-1])
    if isinstance(rate, bool) or rate not in rates:
        raise _refuse(f"{param}.rate", f"{fmt['type']} is served at {' or '.join(map(str, rates))} Hz, "
                                       f"not {rate!r:.20}")
    return AudioFormat(kind, pcm_rate=rate if kind == "pcm16" else SAMPLE_RATE)


def _voice(param: str, value: Any, caps: ModelCaps) -> str | None:
    """The voice prompt asked of the model; None for a built-in name (the model's own voice)."""
    name = value.get("id") if isinstance(value, dict) and set(value) == {"id"} else value
    if not isinstance(name, str) or not name:
        raise _wrong(param, "a voice name or {id: name}", value)
    if name in BUILT_IN_VOICES:
        return None
    if not caps.prompts:
        raise _refuse(param, f"this model has one voice and takes no voice prompt; {name!r:.60} is not "
                             "available (the built-in names mean the model's own voice)")
    return name


def _audio(param: str, value: Any, caps: ModelCaps) -> dict:
    audio = _fields(param, value, ("format", "output"))
    out: dict = {}
    if audio.get("format") is not None:
        out["format"] = _format(f"{param}.format", audio["format"])
    if audio.get("output") is not None:
        output = _fields(f"{param}.output", audio["output"], ("voice",))
        if output.get("voice") is not None:
            out["voice"] = output["voice"]
            out["voice_prompt"] = _voice(f"{param}.output.voice", output["voice"], caps)
    return out


def delegation(param: str, value: Any, backend: bool = False) -> ResponsesSettings | None:
    """Client delegation (omitted, null or {type: client}): None. Responses delegation: its settings,
    when the server has a backend (--delegate-url). Decisions, and Responses without a backend, are
    refused by name."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _wrong(param, "an object", value)
    kind = value.get("type")  # judged first: an unserved kind is refused by its name, whatever it holds
    if kind == "decisions" or (kind == "responses" and not backend):
        why = ("this server has no delegation backend (parley serve --delegate-url)" if kind == "responses"
               else "Parley serves client and responses delegation")
        raise _refuse(f"{param}.type", f"{kind} delegation is not served: {why}; use {{type: client}} "
                                       "(or leave delegation out) and answer delegations with commentary")
    if kind not in ("client", "responses"):
        raise _wrong(f"{param}.type", "'client' or 'responses'", kind)
    fields = _fields(param, value, ("type", "acknowledgement_delay_ms", "responses", "decisions"))
    if fields.get("acknowledgement_delay_ms") is not None:
        raise _refuse(f"{param}.acknowledgement_delay_ms", "Parley's models make no automatic spoken "
                      "acknowledgement of a delegation (they speak when they will; commentary is what they "
                      "say); leave it out")
    for other in ("responses", "decisions"):
        if other in fields and other != kind:
            raise ClientError(f"unknown field {param}.{other} for {kind} delegation", "unknown_parameter",
                              f"{param}.{other}")
    return parse_settings(f"{param}.responses", fields.get("responses")) if kind == "responses" else None


def _input(param: str, value: Any, caps: ModelCaps) -> tuple[Event, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_INPUT_ITEMS:
        raise _wrong(param, f"a list of at most {MAX_INPUT_ITEMS} messages", value)
    if value and not caps.prompts:
        raise _refuse(param, "this model takes no text context (a Moshi checkpoint has no persona prompt to put "
                             "prior messages in); leave input out")
    for i, item in enumerate(value):
        here = f"{param}[{i}]"
        item = _fields(here, item, ("type", "role", "content", "id", "status"))
        if item.get("type", "message") != "message" or item.get("role") not in ROLES:
            raise _wrong(here, "a message of role developer, user or assistant", item)
        content = item.get("content")
        if not isinstance(content, list) or len(content) != 1:
            raise _wrong(f"{here}.content", "a list of exactly one text part", content)
        part = _fields(f"{here}.content[0]", content[0], ("type", "text"))
        if part.get("type", "input_text") not in ("input_text", "text", "output_text") \
                or not isinstance(part.get("text"), str):
            raise _wrong(f"{here}.content[0]", "a text part {type, text}", part)
    return tuple(value)


def _store(param: str, value: Any, caps: ModelCaps) -> bool | None:
    if value is True:
        raise _refuse(param, "Parley stores no sessions (no recording, no fork); leave it out or send false")
    if value not in (None, False):
        raise _wrong(param, "a boolean", value)
    return value


def _safety_identifier(param: str, value: Any, caps: ModelCaps) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) > 64):
        raise _wrong(param, "a string of at most 64 characters", value)
    return value  # logged with the session (live/session.py)


def _triggers(param: str, value: Any, caps: ModelCaps | None = None) -> None:
    if value not in (None, []):
        raise _refuse(param, "Decisions triggers need decisions delegation, which Parley does not serve; "
                             "leave them out or send []")


def _client(param: str, value: Any, caps: ModelCaps) -> None:
    if value is not None:
        raise _refuse(param, "client capabilities are for a WebRTC frontend; this is a WebSocket session")


_START: dict[str, Callable[[str, Any, ModelCaps], Any]] = {
    "model": served_model, "instructions": _instructions, "audio": _audio, "input": _input, "store": _store,
    "safety_identifier": _safety_identifier, "triggers": _triggers, "client": _client,
}


def parse_start(raw: Any, caps: ModelCaps, backend: bool = False) -> tuple[LiveConfig | None, list[ClientError]]:
    """session.start's `session` -> (the config, []) or (None, one error per refused field).
    `backend`: the server has a Responses delegation backend."""
    if not isinstance(raw, dict):
        return None, [ClientError("session.start needs 'session': an object with at least 'model'",
                                  "missing_required_parameter", "session")]
    errors, values = [], {}
    if "model" not in raw:
        errors.append(ClientError("session.model is required", "missing_required_parameter", "session.model"))
    for key, value in raw.items():
        check = _START.get(key)
        try:
            if key == "delegation":
                values[key] = delegation("session.delegation", value, backend)
                continue
            if check is None:
                raise ClientError(f"unknown field session.{key!s:.40}", "unknown_parameter", f"session.{key!s:.40}")
            values[key] = check(f"session.{key}", value, caps)
        except ClientError as exc:
            errors.append(exc)
    if errors:
        return None, errors
    audio = values.get("audio") or {}
    return LiveConfig(model=values["model"], instructions=values.get("instructions", ""),
                      voice=audio.get("voice"), voice_prompt=audio.get("voice_prompt"),
                      format=audio.get("format", AudioFormat()), input=values.get("input"),
                      store=values.get("store"), safety_identifier=values.get("safety_identifier"),
                      responses=values.get("delegation")), []


def check_update(raw: Any, config: LiveConfig, backend: bool = False) -> tuple[list[ClientError], LiveConfig]:
    """session.update's `session`: only the delegation (in the mode the session started with) and
    triggers may be sent; the rest is fixed at start. A Responses session's `responses` may be
    sparse (pipecat and LiveKit send only the tools): it updates the settings field by field.
    Returns (one error per refused field, the config as updated: unchanged if any was refused)."""
    if not isinstance(raw, dict):
        return [ClientError("session.update needs 'session': an object", "missing_required_parameter", "session")], config
    errors, updated = [], config
    for key, value in raw.items():
        param = f"session.{key!s:.40}"
        try:
            if key == "delegation":
                updated = dataclasses.replace(config, responses=_delegation_update(param, value, config, backend))
            elif key == "triggers":
                _triggers(param, value)
            elif key in _START:
                raise _refuse(param, "fixed at session.start; only delegation and triggers can be updated")
            else:
                raise ClientError(f"unknown field {param}", "unknown_parameter", param)
        except ClientError as exc:
            errors.append(exc)
    return errors, config if errors else updated


def _delegation_update(param: str, value: Any, config: LiveConfig, backend: bool) -> ResponsesSettings | None:
    """The delegation after an update: the mode stays the one started with."""
    started = "responses" if config.responses else "client"
    if value is None or not isinstance(value, dict) or value.get("type") != started:
        raise _refuse(f"{param}.type", f"the session started with {started} delegation, which an update "
                                       f"keeps: send {{type: {started}, ...}}")
    if config.responses is None:
        return delegation(param, value, backend)
    sparse = value.get("responses")
    if sparse is not None and not isinstance(sparse, dict):
        raise _wrong(f"{param}.responses", "an object", sparse)
    return delegation(param, {**value, "responses": {**config.responses.sent, **(sparse or {})}}, backend)
