"""The scheduler half of a tick: which rows run, with what input.

All row bookkeeping happens on the engine thread. Other threads talk to it only through
`submit_*`, a FIFO inbox drained at the start of each tick, so a close and a later open of
the same row are always applied in the order they happened.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from .host_rows import join_rows
from .session import Session


@dataclass
class TickPlan:
    """What one tick executes."""

    tick: int  # engine tick number
    request_ids: list[str | None]  # row -> request live this tick (None: idle row)
    live_mask: torch.Tensor  # [B] bool, host: rows whose state the step may change
    frames: torch.Tensor  # [B, FRAME_SAMPLES] float32, host: input frames (silence on idle rows)
    underruns: int  # live rows fed silence because their input was empty
    released: list[int]  # rows whose session ended since the last tick: to be reset now
    # row -> when its input frame reached the server (time.monotonic(); an underrun's silence: when
    # this plan made it; idle rows: None). Paired transcripts carry it (transcript delay).
    arrivals: list[float | None]

    @property
    def any_live(self) -> bool:
        return any(rid is not None for rid in self.request_ids)


class Scheduler:
    def __init__(self, max_sessions: int, frame_samples: int) -> None:
        self.max_sessions = max_sessions
        self.frame_samples = frame_samples
        self._rows: list[Session | None] = [None] * max_sessions  # engine thread only
        self._inbox: deque[tuple[str, Session]] = deque()
        self._inbox_lock = threading.Lock()
        self._admissions: deque[Session] = deque()  # waiting for prefill, engine thread only
        self._released: list[int] = []  # engine thread only

    # ---- any thread ----

    def submit_admit(self, session: Session) -> None:
        with self._inbox_lock:
            self._inbox.append(("admit", session))

    def submit_close(self, session: Session) -> None:
        with self._inbox_lock:
            self._inbox.append(("close", session))

    # ---- engine thread ----

    def plan(self, tick: int) -> TickPlan:
        self._apply_inbox()
        frames_in: list[np.ndarray | None] = []  # the rows' frames, None for silence (engine/host_rows.py)
        request_ids: list[str | None] = [None] * self.max_sessions
        arrivals: list[float | None] = [None] * self.max_sessions
        underruns = 0
        for row, session in enumerate(self._rows):
            frame = None
            if session is not None:
                request_ids[row] = session.request_id
                frame, arrivals[row] = session.input.pop()
                if frame is None:
                    underruns += 1
                    arrivals[row] = time.monotonic()
            frames_in.append(frame)
        frames = join_rows(frames_in, self.frame_samples)
        live = torch.from_numpy(np.array([rid is not None for rid in request_ids], dtype=bool))  # no torch call
        released, self._released = self._released, []
        return TickPlan(tick, request_ids, live, torch.from_numpy(frames), underruns, released, arrivals)

    def next_admission(self) -> Session | None:
        return self._admissions.popleft() if self._admissions else None

    def has_admissions(self) -> bool:
        return bool(self._admissions)

    def has_inbox(self) -> bool:
        """Opens or closes arrived since the last plan (any thread may ask)."""
        with self._inbox_lock:
            return bool(self._inbox)

    def activate(self, session: Session) -> None:
        """The row is prefilled: it runs from the next tick on."""
        self._rows[session.row] = session

    def live_sessions(self) -> list[Session]:
        return [s for s in self._rows if s is not None]

    def _apply_inbox(self) -> None:
        with self._inbox_lock:
            commands = list(self._inbox)
            self._inbox.clear()
        for kind, session in commands:
            if kind == "admit":
                self._admissions.append(session)
            elif self._rows[session.row] is session:  # close: only if it still owns the row
                self._rows[session.row] = None
                self._released.append(session.row)
