"""The built-in demo checkpoint, so `parley serve` works on a fresh machine with no weights.

It is Parley's tiny random checkpoint (`models.synthetic.write_tiny_checkpoint`), PersonaPlex
kind by default: PersonaPlex's 18 published voice names (NATF0-3, NATM0-3, VARF0-4, VARM0-4)
and a context long enough for an ordinary persona, so the page's persona box and voice list
and unmodified PersonaPlex clients (which always send a voice and a persona) work against it.
`parley serve --demo moshi` serves the Moshi kind instead (no persona, one voice), and
`parley serve --demo hibiki` a tiny Hibiki-Zero: it translates (the translation door and
/api/chat serve it; the conversation doors refuse, naming the model). A few
megabytes, generated on first use into `$PARLEY_CACHE/demo-<kind>` (default
`~/.cache/parley/demo-<kind>`) and reused afterwards. Its weights are random, so it babbles:
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
from typing import TYPE_CHECKING

import torch

from parley.models import (TINY_TTS_VOICES, write_tiny_checkpoint, write_tiny_hibiki_checkpoint, write_tiny_stt_checkpoint,
                           write_tiny_tts_checkpoint)

if TYPE_CHECKING:
    from parley.models import ImageStepper

# OpenAI's speech voices: the demo TTS answers to all 13 (through its voice map).
OPENAI_VOICE_NAMES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer",
                      "verse", "marin", "cedar")

log = logging.getLogger("parley.demo")

DONE_MARKER = ".parley-demo-complete"  # written last, so a half-written cache is never used


# `parley serve --demo KIND`; the first is the default.
DEMO_KINDS = ("personaplex", "moshi", "hibiki")
# PersonaPlex's published voice names (LiveKit's plugin defaults to NATF2): the demo ships all 18.
PERSONAPLEX_VOICES = (*(f"NAT{g}{i}" for g in "FM" for i in range(4)), *(f"VAR{g}{i}" for g in "FM" for i in range(5)))
# Frames of temporal context (80 ms each): the prompt (voice, silences and persona: about four
# frames a word with the tiny tokenizer) must fit, so ~200 words do with a minute of conversation
# beside them. At this width attention over it costs little beside Mimi: on 2 shared cores a
# 4-session tick measured within noise of the 40-frame context's (well inside 80 ms).
DEMO_CONTEXT = 1500
# The Hibiki demo's context: 20 s, so a demo translation of a few sentences does not slide.
DEMO_HIBIKI_CONTEXT = 250


def cache_root() -> Path:
    root = os.environ.get("PARLEY_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "parley"


def cache_dir(kind: str = DEMO_KINDS[0]) -> Path:
    """Where the `kind` demo is cached. Named for the kind (and renamed when its layout changes), so
    a cache written by an older Parley (`demo`: the Moshi kind, 40 frames) is never served."""
    if kind not in DEMO_KINDS:
        raise ValueError(f"the demo is one of {', '.join(DEMO_KINDS)}, not {kind!r}")
    return cache_root() / f"demo-{kind}"


STT_NOTICE = ("the demo's speech-to-text model is tiny and random: it transcribes nonsense. For real "
              "transcripts run `parley serve --stt-model kyutai/stt-1b-en_fr` (or a local STT checkpoint).")


def write_demo_checkpoint(directory: Path, kind: str = DEMO_KINDS[0]) -> Path:
    """The `kind` demo's files in `directory` (PersonaPlex: the 18 voices and DEMO_CONTEXT; hibiki:
    a Hibiki-Zero-shaped one)."""
    if kind == "moshi":
        return write_tiny_checkpoint(directory, kind="moshi")
    if kind == "hibiki":
        return write_tiny_hibiki_checkpoint(directory, kind="hibiki-zero", context=DEMO_HIBIKI_CONTEXT)
    return write_tiny_checkpoint(directory, kind="personaplex", voices=PERSONAPLEX_VOICES, context=DEMO_CONTEXT)


def ensure_demo_checkpoint(kind: str = DEMO_KINDS[0], directory: Path | None = None) -> Path:
    """Return the `kind` demo checkpoint directory, writing it first if it is not there yet."""
    target = directory or cache_dir(kind)
    return _ensure(target, lambda scratch: write_demo_checkpoint(scratch, kind),
                   f"no --model given: writing the tiny {kind} demo checkpoint to %s (once). It babbles: its "
                   "weights are random. For a real conversation run `parley serve --model <dir or HF repo id>`.")


def ensure_demo_stt_checkpoint(kind: str = DEMO_KINDS[0], directory: Path | None = None) -> Path:
    """The demo's tiny STT (random; it transcribes nonsense), sharing the `kind` demo model's Mimi
    so that duplex sessions can be transcribed from the same codes."""
    duplex = ensure_demo_checkpoint(kind)
    target = directory or duplex.with_name(f"{duplex.name}-stt")
    return _ensure(target, lambda scratch: write_tiny_stt_checkpoint(scratch, mimi_from=duplex),
                   "writing the tiny demo speech-to-text checkpoint to %s (once); " + STT_NOTICE)


# ---- the demo TTS: a tiny random DSM TTS whose voices answer to OpenAI's 13 names ----

DEMO_TTS_VOICE_MAP = "voice_map.json"


def demo_tts_dir() -> Path:
    return cache_root() / "demo-tts"


def ensure_demo_tts(directory: Path | None = None) -> Path:
    """The demo TTS checkpoint (voices in `voices/`, OpenAI names in voice_map.json)."""

    def write(scratch: Path) -> None:
        write_tiny_tts_checkpoint(scratch)
        names = {name: TINY_TTS_VOICES[i % len(TINY_TTS_VOICES)] for i, name in enumerate(OPENAI_VOICE_NAMES)}
        (scratch / DEMO_TTS_VOICE_MAP).write_text(json.dumps(names, indent=2))

    return _ensure(directory or demo_tts_dir(), write,
                   "writing the tiny demo TTS to %s (once). It mumbles: its weights are random.")


def _ensure(target: Path, write, message: str) -> Path:
    if (target / DONE_MARKER).is_file():
        return target
    log.warning(message, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target, then rename: two servers starting at once cannot see a half checkpoint.
    scratch = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        write(scratch)
        (scratch / DONE_MARKER).write_text("tiny random checkpoint written by parley serve\n")
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


# The demo's served names (its STT's is its directory's).
DEMO_DUPLEX_MODEL = "parley-demo"
DEMO_TRANSLATION_MODEL = "parley-demo-hibiki"  # --demo hibiki's
DEMO_TTS_MODEL = "parley-demo-tts"
DEMO_IMAGE_MODEL = "parley-demo-image"


def demo_image_stepper(device: str | torch.device = "cpu") -> "ImageStepper":
    """The demo server's image model: the tiny random SD-1.5-shaped pipeline, built in memory
    from configs (a fraction of a second, no files). Its images are noise. diffusers is imported
    here, not with this module: a server without an image model never loads it."""
    from parley.models import stepper_for, tiny_pipeline

    return stepper_for(tiny_pipeline("sd").to(device), DEMO_IMAGE_MODEL)
