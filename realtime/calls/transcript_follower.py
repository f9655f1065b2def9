"""What the paired STT row hears on a connection (engine/stt_paired.py), followed in a task beside
the connection's two directions while the session wants it, on both OpenAI doors; across a
re-prefill it follows the new engine session (Slot.follow_transcript).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from ..sessions.session import EdgeSession


class TranscriptFollower:
    """`heard(partial)` for each SttPartial (True: it sent something, its delay is observed),
    `failed(reason)` for a failed transcript."""

    def __init__(self, edge: EdgeSession, heard: Callable[[Any], Awaitable[bool]],
                 failed: Callable[[str], Awaitable[None]]) -> None:
        self.edge = edge
        self.heard = heard
        self.failed = failed
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Follow the transcript, unless it is followed already (or was, until its session ended)."""
        if self._task is None:
            self._task = asyncio.create_task(self.edge.slot.follow_transcript(self.heard, self.failed))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
