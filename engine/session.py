"""What the event loop holds for one conversation: its input buffer, its output stream,
and the calls the network edge makes (`push_audio`, `close`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .config import SessionOptions
from .input_buffer import InputBuffer, InputError
from .stream import OutputStream

if TYPE_CHECKING:  # only for annotations: the engine imports this module, not the reverse
    from .engine import Engine


@dataclass(frozen=True)
class FrameOut:
    """One 80 ms output frame of a duplex session."""

    pcm: np.ndarray  # [FRAME_SAMPLES] float32, the agent's audio
    text: str  # the transcript piece this frame adds ("" for padding)
    text_token: int  # the raw text token id
    tick: int  # the engine tick that produced it (for ordering and tests)
    produced_at: float  # time.monotonic() at the end of that tick (the edge measures delivery delay from it)


class Session:
    """Handle returned by `Engine.open`. `events` is the session's OutputStream."""

    def __init__(self, engine: "Engine", request_id: str, row: int, options: SessionOptions,
                 events: OutputStream[FrameOut], input_buffer: InputBuffer,
                 ready: asyncio.Future["Session"]) -> None:
        self._engine = engine
        self.request_id = request_id
        self.row = row  # the slot; only the engine uses it, routing is by request_id
        self.options = options
        self.events = events
        self.input = input_buffer
        self.ready = ready  # resolved from the engine thread once the row is prefilled

    def push_audio(self, pcm: object, received_at: float | None = None) -> None:
        """Queue mono float32 PCM at 24 kHz, any length, that reached the server at `received_at`
        (time.monotonic(); default now). Bad audio ends this session only, with
        Terminal(failed, reason); pushing to an ended session does nothing."""
        if self.events.finished:
            return
        try:
            dropped = self.input.push(pcm, received_at)
        except InputError as exc:
            self._engine.fail_session(self, str(exc))
            return
        if dropped:
            self._engine.metrics.inc("overruns", dropped)

    def end_input(self, tail_frames: int | None = None) -> None:
        """A translation's source has ended (Hibiki): the audio pushed so far is translated, the
        model is told the source ended, and the session ends by itself with Terminal(completed)
        once the translation is finished (engine/translation.py). Later audio fails the session.
        OptionsError when the model does not translate."""
        self._engine.end_input(self, tail_frames)

    def close(self) -> None:
        """End the session: the stream ends with Terminal(cancelled) and the slot is free
        for the next open(). Idempotent."""
        self._engine.close_session(self)

    @property
    def closed(self) -> bool:
        return self.events.finished
