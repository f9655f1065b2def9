"""`/api/tts_streaming`: Kyutai moshi-server's streaming text-to-speech, on the TTS pool.

Query (checked before the upgrade; a wrong one is a 400 naming it, as serde's query refusal is):
- `format`: `Pcm` (raw little-endian float32 frames), `PcmMessagePack` (`Audio{pcm}`), `OggOpus`
  (raw Ogg pages), `OggOpusMessagePack` (`OggOpus{data}`); default `OggOpus`, as moshi-server's.
- `voice`: a name of the voice set (`--tts-voices`, the names moshi-server's configs use, e.g.
  `unmute-prod-website/default_voice.wav`) or an alias of `--tts-voice-map`; left out,
  `DEFAULT_VOICE` where the set has it (Kyutai's configs' `default_voice`), else its first voice.
- `cfg_alpha`: the model's `cfg` condition, one of the values its LUT holds (Unmute sends 1.5);
  `temperature` / `top_k`: the text and audio sampling (moshi-server's `tts.rs` sets both).
- `seed`, `voices`, `max_seq_len`: refused by name (the pool has one random stream, one voice per
  request, and its own step bound). `auth_id` is the key (server/security.py). Anything else: 400.
Messages (messages.py): in `Text{text}` or a plain text frame (each message's words are words of
their own, as moshi-server splits them), `Voice{embeddings, shape}`, `Eos` or the byte `\\0`; out
`Ready`, `Text{text, start_s, stop_s}`, `Audio{pcm}` / `OggOpus{data}`, `Error{message}`; the raw
formats carry audio only, as moshi-server's do.
Rules:
1. At connect a TTS slot must be free, else `Error{"no free channels"}` (raw formats: nothing) and
   close 1013. Then `Ready`.
2. The first words take a pool row (a `text_open` request: the engine client's `SpeechJob`); later
   text joins its script as it arrives (`SpeechJob.append`), and `Eos` ends it (`end_text`). The row speaks as the words come, holding the DSM's
   lookahead (2 words) + 1 ahead of what it has said, as moshi-server's `tts.py` waits for words.
   Audio and word times stream out as synthesised; after `Eos` the last word is flushed, then
   close 1000 (the `Eos` flush). `Eos` with no words: close 1000 at once, as moshi-server does.
3. `Voice` before the first words replaces the voice when its shape is the voice set's
   (`[1, dim, frames]` or `[dim, frames]`); another shape, or a `Voice` after the first words
   (moshi-server reads the voice at the first words), is an `Error` naming it, then close 1008.
4. Input the door cannot take gets an `Error{message}` on its own connection, then a close: a frame
   that is not a message (1007), text past `MAX_TEXT_CHARS` (1009), a voice or text it cannot speak
   (1008), a full pool at `Eos` (1013), a failed synthesis (1011). Limits, Origin check, keys and
   drain are every door's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from starlette.responses import PlainTextResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..engine_client import (EngineClient, SpeechInputError, SpeechJob, Status, Terminal, TtsAudio, TtsPoolFull,
                             TtsRequest, TtsWord)
from ..http.speech import SpeechService
from ..media.speech_formats import make_encoder
from ..server.security import choose_subprotocol
from ..server.state import app_state
from ..sessions.capacity import deny_upgrade
from ..sessions.session import (CLOSE_INTERNAL, CLOSE_INVALID_PAYLOAD, CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG,
                                CLOSE_TRY_AGAIN_LATER, EdgeSession, SessionManager)
from . import messages as msg
from .asr import NO_FREE_CHANNELS

log = logging.getLogger("parley.kyutai")

PROTOCOL = "kyutai_tts"
FORMATS = ("Pcm", "PcmMessagePack", "OggOpus", "OggOpusMessagePack")
DEFAULT_VOICE = "unmute-prod-website/default_voice.wav"
MAX_TEXT_CHARS = 16384  # text kept until Eos (the pool's row bounds words and tokens too)
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a Voice message of a few hundred thousand floats fits
QUERY = {"format", "voice", "cfg_alpha", "temperature", "top_k", "auth_id", "api_key"}  # the last two: keys
REFUSED = {"seed": "the TTS pool draws from one random stream; a per-connection seed is not served",
           "voices": "one voice per request is served (voice=...)",
           "max_seq_len": "the pool bounds each request's steps by its text"}


class QueryError(ValueError):
    pass


@dataclass(frozen=True)
class TtsQuery:
    format: str
    voice: str
    sampling: dict  # TtsRequest sampling fields the query sets
    cfg: str | None  # the cfg condition's value, if the query set it


def parse_query(query: Mapping[str, str], service: SpeechService) -> TtsQuery:
    """The query's settings, or a QueryError naming the first that cannot be served."""
    for name in query:
        if name in REFUSED:
            raise QueryError(f"{name} is not supported: {REFUSED[name]}")
        if name not in QUERY:
            raise QueryError(f"unknown query parameter {name[:40]!r}; this door takes {', '.join(sorted(QUERY))}")
    fmt = query.get("format", "OggOpus")
    if fmt not in FORMATS:
        raise QueryError(f"format {fmt[:40]!r}: expected one of {', '.join(FORMATS)}")
    front_end = service.front_end
    names = front_end.voices.names()
    voice = query.get("voice") or (DEFAULT_VOICE if DEFAULT_VOICE in front_end.voices else names[0])
    try:
        front_end.check_voice(voice)
    except SpeechInputError:
        raise QueryError(f"unknown voice {voice[:80]!r}; GET /v1/audio/voices lists them") from None
    sampling = {}
    if "temperature" in query:
        value = _number(query["temperature"], "temperature", 0.0, 2.0)
        sampling.update(text_temperature=value, audio_temperature=value)
    if "top_k" in query:
        value = _number(query["top_k"], "top_k", 0, 100_000)
        if value != int(value):
            raise QueryError("top_k must be a whole number")
        sampling.update(text_top_k=int(value), audio_top_k=int(value))
    cfg = None
    if "cfg_alpha" in query:
        alpha = _number(query["cfg_alpha"], "cfg_alpha", 0.0, 100.0)
        cfg = next((v for v in front_end.cfg_values if math.isclose(float(v), alpha)), None)
        if cfg is None:
            served = ", ".join(front_end.cfg_values) or "none: this model has no cfg condition"
            raise QueryError(f"cfg_alpha {alpha:g} is not one this model was trained with ({served})")
    return TtsQuery(fmt, voice, sampling, cfg)


def _number(raw: str, name: str, low: float, high: float) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise QueryError(f"{name} must be a number, got {raw[:40]!r}") from None
    if not (math.isfinite(value) and low <= value <= high):
        raise QueryError(f"{name} {value:g} is outside {low:g} to {high:g}")
    return value


class Output:
    """One connection's output in its format: what moshi-server's `tts::Encoder` writes."""

    def __init__(self, fmt: str) -> None:
        self.packed = fmt.endswith("MessagePack")  # Ready, Error and Text go out only in these
        self._opus = make_encoder("opus") if fmt.startswith("OggOpus") else None

    def message(self, message: bytes) -> bytes | None:
        return message if self.packed else None

    def audio(self, pcm: np.ndarray) -> bytes | None:
        if self._opus is None:
            return msg.audio(pcm) if self.packed else np.asarray(pcm, dtype="<f4").tobytes()
        page = self._opus.push(pcm)  # Ogg pages: the stream's header pages come with the first audio
        if not page:
            return None
        return msg.ogg_opus(page) if self.packed else page

    def word(self, word: TtsWord) -> bytes | None:
        return msg.tts_text(word.text, word.start_s, word.stop_s) if self.packed and word.text else None


class Script:
    """What the client sent before `Eos`: its words and the voice it chose."""

    def __init__(self, voice_shape: tuple[int, ...]) -> None:
        self.parts: list[str] = []
        self.chars = 0
        self.voice: torch.Tensor | None = None  # a Voice message's embeddings, [1, dim, frames]
        self._shape = voice_shape  # the voice set's [1, dim, frames]

    def add_text(self, text: str) -> bool:
        """False when the text would pass MAX_TEXT_CHARS."""
        self.chars += len(text) + 1
        self.parts.append(text)
        return self.chars <= MAX_TEXT_CHARS

    def set_voice(self, voice: msg.Voice) -> str | None:
        """None, or why this voice cannot be used."""
        if voice.shape not in (self._shape, self._shape[1:]):
            return (f"Voice.shape {list(voice.shape)} is not this model's voice shape {list(self._shape)} "
                    f"(or {list(self._shape[1:])})")
        self.voice = torch.from_numpy(voice.embeddings.copy()).reshape(self._shape)
        return None

    @property
    def text(self) -> str:
        return " ".join(self.parts)


async def tts_endpoint(websocket: WebSocket) -> None:
    """Keys and Origins are checked before this runs (server/security.py); mounted only with a
    TTS model (server/doors.py)."""
    state = app_state(websocket)
    manager: SessionManager = state.sessions
    service = state.speech
    assert service is not None  # mounted only with a TTS model
    try:
        query = parse_query(websocket.query_params, service)
    except QueryError as exc:
        state.refusals.record(websocket.scope, "options", str(exc))
        await deny_upgrade(websocket, PlainTextResponse(str(exc), status_code=400), str(exc))
        return
    reservation = await manager.admission.reserve_or_deny(websocket, needs_slot=False)  # draining: 503
    if reservation is None:
        return
    edge = manager.attach(websocket, PROTOCOL, reservation)
    output = Output(query.format)
    edge.notice = lambda reason: _send(edge, output.message(msg.error(reason)))
    try:
        await websocket.accept(subprotocol=choose_subprotocol(websocket.scope.get("subprotocols", [])))
        await _serve(edge, state.client, service, query, output)
    except (WebSocketDisconnect, OSError):
        log.info("kyutai tts session %d: the client left", edge.number)
    finally:
        edge.close()


async def _send(edge: EdgeSession, data: bytes | None) -> None:
    if data:
        await edge.outbox.send_bytes(data)


async def _serve(edge: EdgeSession, client: EngineClient, service: SpeechService, query: TtsQuery,
                 output: Output) -> None:
    slots = client.speech_slots()
    if slots.free <= 0:
        await _full(edge, output, f"all {slots.total} TTS slots are busy")
        return
    await _send(edge, output.message(msg.ready()))
    script = Script(tuple(service.front_end.voices.load(query.voice).shape))
    request = await _first_words(edge, output, service, query, script)
    if request is None:
        return
    try:
        job = await client.submit_speech(request)
    except TtsPoolFull as exc:
        await _full(edge, output, str(exc))
        return
    try:
        await edge.run_duplex(_speak(edge, job, output), _more_words(edge, output, service, job, script))
    finally:
        job.cancel()  # no-op once finished; frees the row at the pool's next offer otherwise


async def _next_message(edge: EdgeSession, output: Output) -> object | None:
    """The client's next message (a text frame is `Text`, the byte 0 `Eos`); None once the
    connection is closed (the client left, or a frame the door cannot take)."""
    frame = await edge.websocket.receive()
    if frame["type"] == "websocket.disconnect":
        return None
    data, text = frame.get("bytes"), frame.get("text")
    if not await edge.outbox.admit_message(len(data) if data is not None else len(text or "")):
        return None
    if data is None:
        return msg.Text(text or "")
    if data == b"\0":
        return msg.Eos()
    if len(data) > MAX_MESSAGE_BYTES:
        await _close(edge, output, CLOSE_TOO_BIG, "too_large",
                     f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        return None
    try:
        return msg.parse(data, msg.TTS_IN)
    except msg.ProtocolError as exc:
        edge.counters.protocol_error()
        await _close(edge, output, CLOSE_INVALID_PAYLOAD, None, str(exc))
        return None


async def _first_words(edge: EdgeSession, output: Output, service: SpeechService, query: TtsQuery,
                       script: Script) -> TtsRequest | None:
    """Messages until the text holds a word: the pool's request for it, its text still open. None
    once the connection is closed (`Eos` with no words closes 1000, as moshi-server does)."""
    while (message := await _next_message(edge, output)) is not None:
        if isinstance(message, msg.Eos):
            await edge.outbox.close_socket(CLOSE_NORMAL, "end of stream")
            return None
        if isinstance(message, msg.Voice):
            if (why := script.set_voice(message)) is not None:
                await _close(edge, output, CLOSE_POLICY, "options", why)
                return None
            continue
        if not script.add_text(message.text):
            await _close(edge, output, CLOSE_TOO_BIG, "too_large", f"the text passed {MAX_TEXT_CHARS} characters")
            return None
        try:
            request, _ = service.front_end.request(script.text, query.voice)
        except SpeechInputError:  # nothing speakable yet (blanks, punctuation): wait for words
            continue
        request = dataclasses.replace(request, text_open=True, **query.sampling)
        if query.cfg is not None:
            request = dataclasses.replace(request, conditions={**request.conditions, "cfg": query.cfg})
        if script.voice is not None:
            request = dataclasses.replace(request, voices=(script.voice,))
        return request
    return None


async def _more_words(edge: EdgeSession, output: Output, service: SpeechService, job: SpeechJob,
                      script: Script) -> None:
    """After the first words: more text onto the job's row, then `Eos`; after it the client may
    still send (moshi-server reads on): counted against the limits and dropped. Returns when the
    client leaves or the connection is closed for bad input."""
    ended = False
    while (message := await _next_message(edge, output)) is not None:
        if ended:
            continue
        if isinstance(message, msg.Eos):
            job.end_text()
            ended = True
        elif isinstance(message, msg.Voice):
            await _close(edge, output, CLOSE_POLICY, "options", "a Voice message must come before the first words")
            return
        elif not script.add_text(message.text):
            await _close(edge, output, CLOSE_TOO_BIG, "too_large", f"the text passed {MAX_TEXT_CHARS} characters")
            return
        elif entries := service.front_end.more_words(message.text):
            job.append(entries)


async def _speak(edge: EdgeSession, job: SpeechJob, output: Output) -> None:
    """Pool -> client: audio and words as synthesised, then the close that ends the stream."""
    try:
        async for event in job.events:
            if isinstance(event, TtsAudio):
                await _send(edge, output.audio(event.pcm))
            elif isinstance(event, TtsWord):
                await _send(edge, output.word(event))
            elif isinstance(event, Terminal):
                if event.status is Status.COMPLETED:
                    await edge.outbox.close_socket(CLOSE_NORMAL, "end of stream")
                else:
                    await _send(edge, output.message(msg.error(f"synthesis failed: {event.reason}")))
                    await edge.outbox.close_socket(CLOSE_INTERNAL, f"synthesis failed: {event.reason}")
                return
    except (WebSocketDisconnect, RuntimeError, OSError):
        return  # the client left


async def _full(edge: EdgeSession, output: Output, detail: str) -> None:
    await _send(edge, output.message(msg.error(NO_FREE_CHANNELS)))
    await edge.outbox.refuse(CLOSE_TRY_AGAIN_LATER, "full", f"{NO_FREE_CHANNELS}: {detail}")


async def _close(edge: EdgeSession, output: Output, code: int, reason: str | None, text: str) -> None:
    """An Error{text} (msgpack formats carry it; the raw ones get the close reason only), then close
    `code`; a refusal `reason` (refusals.py) is logged and counted."""
    await _send(edge, output.message(msg.error(text)))
    if reason is None:
        await edge.outbox.close_socket(code, text)
    else:
        await edge.outbox.refuse(code, reason, text)
