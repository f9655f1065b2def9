"""`POST /v1/audio/transcriptions`: OpenAI's transcription route on the engine's STT rows.

Form fields (multipart, as the openai SDK sends them):
- `file` (required): WAV / FLAC / OGG bytes, any rate and channel count (mixed to 24 kHz mono).
- `model`: one of the STT model's served names (server/served_models.py: its checkpoint's name and
  `--served-model-name stt=...`); another is 404 `model_not_found`; left out, the served one.
- `language`: "en" or "fr" (the Kyutai STT languages) are accepted as a statement about the audio;
  the model detects language itself, so any other value is refused (400, param `language`).
- `response_format`: `json` (default) `{"text"}`, `text`, or `verbose_json` with `words`
  (word timestamps from the model's text stream) and one segment; srt / vtt are refused.
- `timestamp_granularities[]`: `word` and `segment` (verbose_json only).
- `temperature`: 0 (default, greedy) to 2, honoured per request.
- `prompt`: refused when non-empty (Kyutai STT takes no prompt).
- `stream`: true answers as server-sent events `transcript.text.delta` ... `transcript.text.done`.
Errors are OpenAI-shaped: `{"error": {"message", "type", "param", "code"}}`. Mounted only with an
STT model (server/doors.py); without one, a 404 names --stt-model.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from parley.models import AudioFileError, read_audio_bytes

from ..engine_client import (EngineClient, Status, SttBusy, SttFailed, SttInputError, SttPartial, Terminal,
                             collect_transcript)
from ..server.served_models import ModelNotFound
from ..server.state import app_state

log = logging.getLogger("parley.transcriptions")

LANGUAGES = ("en", "fr")
FORMATS = ("json", "text", "verbose_json")
MAX_UPLOAD_BYTES = 200 * 1024 * 1024  # a bound on one request's memory (about 35 min of 16-bit 48 kHz stereo)


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_response(message: str, param: str | None, status: int, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


async def _form(request: Request) -> dict:
    try:
        form = await request.form(max_files=1, max_fields=32)
    except Exception as exc:  # malformed multipart: the client's mistake, no traceback
        raise RequestError(f"the request body must be multipart/form-data with a file: {exc}") from exc
    fields: dict = {}
    for key, value in form.multi_items():
        fields.setdefault(key.removesuffix("[]"), []).append(value)
    return fields


def _one(fields: dict, name: str, default: str | None = None) -> str | None:
    values = fields.get(name)
    if not values:
        return default
    if isinstance(values[0], UploadFile):
        raise RequestError(f"{name} must be a text field, not a file.", name)
    return str(values[0])


def _bool(value: str | None, name: str) -> bool:
    if value is None:
        return False
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise RequestError(f"{name} must be true or false, got {value!r}.", name)


@dataclass(frozen=True)
class TranscriptionOptions:
    """A request's options, checked (everything but the file and the model)."""

    language: str | None
    response_format: str
    granularities: tuple[str, ...]  # word and/or segment; empty: both (verbose_json)
    stream: bool
    temperature: float


def parse_options(fields: dict) -> TranscriptionOptions:
    """The form's options, or a RequestError naming the first bad one."""
    language = _one(fields, "language")
    if language not in (None, "", *LANGUAGES):
        raise RequestError(f"language {language!r} is not supported by this model (Kyutai STT: "
                           f"{', '.join(LANGUAGES)}).", "language")
    if _one(fields, "prompt"):
        raise RequestError("prompt is not supported: Kyutai STT takes no text prompt.", "prompt")
    fmt = _one(fields, "response_format", "json")
    if fmt not in FORMATS:
        raise RequestError(f"response_format {fmt!r} is not supported; use {', '.join(FORMATS)}.",
                           "response_format")
    granularities = [str(v) for v in fields.get("timestamp_granularities", [])]
    if any(g not in ("word", "segment") for g in granularities):
        raise RequestError(f"timestamp_granularities must be word and/or segment, got {granularities}.",
                           "timestamp_granularities")
    if granularities and fmt != "verbose_json":
        raise RequestError("timestamp_granularities needs response_format verbose_json.",
                           "timestamp_granularities")
    stream = _bool(_one(fields, "stream"), "stream")
    try:
        temperature = float(_one(fields, "temperature", "0"))
    except ValueError:
        raise RequestError("temperature must be a number.", "temperature") from None
    return TranscriptionOptions(language, fmt, tuple(granularities), stream, temperature)


async def _submit(client: EngineClient, upload: UploadFile, temperature: float):
    """The upload decoded and fed to a new transcription job, its input ended: (job, pcm)."""
    data = await upload.read(MAX_UPLOAD_BYTES + 1)
    if len(data) > MAX_UPLOAD_BYTES:
        raise RequestError(f"file is larger than {MAX_UPLOAD_BYTES // (1024 * 1024)} MB.", "file", 413)
    try:
        pcm = (await asyncio.to_thread(read_audio_bytes, data, upload.filename or "file")).numpy()
    except AudioFileError as exc:
        raise RequestError(str(exc), "file") from exc
    try:
        job = await client.submit_transcription(temperature=temperature)
    except SttInputError as exc:
        raise RequestError(str(exc), "temperature") from exc
    try:
        job.feed(pcm)
    except SttInputError as exc:
        job.cancel()
        raise RequestError(str(exc), "file") from exc
    job.end_input()
    return job, pcm


async def transcriptions_endpoint(request: Request) -> Response:
    state = app_state(request)  # mounted only with an STT model (server/doors.py)
    try:
        fields = await _form(request)
        upload = (fields.get("file") or [None])[0]
        if not isinstance(upload, UploadFile):
            raise RequestError("file is required (the audio to transcribe).", "file")
        state.models.resolve("stt", _one(fields, "model") or None)
        options = parse_options(fields)
        job, pcm = await _submit(state.client, upload, options.temperature)
    except RequestError as exc:
        return error_response(str(exc), exc.param, exc.status, exc.code)
    except ModelNotFound as exc:
        return error_response(str(exc), "model", 404, "model_not_found")
    except SttBusy as exc:
        state.refusals.record(request.scope, "full", str(exc))
        return error_response(str(exc), None, 503, "server_busy")

    if options.stream:
        return StreamingResponse(_sse(job), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        text, words = await collect_transcript(job)
    except SttFailed as exc:
        return error_response(str(exc), None, 500)
    return _result(options, text, words, duration=pcm.size / 24_000)


def _result(options: TranscriptionOptions, text: str, words, duration: float) -> Response:
    """The transcript in the asked response_format."""
    if options.response_format == "text":
        return PlainTextResponse(text + "\n")
    if options.response_format == "json":
        return JSONResponse({"text": text, "usage": {"type": "duration", "seconds": duration}})
    body = {"task": "transcribe", "language": options.language or "en", "duration": duration, "text": text,
            "usage": {"type": "duration", "seconds": duration}}
    if not options.granularities or "word" in options.granularities:
        body["words"] = [{"word": w.text, "start": w.start, "end": w.end} for w in words]
    if not options.granularities or "segment" in options.granularities:
        body["segments"] = [{"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text, "tokens": [],
                             "temperature": options.temperature, "avg_logprob": 0.0, "compression_ratio": 0.0,
                             "no_speech_prob": 0.0}]
    return JSONResponse(body)


async def _sse(job) -> AsyncIterator[bytes]:
    text = ""
    try:
        async for event in job.events:
            if isinstance(event, Terminal):
                if event.status is Status.COMPLETED:
                    yield _event({"type": "transcript.text.done", "text": text.strip()})
                else:
                    yield _event({"type": "error", "error": {"message": event.reason, "type": "server_error"}})
                return
            assert isinstance(event, SttPartial)
            if event.text:
                delta = event.text if text else event.text.lstrip()
                text += event.text
                yield _event({"type": "transcript.text.delta", "delta": delta})
    finally:
        job.cancel()


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
