"""Mimi, the streaming audio codec: 1920 samples <-> codes per row and frame, per-row state."""

from parley.models.mimi.codec import Mimi, MimiDecoderState, MimiEncoderState, MimiState, model_key

__all__ = ["Mimi", "MimiState", "MimiEncoderState", "MimiDecoderState", "model_key"]
