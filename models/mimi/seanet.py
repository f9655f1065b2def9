"""SEANet encoder / decoder (Mimi's convolutional front and back end), streaming with per-row state.

Layer order and indices follow the reference `moshi.modules.seanet`, so parameter names
(`encoder.model.{i}...`, `decoder.model.{i}...`) equal the checkpoint's. Only the inference
configuration Mimi ships is supported: causal, no weight norm (the published weights are
already folded), ELU activations.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from parley.models.config import ConfigError, SEANetConfig
from parley.models.mimi.conv import (
    StateList,
    StreamingConv1d,
    StreamingConvTranspose1d,
    StreamingModule,
    StreamingSequential,
)


def _check_supported(cfg: SEANetConfig) -> None:
    if not cfg.causal:
        raise ConfigError("seanet.causal must be True: only the causal (streaming) SEANet is supported")
    if cfg.norm != "none":
        raise ConfigError(f"seanet.norm must be 'none' (weights with folded weight norm), got {cfg.norm!r}")
    if cfg.activation != "ELU":
        raise ConfigError(f"seanet.activation must be 'ELU', got {cfg.activation!r}")


def _activation() -> nn.Module:
    return nn.ELU(alpha=1.0)


class ResnetBlock(StreamingModule):
    """x + block(x), block = ELU, conv(k=residual_kernel_size, dilation), ELU, conv(k=1);
    the hidden width is dim // compress."""

    def __init__(self, dim: int, cfg: SEANetConfig, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = StreamingSequential(
            _activation(),
            StreamingConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, pad_mode=cfg.pad_mode),
            _activation(),
            StreamingConv1d(hidden, dim, 1, pad_mode=cfg.pad_mode),
        )
        self.shortcut: nn.Module = (
            nn.Identity() if cfg.true_skip else StreamingConv1d(dim, dim, 1, pad_mode=cfg.pad_mode)
        )

    def init_state(self, batch_size: int, device: torch.device | str) -> StateList:
        shortcut = (self.shortcut.init_state(batch_size, device)
                    if isinstance(self.shortcut, StreamingConv1d) else None)
        return StateList([self.block.init_state(batch_size, device), shortcut])

    def step(self, x: Tensor, state: StateList, exec_mask: Tensor) -> Tensor:
        block_state, shortcut_state = state.states
        if isinstance(self.shortcut, StreamingConv1d):
            skip = self.shortcut.step(x, shortcut_state, exec_mask)
        else:
            skip = x
        return skip + self.block.step(x, block_state, exec_mask)


def _residual_blocks(dim: int, cfg: SEANetConfig) -> list[nn.Module]:
    return [ResnetBlock(dim, cfg, dilation=cfg.dilation_base ** j) for j in range(cfg.n_residual_layers)]


class SEANetEncoder(StreamingModule):
    """Waveform [B, channels, T] -> latent [B, dimension, T / hop], hop = prod(ratios)."""

    def __init__(self, cfg: SEANetConfig):
        super().__init__()
        _check_supported(cfg)
        self.dimension = cfg.dimension
        self.hop_length = math.prod(cfg.ratios)
        width = cfg.n_filters
        layers: list[nn.Module] = [StreamingConv1d(cfg.channels, width, cfg.kernel_size, pad_mode=cfg.pad_mode)]
        # The encoder downsamples in the reverse order of the decoder's upsampling ratios.
        for ratio in reversed(cfg.ratios):
            layers += _residual_blocks(width, cfg)
            layers += [
                _activation(),
                StreamingConv1d(width, width * 2, kernel_size=2 * ratio, stride=ratio, pad_mode=cfg.pad_mode),
            ]
            width *= 2
        layers += [_activation(), StreamingConv1d(width, cfg.dimension, cfg.last_kernel_size, pad_mode=cfg.pad_mode)]
        self.model = StreamingSequential(*layers)

    def init_state(self, batch_size: int, device: torch.device | str) -> StateList:
        return self.model.init_state(batch_size, device)

    def step(self, x: Tensor, state: StateList, exec_mask: Tensor) -> Tensor:
        return self.model.step(x, state, exec_mask)


class SEANetDecoder(StreamingModule):
    """Latent [B, dimension, T] -> waveform [B, channels, T * hop]."""

    def __init__(self, cfg: SEANetConfig):
        super().__init__()
        _check_supported(cfg)
        self.dimension = cfg.dimension
        self.hop_length = math.prod(cfg.ratios)
        width = cfg.n_filters * 2 ** len(cfg.ratios)
        layers: list[nn.Module] = [StreamingConv1d(cfg.dimension, width, cfg.kernel_size, pad_mode=cfg.pad_mode)]
        for ratio in cfg.ratios:
            layers += [
                _activation(),
                StreamingConvTranspose1d(width, width // 2, kernel_size=2 * ratio, stride=ratio),
            ]
            layers += _residual_blocks(width // 2, cfg)
            width //= 2
        layers += [_activation(), StreamingConv1d(cfg.n_filters, cfg.channels, cfg.last_kernel_size,
                                                  pad_mode=cfg.pad_mode)]
        self.model = StreamingSequential(*layers)

    def init_state(self, batch_size: int, device: torch.device | str) -> StateList:
        return self.model.init_state(batch_size, device)

    def step(self, x: Tensor, state: StateList, exec_mask: Tensor) -> Tensor:
        return self.model.step(x, state, exec_mask)
