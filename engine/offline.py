"""Offline duplex run: a whole WAV through one session's frames, no clock.

It drives the same `ModelBackend` frame the live engine ticks, for one row, so an offline
run computes exactly what a live session fed the same audio would hear. The output is
aligned as a live listener hears it: output frame i is what step i returned (silence
while the model is still inside its first `max_delay` frames), so it has the input's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from parley.models.config import FRAME_RATE, FRAME_SAMPLES

from .backend import ModelBackend, rows_mask
from .config import SessionOptions


@dataclass
class TextPiece:
    frame: int  # output frame index (80 ms each) at which the piece was produced
    time_s: float
    token: int
    text: str


@dataclass
class OfflineResult:
    pcm: np.ndarray  # [T] float32 at 24 kHz: the agent's audio, same length as the input
    pieces: list[TextPiece] = field(default_factory=list)

    @property
    def transcript(self) -> str:
        return "".join(piece.text for piece in self.pieces).strip()

    def to_json(self) -> dict:
        return {
            "transcript": self.transcript,
            "frame_rate_hz": FRAME_RATE,
            "pieces": [vars(piece) for piece in self.pieces],
        }


@torch.no_grad()
def run_offline(backend: ModelBackend, pcm: torch.Tensor, options: SessionOptions) -> OfflineResult:
    """Feed `pcm` (24 kHz mono float) through row 0 of `backend`, one 80 ms frame per step."""
    row_mask = rows_mask(backend.max_sessions, [0])
    backend.reset_rows(row_mask)
    if options.sampling is not None:
        backend.set_sampling(0, options.sampling)
    backend.prefill(0, options)

    n_frames = -(-pcm.numel() // FRAME_SAMPLES)  # ceil: the last frame is zero-padded
    padded = torch.zeros(n_frames * FRAME_SAMPLES)
    padded[:pcm.numel()] = pcm.float()
    frames = torch.zeros(backend.max_sessions, FRAME_SAMPLES)
    out = np.zeros(n_frames * FRAME_SAMPLES, dtype=np.float32)
    result = OfflineResult(pcm=out)
    for i in range(n_frames):
        frames[0] = padded[i * FRAME_SAMPLES:(i + 1) * FRAME_SAMPLES]
        host = backend.step(frames, row_mask).to_host()
        if not host.valid[0]:
            continue
        out[i * FRAME_SAMPLES:(i + 1) * FRAME_SAMPLES] = host.pcm[0]
        token = int(host.text_tokens[0])
        text = backend.text_piece(token)
        if text:
            result.pieces.append(TextPiece(frame=i, time_s=round(i / FRAME_RATE, 3), token=token, text=text))
    result.pcm = out[:pcm.numel()]
    return result
