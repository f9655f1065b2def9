"""The built-in demo checkpoint, so `parley serve` works on a fresh machine with no weights.

It is Parley's tiny random Moshi-layout checkpoint (`models.synthetic.write_tiny_checkpoint`):
a few megabytes, generated on first use into `$PARLEY_CACHE/demo` (default
`~/.cache/parley/demo`) and reused afterwards. Its weights are random, so it babbles:
it exercises every part of the server (protocols, codec, engine, metrics) but says nothing
meaningful. Real weights: `parley serve --model <checkpoint dir or Hugging Face repo id>`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from parley.models.synthetic import TINY_TTS_VOICES, write_tiny_checkpoint, write_tiny_tts_checkpoint

# OpenAI's speech voices: the demo TTS answers to all 13 (through its voice map).
OPENAI_VOICE_NAMES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer",
                      "verse", "marin", "cedar")

log = logging.getLogger("parley.demo")

DONE_MARKER = ".parley-demo-complete"  # written last, so a half-written cache is never used


def cache_dir() -> Path:
    root = os.environ.get("PARLEY_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "parley"
    return base / "demo"


def ensure_demo_checkpoint(directory: Path | None = None) -> Path:
    """Return the demo checkpoint directory, writing it first if it is not there yet."""
    target = directory or cache_dir()
    return _ensure_cached(target, lambda scratch: write_tiny_checkpoint(scratch, kind="moshi"),
                          "tiny random Moshi-layout checkpoint written by parley serve\n",
                          "no --model given: writing the tiny demo checkpoint to %s (once). It babbles: its "
                          "weights are random. For a real conversation run `parley serve --model <dir or HF repo id>`.")


# ---- the demo TTS: a tiny random DSM TTS whose voices answer to OpenAI's 13 names ----

DEMO_TTS_VOICE_MAP = "voice_map.json"


def demo_tts_dir() -> Path:
    return cache_dir().parent / "demo-tts"


def ensure_demo_tts(directory: Path | None = None) -> Path:
    """The demo TTS checkpoint (voices in `voices/`, OpenAI names in voice_map.json)."""

    def write(scratch: Path) -> None:
        write_tiny_tts_checkpoint(scratch)
        names = {name: TINY_TTS_VOICES[i % len(TINY_TTS_VOICES)] for i, name in enumerate(OPENAI_VOICE_NAMES)}
        (scratch / DEMO_TTS_VOICE_MAP).write_text(json.dumps(names, indent=2))

    return _ensure_cached(directory or demo_tts_dir(), write, "tiny random DSM TTS written by parley serve\n",
                          "writing the tiny demo TTS to %s (once). It mumbles: its weights are random.")


def _ensure_cached(target: Path, write: Callable[[Path], object], marker_text: str, notice: str) -> Path:
    """`target`, written by `write(scratch)` first if it is not complete yet."""
    if (target / DONE_MARKER).is_file():
        return target
    log.warning(notice, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target, then rename: two servers starting at once cannot see a half checkpoint.
    scratch = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        write(scratch)
        (scratch / DONE_MARKER).write_text(marker_text)
        if (target / DONE_MARKER).is_file():  # another process finished first: keep its copy
            shutil.rmtree(scratch, ignore_errors=True)
            return target
        if target.exists():
            shutil.rmtree(target)  # a half-written leftover (no marker)
        scratch.rename(target)
    except OSError:
        shutil.rmtree(scratch, ignore_errors=True)
        if not (target / DONE_MARKER).is_file():
            raise
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target
