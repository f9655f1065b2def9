"""The dtype a loaded Mimi computes in (`--mimi-dtype`, every loader's `mimi_dtype`).

    dtype = mimi_dtype_for(mimi, None)     # auto: float16 on CUDA when a float16 copy passes the probe
    mimi.compute_in(dtype)

Why float16 by default on CUDA: it runs the codec as fast as bf16, well ahead of float32
(benchmarks/mimi_steps.py), and against the reference's exact float32 (random weights, codebooks
fitted to the latents: `benchmarks/mimi_quality.py` measures both) it stays about as close as the
reference's own GPU run, where bf16 changes many times more codes. float16's risk is range (65504 at most), which random weights cannot speak for, so
auto runs the loaded weights themselves on a loud probe first: noise and a square wave at twice
full scale, a sine, silence. float16 is taken only when every latent and sample stays finite
and its codes and audio stay near float32's; otherwise the codec stays float32 and says why.
On the CPU (no float16 speed to gain) auto is float32, unprobed. An explicit dtype is honoured
as given.
"""

from __future__ import annotations

import copy
import logging
import math

import torch

from ..config import FRAME_SAMPLES
from .codec import Mimi

log = logging.getLogger("parley.models.mimi")

PROBE_FRAMES = 8  # 640 ms: past the encoder's and decoder's first frames, through their transformers
MIN_CODES_EQUAL = 0.9  # float16 moves a small fraction of codes (mimi_quality.py); an overflow moves most
MIN_DECODE_SNR_DB = 40.0  # well below float16's decode against float32 (mimi_quality.py); an overflow is inf or noise


def probe_signal(frames: int = PROBE_FRAMES) -> torch.Tensor:
    """[4, frames * 1920]: uniform noise and a 200 Hz square wave at twice full scale (the range
    a codec's first layers could meet, with room), a 440 Hz sine at full scale, silence."""
    t = torch.arange(frames * FRAME_SAMPLES) / 24_000
    g = torch.Generator().manual_seed(0)
    noise = 4 * torch.rand(t.numel(), generator=g) - 2
    square = 2 * torch.sign(torch.sin(2 * math.pi * 200 * t))
    return torch.stack([noise, square, torch.sin(2 * math.pi * 440 * t), torch.zeros_like(t)])


@torch.no_grad()
def _stream(mimi: Mimi, pcm: torch.Tensor, codes: torch.Tensor | None):
    """Streaming encode of pcm -> (latents [B, F, C], codes [B, K, F]), keeping the latents that
    `Mimi.encode` does not return (an overflow shows there first); `Mimi.decode` of `codes`
    (default its own) -> audio [B, F * 1920]."""
    rows = pcm.shape[0]
    state = mimi.init_state(rows, pcm.device)
    run = torch.ones(rows, dtype=torch.bool, device=pcm.device)
    latents, own = [], []
    for chunk in pcm.split(FRAME_SAMPLES, dim=-1):
        latent = mimi.encode_latent_step(chunk, state, run)
        latents.append(latent.float())
        own.append(mimi.quantize(latent))
    own = torch.stack(own, dim=-1)
    return torch.stack(latents, dim=1), own, mimi.decode(own if codes is None else codes)


def half_precision_problem(mimi: Mimi, frames: int = PROBE_FRAMES) -> str | None:
    """A float16 copy of `mimi` (float32) beside it on the probe: None when float16 stays finite
    and close, else what went wrong, in words."""
    pcm = probe_signal(frames).to(next(mimi.parameters()).device)
    _, codes, audio = _stream(mimi, pcm, None)
    half = copy.deepcopy(mimi).compute_in(torch.float16)
    latents16, codes16, audio16 = _stream(half, pcm, codes)
    del half
    if not torch.isfinite(latents16).all():
        return "float16 overflowed in the encoder on a loud probe"
    if not torch.isfinite(audio16).all():
        return "float16 overflowed in the decoder on a loud probe"
    equal = (codes16 == codes).float().mean().item()
    noise = (audio16.double() - audio.double()).pow(2).sum().item()
    snr = math.inf if noise == 0 else 10 * math.log10(audio.double().pow(2).sum().item() / noise)
    if equal < MIN_CODES_EQUAL:
        return f"float16 changed {1 - equal:.0%} of a loud probe's codes (at most {1 - MIN_CODES_EQUAL:.0%})"
    if snr < MIN_DECODE_SNR_DB:
        return f"float16 decoded a loud probe {snr:.0f} dB from float32 (at least {MIN_DECODE_SNR_DB:.0f} dB)"
    return None


def mimi_dtype_for(mimi: Mimi, requested: torch.dtype | None) -> torch.dtype:
    """`requested`, or for None (auto) float16 on CUDA when `half_precision_problem` finds none,
    else float32 (logged either way)."""
    if requested is not None:
        return requested
    if next(mimi.parameters()).device.type != "cuda":
        log.info("Mimi computes in float32 (--mimi-dtype auto on the CPU)")
        return torch.float32
    problem = half_precision_problem(mimi)
    if problem is not None:
        log.warning("Mimi stays float32 (--mimi-dtype auto): %s", problem)
        return torch.float32
    log.info("Mimi computes in float16 (--mimi-dtype auto): a float16 copy matched float32 on a loud probe")
    return torch.float16
