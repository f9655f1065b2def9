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
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Sequence

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
from .services import DEMO_NOTICE, EdgeSpec, ServerInfo, Services  # noqa: F401 (ServerInfo: tests' import)
from ..sessions.session import SessionManager
from ..media.speech_formats import warm_up_encoders
from ..calls.sideband import LiveCalls
from ..engine_client import EngineClient, InProcessClient
from .state import AppState, app_state
from ..webrtc.pool import WebRTCPool, default_workers
from ..webrtc.transport import PeerHost

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
    """The one-process app: `services`' engine and pools behind an in-process engine client. With
    `services.start_engine`, the lifespan starts the engine (if it is not running); it always shuts
    it down at exit, then closes each modality's service."""
    engine = services.engine
    if services.webrtc_workers is not None and services.webrtc_workers < 1:
        raise ValueError(f"webrtc_workers must be at least 1 (got {services.webrtc_workers}): in one process "
                         "the calls' peers run in worker processes, off the loop whose GIL the engine thread "
                         "shares (only an edge worker runs them itself)")

    async def start() -> None:
        if services.start_engine:
            services.engine.start()

    async def stop() -> None:
        await asyncio.to_thread(services.engine.shutdown)
        services.close_modalities()

    return assemble_app(engine_client(services), services.edge_spec(), EngineLifetime(start, stop),
                        engine_thread=lambda: engine.thread_id, collectors=services.collectors())


@dataclass(frozen=True)
class EngineLifetime:
    """What the app's lifespan does with its engine: start it before the first request, stop it after
    every connection has closed (the one-process app: the engine itself; an edge worker: its link)."""

    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]


def assemble_app(client: EngineClient, spec: EdgeSpec, lifetime: EngineLifetime, *,
                 engine_thread: Callable[[], int | None] = lambda: None, collectors: Sequence = (),
                 process: str | None = None, others: Callable[[], Sequence[bytes]] | None = None,
                 middleware: Sequence[Middleware] = ()) -> Starlette:
    """Map routes and middleware over `client` from `spec` (server/services.py's EdgeSpec): the same
    app in a one-process server and in each edge worker. An edge worker names its `process` and
    gives the other processes' metrics (`others`, exposition text): its /metrics shows every
    process, the engine's counters among them, and its own `middleware` after the access checks
    (server/edge_worker.py)."""
    metrics: metrics_api.EdgeMetrics | None = None

    def count_restart() -> None:
        if metrics is not None:
            metrics.codec_restarts.inc()

    codec = make_codec_runner(spec.codec_workers, max_sessions=client.max_sessions, on_restart=count_restart)
    webrtc = peer_host(spec.webrtc_workers, client.max_sessions, on_restart=lambda: metrics.webrtc_restarts.inc(),
                       on_silent=lambda packets: metrics.webrtc_silent.inc(packets))
    loop_thread: dict[str, int] = {}  # the event loop's OS thread id, taken when the lifespan starts on it
    metrics = metrics_api.EdgeMetrics(client.counters if others is None else None, codec.worker_cpu_seconds
                                      if isinstance(codec, CodecProcessPool) else None, webrtc.worker_cpu_seconds
                                      if isinstance(webrtc, WebRTCPool) else None,
                                      threads=lambda: {"loop": loop_thread.get("id"), "engine": engine_thread()},
                                      process=process, others=others)
    for collector in collectors:
        metrics.registry.register(collector)
    manager = SessionManager(client, spec.defaults, codec, metrics,
                             Admission(client, metrics.registry, ready_min_free=spec.ready_min_free,
                                       refusals=metrics.refusals), models=spec.models)
    has_page = spec.web_dir is not None and (spec.web_dir / "index.html").is_file()  # public: server/security.py
    served = doors.mounted({"page": has_page, **spec.available})
    access = Middleware(AccessMiddleware, keys=spec.defaults.api_keys,
                        protect_metrics=spec.defaults.protect_metrics,
                        allowed_origins=spec.defaults.allowed_origins,
                        static_paths=static_paths(spec.web_dir) if has_page else (),
                        session_paths=doors.WEBRTC_PATHS, refusals=metrics.refusals)
    unknown_ws = Middleware(UnknownWebSocket, paths=frozenset(d.path for d in served if d.method == doors.WS))
    translating = spec.info.model if spec.translator is not None else None
    app = Starlette(routes=[_route(door, spec.web_dir, translating) for door in served],
                    lifespan=_lifespan(lifetime, manager, codec, webrtc, loop_thread),
                    middleware=[access, *middleware, unknown_ws], exception_handlers={HTTPException: http_error})
    app.state = AppState(  # type: ignore[assignment]  # the typed state (server/state.py) replaces starlette's bag
        client, manager, manager.models, metrics.refusals, spec.info, tuple(served),
        Drainer(manager, spec.drain_timeout), codec, webrtc, speech=spec.speech, stt_model=spec.stt_model,
        live_calls=LiveCalls(), translator=spec.translator)
    return app


def peer_host(workers: int | None, max_sessions: int, *, on_restart: Callable[[], None],
              on_silent: Callable[[int], None]) -> PeerHost:
    """Where the app's WebRTC calls run their aiortc peers (webrtc/transport.py): `workers` None, one
    worker process per 6 sessions; N, N worker processes (webrtc/pool.py, started by the first call);
    0, this process's own loop (webrtc/local.py): an edge worker's choice (server/edge_worker.py),
    never the one-process server's, whose loop shares the engine thread's GIL (create_app refuses it)."""
    if workers == 0:
        from ..webrtc.local import LocalPeers  # aiortc: only a process that runs peers imports it

        return LocalPeers(on_silent=on_silent)
    return WebRTCPool(workers or default_workers(max_sessions), on_restart=on_restart, on_silent=on_silent)


def engine_client(services: Services) -> InProcessClient:
    """The doors' one way to the engine (realtime/engine_client.py), over what `services` built."""
    return InProcessClient(services.engine, tts=services.speech and services.speech.pool, stt=services.stt_pool,
                           images=services.images and services.images.queue)


def _lifespan(lifetime: EngineLifetime, manager: SessionManager, codec, webrtc: PeerHost,
              loop_thread: dict[str, int]):
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop_thread["id"] = threading.get_native_id()
        await codec.start()  # worker processes start on the server's loop, before any session
        await load_lazy_modules()
        await lifetime.start()
        try:
            yield
        finally:
            await manager.shutdown()
            calls = app_state(app).calls
            if calls:  # closed by the shutdown above; let them finish hanging up
                await asyncio.wait(set(calls), timeout=CALLS_CLOSE_TIMEOUT_S)
            await lifetime.stop()
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
