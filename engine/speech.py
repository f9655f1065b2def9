"""The TTS text front end: text, a voice name and a speed in, the pool's `TtsRequest` out.

    front_end = SpeechFrontEnd.for_checkpoint(checkpoint, store)  # once, at start (voices read)
    request, input_tokens = front_end.request("Hello there.", "alloy", speed=1.0)
    job = pool.submit(request, loop)

Every door that speaks text (`POST /v1/audio/speech`, `parley tts`, Kyutai's `/api/tts_streaming`)
goes through it, so they split words, pick the voice, set the conditions and map the speed the same
way (text that streams in: `request` for the first words, `more_words` for the rest):
- the text is normalised and split into words, each its tokenizer pieces; a
  `<break time="1.5s"/>` is a pad-only entry; `speaker_token` (None: a single-speaker model)
  opens the first word (tts_pool.text_entries);
- the voice is a name or an alias in the voice store (read at start: no request reads a file);
- `speed` is the padding bonus: bonus = -SPEED_GAIN * log2(speed) (faster speech pads less);
- the sampling defaults (`sampling`: TtsRequest's sampling fields) and the conditions (the
  model's LUT values, `conditions_for`) are the front end's, set once;
- `input_tokens` (usage) counts the text's tokens.
Input it cannot speak raises `SpeechInputError` (a ValueError naming its `param`): no words to
speak, an unknown voice (`UnknownVoice`, which also lists the known names), a speed that is not
positive. The doors keep their own limits (input length, the speed range) and their wording.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from .tts_pool import TtsRequest, text_entries

if TYPE_CHECKING:
    import torch

    from parley.models.tts_checkpoint import TtsCheckpoint

SPEED_GAIN = 2.0  # padding bonus per halving of speed
DEFAULT_CFG = "2.0"  # the distilled CFG value Kyutai's servers use
SHOWN_VOICES = 20  # names an unknown voice's message lists


class Voices(Protocol):
    """What the front end reads of a voice store (models.VoiceStore)."""

    def names(self) -> list[str]: ...
    def __contains__(self, name: str) -> bool: ...
    def load(self, name: str) -> "torch.Tensor": ...
    def read_all(self) -> None: ...


class SpeechInputError(ValueError):
    """Input a speech request cannot be made of; `param` names the request field (input, voice,
    speed) and `code` an OpenAI-style error code, if any."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class UnknownVoice(SpeechInputError):
    def __init__(self, voice: str, known: list[str]) -> None:
        self.voice, self.known = voice, known
        super().__init__(f"unknown voice {voice!r} (known: {', '.join(known[:SHOWN_VOICES])})", "voice",
                         "invalid_voice")


def speed_bonus(speed: float) -> float:
    """The padding bonus for a speaking rate (1.0: none; 2.0: -SPEED_GAIN)."""
    return -SPEED_GAIN * math.log2(speed)


def conditions_for(checkpoint: "TtsCheckpoint") -> dict:
    """The sum conditions every request carries: `control` "ok" and the distilled CFG value
    where the model has them (a model whose cfg LUT lacks DEFAULT_CFG runs unconditioned on cfg)."""
    cfg = checkpoint.config
    names = {c.name for c in cfg.conditioners}
    conditions = {}
    if "control" in names:
        conditions["control"] = "ok"
    if "cfg" in names:
        conditions["cfg"] = DEFAULT_CFG if DEFAULT_CFG in cfg.lut_values("cfg") else None
    return conditions


@dataclass
class SpeechFrontEnd:
    """One TTS model's text front end (module docstring); built once, at start."""

    encode: Callable[[str], list[int]]  # the model's tokenizer's encode
    voices: Voices
    conditions: dict = field(default_factory=lambda: {"control": "ok", "cfg": DEFAULT_CFG})  # LUT values
    speaker_token: int | None = 1  # multi-speaker models prefix the first word with the main speaker
    # TtsRequest sampling fields; empty: the published TTSModel's defaults (temp 0.6, top-k 25 / 250).
    sampling: dict = field(default_factory=dict)
    cfg_values: tuple[str, ...] = ()  # the values the model's `cfg` condition takes (empty: it has none)

    @classmethod
    def for_checkpoint(cls, checkpoint: "TtsCheckpoint", voices: Voices, *, read_voices: bool = True,
                       **options) -> "SpeechFrontEnd":
        """The checkpoint's tokenizer and conditions over `voices`; `read_voices`: read every voice
        now (a server: no request then reads a file, and a broken one stops the start)."""
        if read_voices:
            voices.read_all()
        cfg = checkpoint.config
        cfg_values = cfg.lut_values("cfg") if "cfg" in {c.name for c in cfg.conditioners} else ()
        return cls(checkpoint.tokenizer.encode, voices, conditions_for(checkpoint), cfg_values=tuple(cfg_values),
                   **options)

    def check_voice(self, voice: str) -> None:
        """UnknownVoice unless `voice` is a name or an alias in the store."""
        if voice not in self.voices:
            raise UnknownVoice(voice, self.voices.names())

    def request(self, text: str, voice: str, speed: float = 1.0) -> tuple[TtsRequest, int]:
        """The pool's request for `text` in `voice` at `speed`, and its input token count."""
        self.check_voice(voice)
        if isinstance(speed, bool) or not math.isfinite(speed) or speed <= 0:
            raise SpeechInputError(f"speed {speed} is not a positive number", "speed")
        entries = text_entries(text, self.encode, self.speaker_token)
        tokens = sum(len(e.tokens) for e in entries)
        if not tokens:
            raise SpeechInputError("input holds no words to speak", "input")
        request = TtsRequest(entries=entries, voices=(self.voices.load(voice),), conditions=dict(self.conditions),
                             padding_bonus=speed_bonus(speed), **self.sampling)
        return request, tokens

    def more_words(self, text: str) -> tuple:
        """The entries of text that follows a request's first words (TtsJob.append): split as
        `request` splits, without the speaker token that opens only the first word."""
        return text_entries(text, self.encode, None)
