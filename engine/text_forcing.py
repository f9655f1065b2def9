"""Forced text for live sessions (spoken commentary): from the event loop to the row's queue.

`Engine.force_text(session, text)` tokenizes on the loop and hands the ids here; the engine
thread queues them on the session's row at its next plan (models/forced_text.py: they replace
the row's sampled text tokens from its next pause), and the caller's future resolves with the
number of tokens queued, or an error saying why nothing was. A session still prefilling keeps
its text waiting until it runs; an ended session's text is refused.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Callable

from .config import OptionsError
from .scheduler import TickPlan
from .session import Session

Settle = Callable[..., None]  # engine._settle: resolve a future from any thread


class TextForcing:
    def __init__(self, force: Callable[[int, list[int]], bool], settle: Settle) -> None:
        self._force = force  # backend.force_text(row, ids) -> False when the row's queue is full
        self._settle = settle
        self._lock = threading.Lock()
        self._inbox: deque[tuple[Session, list[int], asyncio.Future]] = deque()

    async def say(self, session: Session, ids: list[int]) -> int:
        """Queue `ids` for `session`'s model to say; returns how many, once they are (within a tick)."""
        if not ids:
            raise OptionsError("the text has no tokens to say.")
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.submit(session, ids, done)
        return await done

    def submit(self, session: Session, ids: list[int], done: asyncio.Future) -> None:
        """Any thread: queue `ids` for `session`'s row; `done` resolves on the engine thread."""
        with self._lock:
            self._inbox.append((session, ids, done))

    def apply(self, plan: TickPlan) -> None:
        """Engine thread, before the step: queue what arrived on the rows this plan runs."""
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        waiting = []
        for session, ids, done in items:
            if session.closed:
                self._settle(done, error=OptionsError("the session has ended; its text was not queued."))
            elif plan.request_ids[session.row] != session.request_id:
                waiting.append((session, ids, done))  # still prefilling: it runs at a later tick
            elif self._force(session.row, ids):
                self._settle(done, result=len(ids))
            else:
                self._settle(done, error=OptionsError(
                    f"the session's forced-text queue is full: these {len(ids)} tokens were not queued; "
                    "send them once the model has spoken what is already waiting."))
        if waiting:
            with self._lock:
                self._inbox.extendleft(reversed(waiting))
