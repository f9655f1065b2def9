"""The source audio of a translation session into its engine session: every sample, in order.

A translation must hear all of its source, but the engine's input buffer keeps only its newest
`input.max_frames` frames (engine/input_buffer.py drops the oldest past that). So the source waits
here and is handed over while the buffer is less than half full, checked twice a tick: a client
that sends ahead (as the SDK's 200 ms appends do) keeps the model fed through its network's
jitter, and none of its audio is dropped. A client that falls behind is heard as silence
meanwhile (the engine's underrun: every session ticks in step), not as a pause in model time.
What waits is bounded (`MAX_WAITING_SAMPLES`): past it an append is refused.
"""

from __future__ import annotations

import asyncio
import collections

import numpy as np

from ..engine_client import TICK_SECONDS
from parley.models import FRAME_SAMPLES, SAMPLE_RATE

from ..sessions.session import EdgeSession

MAX_WAITING_SAMPLES = 120 * SAMPLE_RATE  # at most two minutes of source ahead of the model


class SourceFeed:
    """One session's source: `queue` on the event loop, `run` hands it to the engine session."""

    def __init__(self, edge: EdgeSession) -> None:
        self.edge = edge
        self._waiting: collections.deque[np.ndarray] = collections.deque()
        self._samples = 0
        self._wake = asyncio.Event()

    @property
    def waiting_samples(self) -> int:
        """Source audio not yet handed to the engine."""
        return self._samples

    def queue(self, pcm: np.ndarray) -> None:
        self._waiting.append(pcm)
        self._samples += pcm.size
        self._wake.set()

    def heard_to_the_end(self) -> bool:
        """Whether the model has consumed every whole frame of the source received so far."""
        session = self.edge.engine_session
        return not self._samples and (session is None or not session.input_backlog()[0])

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                self._hand_over()
                if self._waiting:
                    await asyncio.sleep(TICK_SECONDS / 2)

    def _hand_over(self) -> None:
        """Frames to the engine session while its buffer is under half full."""
        session = self.edge.engine_session
        if session is None:
            return
        buffered, capacity = session.input_backlog()
        room = capacity // 2 - buffered  # frames it takes now (a partial chunk counts as one)
        while self._waiting and room > 0:
            room -= 1
            chunk = self._waiting[0]
            frame, rest = chunk[:FRAME_SAMPLES], chunk[FRAME_SAMPLES:]
            if rest.size:
                self._waiting[0] = rest
            else:
                self._waiting.popleft()
            self._samples -= frame.size
            session.push_audio(frame)
