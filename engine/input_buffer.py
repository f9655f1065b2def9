"""Per-session bounded input: arbitrary-length PCM in, one 1920-sample frame per tick out.

Clients send audio in whatever chunk sizes their codec produces; the model wants exact
80 ms frames. The buffer re-frames, and stays bounded in both directions:
- empty at tick time -> a frame of silence, counted as an underrun (the session keeps its
  cadence rather than stalling the whole batch);
- more than `max_frames` queued -> the oldest frames are dropped, counted as overruns
  (latency must not grow during a call).
`push` runs on the event loop (one thread) and `pop` on the engine thread, hence the lock.
`finish` ends the input (a translation's source): the unfinished frame is completed with silence
and queued, and audio pushed after it is an InputError.
Each whole frame keeps the time its last samples arrived (`time.monotonic()`, or the edge's
receive time): transcript delay is measured from it (docs/transcription.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from parley.models.config import FRAME_SAMPLES


class InputError(ValueError):
    """Audio the engine cannot use; the message says why in a plain sentence."""


def validate_pcm(pcm: object) -> np.ndarray:
    """Return `pcm` as a 1-D float32 array, or raise InputError."""
    if hasattr(pcm, "detach"):  # a torch tensor: take it as numpy without importing torch here
        pcm = pcm.detach().cpu().numpy()
    if not isinstance(pcm, np.ndarray):
        raise InputError(f"input audio must be a numpy array of float PCM samples, got {type(pcm).__name__}.")
    if not np.issubdtype(pcm.dtype, np.floating):
        raise InputError(f"input audio must be float PCM in [-1, 1], got dtype {pcm.dtype}.")
    if pcm.ndim == 2 and pcm.shape[0] == 1:
        pcm = pcm[0]
    if pcm.ndim != 1:
        raise InputError(f"input audio must be mono (one channel), got shape {tuple(pcm.shape)}.")
    pcm = pcm.astype(np.float32, copy=False)
    if not np.isfinite(pcm).all():
        raise InputError("input audio contains NaN or infinite samples.")
    return pcm


class InputBuffer:
    def __init__(self, max_frames: int, frame_samples: int = FRAME_SAMPLES) -> None:
        self.max_frames = max_frames
        self.frame_samples = frame_samples
        self._lock = threading.Lock()
        self._frames: deque[tuple[np.ndarray, float]] = deque()  # (frame, arrival time)
        self._partial = np.zeros(frame_samples, dtype=np.float32)  # the unfinished next frame
        self._partial_len = 0
        self.underruns = 0
        self.overruns = 0
        self.ended = False  # `finish` was called: no more audio

    def push(self, pcm: object, received_at: float | None = None) -> int:
        """Append audio (validated) that reached the server at `received_at` (time.monotonic();
        default now); one producer thread. Returns how many frames were dropped to stay bounded."""
        if self.ended:
            raise InputError("the input has ended; no more audio is taken after it.")
        samples = validate_pcm(pcm)
        at = time.monotonic() if received_at is None else received_at
        n = self.frame_samples
        done: list[tuple[np.ndarray, float]] = []
        pos = 0
        while pos < len(samples):  # the partial frame is push's alone: re-framed outside the lock
            take = min(n - self._partial_len, len(samples) - pos)
            self._partial[self._partial_len:self._partial_len + take] = samples[pos:pos + take]
            self._partial_len += take
            pos += take
            if self._partial_len == n:
                done.append((self._partial, at))
                self._partial = np.zeros(n, dtype=np.float32)
                self._partial_len = 0
        if not done:
            return 0
        dropped = 0
        # Only the queue under the lock: numpy copies give the GIL up, and the engine thread's pop
        # would wait out the switch interval behind a lock held across one.
        with self._lock:
            self._frames.extend(done)
            while len(self._frames) > self.max_frames:
                self._frames.popleft()
                dropped += 1
            self.overruns += dropped
        return dropped

    def finish(self) -> None:
        """End the input (same thread as `push`): a partial frame is padded with silence and
        queued; later pushes raise InputError. Idempotent."""
        if self.ended:
            return
        self.ended = True
        if self._partial_len == 0:
            return
        frame = self._partial  # its tail is already zeros: frames start zeroed
        self._partial, self._partial_len = np.zeros(self.frame_samples, dtype=np.float32), 0
        with self._lock:
            self._frames.append((frame, time.monotonic()))
            while len(self._frames) > self.max_frames:
                self._frames.popleft()
                self.overruns += 1

    def pop(self) -> tuple[np.ndarray | None, float | None]:
        """The next frame (the buffer's own array, handed over) and when it arrived
        (time.monotonic()), or (None, None) on an underrun."""
        with self._lock:
            if not self._frames:
                self.underruns += 1
                return None, None
            return self._frames.popleft()

    def __len__(self) -> int:
        with self._lock:
            return len(self._frames)
