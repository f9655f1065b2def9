"""Every modality the server can serve, each one record: its flags, how it is built and warmed, its
doors, its served names, its metrics and its shutdown. One registry, MODALITIES, that everything
naming a modality loops over, so adding a modality is adding one record (and the room its doors
live in), never an edit in each of the places below:

- the CLI registers each record's flags, checks them and copies them into ServeConfig (cli.py);
- the services builder loads each model, builds the engine, then builds, warms and registers each
  service on it (server/services.py);
- the doors table is the records' doors and the server's own (server/doors.py); the app mounts the
  doors whose service was built (server/app.py), so the banner, --help and the 404 that names the
  flag of an unmounted door follow;
- `--served-model-name` and `GET /v1/models` take the record's key and served name
  (server/served_models.py);
- the app registers each service's metrics collector and closes each service at shutdown.

Rules it keeps:
- A record's `key` is the one spelling of its modality, everywhere: the `--served-model-name`
  key, `/v1/models`' `modality`, a door's `needs`, `/api/info`'s `mimi_dtypes`, the build's
  loaded models. Nothing else names a modality by a string of its own.
- A modality with a model of its own also declares where its values live, typed: each setting a
  ServeConfig field of the flag's name, its service a Services field (its doors read it typed).
  tests/test_modalities.py checks both against the records.
- A door needs one modality key (or "page", or nothing: always mounted). A door set served by
  another modality's service (Kyutai's doors on the STT or TTS pool) is a record whose doors need that key and which builds nothing of its own: no
  field, no served names of its own (`--served-model-name` takes only the keys of records with a
  service).
- Torch-free (the standard library and parley.engine's torch-free names): `parley --help` reads the
  records without torch (tests/test_lazy_imports.py). Code that needs torch is named by a "module:function" string,
  relative to parley.realtime, and imported only once serving (`resolve`), as pip's command table
  names its commands.
"""

from __future__ import annotations

import argparse
import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

from parley.engine import DEFAULT_STALL_TIMEOUT_S, KV_ATTENTION, KV_POLICIES, SamplingOptions

WS = "WS"  # a door's method when it is a WebSocket
PACKAGE = "parley.realtime"
DEFAULT_SAMPLING = SamplingOptions()


@dataclass(frozen=True)
class Door:
    path: str
    method: str  # WS, GET or POST
    what: str
    endpoint: str  # "module:function" under parley.realtime: the handler, imported when the app is built
    needs: str | None = None  # a modality key (or "page") whose service it serves; None: always mounted
    # A conversation's door: on a server whose duplex model translates (Hibiki) it is mounted but
    # refuses, naming the model and the doors that serve it (server/app.py), rather than misbehave.
    converses: bool = False


def resolve(ref: str) -> Callable:
    """A "module:name" reference (module relative to parley.realtime) as the object it names."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(f"{PACKAGE}.{module}"), name)


def _no_flags(parser: argparse.ArgumentParser) -> None:
    return None


def _no_error(args: argparse.Namespace) -> str | None:
    return None


@dataclass(frozen=True)
class Modality:
    """One modality. Hooks taking a built service get its Services field's value (never None)."""

    key: str  # its one spelling (module docstring)
    noun: str  # what it is, in messages: "text-to-speech model"
    uses: str  # where it serves, in messages: "/v1/audio/speech"
    loaded_by: str  # what loads it, for --help and the 404 of its unmounted doors
    doors: tuple[Door, ...] = ()
    # -- the CLI (torch-free) --
    add_flags: Callable[[argparse.ArgumentParser], None] = _no_flags
    flag_error: Callable[[argparse.Namespace], str | None] = _no_error  # a sentence naming the flag, or None
    settings: tuple[str, ...] = ()  # its flags' dests, each a ServeConfig field of the same name
    # -- building (server/services.py), "module:function" references --
    load: str | None = None  # (Build) -> its model, before the engine is built; None where it loads none
    start: str | None = None  # (Build, Engine) -> its service, warmed and registered on the engine
    # The Services field holding its service (typed: its doors read it); None: a door set with no
    # service of its own (its doors need another modality's), not in /v1/models.
    field: str | None = None
    # -- serving: each takes the built service --
    served_name: Callable[[Any], str] = lambda service: service.model  # its checkpoint's served name
    codec: Callable[[Any], Any] | None = None  # (its loaded model) -> its Mimi, for /api/info's mimi_dtypes
    collector: Callable[[Any], Any] | None = None  # a Prometheus collector of its own metrics
    close: Callable[[Any], None] | None = None  # at shutdown, after the engine stopped: end what it holds
    demo_aliases: tuple[str, ...] = ()  # the names the demo server answers to beside its own (services.py)

    @property
    def what(self) -> str:
        return f"{self.noun} ({self.uses})"

    @property
    def named(self) -> bool:
        """Whether it has served names (`--served-model-name`, /v1/models): it has a service of its own."""
        return self.field is not None


# ---- duplex: the Moshi-family model every conversation door serves (the engine's frame) ----

def add_duplex_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face repo id (e.g. kyutai/moshiko-pytorch-bf16, "
                        "nvidia/personaplex-7b-v1); omitted: the built-in demo model, which babbles")
    p.add_argument("--demo", choices=("personaplex", "moshi", "hibiki"), default=None,
                   help="which built-in demo model to serve when --model is omitted: personaplex (the default: "
                        "persona prompts and PersonaPlex's 18 voice names), moshi (no persona, one voice) or "
                        "hibiki (a tiny Hibiki-Zero: it translates, on /v1/realtime/translations and /api/chat); "
                        "refused together with --model or --tts-model")
    add_kv_flags(p)
    add_session_default_flags(p)


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    """The duplex model's KV cache: dtype, admission policy and the paged pool."""
    p.add_argument("--kv-dtype", choices=("fp8",), default=None,
                   help="store the temporal KV cache in float8 (e4m3, per-vector scales): half the memory, "
                        "so about twice the sessions per GPU; small drift in the logits (docs/benchmarks.md). "
                        "Default: the weight dtype")
    p.add_argument("--kv-policy", choices=KV_POLICIES, default="reserve",
                   help="admission by KV memory (docs/architecture.md): reserve admits a session only while the "
                        "KV pool can hold every admitted session's full window (never overcommits; beyond it HTTP "
                        "503 before the upgrade); shrink promises each session half a window and, when the pool "
                        "runs out, shortens the longest sessions' windows a block at a time (never below a "
                        "quarter)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="the KV pool's size in blocks (of --kv-block-frames frames of every layer's keys and "
                        "values); with --kv-memory, one of the two. Default: --max-sessions full windows. "
                        "The KV cache is paged (each session holds only the blocks it filled), so a budget "
                        "below that admits sessions by memory; --max-sessions is then a cap on rows")
    p.add_argument("--kv-memory", type=float, default=None,
                   help="the KV pool's size in GiB (turned into blocks; see --kv-blocks)")
    p.add_argument("--kv-block-frames", type=int, default=None,
                   help="frames (80 ms each) per KV block, 1 .. the model's window (Moshi: 3000); the "
                        "window's last block is partly used unless it divides it. Default: 64 (the whole "
                        "window if shorter), a whole number of the attention kernels' tiles")
    p.add_argument("--kv-attention", choices=KV_ATTENTION, default="parley",
                   help="what reads the paged KV cache in each step: parley (its Triton kernels, every KV dtype) "
                        "or flashinfer (FlashInfer's paged decode: bf16 KV on CUDA, flashinfer-python installed; "
                        "the default block is then the largest that divides the window, 60 for Moshi)")


def add_session_default_flags(p: argparse.ArgumentParser) -> None:
    """What a session gets when its client does not choose: persona, voice and sampling."""
    p.add_argument("--persona", default="",
                   help="default persona / system prompt (PersonaPlex); clients override it with "
                        "text_prompt (/api/chat) or instructions (/v1/realtime)")
    p.add_argument("--voice", default=None,
                   help="default voice prompt name, e.g. NATF2.pt (PersonaPlex); clients override it with "
                        "voice_prompt or voice")
    p.add_argument("--text-temperature", type=float, default=None,
                   help="default text sampling temperature, 0 for greedy (default: the checkpoint's "
                        f"lm_gen_config, else {DEFAULT_SAMPLING.text_temperature})")
    p.add_argument("--text-topk", type=int, default=None,
                   help=f"default text top-k (default: the checkpoint's, else {DEFAULT_SAMPLING.text_top_k})")
    p.add_argument("--audio-temperature", type=float, default=None,
                   help="default audio sampling temperature, 0 for greedy (default: the checkpoint's, "
                        f"else {DEFAULT_SAMPLING.audio_temperature})")
    p.add_argument("--audio-topk", type=int, default=None,
                   help=f"default audio top-k (default: the checkpoint's, else {DEFAULT_SAMPLING.audio_top_k})")


DUPLEX = Modality(
    "duplex", "speech-to-speech model", "/api/chat, /v1/realtime, /v1/live/sessions", "--model",
    doors=(
        Door("/api/chat", WS, "Moshi / PersonaPlex / Hibiki binary protocol", "chat.protocol:chat_endpoint"),
        Door("/v1/realtime", WS, "OpenAI Realtime API (a conversation, ?intent=transcription, or a sideband "
             "joining a WebRTC call: ?call_id=)", "realtime_api.endpoint:realtime_endpoint", converses=True),
        Door("/v1/live/sessions", WS, "OpenAI GPT-Live: full duplex, with client delegation",
             "live.session:live_endpoint", converses=True),
        Door("/v1/live/sessions/{session_id}/attach", WS, "GPT-Live sideband: a server joins a WebRTC call's "
             "session (its events out, control events in)", "live.attach:live_attach_endpoint", converses=True),
        Door("/v1/realtime/calls", "POST", "OpenAI Realtime over WebRTC: an SDP offer in, the answer out",
             "webrtc.doors:realtime_calls", converses=True),
        Door("/v1/live/sessions", "POST", "OpenAI GPT-Live over WebRTC: session and SDP offer in, id and answer out",
             "webrtc.doors:live_calls", converses=True),
        Door("/v1/realtime/calls/{call_id}/{action}", "POST", "a Realtime WebRTC call's hangup (accept, reject, "
             "refer: SIP only, refused)", "webrtc.doors:call_action", converses=True),
    ),
    add_flags=add_duplex_flags, settings=("model", "demo", "kv_dtype"),
    # The engine is built around it (services._build_engine); on a server without it the engine's
    # NoDuplexBackend refuses its doors' sessions, saying why, and it has no served name.
    # Its service is the server's info (the engine serves it; None on a server without it).
    load="server.services:load_duplex", field="info", codec=lambda checkpoint: checkpoint.mimi,
    # The names OpenAI's clients send by default (the SDK's examples, openai-agents, pipecat's and
    # LiveKit's GPT-Live services), so each of them talks to a fresh demo unchanged.
    demo_aliases=("parley", "gpt-realtime", "gpt-4o-realtime-preview", "gpt-realtime-2.1", "gpt-live-1"),
)


# ---- speech: text-to-speech on POST /v1/audio/speech (realtime/http/speech.py) ----

def add_speech_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tts-model", default=None,
                   help="DSM TTS checkpoint directory or Hugging Face repo id (e.g. kyutai/tts-1.6b-en_fr), "
                        "served on /v1/audio/speech beside --model, or alone without it; the demo (no --model, "
                        "no --tts-model) includes a tiny TTS")
    p.add_argument("--tts-slots", type=int, default=4, help="concurrent TTS requests; one more gets 429")
    p.add_argument("--tts-voices", default=None,
                   help="voice set for --tts-model: a directory or Hugging Face repo id (default kyutai/tts-voices)")
    p.add_argument("--tts-voice-map", default=None,
                   help="JSON file mapping voice aliases (e.g. OpenAI's alloy, ash, ...) to voice names")


def speech_flag_error(args: argparse.Namespace) -> str | None:
    if args.tts_slots < 1:
        return "--tts-slots must be at least 1"
    if args.tts_model is None and (args.tts_voices or args.tts_voice_map):
        return "--tts-voices and --tts-voice-map need --tts-model"
    return None


SPEECH = Modality(
    "tts", "text-to-speech model", "/v1/audio/speech", "--tts-model; the demo includes a tiny one",
    doors=(Door("/v1/audio/speech", "POST", "OpenAI speech: text to speech", "http.speech:speech_endpoint", "tts"),
           Door("/v1/audio/voices", "GET", "the text-to-speech voices", "http.speech:voices_endpoint", "tts")),
    add_flags=add_speech_flags, flag_error=speech_flag_error,
    settings=("tts_model", "tts_slots", "tts_voices", "tts_voice_map"),
    load="server.services:load_speech", start="server.services:start_speech", field="speech",
    codec=lambda speech: speech.pool.mimi,
    demo_aliases=("tts-1",),
)


# ---- transcription: speech-to-text rows (realtime/http/transcriptions.py, realtime_api/transcription.py) ----

def add_transcription_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stt-model", default=None,
                   help="Kyutai STT checkpoint directory or Hugging Face repo id (e.g. kyutai/stt-1b-en_fr) "
                        "for POST /v1/audio/transcriptions and /v1/realtime?intent=transcription (and, when its "
                        "Mimi equals --model's, transcripts in the frame); the demo server includes a tiny random one")
    p.add_argument("--stt-slots", type=int, default=16,
                   help="standalone transcription rows, shared by POST /v1/audio/transcriptions (more requests "
                        "wait in a queue of 64) and /v1/realtime?intent=transcription sessions (one row each; "
                        "refused when none is free)")


def transcription_flag_error(args: argparse.Namespace) -> str | None:
    return "--stt-slots must be at least 1" if args.stt_slots < 1 else None


TRANSCRIPTION = Modality(
    "stt", "speech-to-text model", "/v1/audio/transcriptions, /v1/realtime?intent=transcription, "
    "/v1/realtime's audio.input.transcription", "--stt-model; the demo includes a tiny one",
    doors=(Door("/v1/audio/transcriptions", "POST", "OpenAI transcription",
                "http.transcriptions:transcriptions_endpoint", "stt"),),
    add_flags=add_transcription_flags, flag_error=transcription_flag_error, settings=("stt_model", "stt_slots"),
    # Loaded before the engine: when its Mimi is the duplex model's, the engine transcribes in the frame.
    load="server.services:load_stt", start="server.services:start_transcription", field="stt_pool",
    served_name=lambda pool: pool.name, codec=lambda stt: stt.mimi,
    # openai-agents' and LiveKit's realtime sessions send gpt-4o-mini-transcribe, pipecat's
    # InputAudioTranscription() gpt-realtime-whisper, pipecat's and openai-agents' STT services
    # gpt-transcribe; whisper-1 and gpt-4o-transcribe are the names of OpenAI's guides.
    demo_aliases=("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "gpt-realtime-whisper",
                  "gpt-transcribe"),
)


# ---- images: /v1/images/generations in the voice ticks' slack (docs/images.md) ----

def add_image_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image-model", default=None,
                   help="diffusers text-to-image pipeline (directory or Hugging Face id; Stable Diffusion 1.x/2.x "
                        "or 3) served on /v1/images/generations in the voice ticks' slack. Omitted: the tiny "
                        "demo pipeline (noise) when --model is omitted too, else no image endpoint")
    p.add_argument("--image-queue", type=int, default=16,
                   help="images waiting or running at once; more are refused with 429 and Retry-After")
    p.add_argument("--image-stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S, metavar="SECONDS",
                   help="an image request that has had no work run for this long (the voice load leaves no "
                        "slack for its size, or it is queued behind others) fails with a message saying so; "
                        "a client not reading its stream does not count")


def image_flag_error(args: argparse.Namespace) -> str | None:
    if args.image_queue < 1:
        return "--image-queue must be at least 1"
    if not 0 < args.image_stall_timeout < math.inf:
        return f"--image-stall-timeout must be a number of seconds more than 0 (got {args.image_stall_timeout:g})"
    return None


IMAGES = Modality(
    "image", "image model", "/v1/images/generations", "--image-model; the demo includes a tiny one",
    doors=(Door("/v1/images/generations", "POST", "OpenAI images", "http.images:images_generations", "image"),),
    add_flags=add_image_flags, flag_error=image_flag_error,
    settings=("image_model", "image_queue", "image_stall_timeout"),
    start="server.services:start_images", field="images",
    collector=lambda images: images,  # parley_images_* (http/images.py ImageService.collect)
    close=lambda images: images.close(),  # the engine thread is gone: end what it will never finish
)


# ---- translation: /v1/realtime/translations (realtime/translation/) ----

# Its model is the engine's: --model (or --demo hibiki) loads a Hibiki checkpoint as the duplex
# model, and `start` makes it this record's service (translation/model.py's Translator, None when
# the duplex model does not translate). The door is always mounted: without Hibiki the duplex
# model stands in (translation/model.py `served_translator`), under the duplex model's names.
# With it, the model's name is this modality's (and the duplex record has none).
TRANSLATION = Modality(
    "translation", "speech-to-speech translation model", "/v1/realtime/translations, /api/chat",
    "--model with a Hibiki checkpoint, or --demo hibiki",
    doors=(Door("/v1/realtime/translations", WS, "OpenAI Realtime translation: speech in, translated speech and "
                "text out", "translation.endpoint:translation_endpoint"),),
    start="server.services:start_translator", field="translator", served_name=lambda translator: translator.name,
    demo_aliases=("gpt-realtime-translate",),  # the openai SDK's translation model
)


# ---- Kyutai moshi-server's doors (realtime/kyutai/), on the STT and TTS pools ----

# A door set with no service of its own: its streaming doors are served by the transcription and
# speech records' pools (mounted with them), its info doors always.
KYUTAI = Modality(
    "kyutai", "Kyutai moshi-server doors", "/api/asr-streaming, /api/tts_streaming", "--stt-model / --tts-model",
    doors=(
        Door("/api/asr-streaming", WS, "Kyutai moshi-server speech-to-text (msgpack; Unmute, LiveKit's Kyutai "
             "plugin)", "kyutai.asr:asr_endpoint", "stt"),
        Door("/api/tts_streaming", WS, "Kyutai moshi-server text-to-speech (msgpack; Unmute)",
             "kyutai.tts:tts_endpoint", "tts"),
        Door("/api/build_info", "GET", "Kyutai moshi-server's build info (Unmute's health check)",
             "kyutai.info:build_info"),
        Door("/api/modules_info", "GET", "Kyutai moshi-server's modules: used and total slots of each Kyutai door",
             "kyutai.info:modules_info"),
    ),
)


# In this order: the doors table, --help, GET /v1/models and the slack sources' warm-ups follow it.
MODALITIES: tuple[Modality, ...] = (DUPLEX, SPEECH, TRANSCRIPTION, IMAGES, TRANSLATION, KYUTAI)
BY_KEY = {modality.key: modality for modality in MODALITIES}
