"""The `parley` command. Each subcommand is one `add_<name>(subparsers)` function that
registers its flags and sets `handler`; `main` only parses and dispatches.

    parley serve [--model DIR_OR_REPO] [--host H] [--port P] [--max-sessions N] ...
    parley offline --model DIR --input-wav IN --output-wav OUT [--output-text OUT.json] ...
    parley tts --model DIR --text TEXT --voice NAME --output OUT.wav [--voices DIR] ...
    parley transcribe --model STT_DIR_OR_REPO IN.wav [--format text|json]
    parley launch (--gpus 0-7 | --workers N --device cpu) [--port P] [--base-port B] -- [serve flags]
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Callable, Sequence

from parley.engine import OptionsError, SamplingOptions, SessionOptions

from .help_format import HelpFormatter
from .launch import add_launch
from .offline_cli import add_offline
from .transcribe_cli import add_transcribe
from .server import ServeConfig, serve
from .tts_cli import add_tts

LOG_LEVELS = ("debug", "info", "warning", "error")

DEFAULT_SAMPLING = SamplingOptions()


def add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="run the realtime server (/api/chat, /v1/realtime, /livez, /readyz, /load, /metrics)",
        description="Serve a Moshi-family model over WebSockets: the Moshi/PersonaPlex protocol on "
                    "/api/chat and the OpenAI Realtime API on /v1/realtime. With no --model, a tiny "
                    "demo model is generated on first run and served: it babbles.",
        formatter_class=HelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face repo id (e.g. kyutai/moshiko-pytorch-bf16, "
                        "nvidia/personaplex-7b-v1); omitted: the built-in demo model, which babbles")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 to accept connections from other machines")
    p.add_argument("--port", type=int, default=8998, help="TCP port to listen on")
    p.add_argument("--max-sessions", type=int, default=8,
                   help="concurrent conversations (engine slots); one more is refused (HTTP 503 at the upgrade)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weight dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--kv-dtype", choices=("fp8",), default=None,
                   help="store the temporal KV cache in float8 (e4m3, per-vector scales): half the memory, "
                        "so about twice the sessions per GPU; small drift in the logits (docs/benchmarks.md). "
                        "Default: the weight dtype")
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
    p.add_argument("--api-key", default=None,
                   help="if set, /v1/realtime requires 'Authorization: Bearer <key>' (or the browser "
                        "subprotocol openai-insecure-api-key.<key>)")
    p.add_argument("--codec-workers", type=int, default=None,
                   help="Ogg-Opus codec worker processes (sessions pinned to one each, off the server's GIL); "
                        "0: a thread pool in the server process (fine for a few sessions). Default: 0 up to 8 "
                        "sessions, else one process per 32 sessions (at most CPU cores - 1)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op CPU threads; more than 1 only pays off for CPU inference of large "
                        "models on a machine with cores to spare (OpenMP workers spin and starve the "
                        "network edge)")
    p.add_argument("--ready-min-free", type=int, default=1,
                   help="/readyz answers 503 when fewer slots than this are free (a balancer then sends "
                        "new sessions elsewhere); 0: ready even when full")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM or POST /admin/drain: refuse new sessions, let live ones run up to this "
                        "many seconds, then close them (1001) and exit; 0: close at once on SIGTERM")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging verbosity")
    # -- speech-to-text (transcription) --
    p.add_argument("--stt-model", default=None,
                   help="Kyutai STT checkpoint directory or Hugging Face repo id (e.g. kyutai/stt-1b-en_fr) "
                        "for POST /v1/audio/transcriptions; the demo server includes a tiny random one")
    p.add_argument("--stt-slots", type=int, default=16,
                   help="transcription rows (requests transcribed at once; more wait in a queue)")
    # ---- images (/v1/images/generations; docs/images.md) ----
    p.add_argument("--image-model", default=None,
                   help="diffusers text-to-image pipeline (directory or Hugging Face id; Stable Diffusion 1.x/2.x "
                        "or 3) served on /v1/images/generations in the voice ticks' slack. Omitted: the tiny "
                        "demo pipeline (noise) when --model is omitted too, else no image endpoint")
    p.add_argument("--image-queue", type=int, default=16,
                   help="images waiting or running at once; more are refused with 429 and Retry-After")
    # ---- TTS: POST /v1/audio/speech (realtime/speech_api.py) ----
    p.add_argument("--tts-model", default=None,
                   help="DSM TTS checkpoint directory or Hugging Face repo id (e.g. kyutai/tts-1.6b-en_fr), "
                        "served on /v1/audio/speech beside --model, or alone without it; the demo (no --model, "
                        "no --tts-model) includes a tiny TTS")
    p.add_argument("--tts-slots", type=int, default=4, help="concurrent TTS requests; one more gets 429")
    p.add_argument("--tts-voices", default=None,
                   help="voice set for --tts-model: a directory or Hugging Face repo id (default kyutai/tts-voices)")
    p.add_argument("--tts-voice-map", default=None,
                   help="JSON file mapping voice aliases (e.g. OpenAI's alloy, ash, ...) to voice names")
    p.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    given = {"text_temperature": args.text_temperature, "text_top_k": args.text_topk,
             "audio_temperature": args.audio_temperature, "audio_top_k": args.audio_topk}
    try:
        SamplingOptions(**{k: v for k, v in given.items() if v is not None})  # validate the flags now
        defaults = SessionOptions(persona=args.persona, voice=args.voice or None)
    except OptionsError as exc:
        print(f"parley serve: {exc}", file=sys.stderr)
        return 2
    if args.codec_workers is not None and args.codec_workers < 0:
        print("parley serve: --codec-workers must be 0 (threads) or more (processes)", file=sys.stderr)
        return 2
    if args.max_sessions < 1:
        print("parley serve: --max-sessions must be at least 1", file=sys.stderr)
        return 2
    if args.tts_slots < 1:
        print("parley serve: --tts-slots must be at least 1", file=sys.stderr)
        return 2
    if args.tts_model is None and (args.tts_voices or args.tts_voice_map):
        print("parley serve: --tts-voices and --tts-voice-map need --tts-model", file=sys.stderr)
        return 2
    if args.stt_slots < 1:
        print("parley serve: --stt-slots must be at least 1", file=sys.stderr)
        return 2
    if args.ready_min_free < 0 or args.drain_timeout < 0:
        print("parley serve: --ready-min-free and --drain-timeout must be 0 or more", file=sys.stderr)
        return 2
    if args.image_queue < 1:
        print("parley serve: --image-queue must be at least 1", file=sys.stderr)
        return 2
    config = ServeConfig(model=args.model, host=args.host, port=args.port, max_sessions=args.max_sessions,
                         device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype, defaults=defaults,
                         sampling={k: v for k, v in given.items() if v is not None}, api_key=args.api_key,
                         log_level=args.log_level, codec_workers=args.codec_workers,
                         torch_threads=args.torch_threads, stt_model=args.stt_model, stt_slots=args.stt_slots,
                         ready_min_free=args.ready_min_free, drain_timeout=args.drain_timeout,
                         image_model=args.image_model, image_queue=args.image_queue, tts_model=args.tts_model,
                         tts_slots=args.tts_slots, tts_voices=args.tts_voices, tts_voice_map=args.tts_voice_map)
    return serve(config)


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (add_serve, add_offline, add_transcribe,
                                                                         add_launch, add_tts)


def installed_version() -> str:
    """The version pip installed (package metadata), so it can never disagree with pyproject.toml."""
    try:
        return version("parley")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parley", description="Realtime full-duplex speech server for "
                                                                "Moshi-family models.")
    parser.add_argument("--version", action="version", version=f"parley {installed_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
