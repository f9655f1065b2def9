"""The peer's audio into a connection's engine session: live audio straight to the model, and
audio items (`/v1/realtime`'s `conversation.item.create`) fed at real-time pace, one 80 ms frame
per 80 ms (the engine's input buffer holds only 2 s), with live audio appended meanwhile queued
behind them.
"""

from __future__ import annotations

import asyncio
import collections
import time

import numpy as np

from parley.models import FRAME_SAMPLES, SAMPLE_RATE

from ..sessions.session import EdgeSession
from ..realtime_api.settings import ClientError

MAX_QUEUED_ITEM_SAMPLES = 120 * SAMPLE_RATE  # audio waiting to be heard behind items: at most 2 minutes


class InputPacer:
    """One connection's input audio: pushed to its engine session (the one a re-prefill handed the
    slot to), or queued behind item audio that `run` is still feeding."""

    def __init__(self, edge: EdgeSession) -> None:
        self.edge = edge
        self._feed: collections.deque[np.ndarray] = collections.deque()
        self._feed_samples = 0
        self._feed_wake = asyncio.Event()

    @property
    def queued_samples(self) -> int:
        """Audio waiting to be heard."""
        return self._feed_samples

    def hear(self, pcm: np.ndarray) -> None:
        """Live audio goes straight to the model, unless item audio is still being fed: then behind it."""
        if not pcm.size:
            return
        if self._feed:
            if self._feed_samples + pcm.size > MAX_QUEUED_ITEM_SAMPLES:  # faster than real time, for minutes
                raise ClientError("input audio is arriving faster than real time while an audio item is being "
                                  "heard; this chunk was dropped", "invalid_value", "audio")
            self.queue(pcm)
            return
        session = self.edge.slot.session
        if session is not None:
            session.push_audio(pcm)

    def queue(self, pcm: np.ndarray) -> None:
        """Item audio, heard at real-time pace after what is queued already."""
        self._feed.append(pcm)
        self._feed_samples += pcm.size
        self._feed_wake.set()

    async def run(self) -> None:
        """Queued audio reaches the input buffer one 80 ms frame per 80 ms (the buffer holds only 2 s)."""
        step = FRAME_SAMPLES / SAMPLE_RATE
        while True:
            await self._feed_wake.wait()
            self._feed_wake.clear()
            due = time.monotonic()
            while self._feed:
                chunk = self._feed[0]
                frame, rest = chunk[:FRAME_SAMPLES], chunk[FRAME_SAMPLES:]
                if rest.size:
                    self._feed[0] = rest
                else:
                    self._feed.popleft()
                self._feed_samples -= frame.size
                session = self.edge.slot.session
                if session is not None:
                    session.push_audio(frame)
                due += step * frame.size / FRAME_SAMPLES
                await asyncio.sleep(max(0.0, due - time.monotonic()))
