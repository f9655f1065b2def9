"""Fused CUDA kernels (Triton) for the one-step (T == 1) streaming decode, and for sampling.
RoPE + ring write also serves calls of a few steps (Mimi's transformers, 2 steps a frame).

A leaf module: it takes plain tensors and numbers, never model objects, and imports nothing
from the rest of Parley but its kernels (models/triton_kernels.py, imported with Triton at the
first fused path taken: a CPU server never imports Triton).

    available(x) -> bool                      # CUDA tensor (or TRITON_INTERPRET=1), Triton importable, switched on
    set_enabled(flag) -> previous flag;  with enabled(flag): ...    # the one switch
    q, k, v = rope_write(qkv[B, (H+2*Hkv)*D], H, D, cos_sin | None, pos[B], exec_mask[B] | None,
                         cache_k[B,Hkv,S,D], cache_v, interleave=True)
    q, k, v = rope_write(qkv[B*T, (H+2*Hkv)*D], ..., steps=T)   # T steps of each row, row-major
    out = decode_attention(q[B,H,D], k_new[B,Hkv,D], v_new[B,Hkv,D], cache_k[B,Hkv,S,D], cache_v,
                           slot_pos[B,S], pos[B], context | None)   # [B, H, D]
    order = row_order(pos[B], H, S, fp8) -> [B] | None     # rows longest window first, for decode_attention(order=)
    y = rms_norm(x[B, N], alpha[N], eps)                  # RMSNorm computed in fp32
    res, y = add_rms_norm(res[B, N], upd[B, N], scale[N] | None, alpha[N], eps)
    a = silu_mul(h[B, 2*F])                               # silu(h[:, :F]) * h[:, F:]
    tokens = sample(logits[B, V], temperature[B], top_k[B], noise[B, V])

Decode attention semantics (equal to SDPA with the streaming mask of transformer.py): a query at
position `pos[b]` attends to the new key/value (`k_new`, `v_new`, position pos[b]) and to every ring
slot n != pos[b] % S whose `slot_pos[b, n]` is >= 0, <= pos[b] and, with a context, > pos[b] - context.
`slot_pos` is the state *before* this step: the kernel never reads the slot being overwritten, so
rows that do not execute (their cache is left unwritten) get the same output as rows that do.

Grouped KV heads (Hkv = H / r, r = kv_repeat, taken from the caches' head count): query head h
attends with KV head h // r (transformer.expand_kv's grouping); rope_write rotates and writes the
Hkv key and value heads once each. `interleave=False` (rope_concat): RoPE rotates the halves
(x[i], x[i + D/2]) of each head instead of the pairs (x[2i], x[2i + 1]).

bf16 / fp32 caches run tensor-core dots (the query row repeated 16 times); fp8 caches run fp32
products on CUDA cores (a tensor-core fp8 loop needed too many registers and was issue-bound).

Paged rings (models/paged_kv.py; `block_table=` [B, ceil(S / bs)] int32 on decode_attention and
rope_write): the caches and fp8 scales are pools [blocks, H, bs(, D)] shared by all rows, slot n
of row b lives at pool block block_table[b, n // bs], slot n % bs, and writes to the null block 0
are dropped. The results are the dense ring's; a constexpr PAGED picks the addressing, so the
dense kernels compile as before.

Only slots below min(pos[b], S) are visited: since a row's positions grow from 0 after a reset,
slots at or above that bound have never been written. Splits of the window past it exit at once,
so the cost follows each row's filled window (split-KV, "flash decoding"), not the capacity.

The switch: PARLEY_FUSED=0 in the environment turns every fused path off at import (1, the
default, leaves them on; any other value is refused); `set_enabled` / `enabled` change it at run
time (tests compare both paths). It is read when a step is traced, so a CUDA graph keeps the
path it was captured with.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Iterator, NamedTuple

import torch

# The kernels themselves are in models/triton_kernels.py, imported at the first fused path taken
# (`triton_kernels()`): importing Triton takes time at start, and a CPU server never launches a kernel.
_triton: dict[str, ModuleType | None] = {}


def _env_switch() -> bool:
    value = os.environ.get("PARLEY_FUSED", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"PARLEY_FUSED={value!r}: expected 1 (fused CUDA kernels, the default) or 0 (plain PyTorch)")
    return value == "1"


_switch = {"on": _env_switch()}


def set_enabled(flag: bool) -> bool:
    """Turn the fused paths on or off for steps traced from now on; returns the previous setting."""
    previous = _switch["on"]
    _switch["on"] = bool(flag)
    return previous


@contextlib.contextmanager
def enabled(flag: bool) -> Iterator[None]:
    """Run a block with the fused paths on or off, then restore the previous setting."""
    previous = set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(previous)


def triton_kernels() -> ModuleType | None:
    """models/triton_kernels.py, imported on the first call; None where Triton cannot be imported
    (it ships with CUDA builds of PyTorch; CPU-only installs run the plain PyTorch path)."""
    if "module" not in _triton:
        try:
            import triton  # noqa: F401
        except Exception:  # pragma: no cover - depends on the install
            _triton["module"] = None
        else:
            from . import triton_kernels as module
            _triton["module"] = module
    return _triton["module"]


def have_triton() -> bool:
    return triton_kernels() is not None


# TRITON_INTERPRET=1 (Triton's own switch): its interpreter runs the kernels on CPU tensors in
# numpy, so the whole CUDA path can be tested without a GPU (tests/interpreted_kernels.py); slow.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available(x: torch.Tensor) -> bool:
    """Whether `x` takes the fused path: CUDA (or interpreted), switched on, Triton importable
    (imported here, at the first such tensor: a CPU server never imports it)."""
    return _switch["on"] and (x.is_cuda or (INTERPRETED and x.device.type == "cpu")) and have_triton()


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Wrappers


class AttentionLaunch(NamedTuple):
    block_n: int  # slots per loop iteration
    blocks: int  # loop iterations per program: a program covers block_n * blocks slots of a row's window
    stages: int  # software-pipelining depth of the loop's loads
    warps: int


def attention_launch(B: int, H: int, S: int, fp8: bool) -> AttentionLaunch:
    """Programs per (row, head): enough to fill the GPU at small B, long enough loops at large B.

    Chosen from benchmarks/attention_kernel.py's sweeps (docs/figures/attention_sweep*.json): with
    2048 or more (row, head) pairs, one program per pair over the whole ring (no reduce pass,
    and nothing to do past the filled window), in 64-slot blocks for bf16 (the fastest at full
    windows). fp8 caches run on CUDA cores in 16-slot blocks, 2 warps, 4 stages deep (the fastest
    of benchmarks/fp8_attention_variants.py's variants at large B), with the same split lengths."""
    if B * H >= 2048 and S > 64:
        if fp8:
            return AttentionLaunch(16, _cdiv(S, 16), 4, 2)
        return AttentionLaunch(64, _cdiv(S, 64), 3, 4)
    block_n = max(16, min(64, _pow2(S)))
    blocks = 2 if B * H <= 64 else (4 if B * H <= 512 else 8)
    one_split = block_n * blocks >= S  # short rings (the depformer's, Mimi's): nothing to pipeline
    if fp8:
        return AttentionLaunch(16, block_n * blocks // 16, 1 if one_split else 4, 2)
    return AttentionLaunch(block_n, blocks, 1 if one_split else 3, 4)


def row_order(pos: torch.Tensor, H: int, S: int, fp8: bool) -> torch.Tensor | None:
    """Rows longest filled window first, for `decode_attention(order=)`, where the default launch
    runs one program a (row, head) (else None): programs start roughly in grid order, so the
    longest ones no longer start last and leave the GPU's tail half idle (rows of mixed lengths)."""
    launch = attention_launch(pos.shape[0], H, S, fp8)
    if launch.block_n * launch.blocks < S:
        return None
    return torch.argsort(pos.clamp(max=S), descending=True)


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, slot_pos: torch.Tensor, pos: torch.Tensor,
                     context: int | None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None,
                     launch: AttentionLaunch | None = None, write: bool = False,
                     exec_mask: torch.Tensor | None = None, order: torch.Tensor | None = None,
                     block_table: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 caches (`k_scale` / `v_scale` [B, H, S] fp32 given): slot n holds cache[n] * scale[n].
    `launch`: block shape and grid (default `attention_launch`; benchmarks sweep others).
    `order` [B] (`row_order`): the order in which a launch of one program a (row, head) takes the
    rows; split launches need none and refuse one. The outputs do not depend on it.
    `write` (bf16 / fp32 caches): also store k_new, v_new at slot pos % S of the rows where
    `exec_mask` is True (all rows without one), as `rope_write` would without RoPE: inside the
    attention kernel when one program covers a row's ring (the depformer's), else after it.
    `block_table`: paged caches (see the module doc)."""
    jit = triton_kernels()
    (B, H, D), S = q.shape, slot_pos.shape[1]
    paged = _paging(block_table, cache_k, B, S)
    _check_attention_strides(q, k_new, v_new, cache_k, cache_v, slot_pos)
    kv_rep = _kv_repeat(H, cache_k)
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    block_n, blocks, stages, warps = launch or attention_launch(B, H, S, k_scale is not None)
    split = block_n * blocks
    num_splits = _cdiv(S, split)
    ieee = cache_k.dtype == torch.float32
    fp8 = k_scale is not None
    qk_scale = (D ** -0.5) * 1.4426950408889634
    common = (q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1))
    ctx = int(context) if context is not None else 0
    assert not (write and fp8), "write= takes bf16 / fp32 caches (rope_write quantizes fp8 ones)"
    ex = exec_mask.view(torch.uint8) if exec_mask is not None else q
    final = num_splits == 1
    assert order is None or final, "order= takes launches of one split a ring"
    rows = order if order is not None else pos
    m_tmp, l_tmp, acc_tmp = (out,) * 3 if final else _split_scratch(B * H * num_splits, D, q.device)
    strides = (cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
               cache_v.stride(0), cache_v.stride(1), cache_v.stride(2))
    table = (block_table, block_table.stride(0)) if paged else (pos, 0)
    shape = dict(D=D, BLOCK_N=block_n, SPLIT=split, NUM_SPLITS=num_splits, HAS_CONTEXT=context is not None,
                 FINAL=final, STAGES=stages, HAS_ORDER=order is not None, num_warps=warps,
                 PAGED=paged, BS=cache_k.shape[2] if paged else 1, KV_REP=kv_rep)
    if fp8:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1
        jit.attn_fp8_kernel[(B * H, num_splits)](
            q, k_new, v_new, cache_k, cache_v, k_scale, v_scale, slot_pos, pos, rows, out, m_tmp, l_tmp, acc_tmp,
            H, S, ctx, qk_scale, *common, *strides, k_scale.stride(0), k_scale.stride(1), slot_pos.stride(0),
            out.stride(0), out.stride(1), *table, **shape)
    else:
        jit.attn_split_kernel[(B * H, num_splits)](
            q, k_new, v_new, cache_k, cache_v, slot_pos, pos, ex, rows, out, m_tmp, l_tmp, acc_tmp,
            H, S, ctx, qk_scale, *common, *strides, slot_pos.stride(0), out.stride(0), out.stride(1), *table,
            IEEE=ieee, WRITE=write and final, HAS_EXEC=exec_mask is not None, **shape)
    if final:
        return out
    jit.attn_reduce_kernel[(B * H,)](
        q, k_new, v_new, pos, out, m_tmp, l_tmp, acc_tmp, H, S, qk_scale, *common, out.stride(0), out.stride(1),
        D=D, SPLIT=split, NUM_SPLITS=num_splits, NS_P2=_pow2(num_splits), num_warps=4, KV_REP=kv_rep)
    if write:  # after every split has read the ring
        _write_kv(k_new, v_new, pos, exec_mask, cache_k, cache_v, block_table, S)
    return out


def _check_attention_strides(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache_k: torch.Tensor,
                             cache_v: torch.Tensor, slot_pos: torch.Tensor) -> None:
    """`decode_attention`'s layout: unit stride along the head dim (and slots), a power-of-two head dim,
    the new key and value with the caches' (KV) heads."""
    D = q.shape[2]
    assert k_new.shape[1] == v_new.shape[1] == cache_v.shape[1] == cache_k.shape[1], "k_new, v_new: the caches' heads"
    assert cache_k.stride(3) == 1 and cache_v.stride(3) == 1 and q.stride(2) == 1
    assert k_new.stride(2) == 1 and v_new.stride(2) == 1 and slot_pos.stride(1) == 1
    assert D == _pow2(D), f"head dim {D} must be a power of two"


def _kv_repeat(H: int, cache_k: torch.Tensor) -> int:
    """Query heads per KV head: the caches hold H / r heads (dense and paged alike: dim 1)."""
    kv_heads = cache_k.shape[1]
    assert H % kv_heads == 0, f"{H} query heads over {kv_heads} KV heads"
    return H // kv_heads


def _split_scratch(programs: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each split's running max, denominator and value sum, for the reduce pass."""
    m_tmp = torch.empty(programs, dtype=torch.float32, device=device)
    return m_tmp, torch.empty_like(m_tmp), torch.empty(programs * D, dtype=torch.float32, device=device)


def _paging(block_table: torch.Tensor | None, cache_k: torch.Tensor, B: int, S: int) -> bool:
    """Whether the caches are paged pools (checked against the table), else dense [B, H, S, D] rings."""
    if block_table is None:
        assert cache_k.shape[2] == S, "a dense ring is [B, H, S, D]"
        return False
    bs = cache_k.shape[2]
    assert block_table.shape == (B, -(-S // bs)), f"a block table [{B}, ceil({S} / {bs})] for this ring"
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    return True


def _write_kv(k_new: torch.Tensor, v_new: torch.Tensor, pos: torch.Tensor, exec_mask: torch.Tensor | None,
              cache_k: torch.Tensor, cache_v: torch.Tensor, block_table: torch.Tensor | None = None,
              S: int | None = None) -> None:
    """cache[b, :, pos[b] % S] = new[b] for executing rows (rope_write's store without RoPE); paged
    caches through the block table, never into the null block 0."""
    B, H, D = k_new.shape
    keep = exec_mask if exec_mask is not None else torch.ones_like(pos, dtype=torch.bool)
    if block_table is not None:
        bs = cache_k.shape[2]
        slot = pos % S
        blk = block_table.long().gather(1, torch.div(slot, bs, rounding_mode="floor")[:, None])[:, 0]
        keep = (keep & (blk != 0))[:, None, None]
        for cache, new in ((cache_k, k_new), (cache_v, v_new)):
            cache[blk, :, slot % bs] = torch.where(keep, new, cache[blk, :, slot % bs])
        return
    keep = keep[:, None, None]
    index = (pos % cache_k.shape[2])[:, None, None, None].expand(B, H, 1, D)
    for cache, new in ((cache_k, k_new), (cache_v, v_new)):
        cache.scatter_(2, index, torch.where(keep, new, cache.gather(2, index)[:, :, 0])[:, :, None])


def rope_write(qkv: torch.Tensor, H: int, D: int, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
               pos: torch.Tensor, exec_mask: torch.Tensor | None, cache_k: torch.Tensor,
               cache_v: torch.Tensor, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None, steps: int = 1,
               block_table: torch.Tensor | None = None, capacity: int | None = None,
               interleave: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, (H + 2*Hkv)*D] -> q (rotated, [B, H, D]), k (rotated, [B, Hkv, D]), v (a view,
    [B, Hkv, D]); k, v written to slot pos % S of executing rows' caches (fp8 caches: quantized
    with a per-(row, head, slot) scale, written to `k_scale` / `v_scale` [B, Hkv, S]; see
    `quantize_kv`). Hkv: the caches' heads (H without grouped KV heads). `interleave`: RoPE on
    pairs (`rope`), else on halves (`rope_concat`).

    `steps` T > 1: qkv [R * T, 3*H*D] holds T consecutive steps of each of R rows (row-major), step
    t of row r at position pos[r] + t (written to slot (pos[r] + t) % S), with cos_sin per step
    ([R * T, D / 2]); exec_mask and pos stay per row [R]; q and k come back [R * T, H, D].

    `block_table` [R, ceil(S / bs)] int32: paged caches (see `decode_attention`), with the ring's
    `capacity` S (a partial last block leaves it no multiple of bs)."""
    jit = triton_kernels()
    B = qkv.shape[0]
    assert block_table is None or capacity is not None, "paged caches take the ring's capacity"
    S = cache_k.shape[2] if block_table is None else capacity
    assert capacity in (None, S), f"a dense ring of {S} slots, not {capacity}"
    paged = _paging(block_table, cache_k, pos.shape[0], S)
    assert B % steps == 0 and pos.shape[0] * steps == B, "qkv must hold `steps` steps of every row"
    assert qkv.stride(1) == 1 and cache_k.stride(3) == 1 and cache_v.stride(3) == 1
    kv_rep = _kv_repeat(H, cache_k)
    kv_heads = H // kv_rep
    assert qkv.shape[1] == (H + 2 * kv_heads) * D, f"qkv rows of {H} query and 2 x {kv_heads} KV heads"
    q_out = torch.empty(B, H, D, dtype=qkv.dtype, device=qkv.device)
    k_out = torch.empty(B, kv_heads, D, dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos_sin if cos_sin is not None else (qkv, qkv)
    ex = exec_mask.view(torch.uint8) if exec_mask is not None else qkv
    fp8 = k_scale is not None
    if fp8:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1
    ks, vs = (k_scale, v_scale) if fp8 else (qkv, qkv)
    jit.rope_write_kernel[(B * H,)](
        qkv, cos, sin, pos, ex, q_out, k_out, cache_k, cache_v, ks, vs, H, S, steps, qkv.stride(0),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(0), cache_v.stride(1), cache_v.stride(2),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        *((block_table, block_table.stride(0)) if paged else (pos, 0)),
        D=D, HAS_ROPE=cos_sin is not None, HAS_EXEC=exec_mask is not None, KV_FP8=fp8, num_warps=1,
        PAGED=paged, BS=cache_k.shape[2] if paged else 1, KV_REP=kv_rep, INTERLEAVE=interleave)
    v = qkv[:, (H + kv_heads) * D:].view(B, kv_heads, D)
    return q_out, k_out, v


def rms_norm(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, N] (last dim contiguous) -> x * alpha / sqrt(eps + mean(x^2)), in fp32, cast back."""
    jit = triton_kernels()
    assert x.stride(-1) == 1
    B, N = x.shape
    y = torch.empty_like(x)
    jit.add_rms_norm_kernel[(B,)](x, x, x, alpha, x, y, N, eps, x.stride(0), 0, 0, y.stride(0),
                               BLOCK=_pow2(N), HAS_U=False, HAS_LS=False, num_warps=8)
    return y


def add_rms_norm(res: torch.Tensor, upd: torch.Tensor, scale: torch.Tensor | None, alpha: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """new = res + scale * upd (rounded to upd's dtype, as the layer does; no scale: + upd), and
    rms_norm(new, alpha, eps)."""
    jit = triton_kernels()
    assert res.stride(-1) == 1 and upd.stride(-1) == 1
    B, N = upd.shape
    new = torch.empty_like(upd)
    y = torch.empty_like(upd)
    jit.add_rms_norm_kernel[(B,)](res, upd, scale if scale is not None else upd, alpha, new, y, N, eps,
                               res.stride(0), upd.stride(0), new.stride(0), y.stride(0),
                               BLOCK=_pow2(N), HAS_U=True, HAS_LS=scale is not None, num_warps=8)
    return new, y


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    jit = triton_kernels()
    B, F2 = h.shape
    F = F2 // 2
    out = torch.empty(B, F, dtype=h.dtype, device=h.device)
    block = 1024
    jit.silu_mul_kernel[(B, _cdiv(F, block))](h, out, F, h.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           noise: torch.Tensor) -> torch.Tensor:
    jit = triton_kernels()
    B, V = logits.shape
    assert logits.stride(1) == 1 and noise.stride(1) == 1
    assert temperature.stride(0) == 1 and top_k.stride(0) == 1  # the kernel reads them as flat [B]
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    block = _pow2(V)
    num_warps = 32 if block >= 16384 else (16 if block >= 4096 else 8)
    jit.sample_kernel[(B,)](logits, noise, temperature, top_k, out, V, logits.stride(0), noise.stride(0),
                         BLOCK=block, num_warps=num_warps)
    return out
