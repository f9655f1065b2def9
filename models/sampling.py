"""Token sampling with per-row settings held in tensors, and no host sync.

    tokens = sample_tokens(logits[B, V], temperature[B] float, top_k[B] long, generator=None)

- temperature <= 0: greedy argmax for that row.
- top_k <= 0 or >= V: no top-k restriction for that row.
- Otherwise: keep the top_k largest logits, softmax(logits / temperature), and draw with the
  "exponential race": argmax(p / E) with E ~ Exp(1) i.i.d. is a sample from p. Unlike
  torch.multinomial it needs no device-to-host sync, so a CUDA graph can capture it; and since the
  settings are tensors, values written into them after capture are honoured on replay.
- Ties at the k-th largest logit may let a few more than k tokens through (all with that logit).

Per-row seeds (`seeds[B]` long, -1 = unseeded): a seeded row's noise is not drawn from the
shared generator but computed from a counter-based hash of (seed, counter, stream, token
index), with `counter` the row's step and `stream` which sampler of the step it is (text,
audio codebook k). So a seeded session samples the same tokens for the same input whatever
the other rows do, and it needs no RNG state: a captured CUDA graph replays it with the
current seed and step tensors. On CUDA a per-row kernel rewrites only the seeded rows (an
unseeded row costs one load and a branch); the default, unseeded path is otherwise unchanged.
"""

from __future__ import annotations

import torch

from . import kernels

UNSEEDED = -1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: the splitmix64 increment
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser constants


def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bit patterns (multiplication wraps like uint64)."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def _row_keys(seeds: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    return _mix(seeds * _signed(_GOLDEN) + _mix(counter * 131 + (stream + 1)))


def hashed_noise(seeds: torch.Tensor, counter: torch.Tensor, stream: int, vocab: int) -> torch.Tensor:
    """[R, vocab] Exp(1) noise for R seeded rows: the reference the CUDA kernel matches."""
    index = torch.arange(1, vocab + 1, dtype=torch.long, device=seeds.device)
    h = _mix(_row_keys(seeds.long(), counter.long(), stream)[:, None] + index[None] * _signed(_GOLDEN))
    uniform = (_shr(h, 40).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in float32, never 0 or 1
    return -torch.log(uniform)



def seed_noise_(noise: torch.Tensor, seeds: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    """Overwrite the rows of `noise` [B, V] whose seed is >= 0 with their hashed noise (in place)."""
    B, V = noise.shape
    jit = kernels.triton_kernels() if noise.is_cuda else None  # Triton: imported at the first CUDA draw
    if jit is not None:
        jit.seeded_noise_kernel[(B,)](noise, seeds, counter, V, noise.stride(0), stream, BLOCK=2048, num_warps=4)
    elif noise.is_cuda:  # no Triton: every row, selected on the device (no host sync: graph-safe)
        seeded = (seeds >= 0)[:, None]
        noise.copy_(torch.where(seeded, hashed_noise(seeds.clamp(min=0), counter, stream, V), noise))
    else:  # the CPU: hash only the seeded rows
        rows = (seeds >= 0).nonzero()[:, 0]
        if rows.numel():
            noise[rows] = hashed_noise(seeds[rows], counter[rows], stream, V)
    return noise


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  generator: torch.Generator | None = None, seeds: torch.Tensor | None = None,
                  counter: torch.Tensor | None = None, stream: int = 0) -> torch.Tensor:
    """`seeds` / `counter` ([B] long) / `stream`: per-row reproducible draws (module docstring)."""
    if kernels.available(logits) and logits.dim() == 2:
        # One fused kernel (k-th largest by bisection instead of a full sort); the noise is drawn
        # exactly as below, so the generator advances the same way.
        noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(
            1.0, generator=generator)
        if seeds is not None:
            seed_noise_(noise, seeds, counter, stream)
        return kernels.sample(logits.contiguous(), temperature, top_k, noise)
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)

    # Per-row top-k: each row's k-th largest value. On the CPU the largest k of any row is read to
    # the host and only that many values are sorted (a fraction of a full sort's time); on a device
    # that read would be a sync (and break graph capture), so the whole row is sorted there. Both
    # read the same value.
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    if logits.device.type == "cpu":
        largest = logits.topk(int(k.max()) if k.numel() else vocab, dim=-1).values
    else:
        largest = logits.sort(dim=-1, descending=True).values
    kth_largest = largest.gather(-1, (k - 1)[:, None])
    logits = logits.masked_fill(logits < kth_largest, float("-inf"))

    # Greedy rows get temperature 1 here (any positive value): their draw is discarded below.
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    if seeds is not None:
        seed_noise_(noise, seeds, counter, stream)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
