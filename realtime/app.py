"""The starlette app: routes, and the engine's lifetime tied to the app's lifespan.

    GET  /             the browser voice-chat page (web/), when that folder exists
    WS   /api/chat     Moshi / PersonaPlex binary protocol          (moshi_protocol.py)
    WS   /v1/realtime  OpenAI Realtime API, GA and beta dialects     (openai_realtime.py)
    GET  /api/voices   the model's voice prompts, for the page
    GET  /api/info     model name, and whether it is the babbling demo model
    POST /v1/audio/speech, GET /v1/audio/voices   OpenAI speech API on the TTS pool (speech_api.py)
    GET  /health /ready /metrics                                    (health.py)

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

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from parley.engine import Engine

from . import health
from .moshi_protocol import chat_endpoint
from .openai_realtime import realtime_endpoint
from .opus import CodecProcessPool, make_codec_runner
from .sessions import ServerDefaults, SessionManager
from .speech_api import SpeechService, speech_routes

log = logging.getLogger("parley.app")

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
DEMO_NOTICE = ("This server runs Parley's tiny demo model: it babbles (random weights). "
               "Start `parley serve --model <checkpoint dir or Hugging Face repo id>` to talk for real.")


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
               web_dir: Path | None = WEB_DIR, speech: SpeechService | None = None) -> Starlette:
    """Build the app around an engine. With `start_engine`, the lifespan starts the engine
    (if it is not running) and always shuts it down at exit."""
    metrics: health.EdgeMetrics | None = None

    def count_restart() -> None:
        if metrics is not None:
            metrics.codec_restarts.inc()

    codec = make_codec_runner(codec_workers, max_sessions=engine.config.max_sessions, on_restart=count_restart)
    metrics = health.EdgeMetrics(engine.counters, codec.worker_cpu_seconds
                                 if isinstance(codec, CodecProcessPool) else None)
    manager = SessionManager(engine, defaults, codec, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await codec.start()  # worker processes start on the server's loop, before any session
        if start_engine:
            engine.start()
        try:
            yield
        finally:
            await manager.shutdown()
            await asyncio.to_thread(engine.shutdown)
            await codec.aclose()

    async def voices(request: Request) -> Response:
        return JSONResponse({"voices": list(info.voices), "default": info.default_voice})

    async def api_info(request: Request) -> Response:
        body = {"model": info.model, "demo": info.demo, "max_sessions": engine.config.max_sessions}
        if info.demo:
            body["notice"] = DEMO_NOTICE
        return JSONResponse(body)

    routes = [
        WebSocketRoute("/api/chat", chat_endpoint),
        WebSocketRoute("/v1/realtime", realtime_endpoint),
        Route("/api/voices", voices),
        Route("/api/info", api_info),
        Route("/health", health.health),
        Route("/ready", health.ready),
        Route("/metrics", health.metrics),
        *speech_routes(speech, defaults.api_key),
    ]
    if web_dir is not None and (web_dir / "index.html").is_file():
        routes.append(Mount("/", app=StaticFiles(directory=str(web_dir), html=True), name="web"))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.sessions = manager
    app.state.codec = codec
    app.state.info = info
    return app
