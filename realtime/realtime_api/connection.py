"""`/v1/realtime`: the OpenAI Realtime API over WebSocket, GA dialect by default, beta on request.

This module is a conversation's connection: I/O and dispatch only (the route, admission and
dialect are `realtime_api/endpoint.py`'s; transcription-only sessions are `realtime_api/transcription.py`):
- client settings (`session.update`, `response.create`, items) are judged in
  `realtime_api/settings.py`: every field honoured or refused with an `error` naming it;
- responses and voice activity (how a full-duplex model's speech becomes turn-shaped
  responses, the energy detector, commits) are kept in `realtime_api/turns.py`: frames in,
  events out;
- `instructions` is the persona and `voice` the voice prompt: changing either (or the
  temperature) re-prefills the session (the slot is handed over without a gap, see
  `Slot.reopen`), then `session.updated` is sent;
- audio items are fed to the model at real-time pace (the input buffer holds only 2 s), and
  live audio appended meanwhile queues behind them;
- input transcription and semantic_vad read the session's paired STT row
  (engine/stt_paired.py) while a setting needs it: the transcript's words and end-of-turn
  probability go to `Turns`, which says what to send.
Errors are OpenAI-shaped `error` events and never close the session. When every slot is
taken the upgrade is refused with HTTP 503 + Retry-After (sessions/capacity.py); if the last slot
goes between upgrade and admission: an `error` (code `session_limit_reached`), then close
1013. A server going away (drain) sends an `error` (code `server_shutting_down`), then 1001.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Awaitable, Callable

import numpy as np

from parley.models import SAMPLE_RATE

from ..engine_client import FrameOut, OptionsError, OptionsRejected, SamplingOptions, SessionOptions, Status
from .events import Dialect, Event, Events, SessionConfig, new_id
from .settings import (
    NO_STT, OPENAI_VOICES, TRANSCRIPTION_INTENT, ClientError, ModelCaps, apply_session_update, parse_item,
    parse_response_options,
)
from ..calls.engine_slot import open_once, reopen_or_lose
from ..calls.event_channel import EventChannel
from ..calls.frame_output import FrameSender, PlayingResponse
from ..calls.input_audio import appended_audio, hear_track
from ..calls.input_pacing import MAX_QUEUED_ITEM_SAMPLES, InputPacer
from ..sessions.limits import ConversationBudget
from .turns import Turns
from ..calls.transcript_follower import TranscriptFollower
from ..sessions.session import CLOSE_INTERNAL, EdgeSession

log = logging.getLogger("parley.realtime")

PROTOCOL = "openai"
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
REALTIME_SUBPROTOCOL = "realtime"

class RealtimeConnection:
    """One `/v1/realtime` connection: reads events, dispatches them, writes what comes back."""

    def __init__(self, edge: EdgeSession, dialect: Dialect, model: str, *, served: tuple[str, ...],
                 transcription_sessions: bool = False, opening_error: ClientError | None = None) -> None:
        # model: the session's label, a served name; served: the names session.model may take.
        # transcription_sessions: the server has standalone STT rows (?intent=transcription works).
        # opening_error: told to the client right after session.created (a refused URL setting).
        self.edge = edge
        self.events = Events(dialect)
        self.channel = EventChannel(edge, PROTOCOL, self.events.error)
        self.caps = ModelCaps(prompts=self.edge.defaults.prompts, transcribe=self.edge.slot.can_transcribe,
                              transcribe_sessions=transcription_sessions, models=served,
                              transcription_models=self.edge.models.of("stt"))
        self._opening_error = opening_error
        defaults = self.edge.defaults.options
        config = SessionConfig(id=new_id("sess"), model=model, instructions=defaults.persona, voice=defaults.voice,
                               temperature=(defaults.sampling or SamplingOptions()).audio_temperature)
        self.turns = Turns(self.events, config,
                           ConversationBudget(self.edge.defaults.limits.max_conversation_bytes))
        self.options = self.edge.defaults.client_options(defaults)
        # reads the paired STT stream while a setting needs it
        self.transcript = TranscriptFollower(edge, self._transcript_heard, self._transcript_failed)
        self._reprefill_lock = asyncio.Lock()
        # Audio items waiting to be heard, fed at real-time pace; live audio queues behind them.
        self.pacer = InputPacer(edge)
        self.output = FrameSender(edge, self.send)
        self.playing = PlayingResponse(self.events.output_audio_buffer)  # WebRTC calls only
        self._handlers: dict[str, Callable[[Event], Awaitable[None]]] = {
            "session.update": self._on_session_update,
            "input_audio_buffer.append": self._on_append,
            "input_audio_buffer.commit": self._on_commit,
            "input_audio_buffer.clear": self._on_clear,
            "conversation.item.create": self._on_item_create,
            "conversation.item.retrieve": self._on_item_retrieve,
            "conversation.item.truncate": self._on_item_truncate,
            "conversation.item.delete": self._on_item_delete,
            "response.create": self._on_response_create,
            "response.cancel": self._on_response_cancel,
            "output_audio_buffer.clear": self._on_output_clear,
            "transcription_session.update": self._on_transcription_session,
        }

    @property
    def config(self) -> SessionConfig:
        return self.turns.config

    # ---- lifecycle ----

    async def run(self) -> None:
        edge = self.edge
        if not await open_once(self.channel, self.options):
            return
        await self.send(self.events.session_created(self.config))
        if self.config.needs_stt:  # configured before the session opened (a WebRTC call's settings)
            self.transcript.start()
        if self._opening_error is not None:
            await self.error(self._opening_error)
        feeder = asyncio.create_task(self.pacer.run(), name=f"openai-feed-{edge.number}")
        media = None if edge.transport.media is None else asyncio.create_task(
            self._media_loop(), name=f"openai-media-{edge.number}")
        try:
            await edge.run_duplex(self._send_loop(), self._receive_loop())
        finally:
            feeder.cancel()
            if media is not None:
                media.cancel()
            self.transcript.stop()

    def configure(self, session: Event) -> list[ClientError]:
        """Settings a WebRTC call brought with its offer, judged as a `session.update`'s are but
        before the session opens (so they are prefilled, never re-prefilled); one error per
        refused field (the door answers 400 with them, and no session starts)."""
        config, refused = apply_session_update(session, self.config, self.caps)
        try:
            self.options = self._session_options(config)
        except OptionsError as exc:
            refused.append(ClientError(str(exc), "invalid_value", "session"))
        self.turns.set_config(config)
        return refused

    async def send(self, event: Event) -> int:
        """Send one event (on a WebRTC call, then the output_audio_buffer event it ends); returns
        the bytes sent (0 if the client has left)."""
        sent = await self.channel.send(event)
        if self.output.on_track:
            sent += await self.channel.send_all(self.playing.after(event))
        return sent

    async def send_all(self, events: list[Event]) -> int:
        """Send events in order; returns the bytes sent (0: none, or the client has left)."""
        return sum([await self.send(event) for event in events])

    async def error(self, exc: ClientError) -> None:
        await self.channel.error(exc)

    # ---- client -> server ----

    async def _receive_loop(self) -> None:
        await self.channel.serve(self._handlers, lambda kind: ClientError(
            f"unknown event type {kind!r:.60}", "invalid_value", "type"))

    async def _on_session_update(self, event: Event) -> None:
        previous = self.config
        config, refused = apply_session_update(event.get("session"), previous, self.caps)
        for exc in refused:
            await self.error(exc)
        try:  # SamplingOptions range-checks what the parser let through
            options = self._session_options(config)
        except OptionsError as exc:
            raise ClientError(str(exc), "invalid_value", "session") from None
        if options != self.options:
            try:
                await self._reprefill(options)
            except ClientError as exc:  # the model refused the persona / voice: keep the previous ones
                await self.error(exc)
                config = dataclasses.replace(config, instructions=previous.instructions, voice=previous.voice,
                                             temperature=previous.temperature)
        if config.tracing != previous.tracing and config.tracing is not None:
            log.info("realtime session %s (%d): tracing %s", config.id, self.edge.number, config.tracing)
        self.turns.set_config(config)
        if config.needs_stt:
            self.transcript.start()
        else:
            self.transcript.stop()
        await self.send(self.events.session_updated(config))

    # ---- input transcription (paired STT row) ----

    async def _transcript_heard(self, event) -> bool:
        return bool(await self.send_all(self.turns.transcript(event.text, event.end_of_turn)))

    async def _transcript_failed(self, reason: str) -> None:
        await self.send_all(self.turns.transcript_failed(reason))

    def _session_options(self, config: SessionConfig) -> SessionOptions:
        """The engine options `config` asks for (OptionsError: SamplingOptions refused a value)."""
        return self.edge.defaults.client_options(SessionOptions(
            persona=config.instructions, voice=None if config.voice in OPENAI_VOICES else config.voice,
            sampling=self._sampling(config.temperature)))

    def _sampling(self, temperature: float) -> SamplingOptions | None:
        current = self.options.sampling
        if temperature == (current or SamplingOptions()).audio_temperature:
            return current  # unchanged (None stays None: the checkpoint's defaults)
        return dataclasses.replace(current or SamplingOptions(), audio_temperature=temperature)

    async def _reprefill(self, options: SessionOptions) -> None:
        async with self._reprefill_lock:
            await self.send_all(self.turns.finish_response("cancelled", {"type": "cancelled",
                                                                         "reason": "client_cancelled"}))
            try:
                await reopen_or_lose(self.channel, options)
            except OptionsRejected as exc:
                param = "session.voice" if options.voice != self.options.voice else "session.instructions"
                raise ClientError(f"the model cannot use these settings: {exc}", "invalid_value", param) from None
            self.options = options

    async def _on_append(self, event: Event) -> None:
        pcm, events = appended_audio(event, self.turns.input_audio)
        await self.send_all(events)
        self._hear(pcm)

    async def _media_loop(self) -> None:
        """A WebRTC call's microphone track, heard as `input_audio_buffer.append`'s audio is."""
        await hear_track(self.edge.transport.media, self._hear_track_audio)

    async def _hear_track_audio(self, pcm: np.ndarray) -> None:
        pcm, events = self.turns.heard(pcm)
        await self.send_all(events)
        try:
            self._hear(pcm)
        except ClientError as exc:
            await self.error(exc)

    def _hear(self, pcm: np.ndarray) -> None:
        """Live audio goes straight to the model, unless item audio is still being fed: then behind it."""
        self.pacer.hear(pcm)

    async def _on_commit(self, event: Event) -> None:
        await self.send_all(self.turns.commit())

    async def _on_clear(self, event: Event) -> None:
        await self.send_all(self.turns.clear())

    async def _on_item_create(self, event: Event) -> None:
        parsed = parse_item(event.get("item"), self.config.input_format)
        if self.pacer.queued_samples + parsed.audio.size > MAX_QUEUED_ITEM_SAMPLES:
            raise ClientError(f"more than {MAX_QUEUED_ITEM_SAMPLES // SAMPLE_RATE} s of item audio is waiting to "
                              "be heard; send the next item later", "invalid_value", "item.content")
        await self.send_all(self.turns.add_item(parsed.item, event.get("previous_item_id")))
        self.pacer.queue(parsed.audio)

    async def _on_item_retrieve(self, event: Event) -> None:
        await self.send(self.events.item_retrieved(self.turns.item(event.get("item_id"))))

    async def _on_item_truncate(self, event: Event) -> None:
        item = self.turns.item(event.get("item_id"))
        audio_end_ms, content_index = event.get("audio_end_ms", 0), event.get("content_index", 0)
        if isinstance(audio_end_ms, bool) or not isinstance(audio_end_ms, int) or audio_end_ms < 0:
            raise ClientError("audio_end_ms must be a non-negative integer", "invalid_value", "audio_end_ms")
        if isinstance(content_index, bool) or not isinstance(content_index, int) \
                or not 0 <= content_index < len(item.get("content") or [None]):
            raise ClientError("content_index must index one of the item's content parts", "invalid_value",
                              "content_index")
        await self.send(self.events.item_truncated(item["id"], content_index, audio_end_ms))

    async def _on_item_delete(self, event: Event) -> None:
        await self.send_all(self.turns.delete(event.get("item_id")))

    async def _on_response_create(self, event: Event) -> None:
        options = parse_response_options(event.get("response"), self.config, self.caps)
        await self.send_all(self.turns.start_response(options))

    async def _on_response_cancel(self, event: Event) -> None:
        wanted = event.get("response_id")
        if wanted is not None and (self.turns.response is None or wanted != self.turns.response.id):
            raise ClientError(f"response {wanted!s:.60} is not the active response", "response_cancel_not_active",
                              "response_id")
        await self.send_all(self.turns.cancel())

    async def _on_output_clear(self, event: Event) -> None:
        if self.turns.response is not None:
            await self.send_all(self.turns.cancel())

    async def _on_transcription_session(self, event: Event) -> None:
        raise ClientError(f"transcription_session.update: {TRANSCRIPTION_INTENT if self.caps.transcribe_sessions else NO_STT}",
                          "unsupported_parameter", "type")

    # ---- engine -> client ----

    async def _send_loop(self) -> None:
        terminal = await self.edge.slot.follow_frames(self._on_frame)  # re-prefills followed
        failed = terminal is not None and terminal.status is Status.FAILED
        await self.send_all(self.turns.finish_response("failed" if failed else "incomplete", None))
        if failed:
            await self.channel.server_error(f"the session failed: {terminal.reason}", "session_failed")
            await self.edge.outbox.close_socket(CLOSE_INTERNAL, f"session failed: {terminal.reason}")

    async def _on_frame(self, frame: FrameOut) -> None:
        events = self.turns.output_frame(frame.pcm, frame.text)
        audio = any(self.events.is_audio_delta(e) for e in events)
        # A WebRTC call plays the audio on its track and sends the other events; over a socket
        # a lagging client's audio is dropped (calls/frame_output.py), its text still goes out.
        output = self.output
        dropped = audio and output.lagging(frame)
        for event in events:
            if not self.events.is_audio_delta(event):
                await self.send(event)
            elif output.on_track:
                await self.send_all(self.playing.before_audio(event))
            elif not dropped:
                await output.send(event)
        if audio and output.on_track:
            output.play(frame)
        if audio and not dropped:
            output.count(frame)
