"""`/v1/live/sessions`: OpenAI's GPT-Live over WebSocket, on a duplex model. I/O and dispatch only.

- settings are judged in live/config.py (every field honoured or refused by name), events built in
  live/events.py, delegation turns watched in live/delegation.py (policy: live/policy.py);
- admission, auth, Origin, limits, metrics and drain are the other doors' (sessions/capacity.py,
  server/security.py, sessions/session.py), and so is the receive side (calls/event_reader.py);
- `session.start`'s `model` must be one of the duplex model's served names (server/served_models.py;
  another is an `error` with code `model_not_found`, and the session does not start);
- the first event must be `session.start`; the engine session opens on it (the persona and voice
  prompt are prefilled), then `session.started`. Until then the slot reserved before the upgrade
  is held, for at most START_TIMEOUT_S;
- the model's frames go out as `session.output_audio.delta` and, where it wrote text,
  `session.output_transcript.delta`; the paired STT's words (when one is loaded) as
  `session.input_transcript.delta`; `session.usage.updated` every USAGE_EVERY_FRAMES frames;
- with Responses delegation (live/responses.py, `parley serve --delegate-url`) Parley's backend
  works each delegation off the event path, its reply spoken as commentary, its function calls
  forwarded to the client (`response.event`), answered with `response.item.create` and continued
  with `response.create`;
- commentary is forced into the model's text stream from its next pause (Engine.force_text);
  instructions and thinking go into the persona (PersonaPlex) by a re-prefill, and are refused
  by name by a model without one.
Errors are `error` events carrying the client's `event_id`; the session goes on.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from typing import Awaitable, Callable

import numpy as np
from starlette.websockets import WebSocket

from parley.models import FRAME_SAMPLES, SAMPLE_RATE

from ..engine_client import FrameOut, OptionsError, OptionsRejected, Status
from . import events as ev
from ..media.audio_formats import InputDecoder, OutputEncoder
from ..calls.engine_slot import open_or_refuse, reopen_or_lose
from ..calls.event_channel import EventChannel, SessionLost
from ..calls.event_reader import next_message
from ..calls.frame_output import FrameSender
from ..calls.input_audio import appended_audio, hear_track
from ..calls.input_pacing import InputPacer
from .config import LiveConfig, check_update, parse_start
from .delegation import Delegations, TurnWatcher
from .responses import ResponsesDelegate
from ..http.models import deny_unserved_model
from ..realtime_api.events import new_id
from ..realtime_api.settings import ClientError, ModelCaps
from ..realtime_api.turns import FRAME_MS
from ..calls.transcript_follower import TranscriptFollower
from ..sessions.session import CLOSE_INTERNAL, CLOSE_NORMAL, CLOSE_POLICY, EdgeSession
from ..server.state import app_state

log = logging.getLogger("parley.live")

PROTOCOL = "live"
START_TIMEOUT_S = 10.0  # a connection that sends no acceptable session.start by then is closed (1008)
USAGE_EVERY_FRAMES = 25  # session.usage.updated every 2 s of session audio
MAX_APPEND_CHARS = 4000  # one append: about OpenAI's 500 tokens of English
REFUSED_EVENTS = {
    "session.output_audio.fixture.play": "audio fixtures are not served by Parley",
    "decision.create": "Decisions delegation is not served by Parley",
    "decision.item.create": "Decisions delegation is not served by Parley",
    "decision.item.delete": "Decisions delegation is not served by Parley",
}


class LiveConnection:
    """One `/v1/live/sessions` connection: reads events, dispatches them, writes what comes back."""

    def __init__(self, edge: EdgeSession, served: tuple[str, ...]) -> None:
        # served: the names session.start's model may take (the duplex model's, server/served_models.py)
        self.edge = edge
        defaults = self.edge.defaults
        self.channel = EventChannel(edge, PROTOCOL, ev.error)
        self.caps = ModelCaps(prompts=defaults.prompts, transcribe=self.edge.slot.can_transcribe,
                              models=served)
        self.policy = defaults.live_delegation
        self.backend = defaults.live_delegate  # None: Responses delegation is refused at start
        self.responder: ResponsesDelegate | None = None  # the session's, with Responses delegation
        self.model_said = ""  # the output transcript since the last delegation (for the backend)
        self.config: LiveConfig | None = None
        self.options = defaults.options
        self.context: tuple[str, ...] = ()  # instructions and thinking appended since start (the persona's tail)
        self.delegations = Delegations()
        self.watcher = TurnWatcher(self.policy, semantic=self.caps.transcribe)
        self.decoder: InputDecoder | None = None  # the session's format, set at start
        self.encoder: OutputEncoder | None = None
        self.muted = False
        self.frames = 0  # output frames sent: the session's audio clock, 80 ms each
        self.heard_ms = 0  # the input transcript's clock (where its last delta ended)
        self.pacer = InputPacer(edge)  # no items here: the audio goes straight to the model
        self.output = FrameSender(edge, self.send)
        self._reprefill_lock = asyncio.Lock()
        self._handlers: dict[str, Callable[[dict], Awaitable[None]]] = {
            "session.start": self._on_start_again, "session.update": self._on_update,
            "session.input_audio.append": self._on_append, "session.input_audio.mute": self._on_mute,
            "session.input_audio.unmute": self._on_mute, "session.commentary.append": self._on_commentary,
            "session.thinking.append": self._on_context, "session.instructions.append": self._on_context,
            "session.close": self._on_close, "response.item.create": self._on_response,
            "response.create": self._on_response,
        }

    @property
    def resource(self) -> dict:
        """The session resource, its blank instructions resolved to the server's persona."""
        return self.config.resource(self.edge.defaults.options.persona)

    @property
    def clock_ms(self) -> int:
        return self.frames * FRAME_MS

    @property
    def _client_event_id(self) -> str | None:
        return self.channel.client_event_id

    # ---- lifecycle ----

    async def run(self, start: LiveConfig | None = None) -> None:
        """`start`: the settings of a session its HTTP request started (a WebRTC call, judged by
        the door); None: they come in the first `session.start` event."""
        if start is None and not await self._start():
            return
        if start is not None and not await self._open(start):
            await self.edge.outbox.close_socket(CLOSE_POLICY, "the session could not start")
            return
        config = self.config
        fmt = self.resource["audio"]["format"]
        log.info("live session %s (%d): model %s, %s at %d Hz, delegation policy %s%s", config.id,
                 self.edge.number, config.model, fmt["type"], fmt["rate"], self.policy,
                 f", safety_identifier {config.safety_identifier}" if config.safety_identifier else "")
        await self.send(ev.session_event("session.started", self.resource, self._client_event_id))
        transcript = TranscriptFollower(self.edge, self._heard, self._transcript_failed)
        transcript.start()
        media = None if self.edge.transport.media is None else asyncio.create_task(
            hear_track(self.edge.transport.media, self._hear), name=f"live-media-{self.edge.number}")
        try:
            await self.edge.run_duplex(self._send_loop(), self._receive_loop())
        finally:
            transcript.stop()
            if media is not None:
                media.cancel()
            if self.responder is not None:
                await self.responder.aclose()

    async def _start(self) -> bool:
        """Read events until a session.start is accepted and its engine session is open (True), or
        the connection is gone or refused (False). Reading is bounded (START_TIMEOUT_S), the prefill is not."""
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    data = await next_message(self.edge)
            except TimeoutError:
                await self.send(ev.error(f"no session.start was accepted within {START_TIMEOUT_S:.0f} s",
                                         "session_start_timeout"))
                await self.edge.outbox.close_socket(CLOSE_POLICY, "no session.start")
                return False
            if data is None:
                return False
            event = await self.channel.read(data)
            if event is None:
                continue
            if event["type"] != "session.start":
                await self.error(ClientError(f"{event['type']!s:.60} before session.start: send session.start "
                                             "first and wait for session.started", "session_not_started", "type"))
                continue
            config, refused = parse_start(event.get("session"), self.caps, backend=self.backend is not None)
            for exc in refused:
                await self.error(exc)
            if config is not None and await self._open(config):
                return True
            if self.edge.closed:
                return False

    async def _open(self, config: LiveConfig) -> bool:
        """The engine session for `config`; False (and an error) if it cannot open."""
        defaults = self.edge.defaults.options
        options = dataclasses.replace(defaults, persona=config.persona(defaults.persona),
                                      voice=config.voice_prompt or defaults.voice)
        try:
            if not await open_or_refuse(self.channel, options):
                return False
        except (OptionsError, OptionsRejected) as exc:  # the session may start again with other settings
            voice = config.voice_prompt is not None and "voice" in str(exc).lower()
            param = "session.audio.output.voice" if voice else "session.instructions"
            await self.error(ClientError(f"the model cannot use these settings: {exc}", "invalid_value", param))
            return False
        self.config, self.options = config, options
        self.decoder, self.encoder = InputDecoder(config.format), OutputEncoder(config.format)
        if config.responses is not None:
            self.responder = ResponsesDelegate(config.responses, self.backend, self.send, self._speak)
        return True

    async def send(self, event: dict) -> int:
        """Send one event; its size (0 if the client has left)."""
        return await self.channel.send(event)

    async def error(self, exc: ClientError) -> None:
        await self.channel.error(exc)

    # ---- client -> server ----

    async def _receive_loop(self) -> None:
        await self.channel.serve(self._handlers, lambda kind: ClientError(
            f"{kind!s:.60}: {REFUSED_EVENTS.get(kind, 'not a GPT-Live client event')}", "invalid_value", "type"))

    async def _on_start_again(self, event: dict) -> None:
        raise ClientError("the session has started; session.start comes once", "session_already_started", "type")

    async def _on_update(self, event: dict) -> None:
        refused, self.config = check_update(event.get("session"), self.config, backend=self.backend is not None)
        for exc in refused:
            await self.error(exc)
        if self.responder is not None:  # the next run takes the updated settings
            self.responder.settings = self.config.responses
        if not refused:
            await self.send(ev.session_event("session.updated", self.resource, self._client_event_id))

    async def _on_append(self, event: dict) -> None:
        await self._hear(appended_audio(event, self.decoder.decode, "format"))

    async def _hear(self, pcm: np.ndarray) -> None:
        """The peer's audio at 24 kHz (an append's, or a WebRTC call's track): to the turn watcher
        (delegations) and the model."""
        if self.muted:  # the model hears silence while the input is muted
            pcm = np.zeros_like(pcm)
        for heard in self.watcher.audio(pcm):
            delegation_id = self.delegations.create()
            if self.responder is None:
                await self.send(ev.delegation_created(delegation_id, self.clock_ms))
                continue
            response_id = new_id("resp")
            await self.send(ev.delegation_created(delegation_id, self.clock_ms, response_id))
            self.responder.delegate(delegation_id, response_id, heard, self.model_said)
            self.model_said = ""
        self.pacer.hear(pcm)

    async def _on_mute(self, event: dict) -> None:
        self.muted = event["type"].endswith(".mute")
        await self.send(ev.event("session.input_audio.muted" if self.muted else "session.input_audio.unmuted",
                                 self._client_event_id))

    async def _on_response(self, event: dict) -> None:
        """response.item.create / response.create: for the session's Responses backend."""
        if self.responder is None:
            raise ClientError(f"{event['type']}: needs Responses delegation (session.delegation {{type: responses}} "
                              "at start, on a server with --delegate-url); this session delegates to the client",
                              "invalid_value", "type")
        if event["type"] == "response.create":
            self.responder.create()
        else:
            self.responder.item(event.get("item"))

    async def _on_close(self, event: dict) -> None:
        """The session closes at once; a Responses run still in flight is cancelled (run's finally)."""
        await self.send(ev.session_closed(self.resource, "close_requested", self.seconds,
                                          self._client_event_id))
        await self.edge.outbox.close_socket(CLOSE_NORMAL, "session closed")
        raise SessionLost("closed by the client")

    @property
    def seconds(self) -> float:
        return round(self.frames * FRAME_SAMPLES / SAMPLE_RATE, 2)

    # ---- appends: commentary (spoken), instructions and thinking (the persona) ----

    def _content(self, event: dict) -> str:
        content = event.get("content")
        if not isinstance(content, str) or not content.strip():
            raise ClientError(f"{event['type']} needs 'content': text", "missing_required_parameter", "content")
        if len(content) > MAX_APPEND_CHARS:
            raise ClientError(f"content is {len(content)} characters; an append holds at most {MAX_APPEND_CHARS} "
                              "(about 500 tokens): split it", "invalid_value", "content")
        if "delegation_id" not in event:
            raise ClientError("delegation_id is required: the id of a session.delegation.created, or null",
                              "missing_required_parameter", "delegation_id")
        self.delegations.check(event["delegation_id"])
        return content

    async def _on_commentary(self, event: dict) -> None:
        """Forced into the model's text stream from its next pause; placed from now, one token a frame."""
        content = self._content(event)
        start = self.clock_ms
        try:
            tokens = await self.edge.slot.force_text(content)
        except OptionsError as exc:
            raise ClientError(f"the commentary was not placed: {exc}", "invalid_value", "content") from None
        await self.send(ev.appended("commentary", start, start + tokens * FRAME_MS, self._client_event_id))

    async def _speak(self, text: str) -> int:
        """The Responses backend's commentary (live/responses.py), forced as a client's is."""
        return await self.edge.slot.force_text(text[:MAX_APPEND_CHARS])

    async def _on_context(self, event: dict) -> None:
        """Instructions and thinking join the persona (PersonaPlex), by a re-prefill."""
        channel = event["type"].split(".")[1]
        if not self.caps.prompts:
            raise ClientError(f"{event['type']}: this model has no persona (a Moshi checkpoint) to keep {channel} "
                              "in, so it cannot take it", "unsupported_parameter", "type")
        content = self._content(event)
        start = self.clock_ms
        await self._reprefill((*self.context, content if channel == "instructions" else f"(thinking) {content}"))
        await self.send(ev.appended(channel, start, self.clock_ms, self._client_event_id))

    async def _reprefill(self, context: tuple[str, ...]) -> None:
        """Hand the slot to a session prefilled with the longer persona (Slot.reopen)."""
        persona = self.config.persona(self.edge.defaults.options.persona, context)
        options = dataclasses.replace(self.options, persona=persona)
        async with self._reprefill_lock:
            try:
                await reopen_or_lose(self.channel, options)
            except OptionsRejected as exc:  # the previous persona is back
                raise ClientError(f"the model cannot take it: {exc}", "invalid_value", "content") from None
        self.context, self.options = context, options

    # ---- engine -> client ----

    async def _send_loop(self) -> None:
        terminal = await self.edge.slot.follow_frames(self._on_frame)
        if terminal is not None and terminal.status is Status.FAILED:
            await self.channel.server_error(f"the session failed: {terminal.reason}", "session_failed")
            await self.send(ev.session_closed(self.resource, "connection_lost", self.seconds))
            await self.edge.outbox.close_socket(CLOSE_INTERNAL, f"session failed: {terminal.reason}")

    async def _on_frame(self, frame: FrameOut) -> None:
        start = self.clock_ms
        self.frames += 1
        if frame.text:
            await self.send(ev.transcript("output", frame.text, start, self.clock_ms))
            if self.responder is not None:
                self.model_said = (self.model_said + frame.text)[-MAX_APPEND_CHARS:]
        if self.output.on_track:  # a WebRTC call: on its track (bounded there)
            self.output.play(frame)
            self.output.count(frame)
        else:
            await self._send_audio(frame)
        if self.frames % USAGE_EVERY_FRAMES == 0:
            await self.send(ev.usage_updated(self.seconds))

    async def _send_audio(self, frame: FrameOut) -> None:
        wire = base64.b64encode(self.encoder.encode(frame.pcm)).decode()
        # A client reading too slowly loses its oldest audio (counted); its text still goes out.
        if not self.output.lagging(frame):
            await self.output.send(ev.output_audio(wire))
            self.output.count(frame)

    async def _heard(self, partial) -> bool:
        """One paired-STT step (engine SttPartial): the turn watcher's, and the client's if it has words."""
        self.watcher.heard(partial.text, partial.end_of_turn)
        if not partial.text:
            return False
        start, self.heard_ms = self.heard_ms, max(self.heard_ms, self.clock_ms)
        return bool(await self.send(ev.transcript("input", partial.text, start, self.heard_ms)))

    async def _transcript_failed(self, reason: str) -> None:
        await self.send(ev.error(f"input transcription failed: {reason}", "transcription_failed", kind="server_error"))


async def live_endpoint(websocket: WebSocket) -> None:
    """Keys and Origins are checked before this runs (security.AccessMiddleware); a full or
    draining server answers the upgrade with 503 (sessions/capacity.py)."""
    manager = app_state(websocket).sessions
    if await deny_unserved_model(websocket, "duplex"):  # a `?model=` in the URL: as on every door
        return
    reservation = await manager.admission.reserve_or_deny(websocket, needs_slot=True)
    if reservation is None:
        return

    async def run(edge: EdgeSession) -> None:
        connection = LiveConnection(edge, served=manager.models.of("duplex"))
        edge.notice = lambda reason: connection.send(ev.error(reason, "server_shutting_down", kind="server_error"))
        await connection.run()
    await manager.serve_websocket(websocket, PROTOCOL, reservation, run)
