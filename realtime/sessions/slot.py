"""One connection's slot in the engine: the reservation, the duplex session admitted into it, and
what follows from it.

Rules this module keeps:
1. The slot reserved before the upgrade (sessions/capacity.py) is held until the engine session's
   prefill is done or has failed; then the reservation is released, whatever happened.
2. Re-prefill hands the slot over with no await between closing the old session and admitting the
   new one, so no other connection can take it on this event loop (EngineClient.reopen). Options
   the model rejects bring the previous ones back the same way, then the rejection is raised.
3. Followers (frames, the paired transcript) follow whichever session holds the slot: a stream
   that ends because of a re-prefill is followed by the new session's.
4. `close()` is idempotent and never blocks: the engine frees the slot at once.
5. Every engine call goes through the engine client (realtime/engine_client.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from ..engine_client import (
    DuplexSession, EngineClient, FrameOut, OptionsError, OptionsRejected, SessionClosed, SessionFull,
    SessionOptions, Status, SttPartial, Terminal,
)
from .capacity import Reservation
from .counters import Counters

if TYPE_CHECKING:
    from .session import ServerDefaults


class Slot:
    """A connection's engine session, opened, replaced on re-prefill, followed and closed."""

    def __init__(self, client: EngineClient, defaults: "ServerDefaults", counters: Counters,
                 reservation: Reservation | None = None) -> None:
        self._client = client
        self._defaults = defaults
        self._counters = counters
        self.reservation = reservation  # the slot held since before the upgrade was accepted
        self.session: DuplexSession | None = None
        self._reopen_lock = asyncio.Lock()
        self._closed = False

    @property
    def can_transcribe(self) -> bool:
        """Whether this server can transcribe what the user says on a duplex session."""
        return self._client.can_transcribe

    async def open(self, options: SessionOptions) -> DuplexSession:
        """Admit through the engine and wait for the prefill (rule 1). Raises SessionFull (no slot),
        OptionsRejected / OptionsError (bad options) or SessionClosed (engine down)."""
        options = self._defaults.client_options(options)
        try:
            if self.reservation is not None:
                self.reservation.opening()  # the engine takes the slot synchronously inside open()
            session = await self._client.open(options)
        except SessionFull:
            self._counters.refused()
            raise
        finally:
            if self.reservation is not None:
                self.reservation.release()
        if self._closed:  # the client left while we prefilled
            session.close()
            raise SessionClosed("the connection closed during prefill")
        self.session = session
        return session

    async def reopen(self, options: SessionOptions) -> DuplexSession:
        """Re-prefill with `options` (rule 2). SessionFull / SessionClosed: the slot was lost."""
        async with self._reopen_lock:
            old = self.session
            assert old is not None, "reopen needs an open session"
            options = self._defaults.client_options(options)
            self.session = self._client.reopen(old, options)
            try:
                await self._client.ready(self.session)
            except OptionsRejected:
                self.session = self._client.reopen(self.session, old.options)
                await self._client.ready(self.session)
                raise
            return self.session

    async def wait_reopen(self) -> None:
        """Return once no re-prefill is in flight."""
        async with self._reopen_lock:
            return

    def push_audio(self, pcm: Any, received_at: float | None = None) -> None:
        """Input audio to the session holding the slot (none yet: dropped)."""
        if self.session is not None:
            self.session.push_audio(pcm, received_at)

    async def force_text(self, text: str) -> int:
        """Have the model say `text` (EngineClient.force_text)."""
        assert self.session is not None, "force_text needs an open session"
        return await self._client.force_text(self.session, text)

    def transcription(self) -> AsyncIterator[SttPartial | Terminal]:
        """What the paired STT hears on this session, until it ends. OptionsError: no STT model."""
        assert self.session is not None, "transcription needs an open session"
        return self._client.transcription(self.session)

    async def follow_frames(self, on_frame: Callable[[FrameOut], Awaitable[None]]) -> Terminal | None:
        """Hand every output frame to `on_frame` (its handling time counted), following the session a
        re-prefill hands the slot to (rule 3); how the last one ended (None: no terminal)."""
        while True:
            session = self.session
            assert session is not None
            terminal: Terminal | None = None
            async for event in session.events:
                if isinstance(event, Terminal):
                    terminal = event
                    break
                start = time.perf_counter()
                await on_frame(event)
                self._counters.frame_handled(time.perf_counter() - start)
            await self.wait_reopen()
            if session is self.session:
                return terminal

    async def follow_transcript(self, on_partial: Callable[[Any], Awaitable[bool]],
                                on_failed: Callable[[str], Awaitable[None]]) -> None:
        """Follow what the paired STT hears (SttPartial to `on_partial`, which says whether it sent
        something: its delay is counted), and after a re-prefill the new session's (rule 3); a
        failed transcript's reason goes to `on_failed`."""
        while True:
            session = self.session
            if session is None or session.closed:
                return
            try:
                stream = self._client.transcription(session)
            except (OptionsError, SessionClosed):
                return
            async for event in stream:
                if isinstance(event, Terminal):
                    if event.status is Status.FAILED:
                        await on_failed(event.reason)
                    break
                if await on_partial(event):
                    self._counters.transcript_sent("paired", event.input_at)
            await asyncio.sleep(0.05)
            if self.session is session:
                return

    def close(self) -> None:
        """End the session and give the reservation back (rule 4)."""
        if self._closed:
            return
        self._closed = True
        if self.reservation is not None:
            self.reservation.release()
        if self.session is not None:
            self.session.close()
