"""`/v1/realtime` and GPT-Live audio formats: PCM16 at 24 kHz (the model's rate; GPT-Live also at
16 kHz) and G.711 mu-law / A-law at 8 kHz (telephony: Twilio media streams, pipecat), both directions.

G.711 coding follows ITU-T G.711 (the classic Sun reference algorithm: 14-bit mu-law with bias
33, 13-bit A-law), vectorised as lookup tables built once. Python's `audioop` did this but is
gone in 3.13, and no maintained package covers 3.11-3.13. Resampling is soxr's streaming
resampler, one per direction per connection, so chunk edges leave no clicks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import soxr

from parley.models import SAMPLE_RATE

G711_RATE = 8000


class FormatError(ValueError):
    """An audio format name or payload this server cannot use; the message says why."""


# ---- G.711 tables -------------------------------------------------------------------------------

_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _ulaw_encode_table() -> np.ndarray:
    pcm = np.arange(-32768, 32768, dtype=np.int64) >> 2
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(pcm), 8159) + 0x21
    seg = np.searchsorted(_ULAW_SEG_END, mag)
    code = (seg << 4) | ((mag >> (seg + 1)) & 0xF)
    return ((np.where(seg >= 8, 0x7F, code) ^ mask) & 0xFF).astype(np.uint8)


def _ulaw_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int64) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _alaw_encode_table() -> np.ndarray:
    pcm = np.arange(-32768, 32768, dtype=np.int64) >> 3
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    mag = np.where(pcm >= 0, pcm, -pcm - 1)
    seg = np.searchsorted(_ALAW_SEG_END, mag)
    low = np.where(seg < 2, mag >> 1, mag >> np.maximum(seg, 1)) & 0xF
    code = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | low)
    return ((code ^ mask) & 0xFF).astype(np.uint8)


def _alaw_decode_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int64) ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, t, -t).astype(np.int16)


_ENCODE = {"pcmu": _ulaw_encode_table(), "pcma": _alaw_encode_table()}
_DECODE = {"pcmu": _ulaw_decode_table(), "pcma": _alaw_decode_table()}


def g711_encode(pcm16: np.ndarray, kind: str) -> bytes:
    """int16 samples -> one G.711 byte each (`kind` pcmu or pcma)."""
    return _ENCODE[kind][pcm16.astype(np.int32) + 32768].tobytes()


def g711_decode(data: bytes, kind: str) -> np.ndarray:
    """G.711 bytes -> int16 samples."""
    return _DECODE[kind][np.frombuffer(data, dtype=np.uint8)]


# ---- formats ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AudioFormat:
    """One direction's wire format: `pcm16` (24 kHz) or G.711 `pcmu` / `pcma` (8 kHz)."""

    kind: str = "pcm16"
    pcm_rate: int = SAMPLE_RATE  # pcm16's rate: 24 kHz on /v1/realtime; GPT-Live also takes 16 kHz

    BETA_NAMES = {"pcm16": "pcm16", "g711_ulaw": "pcmu", "g711_alaw": "pcma"}
    GA_TYPES = {"audio/pcm": "pcm16", "audio/pcmu": "pcmu", "audio/pcma": "pcma"}

    @property
    def rate(self) -> int:
        return self.pcm_rate if self.kind == "pcm16" else G711_RATE

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.kind == "pcm16" else 1

    @classmethod
    def parse(cls, value: Any) -> "AudioFormat":
        """A beta name (`pcm16`, `g711_ulaw`, `g711_alaw`) or a GA object (`{type: audio/pcm, rate}`)."""
        if isinstance(value, str):
            if value not in cls.BETA_NAMES:
                raise FormatError(f"unknown format {value!r:.40}; use pcm16, g711_ulaw or g711_alaw")
            return cls(cls.BETA_NAMES[value])
        if not isinstance(value, dict) or value.get("type") not in cls.GA_TYPES:
            raise FormatError(f"unknown format {value!r:.60}; use {{type: audio/pcm, rate: 24000}}, "
                              "{type: audio/pcmu} or {type: audio/pcma}")
        for key in value:
            if key not in ("type", "rate"):
                raise FormatError(f"unknown format field {key!r:.40}")
        fmt = cls(cls.GA_TYPES[value["type"]])
        rate = value.get("rate", fmt.rate)
        if rate != fmt.rate:
            raise FormatError(f"{value['type']} is served at {fmt.rate} Hz only, got rate {rate!r:.20}")
        return fmt

    def to_ga(self) -> dict[str, Any]:
        if self.kind == "pcm16":
            return {"type": "audio/pcm", "rate": SAMPLE_RATE}
        return {"type": f"audio/{self.kind}"}

    def to_beta(self) -> str:
        return {"pcm16": "pcm16", "pcmu": "g711_ulaw", "pcma": "g711_alaw"}[self.kind]


def _to_pcm16(pcm: np.ndarray) -> np.ndarray:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")


def _unpack(data: bytes, fmt: AudioFormat) -> np.ndarray:
    """Wire bytes at the format's own rate -> float32 in [-1, 1)."""
    if len(data) % fmt.bytes_per_sample:
        raise FormatError("PCM16 audio must hold a whole number of 2-byte samples")
    pcm16 = np.frombuffer(data, dtype="<i2") if fmt.kind == "pcm16" else g711_decode(data, fmt.kind)
    return pcm16.astype(np.float32) / 32768.0


def decode_audio(data: bytes, fmt: AudioFormat) -> np.ndarray:
    """A whole clip (a conversation item) -> 24 kHz float32."""
    pcm = _unpack(data, fmt)
    if fmt.rate == SAMPLE_RATE or not pcm.size:
        return pcm
    return soxr.resample(pcm, fmt.rate, SAMPLE_RATE).astype(np.float32)


class InputDecoder:
    """A connection's input stream: wire chunks -> 24 kHz float32 (resampled across chunk edges)."""

    def __init__(self, fmt: AudioFormat) -> None:
        self.format = fmt
        self._resampler = (None if fmt.rate == SAMPLE_RATE
                           else soxr.ResampleStream(fmt.rate, SAMPLE_RATE, 1, dtype="float32"))

    def decode(self, data: bytes) -> np.ndarray:
        pcm = _unpack(data, self.format)
        if self._resampler is None:
            return pcm
        return self._resampler.resample_chunk(pcm)


class OutputEncoder:
    """A connection's output stream: 24 kHz float32 frames -> wire bytes in its format.

    Each frame gives exactly its duration at the wire rate (640 bytes per 80 ms at 8 kHz): the
    streaming resampler's output comes in bursts, so it goes through a small FIFO that is
    primed with silence whenever it runs short (a one-off delay of a few ms)."""

    def __init__(self, fmt: AudioFormat) -> None:
        self.format = fmt
        self._resampler = (None if fmt.rate == SAMPLE_RATE
                           else soxr.ResampleStream(SAMPLE_RATE, fmt.rate, 1, dtype="float32"))
        self._fifo = np.zeros(0, np.float32)

    def encode(self, pcm: np.ndarray) -> bytes:
        if self._resampler is not None:
            want = pcm.size * self.format.rate // SAMPLE_RATE
            fifo = np.concatenate([self._fifo, self._resampler.resample_chunk(pcm.astype(np.float32, copy=False))])
            if fifo.size < want:
                fifo = np.concatenate([np.zeros(want - fifo.size, np.float32), fifo])
            pcm, self._fifo = fifo[:want], fifo[want:]
        pcm16 = _to_pcm16(pcm)
        return pcm16.tobytes() if self.format.kind == "pcm16" else g711_encode(pcm16, self.format.kind)
