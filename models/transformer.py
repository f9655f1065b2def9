"""Streaming transformer with per-row state: the temporal LM, the depformer and Mimi's transformer.

API
---
    tr = StreamingTransformer(d_model, num_heads, num_layers, dim_feedforward, *, causal=True,
                              context=None, capacity=None, norm="layer_norm", gating="none",
                              layer_scale=None, positional_embedding="rope", max_period=10000.0,
                              weights_per_step=0, weights_per_step_schedule=None,
                              device=None, dtype=None)
    state = tr.init_state(batch_size, device, dtype)      # TransformerState
    y = tr(x[B, T, d], state, exec_mask=None, step=None)  # streaming
    y = tr(x[B, T, d])                                    # no state: plain causal pass over x
    tr = StreamingTransformer(..., cross_attention=True)  # + a cross-attention block per layer (DSM TTS)
    y = tr(x, state, exec_mask, cross_kv=tr.cross_kv(source[B, S, d]))
    state.reset(mask[B])       # masked rows back to position 0 with an empty KV ring
    state.clear()              # every row (the depformer clears once per frame)
    state.row(i)               # a B=1 view of row i: stepping it updates row i in place
    state = tr.init_state(B, kv_blocks=N, block_size=None)  # paged: per-layer pools of N blocks + a block table
    state.map_blocks(released, forgotten, assigned)  # between steps: the engine's block changes, batched
    state.assign_blocks(row, logical, physical);  state.forget_blocks(row, logical);  state.release_row(row)

Semantics (equal to moshi 0.2.13 `RingKVCache` + `StreamingMultiheadAttention`):
- Each row has an absolute position `pos[b]`; step t of a call sits at `pos[b] + t` (RoPE and mask).
- The KV ring has `capacity` slots (default: `context`); position p lives in slot p % capacity.
  A query at position q sees the slots holding positions in [q - context + 1, q]. Positions grow
  forever: the window slides, a session has no length cap.
- Rows where `exec_mask` is False are computed (fixed shapes) but their ring and position are
  left untouched.
- With T > 1 the T new keys are written before attending, exactly as the reference does: once the
  ring is full, the earlier queries of the call lose the few oldest keys the later steps overwrote.
- `weights_per_step` (the depformer): `step` (a Python int, static under CUDA graphs) picks the
  step's slice of the stacked `in_proj_weight` / `out_proj.weight` and its `gating[step]` FFN.
- Nothing in `forward` reads a device value back to the host: it can be captured in a CUDA graph.
- Paged states (models/paged_kv.py) keep these semantics exactly; only where a slot is stored
  changes. The caller (the engine) assigns a row's blocks before the step that writes them.
- `kv_repeat` r > 1 (Hibiki): grouped KV heads, as the reference's `kv_repeat`. `in_proj_weight`
  holds dim query rows then dim / r key and dim / r value rows a weight step; the ring stores
  H / r heads, each serving its r query heads (query head h reads KV head h // r: `expand_kv` on
  the general path, the fused kernels' KV_REP on the fused one). `positional_embedding="rope_concat"`
  (Hibiki-Zero): RoPE rotating the two halves of each head instead of interleaved pairs, as the
  reference's (the fused kernels' INTERLEAVE=False). Both take the fused decode where any
  transformer does (CUDA, T == 1, a power-of-two head dim), with the general path's semantics.

Parameter names are the published checkpoint keys: `layers.{i}.self_attn.in_proj_weight`
(fused QKV, per-step weights stacked on dim 0), `layers.{i}.self_attn.out_proj.weight`,
`layers.{i}.norm{1,2}.{alpha | weight, bias}`, `layers.{i}.gating[.{k}].linear_{in,out}.weight`
or `layers.{i}.linear{1,2}.weight`, `layers.{i}.layer_scale_{1,2}.scale`; with cross-attention
`layers.{i}.cross_attention.{in_proj_weight, out_proj.weight}` and `layers.{i}.norm_cross.{weight, bias}`
(LayerNorm after self-attention, before the FFN; no mask, no RoPE; the fused CUDA decode is not used).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import kernels, paged_kv


# ---------------------------------------------------------------------------------------------
# Norms, layer scale, feed-forward


class RMSNorm(nn.Module):
    """RMSNorm; `compute_dtype=torch.float32` is the reference's `rms_norm_f32` (eps 1e-8)."""

    def __init__(self, dim: int, eps: float, compute_dtype: torch.dtype | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.compute_dtype = compute_dtype
        # The parameter takes the model dtype (the reference casts it with the model); the math
        # still runs in `compute_dtype`.
        self.alpha = nn.Parameter(torch.ones(1, 1, dim, device=device, dtype=dtype))

    def fused_params(self) -> tuple[torch.Tensor, float] | None:
        """(alpha [dim], eps) when the fused fp32 kernel computes exactly this norm, else None."""
        if self.compute_dtype != torch.float32:
            return None
        return self.alpha.reshape(-1), self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        var = self.eps + torch.mean(x ** 2, dim=-1, keepdim=True)
        # Same operation order as the reference, so fp32 results match bit for bit.
        return (x * (self.alpha.to(var) * torch.rsqrt(var))).to(in_dtype)


def make_norm(kind: str, dim: int, device=None, dtype=None) -> nn.Module:
    if kind == "layer_norm":
        return nn.LayerNorm(dim, eps=1e-5, device=device, dtype=dtype)
    if kind == "rms_norm":
        return RMSNorm(dim, eps=1e-5, device=device, dtype=dtype)
    if kind == "rms_norm_f32":
        return RMSNorm(dim, eps=1e-8, compute_dtype=torch.float32, device=device, dtype=dtype)
    raise ValueError(f"unknown norm {kind!r}: expected layer_norm, rms_norm or rms_norm_f32")


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float, device=None, dtype=None):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def gated_hidden_dim(dim: int, dim_feedforward: int) -> int:
    """Hidden width of the gated FFN, as the reference derives it (keeps ~8 d^2 parameters)."""
    if dim_feedforward == 4 * dim:
        return (21 * dim) // 8
    return (2 * dim_feedforward) // 3


class GatedFFN(nn.Module):
    """act(x W_a) * (x W_b), then W_out. `linear_in` holds W_a and W_b stacked."""

    def __init__(self, dim: int, dim_feedforward: int, activation: str, device=None, dtype=None):
        super().__init__()
        hidden = gated_hidden_dim(dim, dim_feedforward)
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False, device=device, dtype=dtype)
        self.linear_out = nn.Linear(hidden, dim, bias=False, device=device, dtype=dtype)
        self.activation = getattr(F, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_in(x)
        h = h.view(*h.shape[:-1], 2, -1)
        return self.linear_out(self.activation(h[..., 0, :]) * h[..., 1, :])


# ---------------------------------------------------------------------------------------------
# RoPE


def rope_cos_sin(positions: torch.Tensor, head_dim: int, max_period: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, fp32 [*positions.shape, head_dim // 2] (as the reference)."""
    ds = torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
    angles = freqs * positions.float()[..., None]
    return torch.cos(angles), torch.sin(angles)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
               interleave: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding. q, k: [B, H, T, D] (k may have fewer heads); cos_sin: `rope_cos_sin` of the
    positions [B, T] (computed once per call, shared by the layers). Computed in fp32. `interleave`:
    pairs (x[2i], x[2i + 1]) rotate (`rope`); else (x[i], x[i + D/2]) do (the reference's `rope_concat`)."""
    D = q.shape[-1]
    cos, sin = (c[:, None] for c in cos_sin)  # [B, 1, T, D/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if not interleave:
            xr, xi = x[..., :D // 2].float(), x[..., D // 2:].float()
            return torch.cat([(xr * cos - xi * sin).to(x.dtype), (xr * sin + xi * cos).to(x.dtype)], dim=-1)
        x = x.view(*x.shape[:-1], D // 2, 2)
        xr, xi = x[..., 0].float(), x[..., 1].float()
        out_r = (xr * cos - xi * sin).to(x.dtype)
        out_i = (xr * sin + xi * cos).to(x.dtype)
        return torch.stack([out_r, out_i], dim=-1).view(*x.shape[:-2], D)

    return rotate(q), rotate(k)


# ---------------------------------------------------------------------------------------------
# Streaming state


def ring_slot_positions(pos: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, capacity]: the position each ring slot holds once a row has stepped to `pos` (slot s
    holds the latest p < pos with p % capacity == s; -1 where none has been written yet)."""
    slots = torch.arange(capacity, device=pos.device)
    latest = pos[:, None] - 1 - ((pos[:, None] - 1 - slots) % capacity)
    return torch.where(latest >= 0, latest, torch.full_like(latest, -1))


class LayerKV(NamedTuple):
    """One layer's ring (`TransformerState.kv`): dense [B, H, capacity, D] or paged pools
    [num_blocks, H, block_size, D] with the state's block table (models/paged_kv.py)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = None  # fp8 only: [B, H, capacity] (paged: [num_blocks, H, block_size])
    value_scales: torch.Tensor | None = None
    block_table: torch.Tensor | None = None  # paged only: [B, ring_blocks(capacity, block_size)] int32


@dataclass
class TransformerState:
    """Per-row streaming state of one StreamingTransformer (all tensors on the model's device).

    Dense (the default): each row owns its whole ring. Paged (`init_state(kv_blocks=)`, the
    temporal LM of duplex rows): `keys[l]` / `values[l]` are pools of blocks shared by all rows and
    `block_table` maps each row's ring blocks to pool blocks (models/paged_kv.py); the engine
    assigns blocks (`assign_blocks`, `release_row`), the model only reads and writes through them.
    """

    pos: torch.Tensor  # [B] long: absolute position of the next step of each row
    slot_pos: torch.Tensor  # [B, capacity] long: position held by each ring slot, -1 when empty
    keys: list[torch.Tensor]  # per layer [B, H, capacity, head_dim] (paged: [num_blocks, H, block_size, head_dim])
    values: list[torch.Tensor]  # per layer, as keys
    # fp8 caches only (`kv_dtype=torch.float8_e4m3fn`): per layer [B, H, capacity] fp32 scales
    # (paged: [num_blocks, H, block_size]); slot n of a head holds keys[..., n, :] * key_scales[..., n].
    key_scales: list[torch.Tensor] | None = None
    value_scales: list[torch.Tensor] | None = None
    # Paged only: [B, ring_blocks(capacity, block_size)] int32, logical ring block -> pool block (0: the null
    # block). A CUDA-graph input: updated in place, never replaced.
    block_table: torch.Tensor | None = None
    # Paged only: the table as `map_blocks` last wrote it, on the host (made from the device's on first use).
    table_host: np.ndarray | None = field(default=None, repr=False)
    # Paged bf16 decode only: attention through page lists (models/paged_decode.py) in place of the
    # Triton kernel; its owner plans each step's lists for the leading rows the step runs.
    page_decode: Any = field(default=None, repr=False)

    def kv(self, layer: int) -> LayerKV:
        """A layer's keys and values, with the fp8 scales and the block table where the state has them."""
        scales = (None, None) if self.key_scales is None else (self.key_scales[layer], self.value_scales[layer])
        return LayerKV(self.keys[layer], self.values[layer], *scales, self.block_table)

    @property
    def batch_size(self) -> int:
        return self.pos.shape[0]

    @property
    def capacity(self) -> int:
        return self.slot_pos.shape[1]

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def block_size(self) -> int:
        """Ring slots per block (paged states)."""
        return self.keys[0].shape[2]

    @property
    def num_blocks(self) -> int:
        """Pool blocks per layer, the null block 0 included (paged states)."""
        return self.keys[0].shape[0]

    def reset(self, mask: torch.Tensor) -> None:
        """Masked rows start over (empty ring, position 0); other rows are untouched. A paged
        row keeps its blocks (the engine frees them with `release_row`)."""
        self.pos.masked_fill_(mask, 0)
        self.slot_pos.masked_fill_(mask[:, None], -1)

    def clear(self) -> None:
        """Every row starts over (paged rows keep their blocks)."""
        self.pos.zero_()
        self.slot_pos.fill_(-1)

    def map_blocks(self, released=(), forgotten=(), assigned=()) -> None:
        """Paged states, between steps, in place (captured graphs read the table and slot positions
        where they are), in this order:
        - `released` rows give every block back (entries -> the null block) and start over with no
          memory (empty ring, position 0);
        - `forgotten` (row, logical) blocks go back: their slots are emptied (never attended again)
          and their entries -> the null block; the row carries on;
        - `assigned` (row, logical, physical): the row's ring block `logical` (slots logical *
          block_size .. + block_size - 1) now lives in pool block `physical` (1 .. num_blocks - 1),
          before the step that first writes it (position p writes block (p % capacity) // block_size).
        All host ints, checked here. The whole batch costs a handful of torch calls however many
        changes it holds: each call gives the GIL up, and the engine's thread shares it with the
        event loop."""
        table = self._table()
        rows, blocks = table.shape
        size, capacity = self.block_size, self.capacity
        released = np.asarray(released, dtype=np.int64).reshape(-1)
        forgotten = np.asarray(forgotten, dtype=np.int64).reshape(-1, 2)
        assigned = np.asarray(assigned, dtype=np.int64).reshape(-1, 3)
        every_row = np.concatenate([released, forgotten[:, 0], assigned[:, 0]])
        if every_row.size and not (0 <= every_row.min() and every_row.max() < rows):
            raise ValueError(f"rows {sorted(set(every_row.tolist()))} outside the state's 0 .. {rows - 1}")
        logical = np.concatenate([forgotten[:, 1], assigned[:, 1]])
        if logical.size and not (0 <= logical.min() and logical.max() < blocks):
            raise ValueError(f"logical blocks {logical.tolist()} outside the ring's 0 .. {blocks - 1}")
        if assigned.size and not (1 <= assigned[:, 2].min() and assigned[:, 2].max() < self.num_blocks):
            raise ValueError(f"physical blocks {assigned[:, 2].tolist()} outside the pool's 1 .. "
                             f"{self.num_blocks - 1} (block 0 is the null block)")
        # The table on the host, in order (releases and forgets write the null block, assignments their
        # block), then copied whole: one call (the table is small: rows x ring blocks int32).
        if self.table_host is None:
            self.table_host = table.cpu().numpy().copy()
        host = self.table_host.reshape(-1)
        host[(released[:, None] * blocks + np.arange(blocks)).ravel()] = paged_kv.NULL_BLOCK
        host[forgotten[:, 0] * blocks + forgotten[:, 1]] = paged_kv.NULL_BLOCK
        entries = assigned[:, 0] * blocks + assigned[:, 1]
        last = entries.size - 1 - np.unique(entries[::-1], return_index=True)[1]  # a repeated entry: its last block
        host[entries[last]] = assigned[last, 2]
        if released.size or forgotten.size or assigned.size:
            table.copy_(torch.from_numpy(self.table_host), non_blocking=True)  # pageable: staged before it returns
        in_block = forgotten[:, 1, None] * size + np.arange(size)  # a partial last block: its ring slots only
        emptied = np.concatenate([(released[:, None] * capacity + np.arange(capacity)).ravel(),
                                  (forgotten[:, 0, None] * capacity + in_block)[in_block < capacity]])
        if emptied.size:
            self.slot_pos.view(-1).index_fill_(0, self._upload(emptied), -1)
        if released.size:
            self.pos.index_fill_(0, self._upload(released), 0)

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        # From pageable memory, a non-blocking copy is staged before it returns: `array` may go.
        return torch.from_numpy(array).to(self.pos.device, non_blocking=True)

    def assign_blocks(self, row: int, logical, physical) -> None:
        """`map_blocks(assigned=...)` for one row: logical blocks `logical` live in `physical`."""
        logical, physical = np.asarray(logical).reshape(-1), np.asarray(physical).reshape(-1)
        if logical.shape != physical.shape:
            raise ValueError(f"{logical.size} logical blocks for {physical.size} physical ones")
        self.map_blocks(assigned=[(row, int(j), int(b)) for j, b in zip(logical, physical)])

    def forget_blocks(self, row: int, logical) -> None:
        """`map_blocks(forgotten=...)` for one row."""
        self.map_blocks(forgotten=[(row, int(j)) for j in np.asarray(logical).reshape(-1)])

    def release_row(self, row: int) -> None:
        """`map_blocks(released=...)` for one row."""
        self.map_blocks(released=[row])

    def _table(self) -> torch.Tensor:
        if self.block_table is None:
            raise ValueError("a dense KV state has no block table (init_state(kv_blocks=) makes a paged one)")
        return self.block_table

    def adopt_prefix(self, row: int, source: "TransformerState", frames: int) -> None:
        """Row `row` takes positions 0 .. frames - 1 from row 0 of `source`, a dense state with the
        same layers and ring whose row 0 ran a prompt from position 0 (so slot == position): those slots'
        keys and values (and fp8 scales), then positions `frames` on are empty, as if the row itself
        had run the prompt. What `source` holds past `frames` (padding) is not taken. A paged row
        must hold blocks covering `frames` slots already (else ValueError)."""
        capacity = self.capacity
        if not 0 < frames <= capacity:
            raise ValueError(f"a prefix of {frames} frames does not fit a ring of {capacity} slots")
        if source.paged:
            raise ValueError("a prefix is adopted from a dense state (LMGen.prompt_state)")
        mine, theirs = self.keys + self.values, source.keys + source.values
        if self.key_scales is not None:
            mine = mine + self.key_scales + self.value_scales
            theirs = theirs + source.key_scales + source.value_scales
        if self.paged:
            self._check_blocks(row, frames)
            for dst, src in zip(mine, theirs):
                paged_kv.write_prefix(dst, self.block_table[row], src[0, :, :frames])
        else:
            for dst, src in zip(mine, theirs):
                dst[row, :, :frames].copy_(src[0, :, :frames])
        slots = torch.arange(capacity, device=self.slot_pos.device)
        self.slot_pos[row] = torch.where(slots < frames, slots, -1)
        self.pos[row] = frames

    def _check_blocks(self, row: int, frames: int) -> None:
        """Raise unless the row's blocks cover slots 0 .. frames - 1 (one read of the table row)."""
        needed = -(-frames // self.block_size)
        held = self.block_table[row, :needed].tolist()
        if paged_kv.NULL_BLOCK in held:
            missing = [j for j, b in enumerate(held) if b == paged_kv.NULL_BLOCK]
            raise ValueError(f"row {row} holds no block for logical blocks {missing}: assign blocks covering "
                             f"its {frames} prefix frames ({needed} blocks of {self.block_size}) first")

    def row(self, index: int) -> "TransformerState":
        """A batch-of-one view of row `index`; in-place updates through it land in this state."""
        return self._rows(slice(index, index + 1))

    def leading_rows(self, n: int) -> "TransformerState":
        """Rows [0, n) as views (models/row_views.py)."""
        return self._rows(slice(0, n))

    def _rows(self, sl: slice) -> "TransformerState":
        """Views of some rows. A paged state's pools belong to every row: they stay whole."""
        def cut(tensors):
            return tensors if tensors is None or self.paged else [t[sl] for t in tensors]

        table = None if self.block_table is None else self.block_table[sl]
        leading = sl.start in (0, None)  # page lists are planned for a bucket's leading rows only
        return TransformerState(self.pos[sl], self.slot_pos[sl], cut(self.keys), cut(self.values),
                                cut(self.key_scales), cut(self.value_scales), table,
                                page_decode=self.page_decode if leading else None)


FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Calls of at most this many steps (Mimi's 2 a frame) on CUDA attend with plain matmuls and
# fuse RoPE with the ring write; longer ones (prompt prefill) take SDPA.
FEW_STEPS = 4


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn [..., D], fp32 scale [...]): one scale per vector, its max |x|
    mapped to 448. The fused kernel (kernels.rope_write) computes the same."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-30)
    return (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_kv(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x8.float() * scale[..., None]).to(dtype)


# ---------------------------------------------------------------------------------------------
# Attention and layer


class StreamingAttention(nn.Module):
    """Multi-head self-attention over a per-row KV ring. No biases (as in every Moshi model)."""

    def __init__(self, dim: int, num_heads: int, num_weights: int, kv_repeat: int = 1, rope_interleave: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.kv_repeat = kv_repeat
        self.rope_interleave = rope_interleave
        # Fused QKV for each weight step, stacked: the checkpoint layout [num_weights * rows, dim],
        # rows = dim query rows then 2 * kv_dim key and value rows (kv_dim = dim / kv_repeat).
        self.rows = dim + 2 * (dim // kv_repeat)
        self.in_proj_weight = nn.Parameter(torch.empty(num_weights * self.rows, dim, device=device, dtype=dtype))
        # Output projections stacked the same way: [num_weights * dim, dim].
        self.out_proj = nn.Linear(dim, num_weights * dim, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.in_proj_weight, a=math.sqrt(5))

    def weights(self, weight_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(QKV weight [rows, dim], output weight [dim, dim]) of one weight step."""
        dim, rows = self.dim, self.rows
        return (self.in_proj_weight[weight_index * rows:(weight_index + 1) * rows],
                self.out_proj.weight[weight_index * dim:(weight_index + 1) * dim])

    def forward(self, x: torch.Tensor, weight_index: int, rope: tuple[torch.Tensor, torch.Tensor] | None,
                kv: LayerKV | None, slots: torch.Tensor | None, attn_mask: torch.Tensor,
                exec_mask: torch.Tensor | None, pos: torch.Tensor | None = None,
                fused_write: bool = False) -> torch.Tensor:
        """`rope`: `rope_cos_sin` of the steps' positions, or None without RoPE. `fused_write` (CUDA,
        a few steps, a bf16 / fp32 ring; the transformer decides): RoPE and the ring write of
        executing rows in one kernel (`kernels.rope_write`), from the rows' positions `pos` [B]."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.dim // self.num_heads
        w_in, w_out = self.weights(weight_index)
        qkv = F.linear(x, w_in)
        if fused_write:
            # Rows that do not execute keep their ring as it was (nothing to restore); their
            # outputs, which nobody reads, attend over the old slot contents.
            cache_k, cache_v = kv.keys, kv.values
            cos_sin = None if rope is None else tuple(c.reshape(B * T, -1) for c in rope)
            q, _, _ = kernels.rope_write(qkv.view(B * T, self.rows), H, D, cos_sin, pos, exec_mask,
                                         cache_k, cache_v, steps=T, interleave=self.rope_interleave)
            out = _attention(q.view(B, T, H, D).transpose(1, 2), cache_k, cache_v, attn_mask)
            return F.linear(out.transpose(1, 2).reshape(B, T, self.dim), w_out)
        if self.kv_repeat == 1:
            q, k, v = qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        else:  # grouped: H query heads, then H / kv_repeat key and value heads
            q = qkv[..., :self.dim].view(B, T, H, D).transpose(1, 2)
            k, v = qkv[..., self.dim:].view(B, T, 2, H // self.kv_repeat, D).permute(2, 0, 3, 1, 4)
        if rope is not None:
            q, k = apply_rope(q, k, rope, self.rope_interleave)

        if kv is None:  # stateless: attend over this call's keys only
            out = F.scaled_dot_product_attention(q, *expand_kv(k, v, H), attn_mask)
        elif kv.block_table is not None:
            out = self._attend_paged(q, k, v, kv, slots, attn_mask, exec_mask)
        else:
            out = self._attend(q, k, v, kv, slots, attn_mask, exec_mask)
        out = out.transpose(1, 2).reshape(B, T, self.dim)
        return F.linear(out, w_out)

    @staticmethod
    def _attend(q, k, v, kv: LayerKV, slots, attn_mask, exec_mask) -> torch.Tensor:
        """Write the call's keys into a dense ring (kept for executing rows only) and attend over it."""
        if kv.key_scales is not None:  # fp8 ring: attend over a dequantized copy, then commit the quantized keys
            return StreamingAttention._attend_fp8(q, k, v, kv, slots, attn_mask, exec_mask)
        cache_k, cache_v = kv.keys, kv.values
        B, H, T, D = k.shape
        index = slots[:, None, :, None].expand(B, H, T, D)
        if exec_mask is not None:
            old_k, old_v = cache_k.gather(2, index), cache_v.gather(2, index)
        cache_k.scatter_(2, index, k)
        cache_v.scatter_(2, index, v)
        out = _attention(q, cache_k, cache_v, attn_mask)
        if exec_mask is not None:
            # Rows that do not execute get their overwritten slots back: their state is untouched,
            # yet they attended over a valid (written) key, so their outputs stay finite.
            keep = exec_mask[:, None, None, None]
            cache_k.scatter_(2, index, torch.where(keep, k, old_k))
            cache_v.scatter_(2, index, torch.where(keep, v, old_v))
        return out

    @staticmethod
    def _attend_paged(q, k, v, kv: LayerKV, slots, attn_mask, exec_mask) -> torch.Tensor:
        """A paged ring: each row's ring gathered through the block table into a dense copy, the
        dense math on it (so the result is the dense path's, bit for bit), then the slots this call
        wrote go back to the pool (executing rows only, never the null block)."""
        table = kv.block_table
        pools = [t for t in kv[:4] if t is not None]
        views = [paged_kv.gather_ring(pool, table, attn_mask.shape[-1]) for pool in pools]  # the mask spans the ring
        out = StreamingAttention._attend(q, k, v, LayerKV(*views), slots, attn_mask, exec_mask)
        for pool, view in zip(pools, views):
            paged_kv.scatter_slots(pool, table, view, slots, exec_mask)
        return out

    @staticmethod
    def _attend_fp8(q, k, v, kv: LayerKV, slots, attn_mask, exec_mask) -> torch.Tensor:
        cache_k, cache_v, k_scale, v_scale = kv[:4]
        B, H, T, D = k.shape
        index = slots[:, None, :, None].expand(B, H, T, D)
        full_k = dequantize_kv(cache_k, k_scale, q.dtype).scatter_(2, index, k)
        full_v = dequantize_kv(cache_v, v_scale, q.dtype).scatter_(2, index, v)
        out = F.scaled_dot_product_attention(q, *expand_kv(full_k, full_v, q.shape[1]), attn_mask)
        sindex = slots[:, None, :].expand(B, H, T)
        for cache, scale, new in ((cache_k, k_scale, k), (cache_v, v_scale, v)):
            new8, new_scale = quantize_kv(new)
            raw = cache.view(torch.uint8)  # index ops on the raw bytes (fp8 lacks some kernels)
            new8 = new8.view(torch.uint8)
            if exec_mask is not None:
                keep = exec_mask[:, None, None]
                new8 = torch.where(keep[..., None], new8, raw.gather(2, index))
                new_scale = torch.where(keep, new_scale, scale.gather(2, sindex))
            raw.scatter_(2, index, new8)
            scale.scatter_(2, sindex, new_scale)
        return out


def expand_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped keys and values [B, H / r, S, D] -> [B, H, S, D]: KV head i serves query heads
    i * r .. i * r + r - 1 (the reference's `expand_repeated_kv`). A no-op when r is 1."""
    repeat = heads // k.shape[1]
    if repeat == 1:
        return k, v
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA over a ring. On CUDA, a few queries (Mimi's T = 2 steps) take plain batched matmuls:
    PyTorch's fused SDPA kernels cost more than the matmuls at that shape (few queries over a short
    ring; benchmarks/mimi_steps.py's `plain` variant runs SDPA); the math is the same up to float rounding. CPU keeps SDPA (bit-exact with the reference)."""
    k, v = expand_kv(k, v, q.shape[1])
    if not (kernels.available(q) and q.shape[2] <= FEW_STEPS):
        return F.scaled_dot_product_attention(q, k, v, mask)
    scores = torch.matmul(q * (q.shape[-1] ** -0.5), k.transpose(-1, -2))
    scores = scores.masked_fill(~mask, float("-inf"))  # every query sees its own key: no empty row
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class CrossAttention(nn.Module):
    """Attention from the stream onto a fixed source (DSM TTS speaker tokens): no mask, no RoPE.

    `in_proj_weight` [3 * dim, dim] holds Q then K, V (the checkpoint layout). The source's keys
    and values are computed once per request (`kv`) and passed to every step.
    """

    def __init__(self, dim: int, num_heads: int, device=None, dtype=None):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim, device=device, dtype=dtype))
        self.out_proj = nn.Linear(dim, dim, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.in_proj_weight, a=math.sqrt(5))

    def kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """source [B, S, dim] -> keys, values [B, H, S, head_dim]."""
        B, S, _ = source.shape
        kv = F.linear(source, self.in_proj_weight[self.dim:])
        k, v = kv.view(B, S, 2, self.num_heads, self.dim // self.num_heads).permute(2, 0, 3, 1, 4)
        return k, v

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = F.linear(x, self.in_proj_weight[:self.dim]).view(B, T, self.num_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, keys, values)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, self.dim))


class StreamingTransformerLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dim_feedforward: int, norm: str, gating: str,
                 layer_scale: float | None, num_weights: int, per_step: bool, cross_attention: bool = False,
                 kv_repeat: int = 1, rope_interleave: bool = True, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.self_attn = StreamingAttention(d_model, num_heads, num_weights, kv_repeat, rope_interleave, **factory)
        self.cross_attention: CrossAttention | None = None
        if cross_attention:  # the reference's cross-attention norm is always a LayerNorm
            self.cross_attention = CrossAttention(d_model, num_heads, **factory)
            self.norm_cross = nn.LayerNorm(d_model, eps=1e-5, **factory)
        self.norm1 = make_norm(norm, d_model, **factory)
        self.norm2 = make_norm(norm, d_model, **factory)
        self.gating: nn.Module | None = None
        self.linear1: nn.Linear | None = None
        self.linear2: nn.Linear | None = None
        if gating == "none":
            if per_step:
                raise ValueError("weights_per_step needs a gated FFN (gating != 'none'), as in the reference")
            # Mimi's plain FFN: linear2(gelu(linear1(x))).
            self.linear1 = nn.Linear(d_model, dim_feedforward, bias=False, **factory)
            self.linear2 = nn.Linear(dim_feedforward, d_model, bias=False, **factory)
        elif per_step:
            self.gating = nn.ModuleList(
                [GatedFFN(d_model, dim_feedforward, gating, **factory) for _ in range(num_weights)])
        else:
            self.gating = GatedFFN(d_model, dim_feedforward, gating, **factory)
        self.layer_scale_1: nn.Module = nn.Identity()
        self.layer_scale_2: nn.Module = nn.Identity()
        if layer_scale is not None:
            self.layer_scale_1 = LayerScale(d_model, layer_scale, **factory)
            self.layer_scale_2 = LayerScale(d_model, layer_scale, **factory)

    def _ffn(self, x: torch.Tensor, weight_index: int) -> torch.Tensor:
        if self.gating is None:
            return self.linear2(F.gelu(self.linear1(x)))
        if isinstance(self.gating, nn.ModuleList):
            return self.gating[weight_index](x)
        return self.gating(x)

    def forward(self, x: torch.Tensor, weight_index: int,
                cross_kv: tuple[torch.Tensor, torch.Tensor] | None = None, **attn_kwargs) -> torch.Tensor:
        update = self.self_attn(self.norm1(x), weight_index, **attn_kwargs)
        x = x.to(update) + self.layer_scale_1(update)
        if self.cross_attention is not None:
            if cross_kv is None:
                raise ValueError("this transformer has cross-attention: pass cross_kv=")
            x = x + self.cross_attention(self.norm_cross(x), *cross_kv)
        update = self._ffn(self.norm2(x), weight_index)
        return x.to(update) + self.layer_scale_2(update)


# ---------------------------------------------------------------------------------------------
# Transformer


class StreamingTransformer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, num_layers: int, dim_feedforward: int, *,
                 causal: bool = True, context: int | None = None, capacity: int | None = None,
                 norm: str = "layer_norm", gating: str = "none", layer_scale: float | None = None,
                 positional_embedding: str = "rope", max_period: float = 10_000.0,
                 weights_per_step: int = 0, weights_per_step_schedule: list[int] | tuple[int, ...] | None = None,
                 cross_attention: bool = False, kv_repeat: int = 1, device=None, dtype=None):
        super().__init__()
        if d_model % num_heads or num_heads % kv_repeat:
            raise ValueError(f"d_model {d_model} is not divisible by num_heads {num_heads}, "
                             f"or num_heads by kv_repeat {kv_repeat}")
        if not causal:
            raise ValueError("only causal streaming transformers are supported")
        if positional_embedding not in ("rope", "rope_concat", "none"):
            raise ValueError(f"positional_embedding {positional_embedding!r}: only 'rope', 'rope_concat' and 'none' "
                             f"are supported")
        self.d_model = d_model
        self.num_heads = num_heads
        self.kv_heads = num_heads // kv_repeat  # heads the KV ring holds (grouped when kv_repeat > 1)
        self.context = context
        self.capacity = capacity if capacity is not None else (context or weights_per_step or None)
        self.rope_max_period = max_period if positional_embedding != "none" else None
        # rope_concat (Hibiki-Zero): halves rotate, not interleaved pairs (the fused kernels take either).
        self.rope_interleave = positional_embedding != "rope_concat"
        self.weights_per_step = weights_per_step
        self.schedule = list(weights_per_step_schedule) if weights_per_step_schedule else None
        self.cross_attention = cross_attention
        num_weights = 1
        if weights_per_step:
            num_weights = max(self.schedule) + 1 if self.schedule else weights_per_step
        self.layers = nn.ModuleList([
            StreamingTransformerLayer(d_model, num_heads, dim_feedforward, norm, gating, layer_scale,
                                      num_weights, per_step=bool(weights_per_step), cross_attention=cross_attention,
                                      kv_repeat=kv_repeat, rope_interleave=self.rope_interleave,
                                      device=device, dtype=dtype)
            for _ in range(num_layers)
        ])

    def init_state(self, batch_size: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
                   kv_blocks: int | None = None, block_size: int | None = None) -> TransformerState:
        """`dtype`: the activations' dtype (default: the weights'). `kv_dtype`: the KV ring's, default
        `dtype`; `torch.float8_e4m3fn` stores keys and values in fp8 with per-(row, head, slot) scales.
        `kv_blocks`: a paged state, each layer's ring a pool of `kv_blocks` blocks of `block_size`
        slots (default `paged_kv.block_size_for`; block 0 is the null block, so kv_blocks - 1 are
        usable) and a block table with every entry on the null block (models/paged_kv.py)."""
        if self.capacity is None:
            raise ValueError("a streaming state needs a context or capacity")
        param = self.layers[0].self_attn.in_proj_weight
        device = param.device if device is None else device
        dtype = param.dtype if dtype is None else dtype
        head_dim = self.d_model // self.num_heads
        table = None
        if kv_blocks is None:
            if block_size is not None:
                raise ValueError("block_size is for paged states: give kv_blocks too")
            shape = (batch_size, self.kv_heads, self.capacity, head_dim)
        else:
            block_size = paged_kv.block_size_for(self.capacity, block_size)
            if kv_blocks < 2:
                raise ValueError(f"kv_blocks {kv_blocks}: a pool needs the null block and at least one more")
            shape = (kv_blocks, self.kv_heads, block_size, head_dim)
            table = torch.zeros(batch_size, paged_kv.ring_blocks(self.capacity, block_size), device=device,
                                dtype=torch.int32)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        scales = {}
        if kv_dtype == torch.float8_e4m3fn:
            scales = dict(key_scales=[torch.zeros(shape[:3], device=device) for _ in self.layers],
                          value_scales=[torch.zeros(shape[:3], device=device) for _ in self.layers])
        elif kv_dtype != dtype:
            raise ValueError(f"kv_dtype {kv_dtype}: only the model dtype or torch.float8_e4m3fn")
        keys = [torch.zeros(shape, device=device, dtype=kv_dtype) for _ in self.layers]
        values = [torch.zeros(shape, device=device, dtype=kv_dtype) for _ in self.layers]
        return TransformerState(
            pos=torch.zeros(batch_size, device=device, dtype=torch.long),
            slot_pos=torch.full((batch_size, self.capacity), -1, device=device, dtype=torch.long),
            keys=keys, values=values, **scales, block_table=table,
        )

    def _weight_index(self, step: int | None) -> int:
        if not self.weights_per_step:
            return 0
        if step is None:
            raise ValueError("this transformer has weights per step: pass step=")
        return self.schedule[step] if self.schedule else step

    def _mask(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, S] bool: key written, not in the future, within the context window."""
        delta = query_pos[:, :, None] - key_pos[:, None, :]
        valid = (key_pos[:, None, :] >= 0) & (delta >= 0)
        if self.context is not None:
            valid = valid & (delta < self.context)
        return valid[:, None]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin of the steps' positions [B, T], once per call for every layer."""
        if self.rope_max_period is None:
            return None
        return rope_cos_sin(positions, self.d_model // self.num_heads, self.rope_max_period)

    def cross_kv(self, source: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer cross-attention keys and values of a source [B, S, d_model]."""
        return [layer.cross_attention.kv(source) for layer in self.layers]

    def forward(self, x: torch.Tensor, state: TransformerState | None = None,
                exec_mask: torch.Tensor | None = None, step: int | None = None,
                cross_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """`cross_kv` (cross-attention transformers only): `cross_kv(source)`, one pair per layer."""
        B, T, _ = x.shape
        weight_index = self._weight_index(step)
        steps = torch.arange(T, device=x.device, dtype=torch.long)
        crosses = cross_kv if cross_kv is not None else [None] * len(self.layers)
        if state is None:
            positions = steps[None].expand(B, T)
            attn = dict(kv=None, slots=None, attn_mask=self._mask(positions, positions), exec_mask=None,
                        rope=self._rope(positions))
            for layer, cross in zip(self.layers, crosses):
                x = layer(x, weight_index, cross, **attn)
            return x

        assert T <= self.capacity, f"{T} steps in one call exceed the KV ring capacity {self.capacity}"
        if T == 1 and self._can_fuse(x):
            return self._forward_decode(x, state, exec_mask, weight_index, cross_kv)
        positions = state.pos[:, None] + steps  # [B, T]
        slots = positions % self.capacity
        # Slot positions as they are once this call's keys are written (all rows, for the mask).
        new_slot_pos = state.slot_pos.scatter(1, slots, positions)
        mask = self._mask(new_slot_pos, positions)
        rope = self._rope(positions)
        # A few steps (Mimi's 2 a frame) on CUDA: RoPE + ring write fused, as in the one-step path.
        # (Paged rings take the general path: it gathers each row's ring through the table.)
        fused_write = T <= FEW_STEPS and state.key_scales is None and not state.paged and self._can_fuse(x)
        for i, (layer, cross) in enumerate(zip(self.layers, crosses)):
            x = layer(x, weight_index, cross, rope=rope, kv=state.kv(i), slots=slots, attn_mask=mask,
                      exec_mask=exec_mask, pos=state.pos, fused_write=fused_write)
        if exec_mask is None:
            state.slot_pos.copy_(new_slot_pos)
            state.pos.add_(T)
        else:
            state.slot_pos.copy_(torch.where(exec_mask[:, None], new_slot_pos, state.slot_pos))
            state.pos.add_(exec_mask.long() * T)
        return x

    # -- fused one-step decode (CUDA only) ----------------------------------------------------

    def _can_fuse(self, x: torch.Tensor) -> bool:
        """CUDA + Triton, a power-of-two head dim: T == 1 steps take `_forward_decode` (grouped KV
        heads and rope_concat too: the kernels take both)."""
        if not kernels.available(x):
            return False
        head_dim = self.d_model // self.num_heads
        return head_dim == 1 << (head_dim.bit_length() - 1)

    def _forward_decode(self, x: torch.Tensor, state: TransformerState, exec_mask: torch.Tensor | None,
                        weight_index: int, cross_kv: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        """One step (T == 1) with fused kernels; same semantics as the general path.

        Per layer: [residual add +] RMSNorm, QKV matmul, RoPE + KV write (executing rows only;
        without RoPE the attention kernel writes them), split-KV attention over each row's filled
        window plus the new key, output matmul,
        residual add + RMSNorm, gated FFN (matmul, fused SiLU * gate, matmul). With cross-attention
        (DSM TTS) the residual add after the output matmul stays unfused: the cross block (the
        layer's own module: LayerNorm, one query over the fixed source) comes between it and the
        FFN's RMSNorm. The KV ring is never written for rows that do not execute, so nothing needs
        restoring.
        """
        if self.cross_attention and cross_kv is None:
            raise ValueError("this transformer has cross-attention: pass cross_kv=")
        B, _, dim = x.shape
        H = self.num_heads
        D = dim // H
        pos = state.pos
        cos_sin = None
        if self.rope_max_period is not None:
            cos_sin = rope_cos_sin(pos, D, self.rope_max_period)
        res = x.reshape(B, dim)
        order = None
        if cos_sin is not None:  # (the depformer's short rings split by themselves)
            order = kernels.row_order(pos, H, self.capacity, state.key_scales is not None)
        pending: torch.Tensor | None = None
        prev: StreamingTransformerLayer | None = None
        for i, layer in enumerate(self.layers):
            if pending is None:
                normed = _norm(res, layer.norm1)
            else:
                res, normed = _add_norm(res, pending, prev.layer_scale_2, layer.norm1)
            update = self._decode_self_attention(layer, i, normed, state, exec_mask, weight_index, cos_sin, order)
            if layer.cross_attention is None:
                res, normed = _add_norm(res, update, layer.layer_scale_1, layer.norm2)
            else:
                res = res.to(update) + layer.layer_scale_1(update)
                res = res + layer.cross_attention(layer.norm_cross(res)[:, None], *cross_kv[i])[:, 0]
                normed = _norm(res, layer.norm2)
            pending = _ffn_fused(layer, normed, weight_index)
            prev = layer
        if pending is not None:
            res = res.to(pending) + prev.layer_scale_2(pending)
        self._advance_decode(state, pos, exec_mask)
        return res.view(B, 1, dim)

    def _decode_self_attention(self, layer: StreamingTransformerLayer, i: int, normed: torch.Tensor,
                               state: TransformerState, exec_mask: torch.Tensor | None, weight_index: int,
                               cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
                               order: torch.Tensor | None) -> torch.Tensor:
        """Layer `i`'s self-attention for one decode step (`_forward_decode`): QKV matmul, RoPE + KV
        write, split-KV attention, output matmul -> the update to add to the residual [B, dim]."""
        B, dim = normed.shape
        H = self.num_heads
        D = dim // H
        pos = state.pos
        table = state.block_table  # paged rings: every kernel addresses slots through it
        w_in, w_out = layer.self_attn.weights(weight_index)
        qkv = F.linear(normed, w_in)
        scales = ((state.key_scales[i], state.value_scales[i]) if state.key_scales is not None
                  else (None, None))
        if cos_sin is None and scales[0] is None:
            # No RoPE (the depformer): q, k, v are views of qkv, and the attention kernel
            # itself writes k and v to the ring (one kernel a layer instead of two).
            kv_dim = self.kv_heads * D
            q = qkv[:, :dim].view(B, H, D)
            k = qkv[:, dim:dim + kv_dim].view(B, self.kv_heads, D)
            v = qkv[:, dim + kv_dim:].view(B, self.kv_heads, D)
            out = kernels.decode_attention(q, k, v, state.keys[i], state.values[i], state.slot_pos, pos,
                                           self.context, write=True, exec_mask=exec_mask, block_table=table)
        else:
            q, k, v = kernels.rope_write(qkv, H, D, cos_sin, pos, exec_mask, state.keys[i], state.values[i],
                                         *scales, block_table=table, capacity=self.capacity,
                                         interleave=self.rope_interleave)
            if state.page_decode is not None:  # the step's key is in the pool now: the lists include it
                out = state.page_decode.run(q, state.keys[i], state.values[i])
            else:
                out = kernels.decode_attention(q, k, v, state.keys[i], state.values[i], state.slot_pos, pos,
                                               self.context, *scales, order=order, block_table=table)
        return F.linear(out.view(B, dim), w_out)

    def _advance_decode(self, state: TransformerState, pos: torch.Tensor, exec_mask: torch.Tensor | None) -> None:
        """After a decode step: the executing rows' new slot holds their position, and they move on one."""
        slots = (pos % self.capacity)[:, None]
        if exec_mask is None:
            state.slot_pos.scatter_(1, slots, pos[:, None])
            state.pos.add_(1)
        else:
            old = state.slot_pos.gather(1, slots)
            state.slot_pos.scatter_(1, slots, torch.where(exec_mask[:, None], pos[:, None], old))
            state.pos.add_(exec_mask.long())


def _norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """The fused fp32 RMSNorm kernel where it computes this norm, else the module."""
    params = norm.fused_params() if isinstance(norm, RMSNorm) else None
    if params is None or x.stride(-1) != 1:
        return norm(x)
    return kernels.rms_norm(x, *params)


def _add_norm(res: torch.Tensor, upd: torch.Tensor, layer_scale: nn.Module,
              norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(res + layer_scale(upd), its norm), fused where the kernel computes exactly this."""
    params = norm.fused_params() if isinstance(norm, RMSNorm) else None
    if params is None or res.stride(-1) != 1 or upd.stride(-1) != 1:
        new = res.to(upd) + layer_scale(upd)
        return new, norm(new)
    scale = layer_scale.scale if isinstance(layer_scale, LayerScale) else None
    return kernels.add_rms_norm(res, upd, scale, *params)


def _ffn_fused(layer: StreamingTransformerLayer, x: torch.Tensor, weight_index: int) -> torch.Tensor:
    gating = layer.gating
    if isinstance(gating, nn.ModuleList):
        gating = gating[weight_index]
    if isinstance(gating, GatedFFN) and gating.activation is F.silu:
        return gating.linear_out(kernels.silu_mul(gating.linear_in(x)))
    return layer._ffn(x, weight_index)
