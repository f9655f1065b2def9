"""`parley tts`: text in, a WAV (and optionally its word timings) out, offline."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from .help_format import HelpFormatter
from .offline_cli import add_run_flags
from ..http.speech_options import DEFAULT_VOICES, SPEED_MAX, SPEED_MIN

log = logging.getLogger("parley.tts")


def add_tts(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tts", help="synthesise text to a WAV with a DSM TTS model (offline)",
        description="Speak --text with a Kyutai DSM TTS checkpoint (e.g. kyutai/tts-1.6b-en_fr) in --voice "
                    "and write a 24 kHz WAV. <break time=\"1s\"/> inserts a pause.",
        formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="TTS checkpoint directory or Hugging Face repo id")
    p.add_argument("--text", required=True, help="what to say (at most 4096 characters)")
    p.add_argument("--voice", required=True, help="a voice name from --voices (or an alias from --voice-map)")
    p.add_argument("--output", required=True, type=Path, help="where to write the WAV (24 kHz mono)")
    p.add_argument("--voices", default=None,
                   help=f"voice set directory or Hugging Face repo id (default {DEFAULT_VOICES})")
    p.add_argument("--voice-map", default=None, help="JSON file mapping aliases to voice names")
    p.add_argument("--speed", type=float, default=1.0, help=f"speaking rate, {SPEED_MIN} to {SPEED_MAX}")
    p.add_argument("--words-json", type=Path, default=None, help="where to write the word timings as JSON")
    add_run_flags(p)
    p.set_defaults(handler=run_tts_command)


def run_tts_command(args: argparse.Namespace) -> int:
    import torch  # the model stack loads here, not for --help

    from parley.engine import CostModel, synthesize
    from parley.models import CheckpointError, write_wav

    from .serve import MIMI_DTYPES, resolve_dtype
    from .speech_setup import load_speech_service

    if args.seed is not None:
        torch.manual_seed(args.seed)
    try:
        started = time.perf_counter()
        service = load_speech_service(args.model, slots=1, voices=args.voices, voice_map=args.voice_map,
                                      device=args.device, dtype=resolve_dtype(args.dtype, args.device),
                                      mimi_dtype=MIMI_DTYPES[args.mimi_dtype],
                                      read_voices=False)  # one voice is used: not the whole set
        service.pool.warm_up(CostModel())  # graphs captured before the first step (no engine: its own costs)
        log.info("loaded %s in %.1f s", args.model, time.perf_counter() - started)
        service.front_end.check_voice(args.voice)  # UnknownVoice names the known ones
        if not SPEED_MIN <= args.speed <= SPEED_MAX:
            raise ValueError(f"--speed {args.speed} is outside {SPEED_MIN} to {SPEED_MAX}")
        # the server's text front end: the same words, voice, conditions and speed mapping
        request, _ = service.front_end.request(args.text, args.voice, args.speed)
        if args.greedy:
            request = dataclasses.replace(request, text_temperature=0.0, audio_temperature=0.0)
    except (CheckpointError, ValueError) as exc:  # ValueError: SpeechInputError among them
        print(f"parley tts: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = synthesize(service.pool, request)
    if result.terminal is None or result.terminal.status.value != "completed":
        print(f"parley tts: synthesis failed: {result.terminal}", file=sys.stderr)
        return 1
    seconds = result.pcm.size / 24_000
    log.info("spoke %.2f s of audio in %.2f s", seconds, time.perf_counter() - started)
    write_wav(args.output, torch.from_numpy(result.pcm))
    if args.words_json is not None:
        args.words_json.write_text(json.dumps([w.__dict__ for w in result.words], ensure_ascii=False, indent=2))
    return 0
