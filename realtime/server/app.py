"""The starlette app: routes, and the engine's lifetime tied to the app's lifespan.

The routes are the doors of server/doors.py's table whose service is loaded (each modality's, from
server/modalities.py, and the server's own), each served by the endpoint its door names: the Moshi
protocol (chat/protocol.py), the OpenAI Realtime API (realtime_api/endpoint.py), OpenAI's GPT-Live
(live/session.py), both over WebRTC too (webrtc/doors.py), speech (http/speech.py), transcription
(http/transcriptions.py), images (http/images.py), Kyutai moshi-server's doors (kyutai/), the probes
and /load (sessions/capacity.py), /metrics (http/metrics.py), /admin/drain (server/drain.py), and the
page (web/). On a server whose model translates (Hibiki) a conversation's door (`Door.converses`)
refuses with HTTP 400 naming the model. What no door serves is answered by http/not_found.py.
Each modality's metrics collector is registered, and its service closed at shutdown, as its
record says.

The app builds nothing: `create_app(services)` maps routes and middleware from what
services.build_services built (tests hand in Services around a fabricated backend). It starts
the engine on startup if needed and shuts it down, bounded, on shutdown after closing every
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
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

from ..http import metrics as metrics_api
from . import doors
from .modalities import MODALITIES, resolve
from .demo_model import STT_NOTICE
from ..sessions.capacity import Admission, deny_upgrade
from .drain import Drainer
from ..http.not_found import UnknownWebSocket, http_error, openai_error
from ..media.opus import CodecProcessPool, make_codec_runner
from .security import AccessMiddleware, static_paths
from .services import DEMO_NOTICE, ServerInfo, Services  # noqa: F401 (ServerInfo: tests' import)
from ..sessions.session import SessionManager
from ..media.speech_formats import warm_up_encoders
from ..calls.sideband import LiveCalls
from ..engine_client import InProcessClient
from .state import AppState, app_state
from ..webrtc.pool import WebRTCPool, default_workers

log = logging.getLogger("parley.app")
CALLS_CLOSE_TIMEOUT_S = 5.0  # at shutdown, WebRTC calls get this long to hang up


async def load_lazy_modules() -> None:
    """Import now what the first requests would import on the server's thread while the engine
    ticks: an import holds the GIL while it runs (tens of ms, more where no .pyc was written) and
    the engine thread waits for it, so the first request of a kind would make a duplex frame late
    (benchmarks/tts_load.py measured it). Starlette's anyio loads its asyncio backend and stream modules on
    the first request, and the static page reads files through anyio; Pillow registers its image
    formats on the first save; PyAV's encoders set themselves up on their first container.
    tests/test_lazy_imports.py fails if a request still imports a module."""
    await anyio.lowlevel.checkpoint()
    await anyio.Path(".").exists()
    Image.init()
    warm_up_encoders()


def create_app(services: Services) -> Starlette:
    """Map routes and middleware from `services` (server/services.py: built, warmed and registered on
    the engine). With `services.start_engine`, the lifespan starts the engine (if it is not
    running); it always shuts it down at exit."""
    engine = services.engine
    client = engine_client(services)  # the doors' one way to the engine
    metrics: metrics_api.EdgeMetrics | None = None

    def count_restart() -> None:
        if metrics is not None:
            metrics.codec_restarts.inc()

    codec = make_codec_runner(services.codec_workers, max_sessions=engine.max_sessions, on_restart=count_restart)
    webrtc = WebRTCPool(services.webrtc_workers or default_workers(engine.max_sessions),  # started by the first call
                        on_restart=lambda: metrics.webrtc_restarts.inc(),
                        on_silent=lambda packets: metrics.webrtc_silent.inc(packets))
    loop_thread: dict[str, int] = {}  # the event loop's OS thread id, taken when the lifespan starts on it
    metrics = metrics_api.EdgeMetrics(client.counters, codec.worker_cpu_seconds
                                      if isinstance(codec, CodecProcessPool) else None, webrtc.worker_cpu_seconds,
                                      threads=lambda: {"loop": loop_thread.get("id"), "engine": engine.thread_id})
    for modality in MODALITIES:  # each modality's own metrics (its record's collector)
        if modality.collector is not None and (service := services.service(modality)) is not None:
            metrics.registry.register(modality.collector(service))
    manager = SessionManager(client, services.defaults, codec, metrics,
                             Admission(client, metrics.registry, ready_min_free=services.ready_min_free,
                                       refusals=metrics.refusals), models=services.served_models())
    has_page = services.web_dir is not None and (services.web_dir / "index.html").is_file()  # public: server/security.py
    served = doors.mounted({"page": has_page, **services.available()})
    access = Middleware(AccessMiddleware, keys=services.defaults.api_keys,
                        protect_metrics=services.defaults.protect_metrics,
                        allowed_origins=services.defaults.allowed_origins,
                        static_paths=static_paths(services.web_dir) if has_page else (),
                        session_paths=doors.WEBRTC_PATHS, refusals=metrics.refusals)
    unknown_ws = Middleware(UnknownWebSocket, paths=frozenset(d.path for d in served if d.method == doors.WS))
    translating = services.info.model if services.translator is not None else None
    app = Starlette(routes=[_route(door, services.web_dir, translating) for door in served],
                    lifespan=_lifespan(services, manager, codec, webrtc, loop_thread), middleware=[access, unknown_ws],
                    exception_handlers={HTTPException: http_error})
    app.state = AppState(  # type: ignore[assignment]  # the typed state (server/state.py) replaces starlette's bag
        client, manager, manager.models, metrics.refusals, services.info, tuple(served),
        Drainer(manager, services.drain_timeout), codec, webrtc, speech=services.speech, images=services.images,
        stt_model=services.stt_pool and services.stt_pool.name, live_calls=LiveCalls(),
        translator=services.translator)
    return app


def engine_client(services: Services) -> InProcessClient:
    """The doors' one way to the engine (realtime/engine_client.py), over what `services` built."""
    return InProcessClient(services.engine, tts=services.speech and services.speech.pool, stt=services.stt_pool,
                           images=services.images and services.images.queue)


def _lifespan(services: Services, manager: SessionManager, codec, webrtc: WebRTCPool, loop_thread: dict[str, int]):
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop_thread["id"] = threading.get_native_id()
        await codec.start()  # worker processes start on the server's loop, before any session
        await load_lazy_modules()
        if services.start_engine:
            services.engine.start()
        try:
            yield
        finally:
            await manager.shutdown()
            calls = app_state(app).calls
            if calls:  # closed by the shutdown above; let them finish hanging up
                await asyncio.wait(set(calls), timeout=CALLS_CLOSE_TIMEOUT_S)
            await asyncio.to_thread(services.engine.shutdown)
            for modality in MODALITIES:  # the engine thread is gone: each ends what it will never finish
                if modality.close is not None and (service := services.service(modality)) is not None:
                    modality.close(service)
            await codec.aclose()
            await webrtc.aclose()

    return lifespan


async def api_voices(request: Request) -> Response:
    info = app_state(request).info
    return JSONResponse({"voices": list(info.voices), "default": info.default_voice})


async def api_info(request: Request) -> Response:
    state = app_state(request)
    info, manager, client = state.info, state.sessions, state.client
    body = {"model": info.model, "demo": info.demo, "max_sessions": client.max_sessions,
            "prompts": manager.defaults.prompts,  # whether a persona / voice prompt can be given
            "mimi_dtypes": info.mimi_dtypes}  # each served codec's dtype (--mimi-dtype auto picks per codec)
    if info.demo:
        body["notice"] = DEMO_NOTICE
    body["transcription"] = state.stt_model is not None  # POST /v1/audio/transcriptions
    body["session_transcript"] = client.can_transcribe  # /api/chat?transcript=1, realtime input transcription
    body["webrtc"] = True  # POST /v1/realtime/calls and /v1/live/sessions (the page calls over WebRTC)
    body["ice_servers"] = [server.for_browser() for server in manager.defaults.ice_servers]
    if info.demo and state.stt_model is not None:
        body["transcription_notice"] = STT_NOTICE
    return JSONResponse(body)


def _route(door: doors.Door, web_dir: Path | None, translating: str | None = None) -> BaseRoute:
    """`door`'s route; a conversation's door refuses when the served model (`translating`) translates."""
    if door.path == "/":  # the page: its files under every path no other door takes
        return Mount("/", app=StaticFiles(directory=str(web_dir), html=True), name="web")
    endpoint = resolve(door.endpoint)  # the door's handler, in its room (server/modalities.py names it)
    if door.converses and translating is not None:
        endpoint = _refuses_conversations(door, translating, endpoint)
    if door.method == doors.WS:
        return WebSocketRoute(door.path, endpoint)
    return Route(door.path, endpoint, methods=[door.method])


def _refuses_conversations(door: doors.Door, model: str, endpoint):
    """A conversation door's endpoint on a server whose model translates (Hibiki): HTTP 400 before
    any session, naming the model and the doors that serve it, rather than a translation session
    misread as a conversation. A transcription session (`?intent=transcription`, on the STT rows)
    needs no conversation: it goes to `endpoint`."""
    message = (f"{door.method} {door.path} holds a conversation, and this server's model {model!r:.100} is a "
               "speech translation model (Hibiki): it serves /v1/realtime/translations and /api/chat only. "
               "Start `parley serve --model` with a conversational checkpoint (Moshi, PersonaPlex) for this door.")

    async def refuse(connection) -> Response | None:
        if door.method == doors.WS and connection.query_params.get("intent") == "transcription":
            return await endpoint(connection)
        response = openai_error(400, message, param="model", code="model_not_supported")
        if door.method == doors.WS:
            await deny_upgrade(connection, response, "the served model translates")
            return None
        return response
    return refuse


def served_paths(app: Starlette) -> list[str]:
    """The paths the app's router serves, in its order (the startup banner lists them)."""
    paths = [route.path or "/" for route in app.routes]  # Mount("/") keeps its path as ""
    return list(dict.fromkeys(paths))  # a path with a WebSocket and a POST door once
