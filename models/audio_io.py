"""Audio file I/O: any WAV/FLAC/OGG in, 24 kHz mono float32 out.

Everything Parley computes on runs at Mimi's rate (`SAMPLE_RATE`, 24 kHz) and in one channel;
this module is the only place that meets other rates and channel counts.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile
import soxr
import torch

from .config import SAMPLE_RATE


class AudioFileError(ValueError):
    """An audio file that cannot be read or written; the message names the file and why."""


def resample(pcm: torch.Tensor, from_sr: int, to_sr: int) -> torch.Tensor:
    """Resample a mono `[T]` (or `[C, T]`) float tensor with soxr's high-quality filter."""
    if from_sr <= 0 or to_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {from_sr} -> {to_sr}")
    if from_sr == to_sr:
        return pcm
    data = pcm.detach().to("cpu", torch.float32).numpy()
    # soxr wants [T] or [T, C]; Parley keeps channels first.
    out = soxr.resample(data.T, from_sr, to_sr, quality="HQ").T
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(pcm.device)


def read_wav(path: str | Path, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Read an audio file as a mono float32 tensor `[T]` at `sample_rate` (default 24 kHz).

    Channels are averaged; other rates are resampled with soxr HQ.
    """
    path = Path(path)
    if not path.is_file():
        raise AudioFileError(f"audio file {path} does not exist")
    return _read(str(path), f"audio file {path}", sample_rate)


def read_audio_bytes(data: bytes, name: str = "upload", sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """An uploaded WAV/FLAC/OGG file's bytes as mono float32 `[T]` at `sample_rate`."""
    return _read(io.BytesIO(data), f"audio file {name!r}", sample_rate)


def _read(source, what: str, sample_rate: int) -> torch.Tensor:
    try:
        data, file_sr = soundfile.read(source, dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError, TypeError, ValueError) as err:
        raise AudioFileError(f"{what} could not be read: {err}") from err
    if data.shape[0] == 0:
        raise AudioFileError(f"{what} holds no samples")
    mono = torch.from_numpy(np.ascontiguousarray(data.mean(axis=1), dtype=np.float32))
    return resample(mono, int(file_sr), sample_rate)


def write_wav(path: str | Path, pcm: torch.Tensor, sample_rate: int = SAMPLE_RATE) -> None:
    """Write a mono `[T]` (or `[C, T]`) float tensor in [-1, 1] as 16-bit PCM WAV."""
    path = Path(path)
    data = pcm.detach().to("cpu", torch.float32).numpy()
    if data.ndim == 2:
        data = data.T  # soundfile wants [T, C]
    elif data.ndim != 1:
        raise AudioFileError(f"cannot write {path}: expected [T] or [C, T] samples, got shape {tuple(pcm.shape)}")
    try:
        soundfile.write(str(path), np.clip(data, -1.0, 1.0), sample_rate, subtype="PCM_16")
    except (RuntimeError, soundfile.LibsndfileError, OSError) as err:
        raise AudioFileError(f"audio file {path} could not be written: {err}") from err
