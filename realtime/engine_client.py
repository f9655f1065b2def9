"""The engine client: the one interface through which every door reaches the engine.

Rules this module keeps:
1. Doors (chat/, realtime_api/, live/, calls/, webrtc/, http/, kyutai/, sessions/) import engine names from
   here and from nowhere else (tests/test_layering.py). server/ builds the engine and its pools and
   hands them to `InProcessClient`; a door is given the client, never the engine.
2. What crosses is plain data, designed as messages: the options, frames, transcript pieces, audio
   chunks, image results and terminals re-exported below are frozen dataclasses of numbers,
   strings, bytes and arrays, or enums. No call takes a callback, and no engine object is handed
   out: a door holds a handle (`DuplexSession`, `Job`) that names its work by id and goes back
   through the client for everything. One exception: `SpeechFrontEnd`, the speech requests' text
   front end (tokenizer, voices), runs on the edge's side of the seam, as vLLM's tokenizer runs in
   its API server; what it makes, a `TtsRequest` or the word entries a `SpeechJob` appends, is
   plain data.
3. Admission answers with the client's own exceptions: `SessionFull` (no slot, or no KV memory),
   `OptionsRejected` (the model will not take these options), `SessionClosed` (the engine is not
   serving). Settings refused before admission raise `OptionsError`.
4. `InProcessClient` is the in-process form (tests, `parley offline`, `parley serve --edge-workers 0`,
   and the engine process itself): it wraps the Engine, TtsPool, SttPool and ImageQueue of this
   process. `engine_process/client.py`'s `RemoteClient` is the edge workers' form: the same calls
   over a channel to the engine process, with audio through shared memory.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, Sequence

from parley.engine import (  # plain data and plain errors, re-exported for the doors (rule 2)
    FULL_COLLECTIONS, IMAGE_STALLED, MAX_PARTIAL_IMAGES, SLACK_COLLECTIONS, TICK_PHASES, TICK_SECONDS, EngineClosed,
    EngineFull, FrameOut, ImagePartial, ImageQueueFull, ImageRefused, ImageResult, ImageSpec, OptionsError,
    SamplingOptions, SessionOptions, SessionRejected, SpeechFrontEnd, SpeechInputError, Status, SttBusy, SttFailed,
    SttInputError, SttPartial, Terminal, TtsAudio, TtsPoolFull, TtsRequest, TtsWord, UnknownVoice, WordEnded,
    WordHeard, collect_transcript,
)

if TYPE_CHECKING:
    from parley.engine import Engine, ImageQueue, Session, SttPool, TtsPool

__all__ = [
    "FULL_COLLECTIONS", "IMAGE_STALLED", "MAX_PARTIAL_IMAGES", "SLACK_COLLECTIONS", "TICK_PHASES", "TICK_SECONDS",
    "DuplexSession", "EngineClient", "FrameOut", "ImageFacts", "ImagePartial", "ImageQueueFull", "ImageRefused",
    "ImageResult", "ImageSpec", "InProcessClient", "Job", "OptionsError", "OptionsRejected", "PoolSlots",
    "SamplingOptions", "SessionClosed", "SessionFull", "SessionOptions", "SpeechFrontEnd", "SpeechInputError",
    "SpeechJob", "Status", "SttBusy", "SttFacts", "SttFailed", "SttInputError", "SttPartial", "Terminal",
    "TranscriptionJob", "TtsAudio", "TtsPoolFull", "TtsRequest", "TtsWord", "UnknownVoice", "WordEnded", "WordHeard",
    "collect_transcript",
]


class SessionFull(Exception):
    """No session can be admitted now: every slot is taken, or the KV memory cannot hold one more."""


class OptionsRejected(Exception):
    """The model will not take these session options (a bad persona or voice prompt)."""


class SessionClosed(Exception):
    """The engine is not serving (shut down or failed), or the session ended before it was ready."""


@dataclass(frozen=True)
class ImageFacts:
    """What a door validates an image request against: the image model's facts, as plain data."""

    family: str  # "flow" or a diffusion family (the default guidance depends on it)
    latent_stride: int  # sizes are multiples of this
    default_size: int
    capacity: int  # images outstanding at most (bounds a request's n)


@dataclass(frozen=True)
class SttFacts:
    """What a transcription door reads of the STT model, as plain data."""

    model: str  # the STT model's name (its checkpoint folder)
    text_delay: int  # frames between an audio frame and the text the model gives for it


@dataclass(frozen=True)
class PoolSlots:
    """A request pool's rows now: in all, and free (neither live nor promised to a waiting request).
    A snapshot: another door on the same pool may take a row the next moment."""

    total: int
    free: int

    @property
    def used(self) -> int:
        return self.total - self.free


class _Messages:
    """An async iterator of a stream's messages, and nothing else of the stream."""

    __slots__ = ("_it",)

    def __init__(self, stream: Any) -> None:
        self._it = stream.__aiter__()

    def __aiter__(self) -> "_Messages":
        return self

    async def __anext__(self) -> Any:
        return await self._it.__anext__()


async def _ended(terminal: Terminal) -> AsyncIterator[Terminal]:
    yield terminal


class DuplexSession:
    """A door's handle of one duplex session: its id and the options it runs with. Every call goes
    through the client that admitted it; a re-prefill hands out a new handle (`EngineClient.reopen`)."""

    __slots__ = ("_client", "id", "options")

    def __init__(self, client: "EngineClient", session_id: int, options: SessionOptions) -> None:
        self._client = client
        self.id = session_id
        self.options = options

    def push_audio(self, pcm: Any, received_at: float | None = None) -> None:
        """Mono float32 PCM at 24 kHz, any length, that reached the server at `received_at`."""
        self._client.push_audio(self, pcm, received_at)

    @property
    def events(self) -> AsyncIterator[FrameOut | Terminal]:
        """The session's frames, ending with its Terminal."""
        return self._client.events(self)

    @property
    def closed(self) -> bool:
        return self._client.is_closed(self)

    def input_backlog(self) -> tuple[int, int]:
        """(frames buffered, frames the input buffer holds before it drops its oldest)."""
        return self._client.input_backlog(self)

    def end_input(self, tail_frames: int | None = None) -> None:
        """The source has ended (a translating model): its translation finishes, then the session
        ends with Terminal(completed). OptionsError when the model does not translate."""
        self._client.end_input(self, tail_frames)

    def close(self) -> None:
        """End the session; its slot is free at once. Idempotent."""
        self._client.close(self)


class Job:
    """A door's handle of one speech, transcription or image request: its id, its events, cancel."""

    def __init__(self, request_id: str, work: Any, stream: Any) -> None:
        self.request_id = request_id
        self._work = work  # the in-process request object; never handed to the door
        self._stream = stream

    @property
    def events(self) -> AsyncIterator[Any]:
        """The request's events, ending with its Terminal."""
        return _Messages(self._stream)

    def cancel(self) -> None:
        """The client went away: the engine drops the request at its next item. Idempotent."""
        self._work.cancel()

    @property
    def cancelled(self) -> bool:
        return bool(self._work.cancelled)


class TranscriptionJob(Job):
    """A transcription request: audio fed in, SttPartial events out, then its Terminal."""

    def feed(self, pcm: Any, received_at: float | None = None) -> None:
        """Mono float PCM at 24 kHz; SttInputError for bad or too much audio."""
        self._work.feed(pcm, received_at)

    def end_input(self) -> None:
        self._work.end_input()


class SpeechJob(Job):
    """A speech request; one submitted with `text_open` takes its later words as they stream in
    (entries made by `SpeechFrontEnd.more_words`), until `end_text`."""

    def append(self, entries: Sequence[Any]) -> None:
        """More words for the row's script; the row speaks them after those it holds."""
        self._work.append(entries)

    def end_text(self) -> None:
        """No more words: the row flushes its last word and ends. Idempotent."""
        self._work.end_text()


class OpensSessions:
    """`open` for both clients, from their own `admit`, `ready` and `close`."""

    async def open(self, options: SessionOptions) -> DuplexSession:
        """`admit`, then `ready`; a caller that goes away meanwhile gives the slot back."""
        session = self.admit(options)  # type: ignore[attr-defined]
        try:
            await self.ready(session)  # type: ignore[attr-defined]
        except asyncio.CancelledError:
            self.close(session)  # type: ignore[attr-defined]
            raise
        return session


class EngineClient(Protocol):
    """The calls a door makes (rule 1): `InProcessClient` here, `RemoteClient` in an edge worker."""

    max_sessions: int

    @property
    def can_transcribe(self) -> bool: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def running(self) -> bool: ...
    def counters(self) -> dict: ...

    # duplex sessions
    def admit(self, options: SessionOptions) -> DuplexSession: ...
    async def ready(self, session: DuplexSession) -> None: ...
    async def open(self, options: SessionOptions) -> DuplexSession: ...
    def reopen(self, old: DuplexSession, options: SessionOptions) -> DuplexSession: ...
    def push_audio(self, session: DuplexSession, pcm: Any, received_at: float | None = None) -> None: ...
    def events(self, session: DuplexSession) -> AsyncIterator[FrameOut | Terminal]: ...
    def transcription(self, session: DuplexSession) -> AsyncIterator[SttPartial | Terminal]: ...
    async def force_text(self, session: DuplexSession, text: str) -> int: ...
    def is_closed(self, session: DuplexSession) -> bool: ...
    def input_backlog(self, session: DuplexSession) -> tuple[int, int]: ...
    def end_input(self, session: DuplexSession, tail_frames: int | None = None) -> None: ...
    def close(self, session: DuplexSession) -> None: ...

    # requests
    async def submit_speech(self, request: TtsRequest) -> SpeechJob: ...
    def speech_slots(self) -> PoolSlots: ...
    async def submit_transcription(self, *, live: bool = False, temperature: float = 0.0) -> TranscriptionJob: ...
    def stt_facts(self) -> SttFacts: ...
    def stt_slots(self) -> PoolSlots: ...
    async def submit_image(self, spec: ImageSpec) -> Job: ...
    def image_facts(self) -> ImageFacts: ...
    async def image_refusal(self, width: int, height: int, guidance: float) -> str | None: ...


class InProcessClient(OpensSessions):
    """The engine client over this process's Engine and pools (rule 4). Engine errors are turned
    into the client's own at admission (rule 3); each open duplex session is kept by id."""

    def __init__(self, engine: "Engine", *, tts: "TtsPool | None" = None, stt: "SttPool | None" = None,
                 images: "ImageQueue | None" = None) -> None:
        self._engine = engine
        self._tts, self._stt, self._images = tts, stt, images
        self._sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)
        self.max_sessions = engine.max_sessions

    @property
    def engine(self) -> "Engine":
        """The wrapped engine: for the server that built it (its lifetime, its fatal hook) and for
        tests. Never a door's (rule 1)."""
        return self._engine

    @property
    def can_transcribe(self) -> bool:
        """Whether duplex sessions can be transcribed (a paired STT model is loaded)."""
        return self._engine.can_transcribe

    @property
    def healthy(self) -> bool:
        return self._engine.healthy

    @property
    def running(self) -> bool:
        return self._engine.running

    def counters(self) -> dict:
        """The engine's counters, as /metrics and /load read them."""
        return self._engine.counters()

    # ---- duplex sessions ----

    def admit(self, options: SessionOptions) -> DuplexSession:
        """Take a slot now (its prefill follows: `ready`). SessionFull, SessionClosed, OptionsError."""
        try:
            session = self._engine.open_nowait(options)
        except EngineFull as exc:
            raise SessionFull(str(exc)) from exc
        except EngineClosed as exc:
            raise SessionClosed(str(exc)) from exc
        handle = DuplexSession(self, next(self._ids), options)
        self._sessions[handle.id] = session
        return handle

    async def ready(self, session: DuplexSession) -> None:
        """Wait for the prefill. OptionsRejected or SessionClosed; the session is then over."""
        try:
            await self._sessions[session.id].ready
        except SessionRejected as exc:
            self._sessions.pop(session.id, None)
            raise OptionsRejected(str(exc)) from exc
        except EngineClosed as exc:
            self._sessions.pop(session.id, None)
            raise SessionClosed(str(exc)) from exc

    def reopen(self, old: DuplexSession, options: SessionOptions) -> DuplexSession:
        """Re-prefill: end `old` and admit `options` in its slot, with no await in between, so no
        other connection can take the slot freed. `ready` follows, as after `admit`."""
        self.close(old)
        return self.admit(options)

    def push_audio(self, session: DuplexSession, pcm: Any, received_at: float | None = None) -> None:
        engine_session = self._sessions.get(session.id)
        if engine_session is not None:  # pushing to an ended session does nothing
            engine_session.push_audio(pcm, received_at)

    def events(self, session: DuplexSession) -> AsyncIterator[FrameOut | Terminal]:
        engine_session = self._sessions.get(session.id)
        if engine_session is None:  # closed here already: its stream has ended so
            return _Messages(_ended(Terminal(Status.CANCELLED, "closed by the client")))
        return _Messages(engine_session.events)

    def transcription(self, session: DuplexSession) -> AsyncIterator[SttPartial | Terminal]:
        """What the paired STT hears on `session`, until it ends. OptionsError: no STT model."""
        engine_session = self._sessions.get(session.id)
        if engine_session is None:
            raise SessionClosed("the session has ended")
        return _Messages(self._engine.enable_transcription(engine_session))

    async def force_text(self, session: DuplexSession, text: str) -> int:
        """Have the model say `text`; the tokens queued. OptionsError where it cannot."""
        engine_session = self._sessions.get(session.id)
        if engine_session is None:
            raise SessionClosed("the session has ended")
        return await self._engine.force_text(engine_session, text)

    def is_closed(self, session: DuplexSession) -> bool:
        engine_session = self._sessions.get(session.id)
        return engine_session is None or engine_session.closed

    def input_backlog(self, session: DuplexSession) -> tuple[int, int]:
        engine_session = self._sessions.get(session.id)
        if engine_session is None:
            return 0, 0
        return len(engine_session.input), engine_session.input.max_frames

    def end_input(self, session: DuplexSession, tail_frames: int | None = None) -> None:
        engine_session = self._sessions.get(session.id)
        if engine_session is not None:  # an ended session's source has nothing left to end
            engine_session.end_input(tail_frames)

    def close(self, session: DuplexSession) -> None:
        engine_session = self._sessions.pop(session.id, None)
        if engine_session is not None:
            engine_session.close()

    # ---- requests ----

    async def submit_speech(self, request: TtsRequest) -> SpeechJob:
        """A speech request (its text may stay open: `SpeechJob`); TtsPoolFull when the pool's
        queue is full."""
        assert self._tts is not None, "no TTS model is loaded"
        job = self._tts.submit(request, asyncio.get_running_loop())
        return SpeechJob(job.request_id, job, job.stream)

    def speech_slots(self) -> PoolSlots:
        assert self._tts is not None, "no TTS model is loaded"
        return PoolSlots(self._tts.slots, self._tts.free)

    async def submit_transcription(self, *, live: bool = False, temperature: float = 0.0) -> TranscriptionJob:
        """A transcription request; SttBusy when no row or queue place is left, SttInputError."""
        assert self._stt is not None, "no STT model is loaded"
        request = self._stt.submit(asyncio.get_running_loop(), live=live, temperature=temperature)
        return TranscriptionJob(request.request_id, request, request.events)

    def stt_facts(self) -> SttFacts:
        assert self._stt is not None, "no STT model is loaded"
        return SttFacts(self._stt.name, self._stt.gen.text_delay)

    def stt_slots(self) -> PoolSlots:
        assert self._stt is not None, "no STT model is loaded"
        return PoolSlots(self._stt.slots, self._stt.free)

    async def submit_image(self, spec: ImageSpec) -> Job:
        """An image request; ImageQueueFull, ImageRefused."""
        assert self._images is not None, "no image model is loaded"
        request = self._images.submit(spec)
        return Job(request.request_id, request, request.events)

    def image_facts(self) -> ImageFacts:
        assert self._images is not None, "no image model is loaded"
        stepper = self._images.stepper
        return ImageFacts(stepper.family, stepper.latent_stride, stepper.default_size, self._images.capacity)

    async def image_refusal(self, width: int, height: int, guidance: float) -> str | None:
        """Why images of this size can never be served here (at this guidance), or None."""
        assert self._images is not None, "no image model is loaded"
        return self._images.refusal(width, height, self._images.stepper.cfg_for(guidance))
