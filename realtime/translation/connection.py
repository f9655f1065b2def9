"""`/v1/realtime/translations`: OpenAI's Realtime translation API over WebSocket. I/O and dispatch only.

- The route, admission and `?model=` are endpoint.py's; settings are judged in settings.py (every
  field honoured or refused by name), events built in events.py; the model and how its source ends
  are model.py's `Translator` (the one seam to the model that translates).
- `session.created` is the first event, once the engine session is prefilled.
- `session.input_audio_buffer.append`: base64 24 kHz PCM16, any length. Every sample of the source
  reaches the model, in order (source.py: it waits while the engine's input buffer is half full,
  up to a bound past which an append is refused, naming `audio`).
- Every model frame goes out as `session.output_audio.delta` (silence included: a translation is one
  continuous stream), its text as `session.output_transcript.delta`; with `audio.input.transcription`
  the paired STT's words as `session.input_transcript.delta`. A client reading too slowly loses its
  oldest audio, counted (calls/frame_output.py); its text still goes out.
- `session.close` flushes: the pending source (its last partial frame padded with silence) is heard,
  the model is told its source ended, the translation still owed comes out, then
  `session.closed` and close 1000. Events after it are refused; the session keeps flushing.
Errors are `error` events carrying the client's `event_id`; the session goes on. Admission, limits
and drain are the other doors' (sessions/): a full server 503s the upgrade, a draining one sends
`error` (`server_shutting_down`) then close 1001.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any, Awaitable, Callable

import numpy as np

from ..engine_client import FrameOut, Status, Terminal
from parley.models import FRAME_SAMPLES, SAMPLE_RATE

from . import events as ev
from .model import Translator
from .settings import TranslationCaps, TranslationConfig, apply_update
from .source import MAX_WAITING_SAMPLES, SourceFeed
from ..calls.engine_slot import open_once
from ..calls.event_channel import EventChannel
from ..calls.frame_output import FrameSender
from ..calls.input_audio import appended_audio
from ..calls.transcript_follower import TranscriptFollower
from ..media.audio_formats import AudioFormat, InputDecoder, OutputEncoder
from ..realtime_api.events import new_id
from ..realtime_api.settings import ClientError
from ..sessions.session import CLOSE_INTERNAL, CLOSE_NORMAL, EdgeSession

log = logging.getLogger("parley.translation")

PROTOCOL = "translation"
FRAME_MS = FRAME_SAMPLES * 1000 // SAMPLE_RATE  # 80: the session clock's step (elapsed_ms)
# The fields each client event may carry (openai RealtimeTranslationClientEvent); others are refused by name.
EVENT_FIELDS = {
    "session.update": ("type", "event_id", "session"),
    "session.input_audio_buffer.append": ("type", "event_id", "audio"),
    "session.close": ("type", "event_id"),
}


class _Translated(Exception):
    """The translation owed after the source's end is out: the session closes."""


class TranslationConnection:
    """One `/v1/realtime/translations` connection: reads events, dispatches them, writes what comes back."""

    def __init__(self, edge: EdgeSession, translator: Translator, model: str) -> None:
        # model: the session's label, one of `translator.modality`'s served names
        self.edge = edge
        self.translator = translator
        self.channel = EventChannel(edge, PROTOCOL, ev.error)
        stt = edge.models.of("stt") if edge.slot.can_transcribe else ()  # paired rows only
        self.caps = TranslationCaps(languages=translator.languages, transcription_models=stt)
        self.config = TranslationConfig(id=new_id("sess"), model=model, language=translator.languages[0])
        self.options = edge.defaults.client_options(edge.defaults.options)
        self.decoder = InputDecoder(AudioFormat())  # 24 kHz PCM16 only, as the API says
        self.encoder = OutputEncoder(AudioFormat())
        self.source = SourceFeed(edge)  # the source, every sample of it, into the engine session
        self.output = FrameSender(edge, self.channel.send)
        self.transcript = TranscriptFollower(edge, self._heard, self._transcript_failed)
        self.frames = 0  # model frames out: the session clock
        self.source_samples = 0  # source audio received
        self.closing = False  # session.close received
        self.source_ended = False  # ... and its source heard to the end, the model told
        self.owed: int | None = None  # frames still to follow after that (None: until the stream ends)
        self._handlers: dict[str, Callable[[dict], Awaitable[None]]] = {
            kind: self._guard(handler) for kind, handler in (
                ("session.update", self._on_update),
                ("session.input_audio_buffer.append", self._on_append),
                ("session.close", self._on_close))}

    # ---- lifecycle ----

    async def run(self) -> None:
        edge = self.edge
        if not await open_once(self.channel, self.options):
            return
        await self.channel.send(ev.session_created(self.config.resource()))
        feeder = asyncio.create_task(self.source.run(), name=f"translation-feed-{edge.number}")
        try:
            await edge.run_duplex(self._send_loop(), self._receive_loop())
        finally:
            feeder.cancel()
            self.transcript.stop()

    async def notice(self, reason: str) -> None:
        """The server is going away (drain, shutdown): told before close 1001."""
        await self.channel.server_error(reason, "server_shutting_down")

    # ---- client -> server ----

    async def _receive_loop(self) -> None:
        await self.channel.serve(self._handlers, lambda kind: ClientError(
            f"unknown event type {kind!r:.60}", "invalid_value", "type"))

    def _guard(self, handler: Callable[[dict], Awaitable[None]]) -> Callable[[dict], Awaitable[None]]:
        """`handler` behind the checks every event gets: a closing session, unknown fields."""
        async def guarded(event: dict) -> None:
            if self.closing:
                raise ClientError(f"{event['type']}: the session is closing (session.close was sent)",
                                  "invalid_value", "type")
            for key in event:
                if key not in EVENT_FIELDS[event["type"]]:
                    await self.channel.error(ClientError(f"unknown parameter {key!r:.60} in {event['type']}",
                                                         "unknown_parameter", key))
            await handler(event)
        return guarded

    async def _on_update(self, event: dict) -> None:
        config, refused = apply_update(event.get("session"), self.config, self.caps)
        for exc in refused:
            await self.channel.error(exc)
        self.config = config
        if config.transcription is not None:
            self.transcript.start()
        else:
            self.transcript.stop()
        await self.channel.send(ev.session_updated(config.resource()))

    async def _on_append(self, event: dict) -> None:
        pcm = appended_audio(event, self.decoder.decode, "format (24 kHz PCM16 mono)")
        if not pcm.size:
            return
        if self.source.waiting_samples + pcm.size > MAX_WAITING_SAMPLES:
            raise ClientError(f"more than {MAX_WAITING_SAMPLES // SAMPLE_RATE} s of audio is waiting to be "
                              "translated (it is heard in real time); this chunk was dropped", "invalid_value",
                              "audio")
        self.source_samples += pcm.size
        self.source.queue(pcm)

    async def _on_close(self, event: dict) -> None:
        """The source ends: its last partial frame is padded with silence so the model hears it."""
        self.closing = True
        pad = -self.source_samples % FRAME_SAMPLES
        if pad:
            self.source.queue(np.zeros(pad, np.float32))
        log.info("translation session %s (%d): closing after %.1f s of source", self.config.id, self.edge.number,
                 self.source_samples / SAMPLE_RATE)

    # ---- engine -> client ----

    async def _send_loop(self) -> None:
        try:
            terminal = await self.edge.slot.follow_frames(self._on_frame)
        except _Translated:
            terminal = None
        if isinstance(terminal, Terminal) and terminal.status is Status.FAILED:
            await self.channel.server_error(f"the session failed: {terminal.reason}", "session_failed")
            await self.edge.outbox.close_socket(CLOSE_INTERNAL, f"session failed: {terminal.reason}")
        elif self.source_ended:  # the owed frames are out, or the model ended its stream
            await self.channel.send(ev.session_closed())
            await self.edge.outbox.close_socket(CLOSE_NORMAL, "session closed")

    async def _on_frame(self, frame: FrameOut) -> None:
        self.frames += 1
        elapsed = self.frames * FRAME_MS
        if frame.text:
            await self.channel.send(ev.output_transcript(frame.text, elapsed))
        audio = ev.output_audio(base64.b64encode(self.encoder.encode(frame.pcm)).decode(), elapsed)
        if not self.output.lagging(frame):
            await self.output.send(audio)
            self.output.count(frame)
        if self.closing:
            self._follow_the_end()

    def _follow_the_end(self) -> None:
        """After session.close, once per frame: has the source been heard to its end (then the
        model is told), and is the translation owed after it out (then _Translated)?"""
        if not self.source_ended:
            if not self.source.heard_to_the_end():
                return
            self.source_ended = True
            self.translator.end_source(self.edge.engine_session)
            self.owed = self.translator.owed_frames
        elif self.owed is not None:
            self.owed -= 1
        if self.owed is not None and self.owed <= 0:
            raise _Translated()

    async def _heard(self, partial: Any) -> bool:
        """One paired-STT step (engine SttPartial): its words, if any, as the source's transcript."""
        if not partial.text:
            return False
        return bool(await self.channel.send(ev.input_transcript(partial.text, self.frames * FRAME_MS)))

    async def _transcript_failed(self, reason: str) -> None:
        await self.channel.server_error(f"input transcription failed: {reason}", "transcription_failed")
