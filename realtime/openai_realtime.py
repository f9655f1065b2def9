"""`/v1/realtime`: the OpenAI Realtime API over WebSocket, GA dialect by default, beta on request.

Mapping a full-duplex model onto a turn-shaped protocol (Parley's own design):

- The model listens and may speak at any time. Its speech is grouped into *responses* by
  its own activity: a response starts on the first frame whose audio is above
  `ACTIVITY_RMS` or which carries transcript text, and ends after `END_QUIET_FRAMES`
  quiet frames. Everything inside a response is sent as audio + transcript deltas, one
  event per 80 ms frame as soon as it is produced; quiet frames outside responses are not
  sent (a turn-based client would only play silence).
- `response.create` opens a response at once (the model's next speech goes into it; if it
  stays quiet for `CREATE_GRACE_FRAMES` the response completes empty). With a response
  already open it is `conversation_already_has_active_response`.
- `response.cancel` ends the open response (`response.done`, status `cancelled`) and mutes
  the agent at once: its output is dropped until it has been quiet for `END_QUIET_FRAMES`,
  so the cancelled utterance does not come back as a new response.
- `instructions` is the persona and `voice` the voice prompt: changing either (or the
  temperature) re-prefills the session (the slot is handed over without a gap, see
  `EdgeSession.reopen`), then `session.updated` is sent. OpenAI's built-in voice names
  (alloy, marin, ...) mean "the model's default voice".
- `input_audio_buffer.speech_started` / `speech_stopped` come from an energy detector on
  the input (only while turn detection is on); at speech end the buffer is committed as a
  user item. The model itself never waits for a commit: it hears the audio as it arrives.
- Input transcription (`audio.input.transcription` GA, `input_audio_transcription` beta) reads
  the session's paired STT row (engine/stt_paired.py): `conversation.item.input_audio_transcription
  .delta` as the words arrive, `.completed` when the user item is committed (text after the commit
  goes to the next item), `.failed` if the STT stream fails. `semantic_vad` ends the user's turn when
  the STT's end-of-turn probability reaches the `eagerness` threshold (`EAGERNESS`) after at least
  `SEMANTIC_MIN_QUIET_MS` of quiet, or at the eagerness's timeout; speech start stays energy-based.
  Both need a paired STT model (`parley serve --stt-model`); without one each such setting gets an
  `error` naming its parameter and is not applied; the rest of the update is, and the session goes on.
- Errors are OpenAI-shaped `error` events and never close the session. When every slot is
  taken the upgrade is refused with HTTP 503 + Retry-After (capacity.py); if the last slot
  goes between upgrade and admission: an `error` (code `session_limit_reached`), then close
  1013. A server going away (drain) sends an `error` (code `server_shutting_down`), then 1001.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import logging
from collections import OrderedDict
from typing import Any, Awaitable, Callable

import numpy as np
from starlette.responses import PlainTextResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from parley.engine import (
    EngineClosed, EngineFull, FrameOut, OptionsError, SamplingOptions, SessionOptions, SessionRejected, Status,
    Terminal,
)
from parley.models.config import FRAME_SAMPLES, SAMPLE_RATE

from .openai_events import (
    AssistantItem, Dialect, Event, Events, ResponseState, SessionConfig, TurnDetection, UserItem, new_id,
)
from .sessions import CLOSE_INTERNAL, CLOSE_TRY_AGAIN_LATER, EdgeSession, SessionManager, now

log = logging.getLogger("parley.realtime")

PROTOCOL = "openai"
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
REALTIME_SUBPROTOCOL = "realtime"
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."

FRAME_MS = FRAME_SAMPLES * 1000 // SAMPLE_RATE  # 80
ACTIVITY_RMS = 0.01  # ~ -40 dBFS: agent audio above this (or any transcript text) is speech
END_QUIET_FRAMES = 10  # 800 ms of quiet ends a response (and lifts the mute after a cancel)
CREATE_GRACE_FRAMES = 25  # a response.create with no speech completes empty after 2 s
SPEECH_RMS_AT_HALF = 0.02  # input energy detector: RMS at OpenAI's default threshold 0.5
MIN_COMMIT_SAMPLES = SAMPLE_RATE // 10  # 100 ms: less is input_audio_buffer_commit_empty
MAX_EVENT_BYTES = 8 * 1024 * 1024  # larger client events are refused with an error (the
# transport closes with 1009 only past uvicorn's ws_max_size, set higher than this)
MAX_ITEMS = 256  # conversation items remembered for retrieve / truncate / delete
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar"})


class ClientError(Exception):
    """A bad client event: becomes an `error` event; the session goes on."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


# semantic_vad eagerness -> (end-of-turn probability that ends the turn, timeout in ms). The
# timeouts are OpenAI's (low 8 s, medium 4 s, high 2 s); the thresholds are Parley's choice.
EAGERNESS = {"low": (0.8, 8000), "medium": (0.5, 4000), "auto": (0.5, 4000), "high": (0.25, 2000)}
SEMANTIC_MIN_QUIET_MS = 160  # at least two quiet frames before the head may end a turn


class SessionLost(Exception):
    """The engine session could not be re-established; the connection is closed."""


def select_dialect(websocket: WebSocket) -> Dialect:
    beta = websocket.headers.get("openai-beta", "").replace(" ", "").lower()
    if "realtime=v1" in beta or BETA_SUBPROTOCOL in websocket.scope.get("subprotocols", []):
        return Dialect.BETA
    return Dialect.GA


def offered_key(websocket: WebSocket) -> str | None:
    auth = websocket.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    for proto in websocket.scope.get("subprotocols", []):
        if proto.startswith(KEY_SUBPROTOCOL_PREFIX):
            return proto[len(KEY_SUBPROTOCOL_PREFIX):]
    return None


async def realtime_endpoint(websocket: WebSocket) -> None:
    manager: SessionManager = websocket.app.state.sessions
    required = manager.defaults.api_key
    if required is not None and offered_key(websocket) != required:
        await websocket.send_denial_response(PlainTextResponse(
            "invalid or missing API key: send Authorization: Bearer <key>", status_code=401))
        return
    reservation = await manager.admission.reserve_or_deny(websocket)
    if reservation is None:
        return
    offered = websocket.scope.get("subprotocols", [])
    edge = manager.attach(websocket, PROTOCOL, reservation)
    try:
        await websocket.accept(subprotocol=REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in offered else None)
        connection = RealtimeConnection(edge, select_dialect(websocket),
                                        websocket.query_params.get("model") or manager.defaults.model_name)
        edge.notice = lambda reason: connection.send(connection.events.error(
            reason, "server_shutting_down", kind="server_error"))
        await connection.run()
    finally:
        edge.close()


@dataclasses.dataclass
class InputTracker:
    """The input side's books: samples since the last commit and the energy detector."""

    total_samples: int = 0  # all input so far (the audio clock for *_ms fields)
    buffered_samples: int = 0  # since the last commit / clear
    pending: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
    speaking: bool = False
    speech_item: str | None = None
    quiet_ms: int = 0


class RealtimeConnection:
    def __init__(self, edge: EdgeSession, dialect: Dialect, model: str) -> None:
        self.edge = edge
        self.manager = edge.manager
        self.events = Events(dialect)
        defaults = self.manager.defaults.options
        self.config = SessionConfig(id=new_id("sess"), model=model, instructions=defaults.persona,
                                    voice=defaults.voice,
                                    temperature=(defaults.sampling or SamplingOptions()).audio_temperature)
        self.options = self.manager.defaults.client_options(defaults)
        self.conversation_id = new_id("conv")
        self.response: ResponseState | None = None
        self.response_quiet = 0  # quiet frames in the open response
        self.response_spoke = False  # the open response has had any speech yet
        self.muted = False  # after response.cancel, until the agent goes quiet
        self.mute_quiet = 0
        self.items: OrderedDict[str, Event] = OrderedDict()
        self.last_item_id: str | None = None
        self.input = InputTracker()
        self._transcript: asyncio.Task | None = None  # reads the paired STT stream while needed
        self._heard = ""  # transcribed since the last commit
        self._end_of_turn = 0.0  # the STT's latest end-of-turn probability
        self._reprefill_lock = asyncio.Lock()
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
        }

    # ---- lifecycle ----

    async def run(self) -> None:
        edge = self.edge
        try:
            await edge.open_engine_session(self.options)
        except EngineFull as exc:
            await self.send(self.events.error(f"server full: {exc}", "session_limit_reached", kind="server_error"))
            await edge.close_socket(CLOSE_TRY_AGAIN_LATER, "server full: every session slot is taken")
            return
        except (OptionsError, SessionRejected, EngineClosed) as exc:
            await self.send(self.events.error(f"cannot start the session: {exc}", "session_failed",
                                              kind="server_error"))
            await edge.close_socket(CLOSE_INTERNAL, str(exc))
            return
        await self.send(self.events.session_created(self.config))
        try:
            await edge.run_duplex(self._send_loop(), self._receive_loop())
        finally:
            self._stop_transcript()

    async def send(self, event: Event) -> None:
        try:
            await self.edge.send_text(json.dumps(event, separators=(",", ":")))
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the client left; the receive loop sees the disconnect and ends the session

    async def send_all(self, events: list[Event]) -> None:
        for event in events:
            await self.send(event)

    async def error(self, exc: ClientError, client_event_id: str | None) -> None:
        self.manager.metrics.protocol_errors.labels(PROTOCOL).inc()
        await self.send(self.events.error(str(exc), exc.code, param=exc.param, client_event_id=client_event_id))

    # ---- client -> server ----

    async def _receive_loop(self) -> None:
        websocket = self.edge.websocket
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            if raw is None:
                data = message.get("bytes") or b""
                self.edge.count_in(len(data))
                try:
                    raw = data.decode()
                except UnicodeDecodeError:
                    await self.error(ClientError("binary messages must be UTF-8 JSON events", "invalid_json"), None)
                    continue
            else:
                self.edge.count_in(len(raw))
            try:
                await self._handle_raw(raw)
            except SessionLost:
                return

    async def _handle_raw(self, raw: str) -> None:
        client_event_id = None
        try:
            if len(raw) > MAX_EVENT_BYTES:
                raise ClientError(f"event of {len(raw)} bytes exceeds the {MAX_EVENT_BYTES}-byte limit",
                                  "message_too_large")
            try:
                event = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ClientError(f"invalid JSON: {exc}", "invalid_json") from None
            if not isinstance(event, dict):
                raise ClientError("an event must be a JSON object", "invalid_json")
            client_event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            kind = event.get("type")
            if not isinstance(kind, str):
                raise ClientError("the event has no 'type'", "missing_required_parameter", "type")
            handler = self._handlers.get(kind)
            if handler is None:
                raise ClientError(f"unknown event type {kind!r}", "invalid_value", "type")
            await handler(event)
        except ClientError as exc:
            await self.error(exc, client_event_id)

    async def _on_session_update(self, event: Event) -> None:
        session = event.get("session")
        if not isinstance(session, dict):
            raise ClientError("session.update needs a 'session' object", "missing_required_parameter", "session")
        config = dataclasses.replace(self.config)
        audio = session.get("audio") if isinstance(session.get("audio"), dict) else {}
        audio_in = audio.get("input") if isinstance(audio.get("input"), dict) else {}
        audio_out = audio.get("output") if isinstance(audio.get("output"), dict) else {}
        for where, fmt in (("session.input_audio_format", session.get("input_audio_format")),
                           ("session.output_audio_format", session.get("output_audio_format")),
                           ("session.audio.input.format", audio_in.get("format")),
                           ("session.audio.output.format", audio_out.get("format"))):
            _check_format(where, fmt)
        if "instructions" in session:
            if not isinstance(session["instructions"], str) and session["instructions"] is not None:
                raise ClientError("instructions must be a string", "invalid_type", "session.instructions")
            config.instructions = session["instructions"] or ""
        voice = audio_out.get("voice", session.get("voice"))
        if isinstance(voice, dict):
            voice = voice.get("id")
        if voice is not None:
            if not isinstance(voice, str) or not voice:
                raise ClientError("voice must be a voice name", "invalid_type", "session.voice")
            config.voice = voice
        modalities = session.get("output_modalities", session.get("modalities"))
        if modalities is not None:
            if not isinstance(modalities, list) or not set(modalities) <= {"text", "audio"} or not modalities:
                raise ClientError("modalities must be a list of 'text' and/or 'audio'", "invalid_value",
                                  "session.output_modalities")
            config.output_modalities = ["audio"] if "audio" in modalities else ["text"]
        if "turn_detection" in audio_in or "turn_detection" in session:
            config.turn_detection = _turn_detection(audio_in.get("turn_detection", session.get("turn_detection")))
        param, transcription = _transcription_setting(session, audio_in)
        if param is not None:
            config.transcription = transcription
        refused = []  # settings that need an STT model this server lacks: not applied, each named
        if not self.manager.engine.can_transcribe:
            if config.transcription is not None:
                refused.append(param)
                config.transcription = self.config.transcription
            if config.turn_detection is not None and config.turn_detection.type == "semantic_vad":
                refused.append("session.audio.input.turn_detection.type" if "turn_detection" in audio_in
                               else "session.turn_detection.type")
                config.turn_detection = self.config.turn_detection
        needs_stt = config.transcription is not None or (
            config.turn_detection is not None and config.turn_detection.type == "semantic_vad")
        if session.get("temperature") is not None:
            temperature = session["temperature"]
            if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
                raise ClientError("temperature must be a number", "invalid_type", "session.temperature")
            config.temperature = float(temperature)
        try:
            options = self.manager.defaults.client_options(SessionOptions(
                persona=config.instructions,
                voice=None if config.voice in OPENAI_VOICES else config.voice,
                sampling=self._sampling(config.temperature)))
        except OptionsError as exc:
            raise ClientError(str(exc), "invalid_value", "session") from None
        if options != self.options:
            await self._reprefill(options)
        self.config = config
        if needs_stt and self._transcript is None:
            self._transcript = asyncio.create_task(self._transcript_loop())
        elif not needs_stt:
            self._stop_transcript()
        for name in refused:
            await self.error(ClientError(f"{name}: this server has no speech-to-text model loaded (parley serve "
                                         f"--stt-model), so it cannot transcribe the input or run semantic_vad; "
                                         f"this setting was not applied (the rest of the update was)",
                                         "invalid_value", name), event.get("event_id"))
        await self.send(self.events.session_updated(self.config))

    def _sampling(self, temperature: float) -> SamplingOptions | None:
        current = self.options.sampling
        if temperature == (current or SamplingOptions()).audio_temperature:
            return current  # unchanged (None stays None: the checkpoint's defaults)
        return dataclasses.replace(current or SamplingOptions(), audio_temperature=temperature)

    async def _reprefill(self, options: SessionOptions) -> None:
        async with self._reprefill_lock:
            if self.response is not None:
                await self._finish_response("cancelled", {"type": "cancelled", "reason": "client_cancelled"})
            try:
                await self.edge.reopen(options)
            except SessionRejected as exc:
                raise ClientError(f"the model cannot use these settings: {exc}", "invalid_value", "session") from None
            except (EngineFull, EngineClosed) as exc:
                await self.send(self.events.error(f"lost the session slot while re-prefilling: {exc}",
                                                  "session_failed", kind="server_error"))
                await self.edge.close_socket(CLOSE_TRY_AGAIN_LATER, "session slot lost while re-prefilling")
                raise SessionLost(str(exc)) from exc
            self.options = options

    async def _on_append(self, event: Event) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise ClientError("input_audio_buffer.append needs 'audio': base64 PCM16", "missing_required_parameter",
                              "audio")
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise ClientError("audio is not valid base64", "invalid_value", "audio") from None
        if len(raw) % 2:
            raise ClientError("PCM16 audio must hold a whole number of 2-byte samples", "invalid_value", "audio")
        if not raw:
            return
        pcm = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
        session = self.edge.engine_session
        if session is not None:
            session.push_audio(pcm)
        await self._detect_speech(pcm)

    async def _detect_speech(self, pcm: np.ndarray) -> None:
        tracker = self.input
        tracker.buffered_samples += pcm.size
        td = self.config.turn_detection
        frames = np.concatenate([tracker.pending, pcm])
        whole = frames.size // FRAME_SAMPLES * FRAME_SAMPLES
        tracker.pending = frames[whole:]
        for start in range(0, whole, FRAME_SAMPLES):
            frame = frames[start:start + FRAME_SAMPLES]
            tracker.total_samples += FRAME_SAMPLES
            if self.response is not None:
                self.response.input_frames += 1
            if td is None:
                continue
            loud = float(np.sqrt(np.mean(frame * frame))) > SPEECH_RMS_AT_HALF * (td.threshold / 0.5)
            clock_ms = tracker.total_samples * 1000 // SAMPLE_RATE
            if loud and not tracker.speaking:
                tracker.speaking, tracker.quiet_ms = True, 0
                tracker.speech_item = tracker.speech_item or new_id("item")  # transcript deltas may have named it
                start_ms = max(0, clock_ms - FRAME_MS - td.prefix_padding_ms)
                await self.send(self.events.speech_started(start_ms, tracker.speech_item))
            elif tracker.speaking:
                tracker.quiet_ms = 0 if loud else tracker.quiet_ms + FRAME_MS
                if self._turn_ended(td, tracker.quiet_ms):
                    tracker.speaking = False
                    item_id = tracker.speech_item or new_id("item")
                    await self.send(self.events.speech_stopped(clock_ms, item_id))
                    await self._commit(item_id)

    def _turn_ended(self, td: TurnDetection, quiet_ms: int) -> bool:
        if td.type != "semantic_vad":
            return quiet_ms >= td.silence_duration_ms
        threshold, timeout_ms = EAGERNESS[td.eagerness]
        return (quiet_ms >= SEMANTIC_MIN_QUIET_MS and self._end_of_turn >= threshold) or quiet_ms >= timeout_ms

    async def _commit(self, item_id: str) -> None:
        previous = self.last_item_id
        item = UserItem(item_id).to_dict(self.events.dialect)
        self._remember(item)
        seconds = self.input.buffered_samples / SAMPLE_RATE
        self.input.buffered_samples = 0
        self.input.speech_item = None
        await self.send(self.events.committed(item_id, previous))
        await self.send_all(self.events.item_entered(item, previous))
        if self.config.transcription is not None and self._transcript is not None:
            heard, self._heard = self._heard.strip(), ""
            await self.send(self.events.transcription_completed(item_id, heard, seconds))

    # ---- input transcription (paired STT row) ----

    async def _transcript_loop(self) -> None:
        """Follow the session's transcript; a re-prefill hands the slot to a new engine session,
        whose transcript is followed in turn."""
        while True:
            session = self.edge.engine_session
            if session is None or session.closed:
                return
            try:
                stream = self.manager.engine.enable_transcription(session)
            except OptionsError:
                return
            async for event in stream:
                if isinstance(event, Terminal):
                    if event.status is Status.FAILED and self.config.transcription is not None:
                        item = self.input.speech_item or new_id("item")
                        await self.send(self.events.transcription_failed(item, event.reason))
                    break
                if event.end_of_turn == event.end_of_turn:  # not NaN
                    self._end_of_turn = event.end_of_turn
                if event.text and self.config.transcription is not None:
                    if self.input.speech_item is None:
                        self.input.speech_item = new_id("item")
                    self._heard += event.text
                    await self.send(self.events.transcription_delta(self.input.speech_item, event.text))
            await asyncio.sleep(0.05)
            if self.edge.engine_session is session:
                return

    def _stop_transcript(self) -> None:
        if self._transcript is not None:
            self._transcript.cancel()
            self._transcript = None

    async def _on_commit(self, event: Event) -> None:
        if self.input.buffered_samples < MIN_COMMIT_SAMPLES:
            ms = self.input.buffered_samples * 1000 // SAMPLE_RATE
            raise ClientError(f"buffer too small: expected at least 100ms of audio, but buffer only has {ms}ms",
                              "input_audio_buffer_commit_empty")
        await self._commit(self.input.speech_item if self.input.speaking and self.input.speech_item
                           else new_id("item"))

    async def _on_clear(self, event: Event) -> None:
        self.input.buffered_samples = 0
        await self.send(self.events.cleared())

    async def _on_item_create(self, event: Event) -> None:
        item = event.get("item")
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise ClientError("conversation.item.create needs an 'item' with a 'type'", "missing_required_parameter",
                              "item")
        stored = {**item, "id": item.get("id") or new_id("item"), "object": "realtime.item", "status": "completed"}
        if stored["type"] == "message" and stored.get("role") not in ("user", "assistant", "system"):
            raise ClientError("a message item needs a role: user, assistant or system", "invalid_value", "item.role")
        previous = event.get("previous_item_id") or self.last_item_id
        self._remember(stored)
        await self.send_all(self.events.item_entered(stored, previous))

    def _item(self, event: Event) -> tuple[str, Event]:
        item_id = event.get("item_id")
        if not isinstance(item_id, str) or item_id not in self.items:
            raise ClientError(f"Item with item_id '{item_id}' not found", "item_not_found", "item_id")
        return item_id, self.items[item_id]

    async def _on_item_retrieve(self, event: Event) -> None:
        _, item = self._item(event)
        await self.send(self.events.item_retrieved(item))

    async def _on_item_truncate(self, event: Event) -> None:
        item_id, _ = self._item(event)
        audio_end_ms = event.get("audio_end_ms", 0)
        content_index = event.get("content_index", 0)
        if isinstance(audio_end_ms, bool) or not isinstance(audio_end_ms, int) or audio_end_ms < 0:
            raise ClientError("audio_end_ms must be a non-negative integer", "invalid_value", "audio_end_ms")
        await self.send(self.events.item_truncated(item_id, content_index if isinstance(content_index, int) else 0,
                                                   audio_end_ms))

    async def _on_item_delete(self, event: Event) -> None:
        item_id, _ = self._item(event)
        del self.items[item_id]
        await self.send(self.events.item_deleted(item_id))

    async def _on_response_create(self, event: Event) -> None:
        if self.response is not None:
            raise ClientError(f"Conversation already has an active response in progress: {self.response.id}",
                              "conversation_already_has_active_response")
        self.muted = False
        await self._start_response()

    async def _on_response_cancel(self, event: Event) -> None:
        if self.response is None:
            raise ClientError("Cancellation failed: no active response found", "response_cancel_not_active")
        await self._cancel()

    async def _on_output_clear(self, event: Event) -> None:
        if self.response is not None:
            await self._cancel()

    async def _cancel(self) -> None:
        await self._finish_response("cancelled", {"type": "cancelled", "reason": "client_cancelled"})
        self.muted, self.mute_quiet = True, 0

    def _remember(self, item: Event) -> None:
        self.items[item["id"]] = item
        self.items.move_to_end(item["id"])
        while len(self.items) > MAX_ITEMS:
            self.items.popitem(last=False)
        self.last_item_id = item["id"]

    # ---- engine -> client ----

    async def _send_loop(self) -> None:
        while True:
            session = self.edge.engine_session
            assert session is not None
            terminal: Terminal | None = None
            async for event in session.events:
                if isinstance(event, Terminal):
                    terminal = event
                    break
                assert isinstance(event, FrameOut)
                start = now()
                await self._on_frame(event)
                self.edge.observe_frame_delay(now() - start)
            await self.edge.wait_reopen()
            if session is not self.edge.engine_session:
                continue  # replaced by a re-prefill: follow the new session
            if self.response is not None:
                await self._finish_response("failed" if terminal and terminal.status is Status.FAILED
                                            else "incomplete", None)
            if terminal is not None and terminal.status is Status.FAILED:
                await self.send(self.events.error(f"the session failed: {terminal.reason}", "session_failed",
                                                  kind="server_error"))
                await self.edge.close_socket(CLOSE_INTERNAL, f"session failed: {terminal.reason}")
            return

    async def _on_frame(self, frame: FrameOut) -> None:
        active = bool(frame.text) or float(np.sqrt(np.mean(frame.pcm * frame.pcm))) > ACTIVITY_RMS
        if self.muted:
            self.mute_quiet = 0 if active else self.mute_quiet + 1
            if self.mute_quiet >= END_QUIET_FRAMES:
                self.muted = False
            return
        if self.response is None:
            if not active:
                return
            await self._start_response()
        response = self.response
        assert response is not None
        if response.item.audio:
            pcm16 = (np.clip(frame.pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
            await self.send(self.events.audio_delta(response, base64.b64encode(pcm16).decode()))
            response.audio_frames += 1
            self.manager.metrics.frames_out.labels(PROTOCOL).inc()
            self.edge.observe_frame_sent(frame.produced_at)
        if frame.text:
            response.item.transcript += frame.text
            response.text_pieces += 1
            delta = (self.events.transcript_delta(response, frame.text) if response.item.audio
                     else self.events.text_delta(response, frame.text))
            await self.send(delta)
        if active:
            self.response_quiet, self.response_spoke = 0, True
        else:
            self.response_quiet += 1
        limit = END_QUIET_FRAMES if self.response_spoke else CREATE_GRACE_FRAMES
        if self.response_quiet >= limit:
            await self._finish_response("completed", None)

    async def _start_response(self) -> None:
        item = AssistantItem(new_id("item"), audio="audio" in self.config.output_modalities)
        response = ResponseState(new_id("resp"), self.conversation_id, item, previous_item_id=self.last_item_id)
        self.response, self.response_quiet, self.response_spoke = response, 0, False
        self._remember(item.to_dict(self.events.dialect))
        await self.send(self.events.response_created(response, self.config))
        await self.send(self.events.output_item_added(response))
        await self.send_all(self.events.item_added(item.to_dict(self.events.dialect), response.previous_item_id))
        await self.send(self.events.content_part_added(response))

    async def _finish_response(self, status: str, details: Event | None) -> None:
        response = self.response
        if response is None:
            return
        self.response = None
        response.status, response.status_details = status, details
        response.item.status = "completed" if status == "completed" else "incomplete"
        item = response.item.to_dict(self.events.dialect)
        self._remember_existing(item)
        if response.item.audio:
            await self.send(self.events.audio_done(response))
            await self.send(self.events.transcript_done(response))
        else:
            await self.send(self.events.text_done(response))
        await self.send(self.events.content_part_done(response))
        await self.send(self.events.output_item_done(response))
        await self.send_all(self.events.item_done(item, response.previous_item_id))
        await self.send(self.events.response_done(response, self.config))

    def _remember_existing(self, item: Event) -> None:
        if item["id"] in self.items:
            self.items[item["id"]] = item


def _check_format(where: str, fmt: Any) -> None:
    if fmt is None:
        return
    if isinstance(fmt, str):
        if fmt != "pcm16":
            raise ClientError(f"{where}: only pcm16 (24 kHz mono) is supported, got {fmt!r}", "invalid_value", where)
        return
    if not isinstance(fmt, dict) or fmt.get("type", "audio/pcm") != "audio/pcm" \
            or fmt.get("rate", SAMPLE_RATE) != SAMPLE_RATE:
        raise ClientError(f"{where}: only audio/pcm at 24000 Hz is supported, got {fmt!r}", "invalid_value", where)


def _turn_detection(raw: Any) -> TurnDetection | None:
    if raw is None or raw is False:
        return None
    if not isinstance(raw, dict):
        raise ClientError("turn_detection must be an object or null", "invalid_type", "session.turn_detection")
    td = TurnDetection()
    kind = raw.get("type", td.type)
    if kind not in ("server_vad", "semantic_vad"):
        raise ClientError(f"turn_detection.type must be server_vad or semantic_vad, got {kind!r}", "invalid_value",
                          "session.turn_detection.type")
    td.type = kind
    for name in ("threshold", "prefix_padding_ms", "silence_duration_ms", "create_response", "interrupt_response",
                 "eagerness"):
        value = raw.get(name)
        if value is not None:
            setattr(td, name, value)
    if td.eagerness not in EAGERNESS:
        raise ClientError(f"turn_detection.eagerness must be one of {', '.join(EAGERNESS)}, got {td.eagerness!r}",
                          "invalid_value", "session.turn_detection.eagerness")
    if not isinstance(td.threshold, (int, float)) or not 0 < td.threshold <= 1:
        raise ClientError("turn_detection.threshold must be in (0, 1]", "invalid_value",
                          "session.turn_detection.threshold")
    return td


def _transcription_setting(session: Event, audio_in: Event) -> tuple[str | None, Event | None]:
    """(the parameter's name, its value) when the update sets input transcription (None: it does
    not). The value is an object (on) or null (off); Parley's STT is the model whatever it names."""
    if "transcription" in audio_in:
        param, value = "session.audio.input.transcription", audio_in["transcription"]
    elif "input_audio_transcription" in session:
        param, value = "session.input_audio_transcription", session["input_audio_transcription"]
    else:
        return None, None
    if value is not None and not isinstance(value, dict):
        raise ClientError(f"{param} must be an object or null", "invalid_type", param)
    return param, value
