"""Streaming audio encoders for `POST /v1/audio/speech`: one 80 ms frame in, bytes out at once.

    enc = make_encoder("mp3")          # pcm | wav | opus | mp3 | flac | aac
    chunk = enc.push(pcm_float32[1920]) # may be b"" while the encoder fills its first block (flac: always)
    tail = enc.finish()

Libraries (well kept, pinned in pyproject.toml): raw int16 for pcm and wav (one streaming WAV
header whose sizes are 0xFFFFFFFF, as OpenAI and Kyutai's server send); sphn's Ogg-Opus writer
for opus (the same one the realtime protocols use); PyAV (FFmpeg, bundled in its wheel) for mp3
(libmp3lame), flac and aac (ADTS, so each chunk is playable as it arrives). PyAV writes mp3 and aac
to a sink without `seek`, so their muxers never rewrite earlier bytes. FLAC is the exception: it is
buffered and sent whole by finish() (FlacEncoder).
"""

from __future__ import annotations

import io
import struct

import av  # at import, not on the first mp3 response (realtime/server/app.py: load_lazy_modules)
import numpy as np
import sphn

from parley.models import FRAME_SAMPLES, SAMPLE_RATE

CONTENT_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav", "opus": "audio/opus", "mp3": "audio/mpeg",
                 "flac": "audio/flac", "aac": "audio/aac"}
FORMATS = tuple(CONTENT_TYPES)


def to_int16(pcm: np.ndarray) -> np.ndarray:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2")


class PcmEncoder:
    def push(self, pcm: np.ndarray) -> bytes:
        return to_int16(pcm).tobytes()

    def finish(self) -> bytes:
        return b""


class WavEncoder(PcmEncoder):
    """16-bit mono WAV with unknown sizes (0xFFFFFFFF), the streaming convention."""

    def __init__(self) -> None:
        self._header_sent = False

    def push(self, pcm: np.ndarray) -> bytes:
        body = super().push(pcm)
        if self._header_sent:
            return body
        self._header_sent = True
        return wav_header() + body

    def finish(self) -> bytes:
        return b"" if self._header_sent else wav_header()  # no audio: still a (empty) WAV file


def wav_header(sample_rate: int = SAMPLE_RATE) -> bytes:
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", unknown))


class OpusEncoder:
    def __init__(self) -> None:
        self._writer = sphn.OpusStreamWriter(SAMPLE_RATE)

    def push(self, pcm: np.ndarray) -> bytes:
        return bytes(self._writer.append_pcm(np.ascontiguousarray(pcm, dtype=np.float32)))

    def finish(self) -> bytes:
        return b""


class _Sink:
    """A write-only file for PyAV (no seek: the muxer streams and never goes back)."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []

    def write(self, data) -> int:
        self._chunks.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._chunks)
        self._chunks.clear()
        return out


# format -> (PyAV container, codec, sample format, bit rate): 64 kb/s keeps speech (and the demo's
# noisy audio) close to the waveform; LAME's own default at 24 kHz mono is ~32 kb/s.
_AV_SPECS = {"mp3": ("mp3", "libmp3lame", "fltp", 64_000), "aac": ("adts", "aac", "fltp", 64_000),
             "flac": ("flac", "flac", "s16", None)}


class AvEncoder:
    def __init__(self, fmt: str, sink=None) -> None:
        container, codec, self._sample_format, bit_rate = _AV_SPECS[fmt]
        self._sink = _Sink() if sink is None else sink
        self._container = av.open(self._sink, mode="w", format=container)
        self._stream = self._container.add_stream(codec, rate=SAMPLE_RATE, layout="mono")
        if bit_rate is not None:
            self._stream.bit_rate = bit_rate
        self._pts = 0

    def push(self, pcm: np.ndarray) -> bytes:
        self._encode(pcm)
        return self._sink.take()

    def finish(self) -> bytes:
        self._close()
        return self._sink.take()

    def _encode(self, pcm: np.ndarray) -> None:
        data = pcm.astype(np.float32)[None] if self._sample_format == "fltp" else to_int16(pcm)[None]
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=self._sample_format, layout="mono")
        frame.sample_rate = SAMPLE_RATE
        frame.pts = self._pts
        self._pts += pcm.shape[-1]
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def _close(self) -> None:
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()


class FlacEncoder(AvEncoder):
    """Buffered, sent whole by finish(): the muxer then seeks back to write STREAMINFO's total
    sample count and MD5. Streamed, the total is 0 ("unknown"), which libsndfile (soundfile)
    reads as hours of audio and fails on. FLAC is a lossless download format: nothing is lost by
    not streaming it."""

    def __init__(self) -> None:
        super().__init__("flac", io.BytesIO())

    def push(self, pcm: np.ndarray) -> bytes:
        self._encode(pcm)
        return b""

    def finish(self) -> bytes:
        self._close()
        return self._sink.getvalue()


def make_encoder(fmt: str):
    if fmt == "pcm":
        return PcmEncoder()
    if fmt == "wav":
        return WavEncoder()
    if fmt == "opus":
        return OpusEncoder()
    if fmt == "flac":
        return FlacEncoder()
    if fmt in _AV_SPECS:
        return AvEncoder(fmt)
    raise ValueError(f"response_format {fmt!r}: expected one of {', '.join(FORMATS)}")


def warm_up_encoders() -> None:
    """Encode one silent frame in every format: PyAV imports more of itself, and each codec does
    its one-time setup, on the first container it opens (realtime/server/app.py: load_lazy_modules)."""
    for fmt in FORMATS:
        encoder = make_encoder(fmt)
        encoder.push(np.zeros(FRAME_SAMPLES, np.float32))
        encoder.finish()
