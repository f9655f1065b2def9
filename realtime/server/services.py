"""`build_services(config) -> Services`: the one place that builds what a server serves.

It walks the modality registry (server/modalities.py) twice around the engine: first each record's
`load` (the duplex model, the TTS and its voices, the STT), then the engine around the duplex backend
(or NoDuplexBackend on a server without one, with paired transcription when the STT shares the
duplex Mimi), then each record's `start`, which builds its service and warms and registers it on
the engine. It refuses flag combinations it cannot serve (ServeError) and names each modality's
served models (server/served_models.py). `app.create_app(services)` then maps routes and
middleware from the result and nothing else; server/serve.py binds sockets and runs uvicorn.

Every slack source is warmed and registered in one place, `register_slack_source` (engine/slack.py's
warm-up protocol: `source.warm_up(engine.slack_costs)`, then `engine.add_slack_source`). Tests build
`Services` by hand around a fabricated engine and register their sources the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from parley.engine import (
    NO_DUPLEX_REASON, Engine, EngineConfig, ImageQueue, KvBlockPool, ModelBackend, NoDuplexBackend, OptionsError,
    PairedTranscription, SamplingOptions, SlackSource, SttPool, TickTrace, default_dtype, kv_layout,
)
from parley.models import (
    Checkpoint, Mimi, SttCheckpoint, load_checkpoint, load_stt_checkpoint, share_equal_tensors,
)

from .demo_model import (DEMO_DUPLEX_MODEL, DEMO_KINDS, DEMO_TRANSLATION_MODEL, DEMO_TTS_MODEL, DEMO_TTS_VOICE_MAP,
                         STT_NOTICE, demo_image_stepper, ensure_demo_checkpoint, ensure_demo_stt_checkpoint, ensure_demo_tts)
from ..http.images import ImageService
from .load_progress import LoadProgress
from .modalities import DUPLEX, MODALITIES, SPEECH, TRANSCRIPTION, Modality, resolve
from .served_models import ServedModels
from ..translation.model import HIBIKI_LANGUAGES, Translator
from ..sessions.session import ServerDefaults
from ..http.speech import SpeechService
from .speech_setup import load_speech_service

if TYPE_CHECKING:
    from .serve import ServeConfig

log = logging.getLogger("parley.server")
# Paired STT rows run in the frame, on a side stream inside its graph: it costs the frame less than
# stepping them after it (docs/benchmarks.md, "Transcription"); graphed equals eager on CUDA
# (tests/test_stt_graphs.py). False steps them after the frame in a graph of their own.
PAIRED_IN_FRAME = True
WEB_DIR = Path(__file__).resolve().parents[2] / "web"
DEMO_NOTICE = ("This server runs Parley's tiny demo model: it babbles (random weights). "
               "Start `parley serve --model <checkpoint dir or Hugging Face repo id>` to talk for real.")
# The demo also answers to the names the docs' examples use (docs/protocols.md) and to the ones
# OpenAI's clients send by default (each record's demo_aliases, server/modalities.py), so each of
# them talks to a fresh demo unchanged; a real checkpoint answers to its own name and the
# operator's --served-model-name aliases only.
DEMO_ALIASES = {m.key: m.demo_aliases for m in MODALITIES if m.demo_aliases}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIMI_DTYPES = {"auto": None, **DTYPES}  # --mimi-dtype; auto: models/mimi/precision.py


class ServeError(RuntimeError):
    """A serve configuration that cannot work; the CLI prints the message and exits 2."""


def mimi_dtype(config: "ServeConfig") -> torch.dtype | None:
    """--mimi-dtype as the loaders take it (None: auto)."""
    if config.mimi_dtype not in MIMI_DTYPES:
        raise ServeError(f"--mimi-dtype must be one of {', '.join(MIMI_DTYPES)}, got {config.mimi_dtype!r}")
    return MIMI_DTYPES[config.mimi_dtype]


@dataclass(frozen=True)
class ServerInfo:
    """What the page and /api/info show about the loaded model."""

    model: str = "parley"
    demo: bool = False
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    notes: list[str] = field(default_factory=list)
    mimi_dtypes: dict[str, str] = field(default_factory=dict)  # by modality: the dtype its codec computes in


@dataclass
class Services:
    """Everything the app serves, built and registered on the engine; None: not served."""

    engine: Engine
    defaults: ServerDefaults = ServerDefaults()
    info: ServerInfo = ServerInfo()
    codec_workers: int | None = None
    webrtc_workers: int | None = None  # WebRTC worker processes (webrtc/pool.py); None: one per 6 sessions
    start_engine: bool = True  # the app's lifespan starts the engine (if not running); it always stops it
    web_dir: Path | None = WEB_DIR
    stt_pool: SttPool | None = None  # standalone transcription rows, already registered (register_slack_source)
    ready_min_free: int = 1  # /readyz is 503 below this many free slots
    drain_timeout: float = 30.0  # seconds a drain lets live sessions run
    images: ImageService | None = None
    speech: SpeechService | None = None
    models: ServedModels | None = None  # None: each service's own name, no aliases
    translator: Translator | None = None  # the served Hibiki (translation/model.py); None: the duplex model stands in

    def service(self, modality: Modality):
        """`modality`'s built service (its record's field), None where it is not served or has none
        of its own. The duplex model's is the server's info: the engine serves it."""
        return getattr(self, modality.field) if modality.field is not None else None

    def collectors(self) -> list:
        """Each served modality's own metrics collector (its record's `collector`)."""
        return [modality.collector(service) for modality in MODALITIES
                if modality.collector is not None and (service := self.service(modality)) is not None]

    def close_modalities(self) -> None:
        """Once the engine thread is gone: each modality ends what it will never finish."""
        for modality in MODALITIES:
            if modality.close is not None and (service := self.service(modality)) is not None:
                modality.close(service)

    def available(self) -> dict[str, bool]:
        """Which modalities are served, by key (server/doors.py's `needs`, less the page)."""
        return {m.key: self.service(m) is not None for m in MODALITIES}

    def served_models(self) -> ServedModels:
        if self.models is not None:
            return self.models
        return ServedModels.build(served_names(self.service), {})

    def edge_spec(self) -> "EdgeSpec":
        """What the app is built from, without an engine object: in this process, or sent to each edge
        worker by the engine process (realtime/engine_process/core.py)."""
        speech = self.speech and dataclasses.replace(self.speech, pool=None)  # the pool stays with the engine
        return EdgeSpec(self.defaults, self.info, self.served_models(), self.available(), self.web_dir,
                        self.codec_workers, self.webrtc_workers, self.ready_min_free, self.drain_timeout, speech,
                        self.stt_pool and self.stt_pool.name, self.translator)


@dataclass(frozen=True)
class EdgeSpec:
    """Everything the app (server/app.py) is built from besides its engine client: plain data and the
    speech front end, picklable, so an edge worker builds the same app as a one-process server."""

    defaults: ServerDefaults
    info: ServerInfo
    models: ServedModels
    available: dict[str, bool]  # which modalities are served, by key (Services.available)
    web_dir: Path | None
    codec_workers: int | None
    webrtc_workers: int | None  # 0 (an edge worker's only): the calls' peers on its loop (server/app.py peer_host)
    ready_min_free: int
    drain_timeout: float
    speech: SpeechService | None  # its pool None: only the engine client submits there
    stt_model: str | None  # the standalone transcription model's name
    translator: Translator | None


def served_names(service_of: Callable[[Modality], Any]) -> dict[str, str | None]:
    """Each modality's checkpoint name (its record's served_name of its service), in the registry's
    order; None where `service_of` has no service for it."""
    names = {}
    for modality in (m for m in MODALITIES if m.named):
        service = service_of(modality)
        names[modality.key] = None if service is None else modality.served_name(service)
    return names


def register_slack_source(engine: Engine, source: SlackSource) -> dict:
    """Warm `source` (capture its graphs, seed the engine's cost model with its measured costs:
    engine/slack.py's warm-up protocol) and make it one of the engine's slack sources. Returns
    what the warm-up measured, {key: seconds}. Every source a server serves goes through here."""
    measured = source.warm_up(engine.slack_costs)
    engine.add_slack_source(source)
    return measured


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


def default_sampling(checkpoint: Checkpoint, overrides: dict) -> SamplingOptions:
    """The checkpoint's sampling (its lm_gen_config), then the command line's flags on top."""
    return SamplingOptions(**{**dataclasses.asdict(checkpoint.sampling), **overrides})


@dataclass
class Build:
    """What build_services has built so far, on one device and dtype."""

    config: "ServeConfig"
    demo: str | None  # the demo kind served, None for a named model
    device: torch.device
    dtype: torch.dtype
    loaded: dict[str, Any] = field(default_factory=dict)  # each modality's model (its record's `load`), by key
    voices: tuple[str, ...] = ()  # the duplex model's voice prompts, read at start by its backend

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The duplex model; None on a server without one."""
        return self.loaded.get(DUPLEX.key)

    @property
    def stt(self) -> SttCheckpoint | None:
        return self.loaded.get(TRANSCRIPTION.key)


def build_services(config: "ServeConfig") -> Services:
    """Load every model named by `config`, build the engine, and build and register every service."""
    demo = _demo_kind(config)
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    device = resolve_device(config.device)
    build = Build(config, demo, device, resolve_dtype(config.dtype, device.type))
    for modality in MODALITIES:
        if modality.load is not None:
            build.loaded[modality.key] = resolve(modality.load)(build)
    engine = _build_engine(build)
    built = {m.key: resolve(m.start)(build, engine) for m in MODALITIES if m.start is not None}
    info, defaults = _info_and_defaults(build)
    # the engine serves it; a translating model's name is the translation record's (its service)
    built[DUPLEX.key] = info if build.checkpoint is not None and not engine.translates else None
    names = served_names(lambda m: built.get(m.key))
    try:
        models = ServedModels.build(names, _aliases(config, demo, names), created=int(time.time()))
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    fields = {m.field: built.get(m.key) for m in MODALITIES if m.field is not None}
    fields["info"] = info  # every server's, the duplex model's service or not (/api/info)
    return Services(engine, defaults, codec_workers=config.codec_workers, webrtc_workers=config.webrtc_workers,
                    ready_min_free=config.ready_min_free, drain_timeout=config.drain_timeout, models=models, **fields)


def _demo_kind(config: "ServeConfig") -> str | None:
    """The demo kind served (no --model, no --tts-model), or None; refuses --demo beside a model."""
    demo = config.model is None and config.tts_model is None
    if config.demo is not None and not demo:
        raise ServeError("--demo picks the built-in demo model, which is served only without --model and "
                         "--tts-model: drop --demo, or those")
    kind = config.demo or DEMO_KINDS[0]
    if kind not in DEMO_KINDS:
        raise ServeError(f"--demo must be one of {', '.join(DEMO_KINDS)}, not {kind!r}")
    return kind if demo else None


def load_duplex(loaded: Build) -> Checkpoint | None:
    """--model, the demo's, or None on a TTS-only server (its duplex doors refuse sessions, saying why)."""
    config = loaded.config
    if config.model is None and loaded.demo is None:
        if config.defaults.persona or config.defaults.voice:
            raise ServeError("--persona / --voice are for the duplex model, and this server has none (--model)")
        return None
    source = str(ensure_demo_checkpoint(loaded.demo)) if loaded.demo else config.model
    if loaded.demo:
        log.warning(DEMO_NOTICE)
    log.info("loading %s on %s (%s, Mimi %s)", source, loaded.device, str(loaded.dtype).removeprefix("torch."),
             config.mimi_dtype)
    progress = LoadProgress()
    try:
        checkpoint = load_checkpoint(source, device=loaded.device, dtype=loaded.dtype, progress=progress,
                                     mimi_dtype=mimi_dtype(config))
    finally:
        progress.close()
    if checkpoint.model_type != "personaplex" and (config.defaults.persona or config.defaults.voice):
        kind = "Hibiki (translation)" if checkpoint.model_type == "hibiki" else "Moshi"
        raise ServeError(f"{source} is a {kind} checkpoint, which takes no persona or voice prompt; "
                         "drop --persona / --voice (they are for PersonaPlex checkpoints).")
    return checkpoint


def _build_engine(loaded: Build) -> Engine:
    """The engine around the duplex backend (NoDuplexBackend without one), with paired
    transcription when the STT model shares the duplex model's Mimi."""
    config, checkpoint, stt = loaded.config, loaded.checkpoint, loaded.stt
    if stt is not None and checkpoint is not None and (shared := share_equal_tensors(stt.mimi, checkpoint.mimi)):
        log.info("the STT model's Mimi shares %.0f MB of weights with the duplex model's", shared / 1e6)
    paired = stt is not None and checkpoint is not None and _shares_mimi(checkpoint, stt)
    if config.live_delegation.needs_transcript and not paired:
        raise ServeError(f"--live-delegation {config.live_delegation} matches the user's words, which need a paired "
                         "speech-to-text model (--stt-model, sharing the duplex model's Mimi); use every_turn or never")
    if checkpoint is None:
        return Engine(NoDuplexBackend(str(loaded.device)), _engine_config(config, loaded.device.type == "cuda"),
                      trace=_tick_trace(loaded))
    if stt is not None and not paired:
        log.warning("the STT model's Mimi differs from the duplex model's: /v1/audio/transcriptions works, "
                    "but sessions cannot be transcribed from the frame's codes (no paired transcription)")
    # Paired transcription (engine/stt_paired.py): after the frame (PAIRED_IN_FRAME False) or in it.
    transcription = PairedTranscription(stt, config.max_sessions, in_frame=PAIRED_IN_FRAME) if paired else None
    in_frame = transcription is not None and PAIRED_IN_FRAME
    kv_dtype = torch.float8_e4m3fn if config.kv_dtype == "fp8" else None
    kv = _kv_pool(config, checkpoint, kv_dtype)
    try:
        backend = ModelBackend(checkpoint, config.max_sessions, kv_dtype=kv_dtype,
                               kv_blocks=kv.total, kv_block_frames=kv.layout.block_frames,
                               paged_attention=config.kv.attention,
                               encode_codebooks=stt.lm_config.n_q if paired and not in_frame else None,
                               side_work=transcription.frame_work if in_frame else None)
    except OptionsError as exc:
        raise ServeError(f"parley serve --kv-attention: {exc}") from exc
    loaded.voices = backend.voice_names()
    engine = Engine(backend, _engine_config(config, loaded.device.type == "cuda"), kv=kv, trace=_tick_trace(loaded))
    if transcription is not None:
        engine.set_paired_transcription(transcription)
    return engine


def _engine_config(config: "ServeConfig", cuda: bool) -> EngineConfig:
    """The engine's settings that `parley serve` takes (the rest keep EngineConfig's defaults)."""
    depth = config.slack_queue_depth
    if depth is None:
        return EngineConfig()
    if depth > 1 and not cuda:  # off CUDA each item ends before the next: there is no queue to deepen
        raise ServeError(f"parley serve --slack-queue-depth {depth}: slack items queue on CUDA only; this server "
                         "runs on the CPU (leave it unset, or 1)")
    try:
        return EngineConfig(slack_queue_depth=depth)
    except OptionsError as exc:
        raise ServeError(f"parley serve --slack-queue-depth: {exc}") from exc


def _tick_trace(loaded: Build) -> TickTrace | None:
    """--tick-trace's timeline (engine/tick_trace.py), with device times on CUDA; None without the flag."""
    config = loaded.config
    if config.tick_trace is None:
        return None
    try:
        trace = TickTrace.open(config.tick_trace, config.tick_trace_ticks, cuda=loaded.device.type == "cuda")
    except OptionsError as exc:
        raise ServeError(f"parley serve --tick-trace: {exc}") from exc
    log.info("tick trace: at most %d ticks to %s", config.tick_trace_ticks, config.tick_trace)
    return trace


def _kv_pool(config: "ServeConfig", checkpoint: Checkpoint, kv_dtype: torch.dtype | None) -> KvBlockPool:
    """The engine's KV block pool (engine/kv_blocks.py) from the --kv-* flags: the allocator of the
    duplex model's paged KV ring, in the model's blocks (--kv-block-frames, or its default), sized
    by --kv-blocks / --kv-memory (default: every row a full window)."""
    settings = config.kv
    try:
        layout = kv_layout(checkpoint, kv_dtype, settings.block_frames, divides=settings.attention == "flashinfer")
        pool = KvBlockPool(layout, config.max_sessions, settings.budget(layout, config.max_sessions), settings.policy)
    except OptionsError as exc:
        raise ServeError(f"parley serve --kv-*: {exc}") from exc
    log.info("KV paged: %d blocks of %d frames (%.2f GiB), %s policy, %d sessions at full windows, read by %s",
             pool.total, layout.block_frames, pool.total * layout.block_bytes / 2**30, pool.policy,
             pool.total // layout.window_blocks, settings.attention)
    return pool


def _info_and_defaults(loaded: Build) -> tuple[ServerInfo, ServerDefaults]:
    config, checkpoint = loaded.config, loaded.checkpoint
    # what --mimi-dtype (auto: a probe per codec) made of each served codec
    codecs = {m.key: m.codec(loaded.loaded[m.key]) for m in MODALITIES
              if m.codec is not None and loaded.loaded.get(m.key) is not None}
    mimi_dtypes = {kind: str(mimi.dtype).removeprefix("torch.") for kind, mimi in codecs.items()}
    if checkpoint is None:
        info = ServerInfo(model=Path(str(config.tts_model)).name, notes=[NO_DUPLEX_REASON], mimi_dtypes=mimi_dtypes)
        options, prompts = config.defaults, False
    else:
        demo_name = DEMO_TRANSLATION_MODEL if checkpoint.model_type == "hibiki" else DEMO_DUPLEX_MODEL
        info = ServerInfo(model=demo_name if loaded.demo else Path(str(config.model)).name,
                          demo=loaded.demo is not None, voices=loaded.voices,
                          default_voice=config.defaults.voice, mimi_dtypes=mimi_dtypes)
        options = dataclasses.replace(config.defaults, sampling=default_sampling(checkpoint, config.sampling))
        prompts = checkpoint.model_type == "personaplex"
    defaults = ServerDefaults(options=options, model_name=info.model, api_key=config.api_key, prompts=prompts,
                              protect_metrics=config.protect_metrics, allowed_origins=config.allowed_origins,
                              limits=config.limits, live_delegation=config.live_delegation,
                              live_delegate=config.live_delegate, ice_servers=config.ice_servers)
    return info, defaults


def _aliases(config: "ServeConfig", demo: str | None, names: dict[str, str | None]) -> dict[str, tuple[str, ...]]:
    """--served-model-name's aliases, after the demo's own (those of the modalities it serves)."""
    aliases = {key: listed for key, listed in DEMO_ALIASES.items() if names.get(key)} if demo else {}
    for modality, names in config.served_model_names.items():
        aliases[modality] = aliases.get(modality, ()) + tuple(names)
    return aliases


# ---- each modality's `load` and `start` (server/modalities.py names them) ----

def load_speech(build: Build) -> SpeechService | None:
    """The TTS service, loaded before the engine so that its Mimi shares the duplex model's weights;
    the demo's answers to the demo's TTS name."""
    checkpoint = build.checkpoint
    speech = build_speech(build.config, build.demo is not None, build.device, build.dtype,
                          checkpoint.mimi if checkpoint is not None else None)
    if speech is not None and build.demo:
        speech = dataclasses.replace(speech, model=DEMO_TTS_MODEL)
    return speech


def start_speech(build: Build, engine: Engine) -> SpeechService | None:
    speech = build.loaded.get(SPEECH.key)
    if speech is not None:
        register_slack_source(engine, speech.pool)  # warm admissions carry the requests' conditions
    return speech


def build_speech(config: "ServeConfig", demo: bool, device: torch.device, dtype: torch.dtype,
                 duplex_mimi: Mimi | None = None) -> SpeechService | None:
    """The TTS pool and voices: --tts-model, or the demo TTS when no model at all was given.
    `duplex_mimi`: the duplex model's codec, whose equal weights the TTS Mimi then shares."""
    if config.tts_model is None and not demo:
        return None
    if config.tts_model is None:
        directory = ensure_demo_tts()
        return load_speech_service(directory, slots=config.tts_slots, voices=directory / "voices",
                                   voice_map=directory / DEMO_TTS_VOICE_MAP, device=str(device), dtype=dtype,
                                   share_mimi=duplex_mimi, mimi_dtype=mimi_dtype(config))
    log.info("loading TTS %s on %s", config.tts_model, device)
    return load_speech_service(config.tts_model, slots=config.tts_slots, voices=config.tts_voices,
                               voice_map=config.tts_voice_map, device=str(device), dtype=dtype,
                               share_mimi=duplex_mimi, mimi_dtype=mimi_dtype(config))


def load_stt(build: Build) -> SttCheckpoint | None:
    """--stt-model, or with a demo served the demo's tiny STT sharing its Mimi."""
    config, demo = build.config, build.demo
    if config.stt_model is None and demo is None:
        return None
    source = config.stt_model or str(ensure_demo_stt_checkpoint(demo))
    if config.stt_model is None:
        log.warning("demo server: %s", STT_NOTICE)
    log.info("loading speech-to-text %s (%d rows)", source, config.stt_slots)
    return load_stt_checkpoint(source, device=build.device, dtype=build.dtype, mimi_dtype=mimi_dtype(config))


def start_transcription(build: Build, engine: Engine) -> SttPool | None:
    """The standalone transcription rows, registered on the engine (paired rows: _build_engine)."""
    if build.stt is None:
        return None
    pool = SttPool(build.stt, build.config.stt_slots)
    register_slack_source(engine, pool)
    return pool


def _shares_mimi(checkpoint: Checkpoint, stt: SttCheckpoint) -> bool:
    """Paired transcription reads the duplex frame's codes: the two Mimis must be one (every
    weight equal) and the duplex one must hold the codebooks the STT reads. Called after
    share_equal_tensors, which pointed every equal STT weight at the duplex one: equal means
    the very same tensor, so nothing is compared twice."""
    ours, theirs = checkpoint.mimi.state_dict(keep_vars=True), stt.mimi.state_dict(keep_vars=True)
    if checkpoint.mimi.quantizer.levels < stt.lm_config.n_q:
        return False
    return all(ours.get(k) is v for k, v in theirs.items())


def build_images(config: "ServeConfig", engine: Engine, device: torch.device, dtype: torch.dtype,
                 demo: bool) -> ImageService | None:
    """Load the image pipeline, measure its items once (warm-up) and register its queue."""
    if config.image_model is None and not demo:
        return None
    if config.image_model is None:
        stepper = demo_image_stepper(device)
    else:
        from parley.models import ImagePipelineError, load_image_pipeline  # diffusers: only with an image model

        log.info("loading image model %s on %s", config.image_model, device)
        try:
            stepper = load_image_pipeline(config.image_model, device, dtype)
        except ImagePipelineError as exc:
            raise ServeError(f"--image-model: {exc}") from exc
    slack = engine.config.tick_seconds - engine.config.slack_guard_s
    queue = ImageQueue(stepper, max_slack_s=slack, capacity=config.image_queue,
                       stall_timeout_s=config.image_stall_timeout)
    measured = register_slack_source(engine, queue)
    log.info("image model %s (%s): default %dpx, latent stride %d; speed-ups: %s; warm-up: %s", stepper.name,
             stepper.family, stepper.default_size, stepper.latent_stride, ", ".join(stepper.speedups) or "none",
             ", ".join(f"{k[1]}{'x' + str(k[-1]) if k[1] == 'denoise' else ''} {v * 1e3:.1f} ms"
                       for k, v in measured.items()))
    return ImageService(queue, engine, stepper.name)


def start_translator(build: Build, engine: Engine) -> Translator | None:
    """The translation record's service: the served Hibiki, when the engine's duplex model
    translates; None otherwise (the duplex model stands in, translation/model.py)."""
    if not engine.translates:
        return None
    name = DEMO_TRANSLATION_MODEL if build.demo is not None else Path(str(build.config.model)).name
    return Translator(modality="translation", languages=HIBIKI_LANGUAGES, owed_frames=None, name=name)


def start_images(build: Build, engine: Engine) -> ImageService | None:
    return build_images(build.config, engine, build.device, build.dtype, build.demo is not None)
