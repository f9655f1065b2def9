"""The end of a translation's source (Hibiki): the input end code, then the translation's end.

A translation session's source ends when its client says so (`Session.end_input`); the model
must be told, or it keeps waiting for more speech. Rules:
1. `Engine.end_input` (event loop): the session's input is finished (`InputBuffer.finish`: the
   unfinished frame padded with silence, later audio an error) and the session queued here.
2. Engine thread, after each plan: a session taken from the queue waits for the frames still in
   its buffer; the tick after the last of them, its row is fed silence and the backend writes the
   input end-of-stream code into every user codebook (`end_source`, the reference's
   `add_input_eos`). From then on the row is fed silence (its buffer is empty), as the reference
   pads the source with silence, while the model finishes the translation.
3. Engine thread, after the step and before routing: the first valid output frame, from the end
   code's tick on, whose text token is end-of-text (2) ends the session with Terminal(completed);
   that frame is not routed (the reference cuts its translation there). A session whose model has
   said no end of text in the `tail_frames` frames from the end code's on ends the same way at the
   next one, the reason saying so. An end of text before the source ended reads as padding (the loader's rule).
4. A session that ended otherwise (closed, failed) is dropped at the next tick.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from parley.models.config import FRAME_RATE, TEXT_EOS

from .backend import HostOutput
from .config import OptionsError
from .scheduler import TickPlan
from .session import Session
from .stream import Status, Terminal

# Frames a translation may run past its source's end before it is ended without an end of text:
# the reference's offline run stops at its generation length; a live session needs a bound.
TAIL_FRAMES = int(20 * FRAME_RATE)  # 20 s


class SourceEndBackend(Protocol):
    def end_source(self, row: int) -> None:
        """The row's next step writes the input end code (engine thread, between ticks)."""


@dataclass
class _Ending:
    session: Session
    wait: int  # ticks until the end code's frame (frames still buffered when taken)
    tail: int  # frames still routed, from the end code's on, while no end of text comes
    sent: bool = False  # the end code was written


class SourceEnds:
    def __init__(self, backend: SourceEndBackend, finish: Callable[[Session, Terminal], None]) -> None:
        self._backend = backend
        self._finish = finish  # ends a session (Engine._end_session), engine thread
        self._inbox: deque[tuple[Session, int]] = deque()
        self._lock = threading.Lock()
        self._endings: dict[str, _Ending] = {}  # engine thread only

    def end_input(self, session: Session, tail_frames: int | None = None) -> None:
        """The session's source has ended (any thread): its pending audio is still translated, then
        the input end code goes in, and the session ends with Terminal(completed) when the model ends
        its translation, or `tail_frames` frames (default TAIL_FRAMES) after the end code. Idempotent."""
        if tail_frames is not None and (isinstance(tail_frames, bool) or not isinstance(tail_frames, int)
                                        or tail_frames < 1):
            raise OptionsError(f"tail_frames must be a whole number of at least 1, got {tail_frames!r}.")
        if session.closed or session.input.ended:
            return
        session.input.finish()
        with self._lock:  # rule 1's queue
            self._inbox.append((session, TAIL_FRAMES if tail_frames is None else tail_frames))

    def before_step(self, plan: TickPlan) -> None:
        """Rules 2 and 4, after the plan popped this tick's frames."""
        due = []
        for rid, ending in list(self._endings.items()):
            if ending.session.closed:
                del self._endings[rid]  # rule 4
            elif plan.request_ids[ending.session.row] != rid:
                continue  # not live yet (still being prefilled): its frames are all still buffered
            elif not ending.sent and ending.wait == 0:
                due.append(ending)
            elif not ending.sent:
                ending.wait -= 1
        for ending in due:
            self._backend.end_source(ending.session.row)
            ending.sent = True
        with self._lock:
            taken, self._inbox = list(self._inbox), deque()
        for session, tail in taken:
            if not session.closed:
                self._endings[session.request_id] = _Ending(session, len(session.input), tail)

    def after_step(self, plan: TickPlan, host: HostOutput) -> None:
        """Rule 3: end the sessions whose translation is finished, before the frame is routed."""
        for rid, ending in list(self._endings.items()):
            row = ending.session.row
            if not ending.sent or plan.request_ids[row] != rid:
                continue
            if host.valid[row] and host.text_tokens[row] == TEXT_EOS:
                reason = "the translation is complete"
            elif ending.tail == 0:
                reason = "the model said no end of text within the tail after the source ended"
            else:
                ending.tail -= 1
                continue
            del self._endings[rid]
            self._finish(ending.session, Terminal(Status.COMPLETED, reason))

    def __len__(self) -> int:
        return len(self._endings)
