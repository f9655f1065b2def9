"""OpenAI's speech API over the engine's TTS pool.

    POST /v1/audio/speech   {model, input, voice, instructions?, response_format?, speed?, stream_format?}
    GET  /v1/audio/voices   {"object": "list", "data": [{"id": name, "object": "voice", "name": name}, ...]}

- `model`: one of the TTS model's served names (server/served_models.py: its checkpoint's name and
  `--served-model-name tts=...`); another is 404 `model_not_found`; left out, the served one.
- `input`: 1 to 4096 characters. `<break time="1.5s"/>` inserts a pause (up to 10 s).
- `voice`: a name from the voice set (`--tts-voices`), an alias from `--tts-voice-map` (OpenAI's
  alloy, ash, ... map to voices there; the demo maps all 13), or `{"id": name}`.
- `instructions`: accepted and ignored (DSM TTS takes no style prompt).
- `response_format`: mp3 (default) | opus | aac | flac | wav | pcm (24 kHz, 16-bit, mono).
- `speed`: SPEED_MIN..SPEED_MAX (a narrower range than OpenAI's 0.25-4.0; outside it is a 400
  naming `speed`), mapped to the model's padding bonus by the engine's speech front end
  (engine/speech.py: bonus = -SPEED_GAIN * log2(speed)), so faster speech pads less between words.
- `stream_format`: `audio` (default): the encoded audio, chunked, each 80 ms frame flushed as it
  is synthesised (flac: the whole file at the end, speech_formats.FlacEncoder); `sse`:
  `speech.audio.delta` events (base64 of the chosen format) and one `speech.audio.done` with
  integer usage (input tokens: text pieces; output: frames x codebooks).
- The text front end (words and their tokens, break tags, the voice, conditions and sampling)
  is the engine's `SpeechFrontEnd`; this door parses the body, asks it for the request, maps its
  `SpeechInputError` to a 400 naming the field, and streams.
- Errors are OpenAI-shaped JSON; a full pool is 429 with Retry-After. A client that disconnects
  cancels its row at the next tick.
- Both doors are mounted only with a TTS model (server/doors.py; without one, a 404 names --tts-model)
  and, with --api-key, behind security.AccessMiddleware like every door.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine_client import (Job, SpeechFrontEnd, SpeechInputError, Status, Terminal, TtsAudio, TtsPoolFull,
                             UnknownVoice)

from ..server.served_models import ModelNotFound
from ..media.speech_formats import CONTENT_TYPES, FORMATS, make_encoder
from .speech_options import SPEED_MAX, SPEED_MIN
from ..server.state import app_state

log = logging.getLogger("parley.speech")

MAX_INPUT_CHARS = 4096
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.05  # while waiting for the first audio
FIELDS = {"model", "input", "voice", "instructions", "response_format", "speed", "stream_format"}


@dataclass
class SpeechService:
    """What the endpoint needs: the engine's text front end (voices, tokenizer, conditions,
    sampling) and model facts; and the TTS pool server/ built, which only the engine client calls."""

    pool: Any  # the engine's TtsPool: server/app.py hands it to the engine client; this door submits there
    front_end: SpeechFrontEnd
    codebooks: int  # audio codebooks per frame (usage's output tokens)
    model: str = "tts"  # the checkpoint's name (server/served_models.py adds the operator's aliases)

    @property
    def voices(self):
        """The voice store (GET /v1/audio/voices lists its names)."""
        return self.front_end.voices


class SpeechError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 429:
            kind = "rate_limit_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


def input_refusal(err: SpeechInputError) -> SpeechError:
    """The 400 for input the front end cannot speak, in this door's words."""
    if isinstance(err, UnknownVoice):
        shown = ", ".join(err.known[:20])
        return SpeechError(400, f"unknown voice {err.voice!r}; GET /v1/audio/voices lists them (e.g. {shown})",
                           err.param, err.code)
    return SpeechError(400, err.message, err.param, err.code)


@dataclass(frozen=True)
class SpeechParams:
    text: str
    voice: str
    response_format: str
    speed: float
    stream_format: str


def parse_request(body: object, front_end: SpeechFrontEnd) -> SpeechParams:
    if not isinstance(body, dict):
        raise SpeechError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise SpeechError(400, f"unsupported parameter(s): {', '.join(unknown)}", unknown[0], "unknown_parameter")
    if "model" in body and (not isinstance(body["model"], str) or not body["model"]):
        raise SpeechError(400, "model must be a model name (GET /v1/models lists them), or left out", "model")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise SpeechError(400, "input is required and must be non-empty text", "input")
    if len(text) > MAX_INPUT_CHARS:
        raise SpeechError(400, f"input is {len(text)} characters; the limit is {MAX_INPUT_CHARS}", "input",
                          "string_above_max_length")
    voice = body.get("voice")
    if isinstance(voice, dict) and set(voice) == {"id"}:
        voice = voice["id"]
    if not isinstance(voice, str) or not voice:
        raise SpeechError(400, "voice is required: a voice name or {\"id\": name}", "voice")
    try:
        front_end.check_voice(voice)  # here, so a body's first wrong field is the one named
    except SpeechInputError as err:
        raise input_refusal(err) from None
    if "instructions" in body and not isinstance(body["instructions"], (str, type(None))):
        raise SpeechError(400, "instructions must be text", "instructions")
    fmt = body.get("response_format", "mp3")
    if fmt not in FORMATS:
        raise SpeechError(400, f"response_format {fmt!r}: expected one of {', '.join(FORMATS)}", "response_format")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not math.isfinite(speed):
        raise SpeechError(400, "speed must be a number", "speed")
    if not SPEED_MIN <= speed <= SPEED_MAX:
        raise SpeechError(400, f"speed {speed} is outside the supported range {SPEED_MIN} to {SPEED_MAX} "
                               "for this model", "speed")
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise SpeechError(400, f"stream_format {stream_format!r}: expected audio or sse", "stream_format")
    return SpeechParams(text, voice, fmt, float(speed), stream_format)


async def speech_endpoint(request: Request) -> Response:
    """POST /v1/audio/speech (mounted only with a TTS model: server/doors.py)."""
    state = app_state(request)
    service = state.speech
    assert service is not None  # mounted only with a TTS model
    try:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SpeechError(400, "the request body is not valid JSON") from None
        params = parse_request(body, service.front_end)
        state.models.resolve("tts", body.get("model"))
        tts_request, input_tokens = service.front_end.request(params.text, params.voice, params.speed)
        try:
            job = await state.client.submit_speech(tts_request)
        except TtsPoolFull as exc:
            state.refusals.record(request.scope, "full", str(exc))
            raise SpeechError(429, f"{exc}; retry shortly", code="tts_pool_full",
                              headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except SpeechError as err:
        return err.response()
    except SpeechInputError as err:  # no words to speak
        return input_refusal(err).response()
    except ModelNotFound as err:
        return SpeechError(404, str(err), "model", "model_not_found").response()
    except ValueError as err:  # a script too long for a row
        return SpeechError(400, str(err), "input").response()
    except Exception as err:  # a fault of ours, answered in the shape the client reads (not a bare 500)
        log.exception("speech request failed before synthesis")
        return SpeechError(500, f"the speech request failed: {type(err).__name__}", code="server_error").response()
    first = await _first_audio(job, request)
    if first is None:  # the client went away before any audio
        return Response(status_code=499)
    if isinstance(first, Terminal):  # nothing was synthesised: the status can still say so
        if first.status is Status.COMPLETED:
            first = None
        else:
            return SpeechError(500, f"synthesis failed: {first.reason}", code="tts_failed").response()
    body = (_sse(job, first, params.response_format, input_tokens, service.codebooks)
            if params.stream_format == "sse" else _audio(job, first, params.response_format))
    media = "text/event-stream" if params.stream_format == "sse" else CONTENT_TYPES[params.response_format]
    return StreamingResponse(body, media_type=media, headers={"Cache-Control": "no-cache",
                                                              "X-Accel-Buffering": "no"})


async def voices_endpoint(request: Request) -> Response:
    """GET /v1/audio/voices."""
    speech = app_state(request).speech
    assert speech is not None  # mounted only with a TTS model
    names = speech.voices.names()
    return JSONResponse({"object": "list", "data": [{"id": n, "object": "voice", "name": n} for n in names]})


async def _first_audio(job: Job, request: Request) -> TtsAudio | Terminal | None:
    """Wait for the first audio frame (words are not sent on this API), watching for a client
    that disconnects meanwhile (None: it did; its row is cancelled)."""

    async def first() -> TtsAudio | Terminal:
        async for event in job.events:
            if isinstance(event, (TtsAudio, Terminal)):
                return event
        return Terminal(Status.FAILED, "the stream ended without a terminal")

    waiter = asyncio.ensure_future(first())
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
            if done:
                return waiter.result()
            if await request.is_disconnected():
                job.cancel()
                return None
    finally:
        if not waiter.done():
            waiter.cancel()
            job.cancel()


async def _frames(job: Job, first: TtsAudio | None) -> AsyncIterator[TtsAudio]:
    """The job's audio frames; a disconnect (the response task is cancelled) cancels the row."""
    try:
        if first is not None:
            yield first
        async for event in job.events:
            if isinstance(event, TtsAudio):
                yield event
            elif isinstance(event, Terminal) and event.status is not Status.COMPLETED:
                log.warning("speech request %s ended early: %s %s", job.request_id, event.status.value, event.reason)
    finally:
        job.cancel()  # no-op once the row finished; frees it at the next tick otherwise


async def _audio(job: Job, first: TtsAudio | None, fmt: str) -> AsyncIterator[bytes]:
    encoder = make_encoder(fmt)
    async for frame in _frames(job, first):
        chunk = encoder.push(frame.pcm)
        if chunk:
            yield chunk
    tail = encoder.finish()
    if tail:
        yield tail


async def _sse(job: Job, first: TtsAudio | None, fmt: str, input_tokens: int,
               codebooks: int) -> AsyncIterator[bytes]:
    encoder = make_encoder(fmt)
    frames = 0

    def delta(chunk: bytes) -> bytes:
        event = {"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode("ascii")}
        return f"data: {json.dumps(event)}\n\n".encode()

    async for frame in _frames(job, first):
        frames += 1
        chunk = encoder.push(frame.pcm)
        if chunk:
            yield delta(chunk)
    tail = encoder.finish()
    if tail:
        yield delta(tail)
    output_tokens = frames * codebooks
    done = {"type": "speech.audio.done", "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                                                   "total_tokens": input_tokens + output_tokens}}
    yield f"data: {json.dumps(done)}\n\n".encode()
