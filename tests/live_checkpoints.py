"""A tiny checkpoint whose text stream pauses often, for the forced-text and GPT-Live tests.

Forced text starts at the model's next pause (a sampled PAD or EPAD). The tiny random LM
samples one about once in a hundred frames; scaling its PAD row of `text_linear` makes PAD win
on about a fifth of the frames, so commentary starts within a few frames.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file

from parley.models.config import LM_FILE, TEXT_PAD
from parley.models.synthetic import write_tiny_checkpoint

PAUSE_GAIN = 4.0


def write_pausing_checkpoint(directory: Path, kind: str = "moshi", gain: float = PAUSE_GAIN, **kwargs) -> Path:
    """`gain`: PersonaPlex behind a persona pauses less; 8 brings it to about a fifth of the frames."""
    directory = write_tiny_checkpoint(directory, kind=kind, **kwargs)
    weights = load_file(directory / LM_FILE)
    weights["text_linear.weight"][TEXT_PAD] *= gain
    save_file(weights, directory / LM_FILE, metadata={"format": "pt"})
    return directory
