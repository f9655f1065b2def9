"""`parley offline`: one WAV in, the agent's WAV (and its inner-monologue text) out."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from .help_format import HelpFormatter

log = logging.getLogger("parley.offline")


def add_offline(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "offline", help="run one WAV through the model and write the agent's reply",
        description="Feed a WAV file (any sample rate and channel count; resampled to 24 kHz mono) "
                    "through one full-duplex session, 80 ms at a time, and write the agent's audio "
                    "(aligned as a live listener hears it) and its inner-monologue text.",
        formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory or Hugging Face repo id")
    p.add_argument("--input-wav", required=True, type=Path, help="the user's audio")
    p.add_argument("--output-wav", required=True, type=Path, help="where to write the agent's audio (24 kHz)")
    p.add_argument("--output-text", type=Path, default=None,
                   help="where to write the text as JSON (transcript and timed pieces)")
    p.add_argument("--persona", default="", help="persona / system prompt (PersonaPlex only)")
    p.add_argument("--voice", default=None, help="voice prompt name, e.g. NATF2 (PersonaPlex only)")
    add_run_flags(p)
    p.set_defaults(handler=run_offline_command)


def device_arg(name: str) -> str:
    """argparse type for --device: a device this machine has (checked now, not after loading)."""
    from .serve import ServeError, resolve_device

    try:
        return str(resolve_device(name))
    except ServeError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--device ")) from None


def add_mimi_dtype_flag(p: argparse.ArgumentParser, whose: str) -> None:
    """--mimi-dtype: `parley serve` and the offline commands (realtime/server/services.py's MIMI_DTYPES maps it)."""
    p.add_argument("--mimi-dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                   help=f"dtype of the audio codec (Mimi) {whose}. auto (default): float16 on CUDA "
                        "when the loaded codec, run in float16 on a loud probe at load, stays finite and near "
                        "float32 (else float32, logged), float32 on the CPU. float16 makes the codec faster and "
                        "changes few of the semantic codes the model hears, about as many as float32 on a GPU "
                        "does; bfloat16 changes many more (docs/benchmarks.md, \"Mimi in float16\")")


def add_device_flags(p: argparse.ArgumentParser, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> None:
    """--device, --dtype, --mimi-dtype, --log-level: shared by the offline commands (offline, tts, transcribe)."""
    p.add_argument("--device", default="cpu", type=device_arg,
                   help="torch device: cpu, cuda, cuda:N or auto (CUDA when present, else CPU)")
    p.add_argument("--dtype", choices=dtypes, default=None,
                   help="weight dtype (default: bfloat16 on CUDA, float32 on CPU)")
    add_mimi_dtype_flag(p, "of the model loaded")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="logging verbosity")


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """--greedy and --seed, then the device flags: the offline commands that sample."""
    p.add_argument("--greedy", action="store_true", help="greedy decoding: the run is deterministic")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    add_device_flags(p)


def run_offline_command(args: argparse.Namespace) -> int:
    import torch  # the model stack loads here, not for --help

    from parley.engine import ModelBackend, OptionsError, SamplingOptions, SessionOptions, SessionRejected, run_offline
    from parley.models import AudioFileError, CheckpointError, read_wav, write_wav

    from .serve import MIMI_DTYPES, resolve_dtype

    try:
        options = SessionOptions(persona=args.persona, voice=args.voice,
                                 sampling=SamplingOptions.greedy() if args.greedy else None)
        pcm = read_wav(args.input_wav)
        started = time.perf_counter()
        backend = ModelBackend.load(args.model, 1, device=args.device, dtype=resolve_dtype(args.dtype, args.device),
                                    mimi_dtype=MIMI_DTYPES[args.mimi_dtype], cuda_graphs=False, seed=args.seed)
        log.info("loaded %s in %.1f s", args.model, time.perf_counter() - started)
        started = time.perf_counter()
        result = run_offline(backend, pcm, options)
    except (OptionsError, AudioFileError, CheckpointError, SessionRejected) as exc:
        print(f"parley offline: {exc}", file=sys.stderr)
        return 2
    seconds = pcm.numel() / 24_000
    log.info("ran %.1f s of audio in %.1f s", seconds, time.perf_counter() - started)
    write_wav(args.output_wav, torch.from_numpy(result.pcm))
    if args.output_text is not None:
        args.output_text.write_text(json.dumps(result.to_json(), ensure_ascii=False, indent=2))
    log.info("wrote %s%s; text: %r", args.output_wav,
             f" and {args.output_text}" if args.output_text else "", result.transcript[:200])
    return 0
