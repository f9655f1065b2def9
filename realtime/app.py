"""The starlette app: routes, and the engine's lifetime tied to the app's lifespan.

The routes are the doors of doors.py's table whose service is loaded, each served by
ENDPOINTS below: the Moshi protocol (moshi_protocol.py), the OpenAI Realtime API
(realtime_endpoint.py), OpenAI's GPT-Live (live_session.py), speech (speech_api.py),
transcription (transcriptions.py), images (images_api.py), the probes and /load (capacity.py), /metrics (health.py), /admin/drain
(drain.py), and the page (web/). What no door serves is answered by not_found.py.

The app does not build the engine (server.py does, from a checkpoint; tests hand in one
over a fabricated backend); it starts it on startup if needed and shuts it down, bounded,
on shutdown after closing every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import anyio
import anyio.lowlevel
from PIL import Image
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from parley.engine import Engine
from parley.engine.stt_pool import SttPool

from . import capacity, doors, health
from .demo_model import STT_NOTICE
from .capacity import Admission
from .drain import Drainer, drain_endpoint
from .not_found import UnknownWebSocket, http_error
from .images_api import ImageService, images_generations
from .moshi_protocol import chat_endpoint
from .live_session import live_endpoint
from .realtime_endpoint import realtime_endpoint
from .opus import CodecProcessPool, make_codec_runner
from .security import AccessMiddleware, static_paths
from .sessions import ServerDefaults, SessionManager
from .speech_api import SpeechService, speech_endpoint, voices_endpoint
from .speech_formats import warm_up_encoders
from .transcriptions import transcriptions_endpoint

log = logging.getLogger("parley.app")

# The doors' endpoints, by path (doors.py); /api/voices and /api/info, which read the app's info, come from create_app.
ENDPOINTS = {
    "/api/chat": chat_endpoint,
    "/v1/realtime": realtime_endpoint,
    "/v1/live/sessions": live_endpoint,
    "/v1/audio/speech": speech_endpoint,
    "/v1/audio/voices": voices_endpoint,
    "/v1/audio/transcriptions": transcriptions_endpoint,
    "/v1/images/generations": images_generations,
    "/livez": capacity.livez,
    "/readyz": capacity.readyz,
    "/health": capacity.livez,
    "/ready": capacity.readyz,
    "/load": capacity.load,
    "/metrics": health.metrics,
    "/admin/drain": drain_endpoint,
}

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
DEMO_NOTICE = ("This server runs Parley's tiny demo model: it babbles (random weights). "
               "Start `parley serve --model <checkpoint dir or Hugging Face repo id>` to talk for real.")


async def load_lazy_modules() -> None:
    """Import now what the first requests would import on the server's thread while the engine
    ticks: an import holds the GIL while it runs (tens of ms, more where no .pyc was written) and
    the engine thread waits for it, so on the H200 the first /v1/audio/speech request made a
    duplex frame 20-50 ms late. Starlette's anyio loads its asyncio backend and stream modules on
    the first request, and the static page reads files through anyio; Pillow registers its image
    formats on the first save; PyAV's encoders set themselves up on their first container.
    tests/test_lazy_imports.py fails if a request still imports a module."""
    await anyio.lowlevel.checkpoint()
    await anyio.Path(".").exists()
    Image.init()
    warm_up_encoders()


@dataclass(frozen=True)
class ServerInfo:
    """What the page and /api/info show about the loaded model."""

    model: str = "parley"
    demo: bool = False
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    notes: list[str] = field(default_factory=list)


def create_app(engine: Engine, defaults: ServerDefaults = ServerDefaults(), info: ServerInfo = ServerInfo(),
               *, codec_workers: int | None = None, start_engine: bool = True,
               web_dir: Path | None = WEB_DIR, stt_pool: SttPool | None = None, ready_min_free: int = 1,
               drain_timeout: float = 30.0, images: ImageService | None = None,
               speech: SpeechService | None = None) -> Starlette:
    """Build the app around an engine. With `start_engine`, the lifespan starts the engine
    (if it is not running) and always shuts it down at exit. `stt_pool` (standalone
    transcription rows) becomes the engine's transcription slack source, warmed up here.
    `ready_min_free`: free slots below which /readyz says 503; `drain_timeout`: seconds a
    drain lets live sessions run."""
    if stt_pool is not None:
        stt_pool.warm_up(engine.slack_costs)
        engine.add_slack_source(stt_pool)
    metrics: health.EdgeMetrics | None = None

    def count_restart() -> None:
        if metrics is not None:
            metrics.codec_restarts.inc()

    codec = make_codec_runner(codec_workers, max_sessions=engine.max_sessions, on_restart=count_restart)
    metrics = health.EdgeMetrics(engine.counters, codec.worker_cpu_seconds
                                 if isinstance(codec, CodecProcessPool) else None)
    if images is not None:
        metrics.registry.register(images)  # parley_images_* (images_api.ImageService.collect)
    manager = SessionManager(engine, defaults, codec, metrics,
                             Admission(engine, metrics.registry, ready_min_free=ready_min_free,
                                       refusals=metrics.refusals))
    drainer = Drainer(manager, drain_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await codec.start()  # worker processes start on the server's loop, before any session
        await load_lazy_modules()
        if start_engine:
            engine.start()
        try:
            yield
        finally:
            await manager.shutdown()
            await asyncio.to_thread(engine.shutdown)
            if images is not None:
                images.close()  # the engine thread is gone: end what it will never finish
            await codec.aclose()

    async def voices(request: Request) -> Response:
        return JSONResponse({"voices": list(info.voices), "default": info.default_voice})

    async def api_info(request: Request) -> Response:
        body = {"model": info.model, "demo": info.demo, "max_sessions": engine.max_sessions,
                "prompts": defaults.prompts}  # whether a persona / voice prompt can be given
        if info.demo:
            body["notice"] = DEMO_NOTICE
        body["transcription"] = stt_pool is not None  # POST /v1/audio/transcriptions
        body["session_transcript"] = engine.can_transcribe  # /api/chat?transcript=1, realtime input transcription
        if info.demo and stt_pool is not None:
            body["transcription_notice"] = STT_NOTICE
        return JSONResponse(body)

    has_page = web_dir is not None and (web_dir / "index.html").is_file()  # public: see security.py
    served = doors.mounted({"page": has_page, "tts": speech is not None, "stt": stt_pool is not None,
                            "images": images is not None})
    endpoints = {**ENDPOINTS, "/api/voices": voices, "/api/info": api_info}
    routes = [_route(door, endpoints, web_dir) for door in served]
    access = Middleware(AccessMiddleware, keys=defaults.api_keys, protect_metrics=defaults.protect_metrics,
                        allowed_origins=defaults.allowed_origins,
                        static_paths=static_paths(web_dir) if has_page else (), refusals=metrics.refusals)
    unknown_ws = Middleware(UnknownWebSocket, paths=frozenset(d.path for d in served if d.method == doors.WS))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[access, unknown_ws],
                    exception_handlers={HTTPException: http_error})
    app.state.doors = served
    app.state.sessions = manager
    app.state.drainer = drainer
    app.state.codec = codec
    app.state.info = info
    app.state.stt_pool = stt_pool
    app.state.images = images
    app.state.speech = speech
    app.state.refusals = metrics.refusals  # for the HTTP doors' own refusals (a full pool or queue)
    return app


def _route(door: doors.Door, endpoints: dict, web_dir: Path | None) -> BaseRoute:
    if door.path == "/":  # the page: its files under every path no other door takes
        return Mount("/", app=StaticFiles(directory=str(web_dir), html=True), name="web")
    if door.method == doors.WS:
        return WebSocketRoute(door.path, endpoints[door.path])
    return Route(door.path, endpoints[door.path], methods=[door.method])


def served_paths(app: Starlette) -> list[str]:
    """The paths the app's router serves, in its order (the startup banner lists them)."""
    return [route.path or "/" for route in app.routes]  # Mount("/") keeps its path as ""
