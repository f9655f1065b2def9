"""`parley serve`, top to bottom: build the services (server/services.py: every model, the engine and its
slack sources) -> build the app ->
run uvicorn (uvloop, websockets sans-I/O) until SIGINT, or SIGTERM which first drains
(server/drain.py: no new sessions, live ones run up to --drain-timeout) -> uvicorn's graceful
shutdown runs the app's lifespan exit, which closes every connection and shuts the engine
down (bounded by `EngineConfig.shutdown_timeout_s`), and `parley serve` exits 0. A fatal
engine error (the shared frame step raised) makes it exit 1 instead, so a supervisor restarts
it rather than it staying up and unhealthy.

WebSocket settings, and why:
- `ws=ParleyWebSocketProtocol` (server/ws_protocol.py): uvicorn's websockets-sansio, plus a 414/400
  answer to a handshake its parser refuses and the send backlog the edge bounds lag with.
  websockets-sansio: each `send` is written to the transport at once (no
  write coalescing: one 80 ms frame is one write), and `send` waits while the transport
  is paused, so a slow client back-pressures its own sender only (the engine's bounded
  output stream then drops that client's oldest frames, counted).
- `ws_per_message_deflate=False`: audio does not compress; deflate would only cost CPU.
- `ws_max_size` 16 MiB: the transport's hard cap (close 1009). The protocols refuse
  smaller messages themselves: `/api/chat` closes past 256 KiB, `/v1/realtime` answers
  an `error` past 8 MiB and goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import signal
import socket
import threading
from dataclasses import dataclass

import uvicorn

from parley.engine import (DEFAULT_STALL_TIMEOUT_S, TICK_TRACE_TICKS, KvSettings, SessionOptions,
                           freeze_loaded_objects)
from parley.models import CheckpointError

from .app import create_app, served_paths
from .drain import DrainingServer
from ..sessions.limits import WS_MAX_SIZE, EdgeLimits
from ..live.policy import DelegateBackend, DelegationPolicy
from .security import RedactKeys
from ..calls.transport import IceServer
# resolve_device / resolve_dtype / DTYPES / MIMI_DTYPES: the offline CLIs import them from here
from .services import DTYPES, MIMI_DTYPES, ServeError, build_services, resolve_device, resolve_dtype  # noqa: F401
from .ws_protocol import ParleyWebSocketProtocol
from .state import app_state

log = logging.getLogger("parley.server")


@dataclass(frozen=True)
class ServeConfig:
    """Everything `parley serve` was asked for (the CLI builds it from its flags)."""

    model: str | None  # checkpoint directory or Hugging Face repo id; None: the demo model
    demo: str | None = None  # which demo (demo_model.DEMO_KINDS) when no model is given; None: the first
    host: str = "127.0.0.1"
    port: int = 8998
    max_sessions: int = 8
    device: str = "auto"  # auto: CUDA when present, else CPU
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    kv_dtype: str | None = None  # temporal KV cache: None = the weights' dtype, "fp8" = float8 e4m3
    kv: KvSettings = KvSettings()  # the KV block pool: admission by memory, paging (engine/kv_blocks.py)
    mimi_dtype: str = "auto"  # every Mimi's (duplex, STT, TTS): auto (float16 where it passes its probe), or a dtype
    defaults: SessionOptions = SessionOptions()  # persona and voice; sampling comes from below
    sampling: dict = dataclasses.field(default_factory=dict)  # SamplingOptions fields set by flags
    api_key: str | tuple[str, ...] | None = None  # one key or several (--api-key-file: rotation)
    protect_metrics: bool = False
    allowed_origins: tuple[str, ...] | None = None  # None: same origin only
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    limits: EdgeLimits = EdgeLimits()
    log_level: str = "info"
    codec_workers: int | None = None
    webrtc_workers: int | None = None  # edge_workers 0: WebRTC calls' worker processes; None: one per 6 sessions
    edge_workers: int = 0  # edge worker processes beside an engine process (server/processes.py); 0: one process
    # torch intra-op threads. 1 by default: OpenMP workers busy-wait between ops and starve the
    # event loop and the codec threads: with torch's default of one thread per core a small box's
    # ticks ran many times over their 80 ms and were skipped.
    torch_threads: int | None = 1
    # Speech-to-text (Kyutai STT) for /v1/audio/transcriptions: checkpoint dir or HF repo id;
    # None: none, except for the demo server, which includes a tiny random one.
    stt_model: str | None = None
    stt_slots: int = 16
    ready_min_free: int = 1  # /readyz is 503 below this many free slots
    drain_timeout: float = 30.0  # SIGTERM / POST /admin/drain: seconds live sessions may run on
    # Images (/v1/images/generations): a diffusers pipeline dir or HF id; None: the tiny demo
    # pipeline when the voice model is the demo too, else no image endpoint.
    image_model: str | None = None
    image_queue: int = 16  # images waiting or running; beyond that 429
    image_stall_timeout: float = DEFAULT_STALL_TIMEOUT_S  # seconds a request may go without an item, then fails
    # TTS (POST /v1/audio/speech): a DSM TTS checkpoint beside (or without) the duplex model.
    tts_model: str | None = None
    tts_slots: int = 4
    tts_voices: str | None = None  # voice set directory or HF repo id; None: kyutai/tts-voices
    tts_voice_map: str | None = None  # JSON {alias: voice name}, e.g. OpenAI's names
    live_delegation: DelegationPolicy = DelegationPolicy()  # GPT-Live: when sessions delegate (live/policy.py)
    live_delegate: DelegateBackend | None = None  # GPT-Live: the Responses delegation backend (--delegate-url)
    ice_servers: tuple[IceServer, ...] = ()  # WebRTC calls' STUN/TURN servers (--ice-servers)
    # --served-model-name: each modality's aliases beside its checkpoint's name (server/served_models.py)
    served_model_names: dict = dataclasses.field(default_factory=dict)
    tick_trace: str | None = None  # --tick-trace: the engine's tick timeline to this file (engine/tick_trace.py)
    tick_trace_ticks: int = TICK_TRACE_TICKS  # tick lines it writes at most
    slack_queue_depth: int | None = None  # --slack-queue-depth (engine/slack_queue.py); None: EngineConfig's


def loop_name() -> str:
    """The event loop every process of the server runs: uvloop where installed."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def runner() -> asyncio.Runner:
    """An asyncio runner on `loop_name`'s loop (the edge workers' and the engine process's mains)."""
    return asyncio.Runner(loop_factory=uvicorn.Config(None, loop=loop_name(), log_config=None).get_loop_factory())


def uvicorn_config(app, host: str, port: int, log_level: str = "info", *, ssl_certfile: str | None = None,
                   ssl_keyfile: str | None = None) -> uvicorn.Config:
    loop = loop_name()
    # log_config=None: uvicorn installs no handlers; its lines go through the root handler
    # (log_format.configure_logging), in the same format as Parley's.
    return uvicorn.Config(app, host=host, port=port, loop=loop, ws=ParleyWebSocketProtocol,
                          ws_max_size=WS_MAX_SIZE, ws_per_message_deflate=False,
                          ws_ping_interval=20.0, ws_ping_timeout=20.0, log_level=log_level,
                          log_config=None, timeout_graceful_shutdown=10, lifespan="on",
                          ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)


def build_app(config: ServeConfig):
    """Load the model(s) and wire engine + app (no sockets yet): services.build_services."""
    return create_app(build_services(config))


def serve(config: ServeConfig, sockets: list[socket.socket]) -> int:
    """Load and serve on `sockets`, already bound to config's address (server/sockets.py), in this
    process (`config.edge_workers` 0; otherwise the CLI runs server/processes.py's supervisor)."""
    try:
        app = build_app(config)
    except (ServeError, CheckpointError) as exc:
        log.error("%s", exc)
        for sock in sockets:
            sock.close()
        return 2
    frozen = freeze_loaded_objects()  # full GC passes must not walk the models (engine/gc_pauses.py)
    log.info("froze %d loaded objects out of garbage collection", frozen)
    log_serving(app, config)
    return run_app(app, uvicorn_config(app, config.host, config.port, config.log_level,
                                       ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile), sockets)


def log_serving(app, config: ServeConfig) -> None:
    """The startup banner: where, and every path the router mounted (server/doors.py), nothing else."""
    scheme = "https" if config.ssl_certfile else "http"
    log.info("serving on %s://%s:%d (%d sessions): %s", scheme, config.host, config.port, config.max_sessions,
             ", ".join(served_paths(app)))


def run_app(app, uv_config: uvicorn.Config, sockets: list[socket.socket] | None = None) -> int:
    """Run uvicorn (SIGTERM drains, server/drain.py) on `sockets` (None: it binds the config's address)
    until it stops: exit 0 with no traceback, or 1 after a fatal engine error."""
    state = app_state(app)
    server = DrainingServer(uv_config, state.drainer)
    fatal: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:  # engine thread: ask uvicorn to stop (it polls the flag)
        fatal.append(exc)
        server.should_exit = True

    state.sessions.engine.on_fatal = on_fatal  # server/ built the engine; its fatal error stops the server
    with runner() as run:  # uvloop where installed
        run.run(run_server(server, sockets))
    if fatal:
        log.error("exiting with status 1 after a fatal engine error, so a supervisor can restart the server")
        return 1
    return 0 if server.started else 1


async def run_server(server: uvicorn.Server, sockets: list[socket.socket] | None) -> None:
    """Run `server` on `sockets` until it stops, as a one-process server and each edge worker do."""
    for name in ("uvicorn.access", "uvicorn.error"):  # they log request paths, query strings included
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactKeys) for f in logger.filters):
            logger.addFilter(RedactKeys())
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal it stopped for once shut down; a no-op handler turns that
        # into a clean exit (no KeyboardInterrupt traceback, no death by SIGTERM).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    await server.serve(sockets=sockets)
