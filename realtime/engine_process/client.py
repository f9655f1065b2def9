"""`RemoteClient`: the engine client of an edge worker, whose engine runs in another process.

It makes the calls of `realtime/engine_client.py`'s `EngineClient` over the link of
engine_process/wire.py. Rules this module keeps:
1. Stream ids are this worker's (one counter for sessions and requests); the engine process keys
   what it holds by them (engine_process/core.py).
2. A call that must answer at once answers from what this side knows: `admit` and `reopen` send
   their admission and hand back the handle at once, and `ready` raises what the engine refused
   (SessionFull, OptionsRejected, SessionClosed), as in-process; the counters, health and free
   rows are the engine's last status, at most `STATUS_INTERVAL_S` old. Submitting a request waits
   for the engine's answer (its refusals are the in-process ones).
3. Each stream's events come from the events ring into its own bounded inbox: a door that does
   not read loses its oldest frames, counted, never another stream's; a terminal is never dropped.
4. If the engine process goes, every open stream ends with Terminal(failed), `healthy` and
   `running` are False (so /readyz fails and doors answer 503), and the client links again when the
   supervisor has started a new engine process.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from typing import Any, AsyncIterator

from ..engine_client import (
    DuplexSession, FrameOut, ImageFacts, ImageSpec, Job, OptionsError, PoolSlots, SessionClosed,
    OpensSessions, SessionOptions, SpeechJob, Status, SttFacts, SttPartial, Terminal, TranscriptionJob, TtsRequest,
)
from .rings import ByteRing
from .wire import Channel, ChannelClosed, Doorbell, input_parts, read_event

log = logging.getLogger("parley.edge")
RING_BYTES = 16 << 20  # each direction; a full events ring drops frames (engine_process/core.py rule 3)
INBOX_FRAMES = 64  # frames a stream's inbox holds before it drops its oldest (rule 3)
ENGINE_GONE = "the engine process stopped; the supervisor is restarting it"
LINK_RETRY_S = 0.2  # how often an unlinked worker tries the engine's socket while an engine process loads
# The counters while unlinked: no slot free, not healthy, so admission refuses as "unhealthy" (rule 4)
UNLINKED_COUNTERS = {"free_slots": 0, "live_slots": 0, "healthy": False, "ticks": 0}


class _Inbox:
    """One stream's events (rule 3), read by one consumer."""

    def __init__(self) -> None:
        self._events: collections.deque = collections.deque()
        self._wake = asyncio.Event()
        self.dropped = 0
        self.ended = False
        self.backlog = 0  # the input frames the engine last reported buffered (duplex sessions)

    def put(self, event: Any) -> None:
        if self.ended:
            return
        if not isinstance(event, Terminal) and len(self._events) >= INBOX_FRAMES:
            self._events.popleft()
            self.dropped += 1
        self._events.append(event)
        self.ended = isinstance(event, Terminal)
        self._wake.set()

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            while self._events:
                event = self._events.popleft()
                yield event
                if isinstance(event, Terminal):
                    return
            self._wake.clear()
            await self._wake.wait()


class _RemoteWork:
    """What a `Job` handle calls on its request: each a cast to the engine process (rule 1)."""

    def __init__(self, client: "RemoteClient", stream: int) -> None:
        self._client, self._stream = client, stream
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._client.cast("job", self._stream, "cancel")

    def feed(self, pcm: Any, received_at: float | None = None) -> None:
        self._client.send_audio(self._stream, pcm, received_at)

    def end_input(self) -> None:
        self._client.cast("job", self._stream, "end_input")

    def append(self, entries: Any) -> None:
        self._client.cast("job", self._stream, "append", tuple(entries))

    def end_text(self) -> None:
        self._client.cast("job", self._stream, "end_text")


class RemoteClient(OpensSessions):
    """The engine client over the link to the engine process (module docstring)."""

    def __init__(self, path: str, worker: int) -> None:
        self._path, self.worker = path, worker
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._inboxes: dict[int, _Inbox] = {}
        self._channel: Channel | None = None
        self._audio_in: ByteRing | None = None
        self._events_out: ByteRing | None = None
        self._bell = Doorbell(lambda: self._channel)
        self._status: tuple = ({}, False, False, None, None)
        self.audio_dropped = 0  # input frames the full audio ring refused
        self.max_sessions = 0
        self.can_transcribe = False
        self.edge_spec: Any = None
        self._facts: dict = {}
        self.others: list[bytes] = []  # the other processes' metrics, exposition text (engine_process/core.py rule 5)

    # ---- the link ----

    async def link(self) -> None:
        """Link once an engine process answers. Until one is ready its socket refuses, and one that
        dies mid-hello closes the channel (the supervisor starts another): both mean try again."""
        while True:
            try:
                await self.connect()
                return
            except (OSError, ChannelClosed):
                await asyncio.sleep(LINK_RETRY_S)

    async def connect(self) -> None:
        """Link to the engine process (its hello gives what the app is built from)."""
        reader, writer = await asyncio.open_unix_connection(self._path)
        channel = Channel(reader, writer)
        rings = ByteRing.create(RING_BYTES), ByteRing.create(RING_BYTES)
        try:
            channel.send(("hello", self.worker, rings[0].name, rings[1].name))
            kind, self.edge_spec, self.max_sessions, self.can_transcribe, self._facts = await channel.receive()
        except BaseException:
            channel.close()
            for ring in rings:
                ring.close(unlink=True)  # the engine never attached (rings.py rule 4)
            raise
        self._audio_in, self._events_out = rings
        assert kind == "hello", f"the engine process answered {kind!r} to a hello"
        kind, *status = await channel.receive()  # the engine sends its status right after its hello
        assert kind == "status", f"the engine process sent {kind!r} where its status belongs"
        self._status = tuple(status)
        self._channel = channel

    async def run(self) -> None:
        """Read the link until it ends (rule 4), then link again; runs for the worker's life."""
        while True:
            try:
                await self._read()
            except ChannelClosed as exc:
                log.error("edge worker %d lost the engine process: %s", self.worker, exc)
            self._unlink()
            await self.link()
            log.info("edge worker %d linked to the engine process again", self.worker)

    async def _read(self) -> None:
        assert self._channel is not None
        while True:
            message = await self._channel.receive()
            kind = message[0]
            self._drain_events()  # what the engine wrote before this message comes first (wire.py rule 3)
            if kind == "status":
                self._status = message[1:]
            elif kind == "metrics":
                self.others = message[1]
            elif kind == "reply":
                _, call_id, ok, value = message
                future = self._calls.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_result(value) if ok else future.set_exception(value)

    def _drain_events(self) -> None:
        assert self._events_out is not None
        while (record := self._events_out.read()) is not None:
            stream, event, backlog = read_event(record)
            inbox = self._inboxes.get(stream)
            if inbox is None:
                continue  # closed on this side already
            if backlog is not None:
                inbox.backlog = backlog
            inbox.put(event)
            if isinstance(event, Terminal):
                del self._inboxes[stream]

    def _unlink(self) -> None:
        self.others = []
        self._status = ({}, False, False, None, None)
        for inbox in self._inboxes.values():
            inbox.put(Terminal(Status.FAILED, ENGINE_GONE))
        self._inboxes.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(SessionClosed(ENGINE_GONE))
        self._calls.clear()
        if self._channel is not None:
            self._channel.close()
        for ring in (self._audio_in, self._events_out):
            if ring is not None:
                ring.close()
        self._channel = self._audio_in = self._events_out = None

    def close_link(self) -> None:
        """The worker is exiting: end the link (the engine process ends what this worker held)."""
        self._unlink()

    def cast(self, method: str, *args: Any) -> None:
        if self._channel is None:
            return  # the engine has gone: what this would end has ended
        try:
            self._channel.send(("cast", method, args))
        except ChannelClosed:
            pass

    async def call(self, method: str, *args: Any) -> Any:
        if self._channel is None:
            raise SessionClosed(ENGINE_GONE)
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._channel.send(("call", call_id, method, args))
        except ChannelClosed as exc:
            self._calls.pop(call_id, None)
            raise SessionClosed(ENGINE_GONE) from exc
        return await future

    def send_audio(self, stream: int, pcm: Any, received_at: float | None) -> None:
        if self._audio_in is None or stream not in self._inboxes:
            return
        if not self._audio_in.write(*input_parts(stream, pcm, received_at)):
            self.audio_dropped += 1
            return
        self._bell.ring()

    def _open_stream(self) -> tuple[int, _Inbox]:
        stream = next(self._ids)
        inbox = self._inboxes[stream] = _Inbox()
        return stream, inbox

    # ---- status (rule 2) ----

    @property
    def healthy(self) -> bool:
        return self._channel is not None and self._status[1]

    @property
    def running(self) -> bool:
        return self._channel is not None and self._status[2]

    @property
    def linked(self) -> bool:
        return self._channel is not None

    def counters(self) -> dict:
        return dict(self._status[0]) if self._channel is not None else dict(UNLINKED_COUNTERS)

    def speech_slots(self) -> PoolSlots:
        return self._status[3] or PoolSlots(0, 0)

    def stt_slots(self) -> PoolSlots:
        return self._status[4] or PoolSlots(0, 0)

    def stt_facts(self) -> SttFacts:
        assert self._facts.get("stt") is not None, "no STT model is loaded"
        return self._facts["stt"]

    def image_facts(self) -> ImageFacts:
        assert self._facts.get("image") is not None, "no image model is loaded"
        return self._facts["image"]

    # ---- duplex sessions ----

    def admit(self, options: SessionOptions) -> DuplexSession:
        if self._channel is None:
            raise SessionClosed(ENGINE_GONE)
        stream, _ = self._open_stream()
        self.cast("admit", stream, options)
        return DuplexSession(self, stream, options)

    async def ready(self, session: DuplexSession) -> None:
        try:
            await self.call("ready", session.id)
        except BaseException:
            self._inboxes.pop(session.id, None)
            raise

    def reopen(self, old: DuplexSession, options: SessionOptions) -> DuplexSession:
        if self._channel is None:
            raise SessionClosed(ENGINE_GONE)
        self._inboxes.pop(old.id, None)
        stream, _ = self._open_stream()
        self.cast("reopen", old.id, stream, options)
        return DuplexSession(self, stream, options)

    def push_audio(self, session: DuplexSession, pcm: Any, received_at: float | None = None) -> None:
        self.send_audio(session.id, pcm, received_at)

    def events(self, session: DuplexSession) -> AsyncIterator[FrameOut | Terminal]:
        inbox = self._inboxes.get(session.id)
        if inbox is None:
            return _once(Terminal(Status.CANCELLED, "closed by the client"))
        return inbox.__aiter__()

    def transcription(self, session: DuplexSession) -> AsyncIterator[SttPartial | Terminal]:
        if not self.can_transcribe:
            raise OptionsError("this server has no transcription model for its sessions")
        if session.id not in self._inboxes:
            raise SessionClosed("the session has ended")
        stream, inbox = self._open_stream()
        self.cast("transcribe", session.id, stream)
        return inbox.__aiter__()

    async def force_text(self, session: DuplexSession, text: str) -> int:
        if session.id not in self._inboxes:
            raise SessionClosed("the session has ended")
        return await self.call("force_text", session.id, text)

    def is_closed(self, session: DuplexSession) -> bool:
        inbox = self._inboxes.get(session.id)
        return inbox is None or inbox.ended

    def input_backlog(self, session: DuplexSession) -> tuple[int, int]:
        inbox = self._inboxes.get(session.id)
        return (0 if inbox is None else inbox.backlog), self._facts["input_frames"]

    def end_input(self, session: DuplexSession, tail_frames: int | None = None) -> None:
        if session.id in self._inboxes:
            self.cast("end_input", session.id, tail_frames)

    def close(self, session: DuplexSession) -> None:
        if self._inboxes.pop(session.id, None) is not None:
            self.cast("close", session.id)

    # ---- requests ----

    async def _submit(self, method: str, *args: Any) -> tuple[int, _RemoteWork, _Inbox]:
        stream, inbox = self._open_stream()
        try:
            await self.call(method, stream, *args)
        except BaseException:
            self._inboxes.pop(stream, None)
            raise
        return stream, _RemoteWork(self, stream), inbox

    async def submit_speech(self, request: TtsRequest) -> SpeechJob:
        stream, work, inbox = await self._submit("submit_speech", request)
        return SpeechJob(f"w{self.worker}-{stream}", work, inbox)

    async def submit_transcription(self, *, live: bool = False, temperature: float = 0.0) -> TranscriptionJob:
        stream, work, inbox = await self._submit("submit_transcription", live, temperature)
        return TranscriptionJob(f"w{self.worker}-{stream}", work, inbox)

    async def submit_image(self, spec: ImageSpec) -> Job:
        stream, work, inbox = await self._submit("submit_image", spec)
        return Job(f"w{self.worker}-{stream}", work, inbox)

    async def image_refusal(self, width: int, height: int, guidance: float) -> str | None:
        return await self.call("image_refusal", width, height, guidance)


async def _once(terminal: Terminal) -> AsyncIterator[Terminal]:
    yield terminal
