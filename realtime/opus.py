"""Ogg-Opus at 24 kHz, decoded and encoded off the event loop.

Each connection owns one `OpusCodec` (a stream reader and a stream writer: Ogg streams
are stateful). The codec calls are blocking and hold the GIL (sphn 0.2.1 measured on
the 2-core dev machine: encode ~0.25-0.8 ms per 80 ms frame, decode ~0.05-0.07 ms), so
they never run on the event loop thread itself: `CodecRunner` hands them to a small
thread pool. That keeps the loop free to read and write sockets while a frame is being
encoded, but since the GIL is held, codec work from all sessions of one process still
shares one core with the loop and the engine's tick. At the session count of a CPU box
(a handful) that is a few percent of a core; at a full GPU's session count it is not:
see docs/configuration.md ("Codec workers") for the numbers and what to do.

Ordering: a connection decodes only from its receive task and encodes only from its
send task, each awaiting one call at a time, so a stream's calls never overlap or
reorder even though the pool has several threads. Reader and writer are separate
objects, so a decode and an encode of one connection may run at the same time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

import numpy as np
import sphn

from models.config import FRAME_SAMPLES, SAMPLE_RATE

# sphn 0.2's writer takes 960- or 1920-sample frames; one model frame (80 ms) is one call.
WRITER_FRAME_SAMPLES = FRAME_SAMPLES  # 1920


class OpusError(ValueError):
    """Bytes that are not a decodable Ogg-Opus stream; the message says why."""


class OpusCodec:
    """One connection's Ogg-Opus reader and writer (blocking calls: run via CodecRunner)."""

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        self._reader = sphn.OpusStreamReader(sample_rate)
        self._writer = sphn.OpusStreamWriter(sample_rate)
        self._broken = False

    def decode(self, data: bytes) -> np.ndarray:
        """Feed any number of Ogg bytes (partial pages allowed); return the float32 PCM
        decodable so far (possibly empty). Raises OpusError on a corrupt stream, after
        which this reader is unusable (an Ogg stream cannot resynchronise reliably)."""
        if self._broken:
            raise OpusError("the Ogg-Opus input stream is already broken")
        try:
            pcm = self._reader.append_bytes(data)
        except ValueError as err:
            self._broken = True
            raise OpusError(f"input is not a valid Ogg-Opus stream: {err}") from err
        return np.asarray(pcm, dtype=np.float32)

    def encode(self, pcm: np.ndarray) -> bytes:
        """Encode one 1920-sample float32 frame; return the Ogg page bytes it completes
        (the first call's bytes also carry the OpusHead/OpusTags header pages)."""
        if pcm.shape[-1] != WRITER_FRAME_SAMPLES:
            raise ValueError(f"encode takes {WRITER_FRAME_SAMPLES}-sample frames, got {pcm.shape[-1]}")
        return bytes(self._writer.append_pcm(np.ascontiguousarray(pcm, dtype=np.float32)))


class CodecRunner:
    """Runs blocking codec calls on a small thread pool so the event loop never waits on them."""

    def __init__(self, workers: int | None = None) -> None:
        if workers is None:
            workers = min(4, os.cpu_count() or 1)
        self.workers = max(1, workers)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="opus")

    async def decode(self, codec: OpusCodec, data: bytes) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self._pool, codec.decode, data)

    async def encode(self, codec: OpusCodec, pcm: np.ndarray) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(self._pool, codec.encode, pcm)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
