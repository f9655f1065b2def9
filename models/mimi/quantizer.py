"""Mimi's split residual vector quantizer: 1 semantic level + acoustic levels, inference only.

Layout and parameter names follow the reference `SplitResidualVectorQuantizer`:
`quantizer.rvq_first` (semantic) and `quantizer.rvq_rest` (acoustic) each project the
latent with a 1x1 conv (`input_proj`), quantize it residually over `vq.layers.{i}._codebook`,
and project back (`output_proj`). A codebook is stored as EMA statistics
(`embedding_sum`, `cluster_usage`); the centroids are their ratio.

Only the first `num_codebooks` levels are used (1 semantic + num_codebooks - 1 acoustic);
all `n_q` levels are kept so the full checkpoint loads strictly. The quantizer is stateless.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from parley.models import kernels
from parley.models.config import ConfigError, QuantizerConfig

# The reference EuclideanCodebook's default epsilon: centroid = embedding_sum / max(usage, eps).
CLUSTER_USAGE_EPSILON = 1e-5

# Older checkpoint buffer names the reference still accepts, mapped to the current ones.
LEGACY_CODEBOOK_KEYS = {
    "inited": "_initialized",
    "cluster_size": "cluster_usage",
    "embed_avg": "embedding_sum",
    "embed_sum": "embedding_sum",
}


class Codebook(nn.Module):
    """`bins` centroids of width `dim`, nearest by L2 distance."""

    def __init__(self, dim: int, bins: int):
        super().__init__()
        self.register_buffer("_initialized", torch.tensor([False], dtype=torch.float))
        self.register_buffer("cluster_usage", torch.ones(bins))
        self.register_buffer("embedding_sum", torch.zeros(bins, dim))
        # Centroids, derived from the two statistics above; refreshed on every load.
        self.register_buffer("_embedding", torch.zeros(bins, dim), persistent=False)
        self.register_buffer("_squared_norms", torch.zeros(bins), persistent=False)  # |c|^2
        if not self.cluster_usage.is_meta:  # on meta: nothing to compute (and clamp there imports torch._dynamo)
            self.refresh_embedding()

    @torch.no_grad()
    def refresh_embedding(self) -> None:
        """Recompute the centroids; call after editing `embedding_sum` / `cluster_usage` in place."""
        usage = self.cluster_usage.clamp(min=CLUSTER_USAGE_EPSILON)
        embedding = self.embedding_sum / usage[:, None]
        if self._embedding.is_meta:  # statistics assigned over a meta module (load_state_dict(assign=True))
            self._embedding = torch.empty_like(embedding)
            self._squared_norms = embedding.new_empty(embedding.shape[0])
        self._embedding.copy_(embedding)
        self._squared_norms.copy_(embedding.pow(2).sum(-1))

    @property
    def embedding(self) -> Tensor:
        return self._embedding

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        for old, new in LEGACY_CODEBOOK_KEYS.items():
            if prefix + old in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.refresh_embedding()

    def encode(self, x: Tensor) -> Tensor:
        """x [N, dim] -> index of the nearest centroid [N]."""
        # torch.cdist, as the reference computes it: with 2048 centroids it takes the
        # matmul path (|x|^2 - 2 x.c + |c|^2, clamped, sqrt), and matching that exact
        # rounding is what keeps near-ties resolving to the same code.
        if kernels.available(x):
            # CUDA: the same nearest centroid from |c|^2 - 2 x.c (|x|^2 and the sqrt change no
            # ranking) in one matmul, against cdist's ~8 kernels a level; near-ties may round
            # differently, as any CUDA fp32 path does.
            return torch.addmm(self._squared_norms, x, self.embedding.t(), alpha=-2).argmin(dim=-1)
        distances = torch.cdist(x[None], self.embedding[None], p=2)[0]
        return distances.argmin(dim=-1)

    def decode(self, codes: Tensor) -> Tensor:
        """codes [...] -> centroids [..., dim]."""
        return F.embedding(codes, self.embedding)


class _Level(nn.Module):
    """One residual level. It only exists so the checkpoint key reads `layers.{i}._codebook`."""

    def __init__(self, dim: int, bins: int):
        super().__init__()
        self._codebook = Codebook(dim, bins)


class _Levels(nn.Module):
    """Holds the levels under `vq.layers` (checkpoint layout)."""

    def __init__(self, dim: int, bins: int, n_levels: int):
        super().__init__()
        self.layers = nn.ModuleList([_Level(dim, bins) for _ in range(n_levels)])


class ResidualQuantizer(nn.Module):
    """Projection in (1x1 conv), residual quantization over `n_levels`, projection out."""

    def __init__(self, cfg: QuantizerConfig, n_levels: int):
        super().__init__()
        self.input_proj = nn.Conv1d(cfg.input_dimension, cfg.dimension, 1, bias=False)
        self.output_proj = nn.Conv1d(cfg.dimension, cfg.output_dimension, 1, bias=False)
        self.vq = _Levels(cfg.dimension, cfg.bins, n_levels)

    def codebook(self, level: int) -> Codebook:
        return self.vq.layers[level]._codebook

    def encode(self, x: Tensor, n_levels: int) -> Tensor:
        """x [B, input_dimension, T] -> codes [B, n_levels, T]."""
        residual = self.input_proj(x)
        batch, _, frames = residual.shape
        codes = []
        for level in range(n_levels):
            codebook = self.codebook(level)
            flat = residual.transpose(1, 2).reshape(batch * frames, -1)
            level_codes = codebook.encode(flat).view(batch, frames)
            residual = residual - codebook.decode(level_codes).transpose(1, 2)
            codes.append(level_codes)
        return torch.stack(codes, dim=1)

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, K, T] -> [B, output_dimension, T]: the projected sum of the K centroids."""
        quantized = self.codebook(0).decode(codes[:, 0]).transpose(1, 2)
        for level in range(1, codes.shape[1]):
            quantized = quantized + self.codebook(level).decode(codes[:, level]).transpose(1, 2)
        return self.output_proj(quantized)


class SplitResidualVectorQuantizer(nn.Module):
    """Semantic levels (`rvq_first`) and acoustic levels (`rvq_rest`) quantize the same latent
    independently; their decoded outputs add up."""

    def __init__(self, cfg: QuantizerConfig, num_codebooks: int):
        super().__init__()
        if cfg.n_q <= cfg.n_q_semantic:
            raise ConfigError(f"quantizer.n_q ({cfg.n_q}) must exceed n_q_semantic ({cfg.n_q_semantic})")
        if not cfg.n_q_semantic <= num_codebooks <= cfg.n_q:
            raise ConfigError(
                f"num_codebooks ({num_codebooks}) must be between n_q_semantic ({cfg.n_q_semantic}) "
                f"and quantizer.n_q ({cfg.n_q})")
        self.n_semantic = cfg.n_q_semantic
        self.n_acoustic = num_codebooks - cfg.n_q_semantic
        self.bins = cfg.bins
        self.rvq_first = ResidualQuantizer(cfg, cfg.n_q_semantic)
        self.rvq_rest = ResidualQuantizer(cfg, cfg.n_q - cfg.n_q_semantic)

    @property
    def num_codebooks(self) -> int:
        return self.n_semantic + self.n_acoustic

    @property
    def levels(self) -> int:
        """Codebooks the weights hold (encode can return up to this many)."""
        return self.n_semantic + len(self.rvq_rest.vq.layers)

    def encode(self, x: Tensor, num_codebooks: int | None = None) -> Tensor:
        """latent [B, input_dimension, T] -> codes [B, num_codebooks, T] (int64). `num_codebooks`
        (default: the configured count) may exceed it up to `levels`: residual quantization is
        sequential, so the first codebooks do not change when more are encoded."""
        n_acoustic = self.n_acoustic if num_codebooks is None else num_codebooks - self.n_semantic
        codes = self.rvq_first.encode(x, self.n_semantic)
        if n_acoustic:
            codes = torch.cat([codes, self.rvq_rest.encode(x, n_acoustic)], dim=1)
        return codes

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, num_codebooks, T] -> latent [B, output_dimension, T]."""
        quantized = self.rvq_first.decode(codes[:, :self.n_semantic])
        if self.n_acoustic:
            quantized = quantized + self.rvq_rest.decode(codes[:, self.n_semantic:])
        return quantized
