"""Token sampling with per-row settings held in tensors, and no host sync.

    tokens = sample_tokens(logits[B, V], temperature[B] float, top_k[B] long, generator=None)

- temperature <= 0: greedy argmax for that row.
- top_k <= 0 or >= V: no top-k restriction for that row.
- Otherwise: keep the top_k largest logits, softmax(logits / temperature), and draw with the
  "exponential race": argmax(p / E) with E ~ Exp(1) i.i.d. is a sample from p. Unlike
  torch.multinomial it needs no device-to-host sync, so a CUDA graph can capture it; and since the
  settings are tensors, values written into them after capture are honoured on replay.
- Ties at the k-th largest logit may let a few more than k tokens through (all with that logit).
"""

from __future__ import annotations

import torch

from . import kernels

def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    if kernels.available(logits) and logits.dim() == 2:
        # One fused kernel (k-th largest by bisection instead of a full sort); the noise is drawn
        # exactly as below, so the generator advances the same way.
        noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(
            1.0, generator=generator)
        return kernels.sample(logits.contiguous(), temperature, top_k, noise)
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)

    # Per-row top-k without a host-side k: sort once, read each row's k-th largest value.
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    kth_largest = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    logits = logits.masked_fill(logits < kth_largest, float("-inf"))

    # Greedy rows get temperature 1 here (any positive value): their draw is discarded below.
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
