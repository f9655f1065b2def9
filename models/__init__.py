"""Parley's models: checkpoints and their loaders, the audio codec, tokenizers, the image
pipelines, and the tiny synthetic checkpoints the demo and the tests run on.

The network edge uses only the names exported here (tests/test_layering.py fails on any other);
the engine, below it, may use any module. The names load lazily (PEP 562), as parley.engine's
do: `from parley.models import SAMPLE_RATE` imports only the torch-free config module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the submodule that defines it
_EXPORTS = {
    "AudioFileError": "audio_io", "read_audio_bytes": "audio_io", "read_wav": "audio_io", "write_wav": "audio_io",
    "Checkpoint": "checkpoint", "CheckpointError": "checkpoint", "SttCheckpoint": "checkpoint",
    "load_checkpoint": "checkpoint", "load_stt_checkpoint": "checkpoint",
    "FRAME_RATE": "config", "FRAME_SAMPLES": "config", "SAMPLE_RATE": "config",
    "ImagePipelineError": "image_pipeline", "ImageStepper": "image_pipeline",
    "load_image_pipeline": "image_pipeline", "stepper_for": "image_pipeline",
    "Mimi": "mimi.codec",
    "TINY_TTS_VOICES": "synthetic", "write_tiny_checkpoint": "synthetic", "write_tiny_stt_checkpoint": "synthetic",
    "write_tiny_tts_checkpoint": "synthetic", "HIBIKI_KINDS": "synthetic", "write_tiny_hibiki_checkpoint": "synthetic",
    "share_equal_tensors": "tensor_sharing",
    "tiny_pipeline": "tiny_diffusion",
    "TextTokenizer": "tokenizer",
    "VoiceStore": "tts_checkpoint", "load_tts_checkpoint": "tts_checkpoint",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .audio_io import AudioFileError, read_audio_bytes, read_wav, write_wav
    from .checkpoint import Checkpoint, CheckpointError, SttCheckpoint, load_checkpoint, load_stt_checkpoint
    from .config import FRAME_RATE, FRAME_SAMPLES, SAMPLE_RATE
    from .image_pipeline import ImagePipelineError, ImageStepper, load_image_pipeline, stepper_for
    from .mimi.codec import Mimi
    from .synthetic import (HIBIKI_KINDS, TINY_TTS_VOICES, write_tiny_checkpoint, write_tiny_hibiki_checkpoint,
                            write_tiny_stt_checkpoint, write_tiny_tts_checkpoint)
    from .tensor_sharing import share_equal_tensors
    from .tiny_diffusion import tiny_pipeline
    from .tokenizer import TextTokenizer
    from .tts_checkpoint import VoiceStore, load_tts_checkpoint


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
