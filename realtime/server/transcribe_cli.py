"""`parley transcribe`: one audio file through a Kyutai STT model, the transcript out."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from .help_format import HelpFormatter
from .offline_cli import add_device_flags


def add_transcribe(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "transcribe", help="transcribe an audio file with a Kyutai STT model",
        description="Run an audio file (WAV/FLAC/OGG, any rate; mixed to 24 kHz mono) through a Kyutai "
                    "speech-to-text checkpoint and print the transcript (or JSON with word timestamps).",
        formatter_class=HelpFormatter)
    p.add_argument("input", type=Path, help="the audio file")
    p.add_argument("--model", required=True, help="STT checkpoint directory or Hugging Face repo id "
                                                  "(e.g. kyutai/stt-1b-en_fr)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: the transcript; json: {text, duration, words: [{word, start, end}]}")
    add_device_flags(p, ("float32", "bfloat16", "float16"))
    p.set_defaults(handler=run_transcribe)


def run_transcribe(args: argparse.Namespace) -> int:
    import torch  # the model stack loads here, not for --help

    from parley.engine import SttFailed, SttPool, collect_transcript
    from parley.models import AudioFileError, CheckpointError, load_stt_checkpoint, read_wav

    from .serve import MIMI_DTYPES, resolve_dtype

    try:
        pcm = read_wav(args.input).numpy()
        checkpoint = load_stt_checkpoint(args.model, args.device, resolve_dtype(args.dtype, args.device),
                                         MIMI_DTYPES[args.mimi_dtype])
    except (AudioFileError, CheckpointError) as exc:
        print(f"parley transcribe: {exc}", file=sys.stderr)
        return 2

    async def transcribe() -> tuple[str, list]:
        pool = SttPool(checkpoint, slots=1)
        request = pool.submit()
        request.feed(pcm)
        request.end_input()
        with torch.inference_mode():
            pool.run_until_idle()  # manual mode: no engine, steps back to back
        return await collect_transcript(request)

    try:
        text, words = asyncio.run(transcribe())
    except SttFailed as exc:
        print(f"parley transcribe: {exc}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps({"text": text, "duration": pcm.size / 24_000,
                          "words": [{"word": w.text, "start": w.start, "end": w.end} for w in words]}))
    else:
        print(text)
    return 0
