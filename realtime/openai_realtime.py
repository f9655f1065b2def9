"""`/v1/realtime`: the OpenAI Realtime API over WebSocket, GA dialect by default, beta on request.

This module is a conversation's connection: I/O and dispatch only (the route, admission and
dialect are `realtime_endpoint.py`'s; transcription-only sessions are `realtime_transcription.py`):
- client settings (`session.update`, `response.create`, items) are judged in
  `realtime_settings.py`: every field honoured or refused with an `error` naming it;
- responses and voice activity (how a full-duplex model's speech becomes turn-shaped
  responses, the energy detector, commits) are kept in `realtime_turns.py`: frames in,
  events out;
- `instructions` is the persona and `voice` the voice prompt: changing either (or the
  temperature) re-prefills the session (the slot is handed over without a gap, see
  `EdgeSession.reopen`), then `session.updated` is sent;
- audio items are fed to the model at real-time pace (the input buffer holds only 2 s), and
  live audio appended meanwhile queues behind them;
- input transcription and semantic_vad read the session's paired STT row
  (engine/stt_paired.py) while a setting needs it: the transcript's words and end-of-turn
  probability go to `Turns`, which says what to send.
Errors are OpenAI-shaped `error` events and never close the session. When every slot is
taken the upgrade is refused with HTTP 503 + Retry-After (capacity.py); if the last slot
goes between upgrade and admission: an `error` (code `session_limit_reached`), then close
1013. A server going away (drain) sends an `error` (code `server_shutting_down`), then 1001.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import dataclasses
import json
import logging
import time
from typing import Awaitable, Callable

import numpy as np
from starlette.websockets import WebSocketDisconnect

from parley.engine import (
    EngineClosed, EngineFull, FrameOut, OptionsError, SamplingOptions, SessionOptions, SessionRejected, Status,
)
from parley.models import FRAME_SAMPLES, SAMPLE_RATE

from .audio_formats import FormatError
from .openai_events import Dialect, Event, Events, SessionConfig, new_id
from .realtime_settings import (
    NO_STT, OPENAI_VOICES, TRANSCRIPTION_INTENT, ClientError, ModelCaps, apply_session_update, parse_item,
    parse_response_options,
)
from .event_reader import client_event_id, event_type, next_message, parse_client_event
from .limits import ConversationBudget
from .realtime_turns import Turns
from .edge_sessions import CLOSE_INTERNAL, CLOSE_TRY_AGAIN_LATER, EdgeSession

log = logging.getLogger("parley.realtime")

PROTOCOL = "openai"
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
REALTIME_SUBPROTOCOL = "realtime"

MAX_QUEUED_ITEM_SAMPLES = 120 * SAMPLE_RATE  # audio waiting to be heard behind items: at most 2 minutes


class SessionLost(Exception):
    """The engine session could not be re-established; the connection is closed."""


class RealtimeConnection:
    """One `/v1/realtime` connection: reads events, dispatches them, writes what comes back."""

    def __init__(self, edge: EdgeSession, dialect: Dialect, model: str, *, served: tuple[str, ...],
                 transcription_sessions: bool = False, opening_error: ClientError | None = None) -> None:
        # model: the session's label, a served name; served: the names session.model may take.
        # transcription_sessions: the server has standalone STT rows (?intent=transcription works).
        # opening_error: told to the client right after session.created (a refused URL setting).
        self.edge = edge
        self.manager = edge.manager
        self.events = Events(dialect)
        self.caps = ModelCaps(prompts=self.manager.defaults.prompts, transcribe=self.manager.engine.can_transcribe,
                              transcribe_sessions=transcription_sessions, models=served)
        self._opening_error = opening_error
        defaults = self.manager.defaults.options
        config = SessionConfig(id=new_id("sess"), model=model, instructions=defaults.persona, voice=defaults.voice,
                               temperature=(defaults.sampling or SamplingOptions()).audio_temperature)
        self.turns = Turns(self.events, config,
                           ConversationBudget(self.manager.defaults.limits.max_conversation_bytes))
        self.options = self.manager.defaults.client_options(defaults)
        self._client_event_id: str | None = None
        self._transcript: asyncio.Task | None = None  # reads the paired STT stream while a setting needs it
        self._reprefill_lock = asyncio.Lock()
        # Audio items waiting to be heard, fed at real-time pace; live audio queues behind them.
        self._feed: collections.deque[np.ndarray] = collections.deque()
        self._feed_samples = 0
        self._feed_wake = asyncio.Event()
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
        try:
            await edge.open_engine_session(self.options)
        except EngineFull as exc:
            await self.send(self.events.error(f"server full: {exc}", "session_limit_reached", kind="server_error"))
            await edge.refuse(CLOSE_TRY_AGAIN_LATER, "full", "server full: every session slot is taken")
            return
        except (OptionsError, SessionRejected, EngineClosed) as exc:
            await self.send(self.events.error(f"cannot start the session: {exc}", "session_failed",
                                              kind="server_error"))
            await edge.refuse(CLOSE_INTERNAL, "unavailable" if isinstance(exc, EngineClosed) else "options", str(exc))
            return
        await self.send(self.events.session_created(self.config))
        if self.config.needs_stt:  # configured before the session opened (a WebRTC call's settings)
            self._transcript = asyncio.create_task(self._transcript_loop())
        if self._opening_error is not None:
            await self.error(self._opening_error)
        feeder = asyncio.create_task(self._feed_loop(), name=f"openai-feed-{edge.number}")
        media = None if edge.transport.media is None else asyncio.create_task(
            self._media_loop(), name=f"openai-media-{edge.number}")
        try:
            await edge.run_duplex(self._send_loop(), self._receive_loop())
        finally:
            feeder.cancel()
            if media is not None:
                media.cancel()
            self._stop_transcript()

    def configure(self, session: Event) -> list[ClientError]:
        """Settings a WebRTC call brought with its offer, judged as a `session.update`'s are but
        before the session opens (so they are prefilled, never re-prefilled); one error per
        refused field (the door answers 400 with them, and no session starts)."""
        config, refused = apply_session_update(session, self.config, self.caps)
        try:
            self.options = self.manager.defaults.client_options(SessionOptions(
                persona=config.instructions, voice=None if config.voice in OPENAI_VOICES else config.voice,
                sampling=self._sampling(config.temperature)))
        except OptionsError as exc:
            refused.append(ClientError(str(exc), "invalid_value", "session"))
        self.turns.set_config(config)
        return refused

    async def send(self, event: Event) -> int:
        """Send one event; returns its size (0 if the client has left)."""
        text = json.dumps(event, separators=(",", ":"))
        try:
            await self.edge.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError):
            return 0  # the client left; the receive loop sees the disconnect and ends the session
        return len(text)

    async def send_all(self, events: list[Event]) -> int:
        """Send events in order; returns the bytes sent (0: none, or the client has left)."""
        sent = 0
        for event in events:
            sent += await self.send(event)
        return sent

    async def error(self, exc: ClientError) -> None:
        self.manager.metrics.protocol_errors.labels(PROTOCOL).inc()
        await self.send(self.events.error(str(exc), exc.code, param=exc.param, client_event_id=self._client_event_id))

    # ---- client -> server ----

    async def _receive_loop(self) -> None:
        while (data := await next_message(self.edge)) is not None:
            try:
                await self._handle_raw(data)
            except SessionLost:
                return

    async def _handle_raw(self, raw: str | bytes) -> None:
        self._client_event_id = None
        try:
            event = parse_client_event(raw, self.manager.defaults.limits)
            self._client_event_id = client_event_id(event)
            kind = event_type(event)
            handler = self._handlers.get(kind)
            if handler is None:
                raise ClientError(f"unknown event type {kind!r:.60}", "invalid_value", "type")
            await handler(event)
        except ClientError as exc:
            await self.error(exc)

    async def _on_session_update(self, event: Event) -> None:
        previous = self.config
        config, refused = apply_session_update(event.get("session"), previous, self.caps)
        for exc in refused:
            await self.error(exc)
        try:  # SamplingOptions range-checks what the parser let through
            options = self.manager.defaults.client_options(SessionOptions(
                persona=config.instructions, voice=None if config.voice in OPENAI_VOICES else config.voice,
                sampling=self._sampling(config.temperature)))
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
        if config.needs_stt and self._transcript is None:
            self._transcript = asyncio.create_task(self._transcript_loop())
        elif not config.needs_stt:
            self._stop_transcript()
        await self.send(self.events.session_updated(config))

    # ---- input transcription (paired STT row) ----

    async def _transcript_loop(self) -> None:
        """Follow the session's transcript (and, after a re-prefill, the new session's)."""

        async def heard(event) -> bool:
            return bool(await self.send_all(self.turns.transcript(event.text, event.end_of_turn)))

        async def failed(reason: str) -> None:
            await self.send_all(self.turns.transcript_failed(reason))

        await self.edge.follow_transcript(heard, failed)

    def _stop_transcript(self) -> None:
        if self._transcript is not None:
            self._transcript.cancel()
            self._transcript = None

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
                await self.edge.reopen(options)
            except SessionRejected as exc:
                param = "session.voice" if options.voice != self.options.voice else "session.instructions"
                raise ClientError(f"the model cannot use these settings: {exc}", "invalid_value", param) from None
            except (EngineFull, EngineClosed) as exc:
                await self.send(self.events.error(f"lost the session slot while re-prefilling: {exc}",
                                                  "session_failed", kind="server_error"))
                await self.edge.close_socket(CLOSE_TRY_AGAIN_LATER, "session slot lost while re-prefilling")
                raise SessionLost(str(exc)) from exc
            self.options = options

    async def _on_append(self, event: Event) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise ClientError("input_audio_buffer.append needs 'audio': base64 audio in the session's input format",
                              "missing_required_parameter", "audio")
        try:
            raw = base64.b64decode(audio, validate=True)
            pcm, events = self.turns.input_audio(raw)
        except (binascii.Error, ValueError):
            raise ClientError("audio is not valid base64", "invalid_value", "audio") from None
        except FormatError as exc:
            raise ClientError(str(exc), "invalid_value", "audio") from None
        await self.send_all(events)
        self._hear(pcm)

    async def _media_loop(self) -> None:
        """A WebRTC call's microphone track, heard as `input_audio_buffer.append`'s audio is."""
        media = self.edge.transport.media
        while (pcm := await media.read()) is not None:
            pcm, events = self.turns.heard(pcm)
            await self.send_all(events)
            try:
                self._hear(pcm)
            except ClientError as exc:
                await self.error(exc)

    def _hear(self, pcm: np.ndarray) -> None:
        """Live audio goes straight to the model, unless item audio is still being fed: then behind it."""
        if not pcm.size:
            return
        if self._feed:
            if self._feed_samples + pcm.size > MAX_QUEUED_ITEM_SAMPLES:  # faster than real time, for minutes
                raise ClientError("input audio is arriving faster than real time while an audio item is being "
                                  "heard; this chunk was dropped", "invalid_value", "audio")
            self._queue(pcm)
            return
        session = self.edge.engine_session
        if session is not None:
            session.push_audio(pcm)

    def _queue(self, pcm: np.ndarray) -> None:
        self._feed.append(pcm)
        self._feed_samples += pcm.size
        self._feed_wake.set()

    async def _feed_loop(self) -> None:
        """Queued audio reaches the input buffer one 80 ms frame per 80 ms (the buffer holds only 2 s)."""
        step = FRAME_SAMPLES / SAMPLE_RATE
        while True:
            await self._feed_wake.wait()
            self._feed_wake.clear()
            due = time.monotonic()
            while self._feed:
                chunk = self._feed[0]
                frame, rest = chunk[:FRAME_SAMPLES], chunk[FRAME_SAMPLES:]
                if rest.size:
                    self._feed[0] = rest
                else:
                    self._feed.popleft()
                self._feed_samples -= frame.size
                session = self.edge.engine_session
                if session is not None:
                    session.push_audio(frame)
                due += step * frame.size / FRAME_SAMPLES
                await asyncio.sleep(max(0.0, due - time.monotonic()))

    async def _on_commit(self, event: Event) -> None:
        await self.send_all(self.turns.commit())

    async def _on_clear(self, event: Event) -> None:
        await self.send_all(self.turns.clear())

    async def _on_item_create(self, event: Event) -> None:
        parsed = parse_item(event.get("item"), self.config.input_format)
        if self._feed_samples + parsed.audio.size > MAX_QUEUED_ITEM_SAMPLES:
            raise ClientError(f"more than {MAX_QUEUED_ITEM_SAMPLES // SAMPLE_RATE} s of item audio is waiting to "
                              "be heard; send the next item later", "invalid_value", "item.content")
        await self.send_all(self.turns.add_item(parsed.item, event.get("previous_item_id")))
        self._queue(parsed.audio)

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
        terminal = await self.edge.follow_frames(self._on_frame)  # re-prefills followed
        failed = terminal is not None and terminal.status is Status.FAILED
        await self.send_all(self.turns.finish_response("failed" if failed else "incomplete", None))
        if failed:
            await self.send(self.events.error(f"the session failed: {terminal.reason}", "session_failed",
                                              kind="server_error"))
            await self.edge.close_socket(CLOSE_INTERNAL, f"session failed: {terminal.reason}")

    async def _on_frame(self, frame: FrameOut) -> None:
        events = self.turns.output_frame(frame.pcm, frame.text)
        audio = any(self.events.is_audio_delta(e) for e in events)
        # A WebRTC call plays the audio on its track (bounded there) and sends the other events.
        media = self.edge.transport.media
        # A client that reads too slowly loses its oldest audio (counted), never falls behind by more
        # than the lag limit; its text still goes out.
        dropped = audio and media is None and self.edge.drop_if_lagging(frame.produced_at)
        for event in events:
            if not self.events.is_audio_delta(event):
                await self.send(event)
            elif media is None and not dropped:
                self.edge.lag.sent(await self.send(event))
        if audio and media is not None:
            self.edge.play(frame.pcm)
        if audio and not dropped:
            self.manager.metrics.frames_out.labels(PROTOCOL).inc()
            self.edge.observe_frame_sent(frame.produced_at)
