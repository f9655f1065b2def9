"""Streaming causal convolutions with per-row state, and the state primitives Mimi shares.

Every streaming module here follows one protocol (`StreamingModule`):
`init_state(batch_size, device)` allocates its buffers once, and
`step(x, state, exec_mask)` computes on all rows but commits new state only where
`exec_mask` is True. Buffers are updated in place with `copy_` / `masked_fill_`, so shapes
and addresses stay fixed for CUDA graphs, and nothing is read back to the host.

The math (window layout, initial padding, bias handling of the transposed conv) mirrors
the reference `moshi.modules.conv` streaming path op for op, so results are bit-identical.
Parameter names follow the reference checkpoint: `<conv>.conv.conv.weight` and
`<convtr>.convtr.convtr.weight`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from parley.models import kernels


# --------------------------------------------------------------------------- state primitives

def rows(mask: Tensor, like: Tensor, batch_dim: int = 0) -> Tensor:
    """View a [B] mask so that it broadcasts over `like`, whose batch rows are `batch_dim`."""
    shape = [1] * like.dim()
    shape[batch_dim] = -1
    return mask.view(shape)


def commit_rows_(buffer: Tensor, new: Tensor, exec_mask: Tensor, batch_dim: int = 0) -> None:
    """buffer[row] = new[row] for executed rows; other rows are left as they were. `new` must not
    overlap `buffer` (one kernel: `where` writes its result over its own input)."""
    torch.where(rows(exec_mask, buffer, batch_dim), new, buffer, out=buffer)


def fill_rows_(buffer: Tensor, mask: Tensor, value: Any, batch_dim: int = 0) -> None:
    """buffer[row] = value for the masked rows (the fresh value on reset)."""
    buffer.masked_fill_(rows(mask, buffer, batch_dim), value)


class RowState(abc.ABC):
    """Per-row streaming buffers of one module."""

    @abc.abstractmethod
    def reset(self, mask: Tensor) -> None:
        """Return the masked rows to the fresh state; other rows are untouched."""


class StateList(RowState):
    """The states of a container's children, in order (None for stateless children)."""

    def __init__(self, states: Sequence[RowState | None]):
        self.states = list(states)

    def __getitem__(self, index: int) -> RowState | None:
        return self.states[index]

    def __len__(self) -> int:
        return len(self.states)

    def reset(self, mask: Tensor) -> None:
        for state in self.states:
            if state is not None:
                state.reset(mask)


class StreamingModule(nn.Module, abc.ABC):
    """A module that runs one chunk at a time with explicit per-row state."""

    @abc.abstractmethod
    def init_state(self, batch_size: int, device: torch.device | str) -> RowState:
        ...

    @abc.abstractmethod
    def step(self, x: Tensor, state: Any, exec_mask: Tensor) -> Tensor:
        ...


class StreamingSequential(nn.Sequential):
    """nn.Sequential whose streaming children each get their own state (keys stay `model.{i}`)."""

    def init_state(self, batch_size: int, device: torch.device | str) -> StateList:
        return StateList([
            layer.init_state(batch_size, device) if isinstance(layer, StreamingModule) else None
            for layer in self
        ])

    def step(self, x: Tensor, state: StateList, exec_mask: Tensor) -> Tensor:
        for layer, layer_state in zip(self, state.states):
            if isinstance(layer, StreamingModule):
                x = layer.step(x, layer_state, exec_mask)
            else:
                x = layer(x)
        return x


# --------------------------------------------------------------------------- conv1d

class _Holder(nn.Module):
    """One level of nesting where the reference's NormConv1d/NormConvTranspose1d sat, so the
    checkpoint keys read `conv.conv.weight` / `convtr.convtr.weight`."""

    def __init__(self, name: str, module: nn.Module):
        super().__init__()
        self.add_module(name, module)


@dataclass
class ConvState(RowState):
    previous: Tensor  # [B, C_in, K_eff - stride]: input tail the next window overlaps
    first: Tensor  # [B] bool: no chunk executed yet (replicate padding still to apply)

    def reset(self, mask: Tensor) -> None:
        fill_rows_(self.previous, mask, 0.0)
        fill_rows_(self.first, mask, True)


class StreamingConv1d(StreamingModule):
    """Causal Conv1d. The left context is carried in `previous`, which starts as zeros
    ('constant') or as copies of the row's first sample ('replicate'), i.e. the causal
    left padding of the reference."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 dilation: int = 1, groups: int = 1, bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        if pad_mode not in ("constant", "replicate"):
            raise ValueError(f"pad_mode must be 'constant' or 'replicate', got {pad_mode!r}")
        self.pad_mode = pad_mode
        self.conv = _Holder("conv", nn.Conv1d(in_channels, out_channels, kernel_size, stride,
                                              dilation=dilation, groups=groups, bias=bias))
        self.stride = stride
        effective_kernel = (kernel_size - 1) * dilation + 1
        # A window of K_eff samples advances by `stride`; K_eff - stride samples are shared
        # with the next chunk and kept as state.
        self.context = effective_kernel - stride

    @property
    def torch_conv(self) -> nn.Conv1d:
        return self.conv.conv

    def init_state(self, batch_size: int, device: torch.device | str) -> ConvState:
        weight = self.torch_conv.weight
        previous = torch.zeros(batch_size, self.torch_conv.in_channels, self.context,
                               device=device, dtype=weight.dtype)
        first = torch.ones(batch_size, device=device, dtype=torch.bool)
        return ConvState(previous, first)

    def step(self, x: Tensor, state: ConvState, exec_mask: Tensor) -> Tensor:
        length = x.shape[-1]
        if length == 0 or length % self.stride:
            raise ValueError(f"chunk length {length} must be a positive multiple of stride {self.stride}")
        if not self.context:
            return self.torch_conv(x)
        previous = state.previous
        if self.pad_mode == "replicate":
            # Before a row's first chunk its left context is its first sample repeated.
            previous = torch.where(rows(state.first, previous), x[..., :1], previous)
        window = torch.cat([previous, x], dim=-1)
        y = self.torch_conv(window)
        commit_rows_(state.previous, window[..., -self.context:], exec_mask)
        if self.pad_mode == "replicate":
            commit_rows_(state.first, torch.zeros_like(state.first), exec_mask)
        return y


# --------------------------------------------------------------------------- conv-transpose1d

@dataclass
class ConvTrState(RowState):
    partial: Tensor  # [B, C_out, K - stride]: overlap-add tail owed to the next chunk, bias-free

    def reset(self, mask: Tensor) -> None:
        fill_rows_(self.partial, mask, 0.0)


class StreamingConvTranspose1d(StreamingModule):
    """Causal ConvTranspose1d: a chunk of T inputs yields exactly T * stride outputs; the
    K - stride trailing outputs are incomplete and are added to the next chunk's head."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 groups: int = 1, bias: bool = True):
        super().__init__()
        self.convtr = _Holder("convtr", nn.ConvTranspose1d(in_channels, out_channels, kernel_size,
                                                           stride, groups=groups, bias=bias))
        self.overlap = kernel_size - stride

    @property
    def torch_convtr(self) -> nn.ConvTranspose1d:
        return self.convtr.convtr

    def init_state(self, batch_size: int, device: torch.device | str) -> ConvTrState:
        weight = self.torch_convtr.weight
        partial = torch.zeros(batch_size, self.torch_convtr.out_channels, self.overlap,
                              device=device, dtype=weight.dtype)
        return ConvTrState(partial)

    def step(self, x: Tensor, state: ConvTrState, exec_mask: Tensor) -> Tensor:
        conv = self.torch_convtr
        if kernels.available(x) and conv.groups == 1 and conv.kernel_size[0] == 2 * conv.stride[0]:
            y = _convtr_matmul(x, conv.weight, conv.bias, conv.stride[0])
        else:
            y = conv(x)
        overlap = self.overlap
        if not overlap:
            return y
        y[..., :overlap] += state.partial
        tail = y[..., -overlap:]
        bias = self.torch_convtr.bias
        if bias is not None:
            # The bias is added once per output sample: the next chunk adds it again.
            tail = tail - bias[:, None]
        commit_rows_(state.partial, tail, exec_mask)
        # A strided view, not a copy, like the reference: the memory layout decides how
        # elementwise kernels (ELU's expm1) split into vector and scalar loops, hence their
        # last-bit rounding, so matching it keeps decoding bit-identical.
        return y[..., :-overlap]


def _convtr_matmul(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int) -> Tensor:
    """ConvTranspose1d with kernel 2 * stride as one matmul plus an overlap-add (CUDA only).

    cuDNN picks a slow non-tensor-core dgrad kernel for one of SEANet's decoder upsamplers at
    large batches (benchmarks/mimi_steps.py times the decode); this is the same sum in fp32 (rounding may differ in the last bits).
    """
    B, c_in, T = x.shape
    c_out = weight.shape[1]
    y = torch.matmul(x.transpose(1, 2), weight.reshape(c_in, -1)).view(B, T, c_out, 2, stride)
    # Input step t writes outputs t * stride + [0, 2 * stride): its first half and step t - 1's second.
    z = nn.functional.pad(y[:, :, :, 0], (0, 0, 0, 0, 0, 1)) + nn.functional.pad(y[:, :, :, 1], (0, 0, 0, 0, 1, 0))
    z = z.permute(0, 2, 1, 3).reshape(B, c_out, (T + 1) * stride)
    return z + bias[:, None] if bias is not None else z


# --------------------------------------------------------------------------- Mimi's 25 <-> 12.5 Hz resampling

class ConvDownsample1d(StreamingModule):
    """Learnt causal downsampling by `stride` (kernel 2 * stride, no bias, replicate padding):
    the reference's ConvDownsample1d(learnt=True, channel_wise=False)."""

    def __init__(self, stride: int, dimension: int):
        super().__init__()
        self.conv = StreamingConv1d(dimension, dimension, kernel_size=2 * stride, stride=stride,
                                    bias=False, pad_mode="replicate")

    def init_state(self, batch_size: int, device: torch.device | str) -> ConvState:
        return self.conv.init_state(batch_size, device)

    def step(self, x: Tensor, state: ConvState, exec_mask: Tensor) -> Tensor:
        return self.conv.step(x, state, exec_mask)


class ConvTrUpsample1d(StreamingModule):
    """Learnt causal upsampling by `stride`, one filter per channel (groups = dimension): the
    reference's ConvTrUpsample1d(learnt=True, channel_wise=True), which Mimi uses
    (`upsample_channel_wise_bug`)."""

    def __init__(self, stride: int, dimension: int):
        super().__init__()
        self.convtr = StreamingConvTranspose1d(dimension, dimension, kernel_size=2 * stride,
                                               stride=stride, groups=dimension, bias=False)

    def init_state(self, batch_size: int, device: torch.device | str) -> ConvTrState:
        return self.convtr.init_state(batch_size, device)

    def step(self, x: Tensor, state: ConvTrState, exec_mask: Tensor) -> Tensor:
        return self.convtr.step(x, state, exec_mask)


__all__ = [
    "RowState", "StateList", "StreamingModule", "StreamingSequential", "ConvState", "ConvTrState",
    "StreamingConv1d", "StreamingConvTranspose1d", "ConvDownsample1d", "ConvTrUpsample1d",
    "rows", "commit_rows_", "fill_rows_",
]
