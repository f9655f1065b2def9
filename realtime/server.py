"""`parley serve`, top to bottom: load the checkpoint -> build the engine -> build the app ->
run uvicorn (uvloop, websockets sans-I/O) until SIGINT, or SIGTERM which first drains
(drain.py: no new sessions, live ones run up to --drain-timeout) -> uvicorn's graceful
shutdown runs the app's lifespan exit, which closes every connection and shuts the engine
down (bounded by `EngineConfig.shutdown_timeout_s`), and `parley serve` exits 0. A fatal
engine error (the shared frame step raised) makes it exit 1 instead, so a supervisor restarts
it rather than it staying up and unhealthy.

WebSocket settings, and why:
- `ws=ParleyWebSocketProtocol` (ws_protocol.py): uvicorn's websockets-sansio, plus a 414/400
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

import dataclasses
import importlib.util
import logging
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn

from parley.engine import Engine, SamplingOptions, SessionOptions
from parley.engine.backend import ModelBackend, default_dtype
from parley.engine.gc_pauses import freeze_loaded_objects
from parley.engine.image_queue import DEFAULT_STALL_TIMEOUT_S, ImageQueue
from parley.engine.no_duplex import NO_DUPLEX_REASON, NoDuplexBackend
from parley.engine.stt_paired import PairedTranscription
from parley.engine.stt_pool import SttPool
from parley.models.checkpoint import Checkpoint, CheckpointError, SttCheckpoint, load_checkpoint, load_stt_checkpoint
from parley.models.image_pipeline import ImagePipelineError, load_image_pipeline
from parley.models.mimi.codec import Mimi
from parley.models.tensor_sharing import share_equal_tensors

from .app import DEMO_NOTICE, ServerInfo, create_app, served_paths
from .demo_model import (DEMO_KINDS, DEMO_TTS_VOICE_MAP, STT_NOTICE, demo_image_stepper, ensure_demo_checkpoint,
                         ensure_demo_stt_checkpoint, ensure_demo_tts)
from .drain import DrainingServer
from .images_api import ImageService
from .limits import WS_MAX_SIZE, EdgeLimits
from .live_policy import DelegateBackend, DelegationPolicy
from .load_progress import LoadProgress
from .security import RedactKeys
from .sessions import ServerDefaults
from .speech_api import SpeechService
from .speech_setup import load_speech_service
from .ws_protocol import ParleyWebSocketProtocol

log = logging.getLogger("parley.server")
# Paired STT rows run in the frame, on a side stream inside its graph: +9.8 % on the B=64 frame on an
# H200 against +20 % after it (docs/benchmarks.md); graphed equals eager on CUDA
# (tests/test_stt_graphs.py). False steps them after the frame in a graph of their own.
PAIRED_IN_FRAME = True


class ServeError(RuntimeError):
    """A serve configuration that cannot work; the CLI prints the message and exits 2."""


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
    mimi_dtype: str = "float32"  # every Mimi's (duplex, STT, TTS): float32 (the reference's) or bfloat16
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
    # torch intra-op threads. 1 by default: OpenMP workers busy-wait between ops and starve the
    # event loop and the codec threads; on the 2-core dev box the tiny model's tick went from
    # ~30 ms to ~300 ms (most ticks skipped) with torch's default of one thread per core.
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
    live_delegation: DelegationPolicy = DelegationPolicy()  # GPT-Live: when sessions delegate (live_policy.py)
    live_delegate: DelegateBackend | None = None  # GPT-Live: the Responses delegation backend (--delegate-url)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when a device is present, else the CPU; the log says which and why. Any other
    name must be a CPU or CUDA device this machine has (a ServeError naming --device otherwise)."""
    if name != "auto":
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ServeError(f"--device {name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
        if device.type not in ("cpu", "cuda"):
            raise ServeError(f"--device {name}: Parley runs on cpu or cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ServeError(f"--device {name}: no CUDA device is available here (use --device cpu)")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ServeError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return device
    if torch.cuda.is_available():
        log.info("device auto: CUDA is present, using cuda (%s)", torch.cuda.get_device_name(0))
        return torch.device("cuda")
    log.info("device auto: no CUDA device, using the CPU")
    return torch.device("cpu")


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    return default_dtype(device) if name is None else DTYPES[name]


def uvicorn_config(app, host: str, port: int, log_level: str = "info", *, ssl_certfile: str | None = None,
                   ssl_keyfile: str | None = None) -> uvicorn.Config:
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    # log_config=None: uvicorn installs no handlers; its lines go through the root handler
    # (log_format.configure_logging), in the same format as Parley's.
    return uvicorn.Config(app, host=host, port=port, loop=loop, ws=ParleyWebSocketProtocol,
                          ws_max_size=WS_MAX_SIZE, ws_per_message_deflate=False,
                          ws_ping_interval=20.0, ws_ping_timeout=20.0, log_level=log_level,
                          log_config=None, timeout_graceful_shutdown=10, lifespan="on",
                          ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)


def default_sampling(checkpoint: Checkpoint, overrides: dict) -> SamplingOptions:
    """The checkpoint's sampling (its lm_gen_config), then the command line's flags on top."""
    return SamplingOptions(**{**dataclasses.asdict(checkpoint.sampling), **overrides})


def build_speech(config: ServeConfig, demo: bool, device: torch.device, dtype: torch.dtype,
                 duplex_mimi: Mimi | None = None) -> SpeechService | None:
    mimi_dtype = DTYPES[config.mimi_dtype]
    """The TTS pool and voices: --tts-model, or the demo TTS when no model at all was given.
    `duplex_mimi`: the duplex model's codec, whose equal weights the TTS Mimi then shares."""
    if config.tts_model is None and not demo:
        return None
    if config.tts_model is None:
        directory = ensure_demo_tts()
        return load_speech_service(directory, slots=config.tts_slots, voices=directory / "voices",
                                   voice_map=directory / DEMO_TTS_VOICE_MAP, device=str(device), dtype=dtype,
                                   share_mimi=duplex_mimi, mimi_dtype=mimi_dtype)
    log.info("loading TTS %s on %s", config.tts_model, device)
    return load_speech_service(config.tts_model, slots=config.tts_slots, voices=config.tts_voices,
                               voice_map=config.tts_voice_map, device=str(device), dtype=dtype,
                               share_mimi=duplex_mimi, mimi_dtype=mimi_dtype)


def build_app(config: ServeConfig):
    """Load the model(s) and wire engine + app (no sockets yet)."""
    demo = config.model is None and config.tts_model is None
    if config.demo is not None and not demo:
        raise ServeError("--demo picks the built-in demo model, which is served only without --model and "
                         "--tts-model: drop --demo, or those")
    demo_kind = config.demo or DEMO_KINDS[0]
    if demo_kind not in DEMO_KINDS:
        raise ServeError(f"--demo must be one of {', '.join(DEMO_KINDS)}, not {demo_kind!r}")
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device.type)
    if config.model is None and not demo:  # TTS only: the duplex routes refuse sessions, saying why
        speech = build_speech(config, demo, device, dtype)
        engine = Engine(NoDuplexBackend(str(device)))
        engine.add_slack_source(speech.pool)
        info = ServerInfo(model=Path(str(config.tts_model)).name, notes=[NO_DUPLEX_REASON])
        return create_app(engine, _server_defaults(config, config.defaults, info.model, prompts=False), info,
                          codec_workers=config.codec_workers, ready_min_free=config.ready_min_free,
                          drain_timeout=config.drain_timeout, speech=speech)
    source = str(ensure_demo_checkpoint(demo_kind)) if demo else config.model
    if demo:
        log.warning(DEMO_NOTICE)
    log.info("loading %s on %s (%s, Mimi %s)", source, device, str(dtype).removeprefix("torch."), config.mimi_dtype)
    progress = LoadProgress()
    try:
        checkpoint = load_checkpoint(source, device=device, dtype=dtype, progress=progress,
                                     mimi_dtype=DTYPES[config.mimi_dtype])
    finally:
        progress.close()
    prompts = checkpoint.model_type == "personaplex"
    if not prompts and (config.defaults.persona or config.defaults.voice):
        raise ServeError(f"{source} is a Moshi checkpoint, which takes no persona or voice prompt; "
                         "drop --persona / --voice (they are for PersonaPlex checkpoints).")
    kv_dtype = torch.float8_e4m3fn if config.kv_dtype == "fp8" else None
    speech = build_speech(config, demo, device, dtype, checkpoint.mimi)
    stt = _load_stt(config, demo_kind if demo else None, device, dtype)
    if stt is not None and (shared := share_equal_tensors(stt.mimi, checkpoint.mimi)):
        log.info("the STT model's Mimi shares %.0f MB of weights with the duplex model's", shared / 1e6)
    paired = stt is not None and _shares_mimi(checkpoint, stt)
    if config.live_delegation.needs_transcript and not paired:
        raise ServeError(f"--live-delegation {config.live_delegation} matches the user's words, which need a paired "
                         "speech-to-text model (--stt-model, sharing the duplex model's Mimi); use every_turn or never")
    if stt is not None and not paired:
        log.warning("the STT model's Mimi differs from the duplex model's: /v1/audio/transcriptions works, "
                    "but sessions cannot be transcribed from the frame's codes (no paired transcription)")
    # Paired transcription (engine/stt_paired.py): after the frame (PAIRED_IN_FRAME False) or in it.
    transcription = PairedTranscription(stt, config.max_sessions, in_frame=PAIRED_IN_FRAME) if paired else None
    in_frame = transcription is not None and PAIRED_IN_FRAME
    backend = ModelBackend(checkpoint, config.max_sessions, kv_dtype=kv_dtype,
                           encode_codebooks=stt.lm_config.n_q if paired and not in_frame else None,
                           side_work=transcription.frame_work if in_frame else None)
    engine = Engine(backend)
    if speech is not None:
        engine.add_slack_source(speech.pool)
    if transcription is not None:
        engine.set_paired_transcription(transcription)
    images = build_images(config, engine, device, dtype, demo)
    info = ServerInfo(model="parley-demo" if demo else Path(str(source)).name, demo=demo,
                      voices=backend.voice_names(), default_voice=config.defaults.voice)
    options = dataclasses.replace(config.defaults, sampling=default_sampling(checkpoint, config.sampling))
    return create_app(engine, _server_defaults(config, options, info.model, prompts), info, codec_workers=config.codec_workers,
                      stt_pool=SttPool(stt, config.stt_slots) if stt is not None else None,
                      ready_min_free=config.ready_min_free, drain_timeout=config.drain_timeout, images=images,
                      speech=speech)


def _server_defaults(config: ServeConfig, options: SessionOptions, model_name: str, prompts: bool) -> ServerDefaults:
    return ServerDefaults(options=options, model_name=model_name, api_key=config.api_key, prompts=prompts,
                          protect_metrics=config.protect_metrics, allowed_origins=config.allowed_origins,
                          limits=config.limits, live_delegation=config.live_delegation,
                          live_delegate=config.live_delegate)


def _load_stt(config: ServeConfig, demo: str | None, device: torch.device, dtype: torch.dtype) -> SttCheckpoint | None:
    """--stt-model, or with `demo` (the demo kind served) the demo's tiny STT sharing its Mimi."""
    if config.stt_model is None and demo is None:
        return None
    source = config.stt_model or str(ensure_demo_stt_checkpoint(demo))
    if config.stt_model is None:
        log.warning("demo server: %s", STT_NOTICE)
    log.info("loading speech-to-text %s (%d rows)", source, config.stt_slots)
    return load_stt_checkpoint(source, device=device, dtype=dtype, mimi_dtype=DTYPES[config.mimi_dtype])


def _shares_mimi(checkpoint: Checkpoint, stt: SttCheckpoint) -> bool:
    """Paired transcription reads the duplex frame's codes: the two Mimis must be one (every
    weight equal) and the duplex one must hold the codebooks the STT reads. Called after
    share_equal_tensors, which pointed every equal STT weight at the duplex one: equal means
    the very same tensor, so nothing is compared twice."""
    ours, theirs = checkpoint.mimi.state_dict(keep_vars=True), stt.mimi.state_dict(keep_vars=True)
    if checkpoint.mimi.quantizer.levels < stt.lm_config.n_q:
        return False
    return all(ours.get(k) is v for k, v in theirs.items())


def build_images(config: ServeConfig, engine: Engine, device: torch.device, dtype: torch.dtype,
                 demo: bool) -> ImageService | None:
    """Load the image pipeline, measure its items once (warm-up) and register its queue."""
    if config.image_model is None and not demo:
        return None
    if config.image_model is None:
        stepper = demo_image_stepper(device)
    else:
        log.info("loading image model %s on %s", config.image_model, device)
        try:
            stepper = load_image_pipeline(config.image_model, device, dtype)
        except ImagePipelineError as exc:
            raise ServeError(f"--image-model: {exc}") from exc
    slack = engine.config.tick_seconds - engine.config.slack_guard_s
    queue = ImageQueue(stepper, max_slack_s=slack, capacity=config.image_queue,
                       stall_timeout_s=config.image_stall_timeout)
    measured = queue.warm_up()
    log.info("image model %s (%s): default %dpx, latent stride %d; speed-ups: %s; warm-up: %s", stepper.name,
             stepper.family, stepper.default_size, stepper.latent_stride, ", ".join(stepper.speedups) or "none",
             ", ".join(f"{k[1]}{'x' + str(k[-1]) if k[1] == 'denoise' else ''} {v * 1e3:.1f} ms"
                       for k, v in measured.items()))
    engine.add_slack_source(queue)
    return ImageService(queue, engine, stepper.name)


def serve(config: ServeConfig, sockets: list[socket.socket]) -> int:
    """Load and serve on `sockets`, already bound to config's address (server_sockets.py)."""
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
    """The startup banner: where, and every path the router mounted (doors.py), nothing else."""
    scheme = "https" if config.ssl_certfile else "http"
    log.info("serving on %s://%s:%d (%d sessions): %s", scheme, config.host, config.port, config.max_sessions,
             ", ".join(served_paths(app)))


def run_app(app, uv_config: uvicorn.Config, sockets: list[socket.socket] | None = None) -> int:
    """Run uvicorn (SIGTERM drains, drain.py) on `sockets` (None: it binds the config's address)
    until it stops: exit 0 with no traceback, or 1 after a fatal engine error."""
    for name in ("uvicorn.access", "uvicorn.error"):  # they log request paths, query strings included
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactKeys) for f in logger.filters):
            logger.addFilter(RedactKeys())
    server = DrainingServer(uv_config, app.state.drainer)
    fatal: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:  # engine thread: ask uvicorn to stop (it polls the flag)
        fatal.append(exc)
        server.should_exit = True

    app.state.sessions.engine.on_fatal = on_fatal
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal it stopped for once shut down; a no-op handler turns that
        # into a clean exit (no KeyboardInterrupt traceback, no death by SIGTERM).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    server.run(sockets=sockets)
    if fatal:
        log.error("exiting with status 1 after a fatal engine error, so a supervisor can restart the server")
        return 1
    return 0 if server.started else 1
