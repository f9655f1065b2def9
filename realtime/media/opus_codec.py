"""One connection's Ogg-Opus reader and writer (sphn), as blocking calls.

The unit both codec runners use: the thread runner calls it in its pool, a codec worker
process (`media/codec_worker.py`) holds one per session. Imports only numpy and sphn, so a worker
starts without torch.
"""

from __future__ import annotations

import numpy as np
import sphn

from parley.models import FRAME_SAMPLES, SAMPLE_RATE

# sphn 0.2's writer takes 960- or 1920-sample frames; one model frame (80 ms) is one call.
WRITER_FRAME_SAMPLES = FRAME_SAMPLES  # 1920


class OpusError(ValueError):
    """Bytes that are not a decodable Ogg-Opus stream; the message says why."""


class OpusCodec:
    """One connection's Ogg-Opus reader and writer, blocking calls (the thread runner's unit)."""

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        self._reader = sphn.OpusStreamReader(sample_rate)
        self._writer = sphn.OpusStreamWriter(sample_rate)
        self._broken = False

    def decode(self, data: bytes) -> np.ndarray:
        if self._broken:
            raise OpusError("the Ogg-Opus input stream is already broken")
        try:
            pcm = self._reader.append_bytes(data)
        except ValueError as err:
            self._broken = True
            raise OpusError(f"input is not a valid Ogg-Opus stream: {err}") from err
        return np.asarray(pcm, dtype=np.float32).reshape(-1)

    def encode(self, pcm: np.ndarray) -> bytes:
        check_frame(pcm)
        return bytes(self._writer.append_pcm(np.ascontiguousarray(pcm, dtype=np.float32)))


def check_frame(pcm: np.ndarray) -> None:
    """One model frame per encode call (ValueError otherwise)."""
    if pcm.shape[-1] != WRITER_FRAME_SAMPLES:
        raise ValueError(f"encode takes {WRITER_FRAME_SAMPLES}-sample frames, got {pcm.shape[-1]}")
