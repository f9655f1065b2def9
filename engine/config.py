"""Engine and session options: frozen dataclasses, validated once here, at the edge.

Every check raises `OptionsError` (a ValueError) with a plain sentence that names the
field, so the network edge can hand the message to a client unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parley.models.config import FRAME_SAMPLES, SAMPLE_RATE, SamplingDefaults

TICK_SECONDS = FRAME_SAMPLES / SAMPLE_RATE  # 0.08: one frame of audio per tick
# What the model can hold: sampling settings live in float32 / int64 device tensors, and a value
# past these does not fit (writing it raises on the engine thread, in every session's tick).
MAX_TEMPERATURE = 3.4028234663852886e38  # the largest finite float32
MAX_TOP_K = 2**63 - 1  # int64; any top-k at or above the vocabulary size means "no restriction"
# An image request with no work run for this long fails (engine/image_queue.py); here, torch-free,
# so `parley serve --help` can show it.
DEFAULT_STALL_TIMEOUT_S = 60.0


class OptionsError(ValueError):
    """Options that cannot be served; the message says which one and why."""


def _check_temperature(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OptionsError(f"{name} must be a finite number, got {value!r}.")
    if value < 0:
        raise OptionsError(f"{name} must be 0 (greedy) or more, got {value}.")
    if value > MAX_TEMPERATURE:
        raise OptionsError(f"{name} must be at most {MAX_TEMPERATURE:.4g} (a float32), got {value:.4g}.")


MAX_SEED = 2 ** 63 - 1


def _check_seed(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise OptionsError(f"{name} must be a whole number from 0 to {MAX_SEED}, got {value!r}.")


def _check_top_k(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOP_K:
        raise OptionsError(f"{name} must be a whole number from 1 to {MAX_TOP_K}, got {value!r}.")


@dataclass(frozen=True)
class SamplingOptions:
    """Per-session sampling, validated; temperature 0 is greedy. Defaults: `SamplingDefaults`
    (the reference LMGen's); a checkpoint's own come from `Checkpoint.sampling`."""

    text_temperature: float = SamplingDefaults.text_temperature
    text_top_k: int = SamplingDefaults.text_top_k
    audio_temperature: float = SamplingDefaults.audio_temperature
    audio_top_k: int = SamplingDefaults.audio_top_k
    # Seeds make a session's sampling reproducible for the same input (None: the shared generator).
    text_seed: int | None = None
    audio_seed: int | None = None

    def __post_init__(self) -> None:
        _check_temperature("text_temperature", self.text_temperature)
        _check_temperature("audio_temperature", self.audio_temperature)
        _check_top_k("text_top_k", self.text_top_k)
        _check_top_k("audio_top_k", self.audio_top_k)
        _check_seed("text_seed", self.text_seed)
        _check_seed("audio_seed", self.audio_seed)

    @classmethod
    def greedy(cls) -> "SamplingOptions":
        return cls(text_temperature=0.0, audio_temperature=0.0)


@dataclass(frozen=True)
class SessionOptions:
    """What a client chooses when it opens a session."""

    persona: str = ""  # PersonaPlex system prompt text; empty means none
    voice: str | None = None  # voice prompt name (PersonaPlex), None for the model's default
    sampling: SamplingOptions | None = None  # None: the checkpoint's defaults

    def __post_init__(self) -> None:
        if not isinstance(self.persona, str):
            raise OptionsError(f"persona must be text, got {type(self.persona).__name__}.")
        if self.voice is not None and (not isinstance(self.voice, str) or not self.voice):
            raise OptionsError(f"voice must be a non-empty name or left out, got {self.voice!r}.")
        if self.sampling is not None and not isinstance(self.sampling, SamplingOptions):
            raise OptionsError("sampling must be a SamplingOptions or left out.")


@dataclass(frozen=True)
class EngineConfig:
    """Engine clock and bounds: input per session, output per request. The number of slots is
    not here: the backend owns it (it allocates the rows), and the engine reads `backend.max_sessions`."""

    tick_seconds: float = TICK_SECONDS  # the clock period (tests may shorten it)
    input_frames: int = 25  # per-session input bound: 2 s of audio before overrun drops the oldest
    output_events: int = 64  # per-request output bound: ~5 s of frames before the oldest are dropped
    shutdown_timeout_s: float = 5.0  # how long shutdown waits for the engine thread
    # Slack work must end this long before the next boundary: room for the host to launch the
    # next frame and for estimate noise (engine/slack.py).
    slack_guard_s: float = 0.003
    # Slack items in flight on the device at once, queued back to back without a host round trip
    # (engine/slack_queue.py; CUDA only: on CPU each item has ended when it returns). 1: each item is
    # waited for before the next is chosen.
    slack_queue_depth: int = 2

    def __post_init__(self) -> None:
        for name in ("input_frames", "output_events", "slack_queue_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OptionsError(f"{name} must be a whole number of at least 1, got {value!r}.")
        if not isinstance(self.slack_guard_s, (int, float)) or not 0 <= self.slack_guard_s < self.tick_seconds:
            raise OptionsError(f"slack_guard_s must be at least 0 and less than a tick, got {self.slack_guard_s!r}.")
        for name in ("tick_seconds", "shutdown_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise OptionsError(f"{name} must be a positive number of seconds, got {value!r}.")
