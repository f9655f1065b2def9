"""OpenAI Images: `POST /v1/images/generations`, served by the engine's image queue.

The request body is validated here, field by field, into an `ImageSpec` (engine/image_queue.py);
anything we cannot honour is refused with an OpenAI-shaped 400 naming the field, never
ignored. The engine produces raw pixels; PNG/JPEG/WebP encoding and base64 run on a worker
thread, never on the engine thread or the event loop.

    stream false: one JSON `ImagesResponse` once every image is done.
    stream true:  SSE `image_generation.partial_image` events (0-3 per image, `partial_images`),
                  then one `image_generation.completed` per image; with n > 1 the images'
                  events carry an `image_index` extension field.

Quality maps to denoising steps (docs/images.md): low 8, medium 20, high 40, auto = medium;
`standard`/`hd` (the older names) are medium/high. Extensions (as vllm-omni): `seed`,
`num_inference_steps`, `guidance_scale`, `negative_prompt`.

A client that goes away (closed connection, SSE or not) cancels its request; the engine
drops it at the next item boundary.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable

from PIL import Image
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine_client import (
    IMAGE_STALLED, MAX_PARTIAL_IMAGES, EngineClient, ImageFacts, ImagePartial, ImageQueueFull, ImageRefused,
    ImageResult, ImageSpec, Job, Status, Terminal,
)
from ..server.served_models import ModelNotFound
from ..server.state import app_state

log = logging.getLogger("parley.images")

QUALITY_STEPS = {"low": 8, "medium": 20, "high": 40, "auto": 20, "standard": 20, "hd": 40}
OUTPUT_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
MAX_PROMPT_CHARS = 32000
MAX_N = 10
MAX_STEPS = 100
MAX_SIDE = 2048  # a hard cap before any cost prediction; the queue refuses what cannot fit anyway
HEALTH_POLL_S = 0.5  # how often a waiting request checks the engine is still serving
KNOWN_FIELDS = {"prompt", "model", "n", "size", "quality", "response_format", "output_format",
                "output_compression", "background", "stream", "partial_images", "user",
                "seed", "num_inference_steps", "guidance_scale", "negative_prompt"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class ImageService:
    """The image modality as server/ built it: its queue and engine (which only the engine client
    and the app's lifetime and /metrics use; the route submits through the client) and its name."""

    queue: Any  # the engine's ImageQueue
    engine: Any  # the Engine it runs on
    model: str

    def close(self) -> None:
        self.queue.close("the server is shutting down")

    def collect(self) -> Iterable:
        """Prometheus collector (registered on the app's /metrics registry): the queue's counters."""
        snap = self.queue.counters()
        for name, value in snap.items():
            if name == "images_outstanding":
                family = GaugeMetricFamily("parley_images_outstanding", "images waiting or running")
            else:
                family = CounterMetricFamily(f"parley_{name}", f"image queue counter: {name}")
            family.add_metric([], float(value))
            yield family


@dataclass(frozen=True)
class Parsed:
    spec: ImageSpec
    stream: bool
    output_format: str
    compression: int | None
    quality: str
    size: str


def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _invalid(name, f"{name} must be a whole number from {lo} to {hi}, got {value!r}.")
    return value


def _choice(body: dict, name: str, default: str, allowed) -> str:
    value = body.get(name, default)
    if value is None:
        value = default
    if value not in allowed:
        raise _invalid(name, f"{name} must be one of {', '.join(allowed)}, got {value!r}.")
    return value


async def parse_request(body: object, client: EngineClient) -> Parsed:
    """The request body -> a validated ImageSpec, or an ApiError naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object.")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise _invalid(unknown[0], f"unknown parameter {unknown[0]!r} (not supported by this server).",
                       "unknown_parameter")
    facts = client.image_facts()
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _invalid("prompt", "prompt is required and must be non-empty text.")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise _invalid("prompt", f"prompt is longer than {MAX_PROMPT_CHARS} characters.")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise _invalid("model", "model must be a model name (GET /v1/models lists them), or left out.")
    n = _int(body, "n", 1, 1, min(MAX_N, facts.capacity))
    width, height, size = _size(body.get("size"), facts.latent_stride, facts.default_size)
    quality = _choice(body, "quality", "auto", list(QUALITY_STEPS))
    steps = _int(body, "num_inference_steps", None, 1, MAX_STEPS) or QUALITY_STEPS[quality]
    if body.get("response_format", "b64_json") not in (None, "b64_json"):
        if body.get("response_format") == "url":
            raise _invalid("response_format", "response_format 'url' is not supported: this server does not "
                                              "host images; use b64_json (the default).", "unsupported_value")
        raise _invalid("response_format", "response_format must be b64_json.")
    output_format = _choice(body, "output_format", "png", list(OUTPUT_FORMATS))
    compression = _int(body, "output_compression", None, 0, 100)
    if compression is not None and output_format == "png":
        raise _invalid("output_compression", "output_compression applies to jpeg and webp only.")
    background = _choice(body, "background", "auto", ["auto", "opaque", "transparent"])
    if background == "transparent":
        raise _invalid("background", "background 'transparent' is not supported: images are opaque.",
                       "unsupported_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream", f"stream must be true or false, got {stream!r}.")
    partial = _int(body, "partial_images", 0, 0, MAX_PARTIAL_IMAGES)
    if partial and not stream:
        raise _invalid("partial_images", "partial_images needs stream: true.")
    seed = _int(body, "seed", None, 0, 2**31 - 1 - MAX_N)
    guidance = body.get("guidance_scale", default_guidance(facts))
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not 0 <= guidance <= 50:
        raise _invalid("guidance_scale", f"guidance_scale must be a number from 0 to 50, got {guidance!r}.")
    negative = body.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise _invalid("negative_prompt", "negative_prompt must be text.")
    if body.get("user") is not None and not isinstance(body.get("user"), str):
        raise _invalid("user", "user must be text.")
    refused = await client.image_refusal(width, height, guidance)
    if refused:
        raise _invalid("size", refused, "size_too_large")
    spec = ImageSpec(prompt, width, height, steps, float(guidance), n=n, negative=negative, seed=seed,
                     partial_images=partial)
    return Parsed(spec, stream, output_format, compression, quality, size)


def default_guidance(facts: ImageFacts) -> float:
    return 7.0 if facts.family == "flow" else 7.5  # the pipelines' own __call__ defaults


SIZE_RE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


def _size(value: object, stride: int, default: int) -> tuple[int, int, str]:
    if value is None or value == "auto":
        return default, default, f"{default}x{default}"
    match = SIZE_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise _invalid("size", f"size must be 'auto' or WIDTHxHEIGHT such as 512x512, got {value!r}.")
    w, h = int(match.group(1)), int(match.group(2))
    if w % stride or h % stride or not (stride <= w <= MAX_SIDE and stride <= h <= MAX_SIDE):
        raise _invalid("size", f"size {value} is not supported: width and height must be multiples of {stride} "
                               f"(this model's latent stride) from {stride} to {MAX_SIDE}.")
    return w, h, value


def encode_image(pixels, output_format: str, compression: int | None) -> str:
    """HWC uint8 -> base64 of a PNG/JPEG/WebP file (runs on a worker thread)."""
    buf = io.BytesIO()
    kwargs = {} if compression is None else {"quality": compression}
    Image.fromarray(pixels).save(buf, format=OUTPUT_FORMATS[output_format], **kwargs)
    return base64.b64encode(buf.getvalue()).decode("ascii")


async def _events(request: Job, client: EngineClient) -> AsyncIterator[object]:
    """The request's events, ending with its Terminal (a FAILED one if the engine stops)."""
    iterator = request.events.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=HEALTH_POLL_S)
            if not done:
                if not client.healthy:
                    request.cancel()
                    yield Terminal(Status.FAILED, "the engine stopped (see the server log)")
                    return
                continue
            task, pending = pending, None
            try:
                event = task.result()
            except StopAsyncIteration:
                return
            yield event
            if isinstance(event, Terminal):
                return
    finally:
        if pending is not None:
            pending.cancel()


def _terminal_error(terminal: Terminal) -> ApiError:
    if terminal.status is Status.CANCELLED:
        return ApiError(503, f"the request was cancelled: {terminal.reason}", kind="server_error",
                        code="cancelled")
    if "too large" in terminal.reason:
        return _invalid("size", terminal.reason, "size_too_large")
    if terminal.reason.startswith(IMAGE_STALLED):  # the load left it no slack: retryable, not a server fault
        return ApiError(503, terminal.reason, kind="server_error", code="image_stalled")
    return ApiError(500, terminal.reason or "image generation failed", kind="server_error", code="server_error")


async def images_generations(http: Request) -> Response:
    state = app_state(http)  # mounted only with an image model (server/doors.py)
    try:
        body = json.loads(await http.body())
    except (ValueError, UnicodeDecodeError):
        return ApiError(400, "the request body is not valid JSON.").response()
    try:
        parsed = await parse_request(body, state.client)
        state.models.resolve("image", body.get("model"))
        if not state.client.healthy:
            raise ApiError(503, "the engine is not serving (see the server log).", kind="server_error")
        request = await state.client.submit_image(parsed.spec)
    except ImageQueueFull as exc:
        state.refusals.record(http.scope, "full", str(exc))
        return ApiError(429, str(exc), code="rate_limit_exceeded", kind="rate_limit_error",
                        headers={"Retry-After": str(exc.retry_after_s)}).response()
    except ImageRefused as exc:
        return _invalid("size", str(exc), "size_too_large").response()
    except ApiError as exc:
        return exc.response()
    except ModelNotFound as exc:
        return ApiError(404, str(exc), "model", "model_not_found").response()
    log.info("image request %s: %dx%d, n=%d, %d steps, stream=%s", request.request_id, parsed.spec.width,
             parsed.spec.height, parsed.spec.n, parsed.spec.steps, parsed.stream)
    if parsed.stream:
        return StreamingResponse(_sse(request, parsed, state.client), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _collect(http, request, parsed, state.client)


def _fields(parsed: Parsed) -> dict:
    return {"size": parsed.size, "quality": parsed.quality, "background": "opaque",
            "output_format": parsed.output_format}


async def _collect(http: Request, request: Job, parsed: Parsed, client: EngineClient) -> Response:
    async def watch_disconnect() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        request.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    images: dict[int, str] = {}
    try:
        async for event in _events(request, client):
            if isinstance(event, ImageResult):
                images[event.image_index] = await asyncio.to_thread(encode_image, event.pixels,
                                                                    parsed.output_format, parsed.compression)
            elif isinstance(event, Terminal) and event.status is not Status.COMPLETED:
                return _terminal_error(event).response()
    finally:
        watcher.cancel()
    return JSONResponse({"created": int(time.time()),
                         "data": [{"b64_json": images[i]} for i in sorted(images)], **_fields(parsed)})


def _sse_event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


async def _sse(request: Job, parsed: Parsed, client: EngineClient) -> AsyncIterator[bytes]:
    multi = parsed.spec.n > 1
    try:
        async for event in _events(request, client):
            if isinstance(event, (ImagePartial, ImageResult)):
                b64 = await asyncio.to_thread(encode_image, event.pixels, parsed.output_format, parsed.compression)
                data = {"b64_json": b64, "created_at": int(time.time()), **_fields(parsed)}
                if multi:
                    data["image_index"] = event.image_index  # extension: which of the n images
                if isinstance(event, ImagePartial):
                    data = {"type": "image_generation.partial_image", **data,
                            "partial_image_index": event.partial_index}
                else:
                    data = {"type": "image_generation.completed", **data}
                yield _sse_event(data["type"], data)
            elif isinstance(event, Terminal) and event.status is not Status.COMPLETED:
                error = _terminal_error(event).body()
                yield _sse_event("error", {"type": "error", **error})
    finally:
        request.cancel()  # a no-op when it completed; otherwise the client went away mid-stream
