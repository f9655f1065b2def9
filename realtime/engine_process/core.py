"""The engine process's side of each edge worker's link: the worker's calls, run on this process's
in-process engine client.

Rules this module keeps:
1. One `WorkerLink` per connected worker. Everything the worker opened (duplex sessions, requests)
   is kept by the worker's stream id, in this link only: when the link ends (the worker exited or
   died) every one of them is closed or cancelled at once, so their slots free at the next tick and
   no other worker notices.
2. Calls run in the order they arrive. A call that waits (a prefill, a prompt's admission) runs as
   its own task, so one worker's slow call holds up nothing else of the link.
3. Each stream's events go out through the link's events ring, in order (engine_process/wire.py).
   A full ring drops a duplex or speech frame (counted in `frames_dropped`: the worker is not
   keeping up, as a slow client loses its own frames) and holds any other event until there is room.
4. The engine's status (counters, health, the pools' free rows) goes to every worker every
   `STATUS_INTERVAL_S`; admission across workers is decided by the engine (SessionFull), never by
   a worker's copy of it.
5. /metrics is one scrape of every process: each worker sends its metric families here, and each
   gets back this process's and the other workers', so the worker a scrape lands on shows them all
   (exposition text labelled by process, forwarded untouched; http/metrics.py `_Merged` joins
   them into one scrape).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from prometheus_client import CollectorRegistry

from ..engine_client import DuplexSession, FrameOut, InProcessClient, Job, Status, Terminal, TtsAudio
from ..http.metrics import exposition
from .rings import ByteRing
from .wire import Channel, ChannelClosed, Doorbell, event_parts, read_input

log = logging.getLogger("parley.engine_process")
STATUS_INTERVAL_S = 0.05  # how stale a worker's view of the engine's counters may be
METRICS_EVERY = 20  # status pushes between two metrics pushes (rule 5)
FULL_RING_RETRY_S = 0.002  # a held (non-frame) event tries the full ring again after this


def status_of(client: InProcessClient, has_tts: bool, has_stt: bool) -> tuple:
    """What every worker's copy of the engine's status holds (rule 4)."""
    speech = client.speech_slots() if has_tts else None
    stt = client.stt_slots() if has_stt else None
    return ("status", client.counters(), client.healthy, client.running, speech, stt)


class WorkerLink:
    """One edge worker's link (rule 1): its streams, its rings, its calls."""

    def __init__(self, client: InProcessClient, channel: Channel, audio_in: ByteRing, events_out: ByteRing,
                 worker: int) -> None:
        self.client, self.channel, self.worker = client, channel, worker
        self._in, self._out = audio_in, events_out
        self._sessions: dict[int, DuplexSession] = {}
        self._jobs: dict[int, Job] = {}
        self._refused: dict[int, BaseException] = {}  # a reopen's admission error, for its `ready`
        self._tasks: set[asyncio.Task] = set()
        self._bell = Doorbell(lambda: self.channel)
        self.frames_dropped = 0
        self.families = b""  # the worker's metrics (exposition text), as it last sent them (rule 5)

    # ---- events out (rule 3) ----

    async def _forward(self, stream: int, events: Any, session: DuplexSession | None = None) -> None:
        async for event in events:
            backlog = session.input_backlog()[0] if session is not None and isinstance(event, FrameOut) else 0
            parts = event_parts(stream, event, backlog)
            while not self._out.write(*parts):
                if isinstance(event, (FrameOut, TtsAudio)):
                    self.frames_dropped += 1
                    break
                await asyncio.sleep(FULL_RING_RETRY_S)
            self._bell.ring()
            if isinstance(event, Terminal):
                break
        self._sessions.pop(stream, None)
        self._jobs.pop(stream, None)

    def _follow(self, stream: int, events: Any, session: DuplexSession | None = None) -> None:
        self._spawn(self._forward(stream, events, session))

    def _spawn(self, work: Any) -> None:
        """Run `work` as a task of this link's (cancelled when the link ends)."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- audio in ----

    def drain_input(self) -> None:
        while (record := self._in.read()) is not None:
            stream, pcm, received_at = read_input(record)
            try:
                if (session := self._sessions.get(stream)) is not None:
                    session.push_audio(pcm, received_at)
                elif (job := self._jobs.get(stream)) is not None:
                    job.feed(pcm, received_at)  # type: ignore[attr-defined]  # a TranscriptionJob's stream
            except Exception as exc:  # bad audio (SttInputError, a wrong shape): that stream ends, alone
                self._fail(stream, exc)

    def _fail(self, stream: int, exc: Exception) -> None:
        """End one stream whose input the engine refused, with a terminal that says why."""
        log.warning("worker %d stream %d: %s", self.worker, stream, exc)
        self.close(stream)
        if (job := self._jobs.pop(stream, None)) is not None:
            job.cancel()
        self._out.write(*event_parts(stream, Terminal(Status.FAILED, str(exc))))
        self._bell.ring()

    # ---- calls (rule 2) ----

    def admit(self, stream: int, options: Any) -> None:
        try:
            session = self.client.admit(options)
        except Exception as exc:  # SessionFull, SessionClosed, OptionsError: told at `ready`
            self._refused[stream] = exc
            return
        self._sessions[stream] = session
        self._follow(stream, session.events, session)

    async def ready(self, stream: int) -> None:
        if (refused := self._refused.pop(stream, None)) is not None:
            raise refused
        await self.client.ready(self._sessions[stream])

    def close(self, stream: int) -> None:
        self._refused.pop(stream, None)
        if (session := self._sessions.pop(stream, None)) is not None:
            session.close()

    def reopen(self, old: int, stream: int, options: Any) -> None:
        self.close(old)
        self.admit(stream, options)

    def transcribe(self, session: int, stream: int) -> None:
        self._follow(stream, self.client.transcription(self._sessions[session]))

    async def force_text(self, stream: int, text: str) -> int:
        return await self.client.force_text(self._sessions[stream], text)

    def end_input(self, stream: int, tail_frames: int | None) -> None:
        if (session := self._sessions.get(stream)) is not None:
            session.end_input(tail_frames)

    def _job(self, stream: int, job: Job) -> None:
        self._jobs[stream] = job
        self._follow(stream, job.events)

    async def submit_speech(self, stream: int, request: Any) -> None:
        self._job(stream, await self.client.submit_speech(request))

    async def submit_transcription(self, stream: int, live: bool, temperature: float) -> None:
        self._job(stream, await self.client.submit_transcription(live=live, temperature=temperature))

    async def submit_image(self, stream: int, spec: Any) -> None:
        self._job(stream, await self.client.submit_image(spec))

    def job(self, stream: int, action: str, *args: Any) -> None:
        """cancel, end_input, append or end_text on a request this worker submitted."""
        if (job := self._jobs.get(stream)) is not None:
            getattr(job, action)(*args)

    async def image_refusal(self, width: int, height: int, guidance: float) -> str | None:
        return await self.client.image_refusal(width, height, guidance)

    def metrics(self, families: bytes) -> None:
        self.families = families

    CALLS = frozenset({"admit", "ready", "close", "reopen", "transcribe", "force_text", "end_input", "submit_speech",
                       "submit_transcription", "submit_image", "job", "image_refusal", "metrics"})

    async def _answer(self, call_id: int, method: str, args: tuple) -> None:
        try:
            value = getattr(self, method)(*args)
            if asyncio.iscoroutine(value):
                value = await value
            reply = ("reply", call_id, True, value)
        except Exception as exc:  # the worker re-raises it in the door that called
            reply = ("reply", call_id, False, exc)
        try:
            self.channel.send(reply)
        except ChannelClosed:
            pass

    def handle(self, message: tuple) -> None:
        kind = message[0]
        self.drain_input()  # audio the worker wrote before this message comes first (wire.py rule 3)
        if kind == "bell":
            pass
        elif kind == "call":
            _, call_id, method, args = message
            if method not in self.CALLS:
                raise ChannelClosed(f"worker {self.worker} called {method!r}, which the engine process does not serve")
            # each its own task (rule 2): the ones that do not wait finish in arrival order
            self._spawn(self._answer(call_id, method, args))
        elif kind == "cast":
            _, method, args = message
            if method not in self.CALLS:
                raise ChannelClosed(f"worker {self.worker} sent {method!r}, which the engine process does not serve")
            try:
                getattr(self, method)(*args)
            except Exception as exc:  # a cast has no one to answer: log it; the link goes on
                log.exception("worker %d's %s failed: %s", self.worker, method, exc)
        else:
            raise ChannelClosed(f"worker {self.worker} sent a message of unknown kind {kind!r}")

    def end(self) -> None:
        """The worker has gone (rule 1): end everything it held."""
        for stream in list(self._sessions):
            self.close(stream)
        for job in list(self._jobs.values()):
            job.cancel()
        self._jobs.clear()
        for task in list(self._tasks):
            task.cancel()
        self._in.close()
        self._out.close()


class CoreServer:
    """Serves edge workers on a Unix socket: the engine process's only door (it has no other socket)."""

    def __init__(self, client: InProcessClient, edge_spec: Any, *, has_tts: bool, has_stt: bool,
                 has_images: bool, registry: CollectorRegistry) -> None:
        self.client = client
        self.registry = registry  # this process's metrics (http/metrics.py engine_registry)
        self.edge_spec = edge_spec  # what a worker builds its app from (server/edge_worker.py)
        self._has_tts, self._has_stt, self._has_images = has_tts, has_stt, has_images
        self.links: dict[int, WorkerLink] = {}

    async def serve(self, path: str) -> asyncio.AbstractServer:
        server = await asyncio.start_unix_server(self._serve_link, path=path)
        asyncio.create_task(self._push_status())
        return server

    async def _push_status(self) -> None:
        for push in itertools.count():
            await asyncio.sleep(STATUS_INTERVAL_S)
            status = status_of(self.client, self._has_tts, self._has_stt)
            own = exposition(self.registry.collect(), "engine") if push % METRICS_EVERY == 0 else None
            for link in list(self.links.values()):
                try:
                    link.channel.send(status)
                    if own is not None:  # rule 5: this process's families and the other workers'
                        others = [other.families for other in self.links.values() if other is not link]
                        link.channel.send(("metrics", [own, *others]))
                except ChannelClosed:
                    pass

    async def _serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer)
        try:
            kind, worker, audio_in, events_out = await channel.receive()
            assert kind == "hello", f"a worker's first message must be its hello, not {kind!r}"
            link = WorkerLink(self.client, channel, ByteRing.attach(audio_in), ByteRing.attach(events_out), worker)
        except (ChannelClosed, AssertionError, FileNotFoundError) as exc:
            log.warning("an edge worker's link could not start: %s", exc)
            channel.close()
            return
        self.links[worker] = link
        channel.send(("hello", self.edge_spec, self.client.max_sessions, self.client.can_transcribe,
                      self._facts()))
        channel.send(status_of(self.client, self._has_tts, self._has_stt))
        channel.send(("metrics", [exposition(self.registry.collect(), "engine")]))  # a scrape right away has them
        log.info("edge worker %d linked", worker)
        try:
            while True:
                link.handle(await channel.receive())
        except ChannelClosed as exc:
            log.info("edge worker %d's link ended (%s): its sessions and requests end", worker, exc)
        finally:
            if self.links.get(worker) is link:
                del self.links[worker]
            link.end()
            channel.close()

    def _facts(self) -> dict:
        return {"stt": self.client.stt_facts() if self._has_stt else None,
                "image": self.client.image_facts() if self._has_images else None,
                "input_frames": self.client.engine.config.input_frames}

