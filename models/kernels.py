"""Fused CUDA kernels (Triton) for the one-step (T == 1) streaming decode, and for sampling.
RoPE + ring write also serves calls of a few steps (Mimi's transformers, 2 steps a frame).

A leaf module: it takes plain tensors and numbers, never model objects, and imports nothing
from the rest of Parley.

    available(x) -> bool                      # CUDA tensor (or TRITON_INTERPRET=1), Triton importable, switched on
    set_enabled(flag) -> previous flag;  with enabled(flag): ...    # the one switch
    q, k, v = rope_write(qkv[B, 3*H*D], H, D, cos_sin | None, pos[B], exec_mask[B] | None, cache_k, cache_v)
    q, k, v = rope_write(qkv[B*T, 3*H*D], ..., steps=T)   # T steps of each row, row-major
    out = decode_attention(q[B,H,D], k_new[B,H,D], v_new[B,H,D], cache_k[B,H,S,D], cache_v, slot_pos[B,S],
                           pos[B], context | None)        # [B, H, D]
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

bf16 / fp32 caches run tensor-core dots (the query row repeated 16 times); fp8 caches run fp32
products on CUDA cores (a tensor-core fp8 loop needed ~250 registers and was issue-bound).

Paged rings (models/paged_kv.py; `block_table=` [B, S // bs] int32 on decode_attention and
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
from typing import Iterator, NamedTuple

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs run the plain PyTorch path.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    _HAVE_TRITON = False


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


def have_triton() -> bool:
    return _HAVE_TRITON


# TRITON_INTERPRET=1 (Triton's own switch): its interpreter runs the kernels on CPU tensors in
# numpy, so the whole CUDA path can be tested without a GPU (tests/interpreted_kernels.py); slow.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available(x: torch.Tensor) -> bool:
    return _switch["on"] and _HAVE_TRITON and (x.is_cuda or (INTERPRETED and x.device.type == "cpu"))


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if _HAVE_TRITON:

    @triton.jit
    def _attn_program(ORDER, POS, H, S, HAS_ORDER: tl.constexpr):
        """This program's (row, head) pair bh and split, its row b and head h, the row's query
        position, filled slots and current slot."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H
        if HAS_ORDER:  # (one split a ring) rows in the given order: the longest windows start first
            b = tl.load(ORDER + b)
        h = bh % H
        qpos = tl.load(POS + b)
        return bh, split, b, h, qpos, tl.minimum(qpos, S), qpos % S

    @triton.jit
    def _new_key(q, KN, VN, b, h, d, skn_b, skn_h, svn_b, svn_h, qk_scale):
        """The step's own key and value (never in the ring the loop reads): the key's score
        against q (fp32 [D]) in log2 units, and the value in fp32."""
        kn = tl.load(KN + b * skn_b + h * skn_h + d).to(tl.float32)
        vn = tl.load(VN + b * svn_b + h * svn_h + d).to(tl.float32)
        return tl.sum(kn * q, axis=0) * qk_scale, vn

    @triton.jit
    def _page(TABLE, b, stb, n, mask, BS: tl.constexpr):
        """Paged rings: the pool block (int64: pools pass 2^31 elements) and the slot within it of
        ring slots n of row b. Masked lanes read the null block 0."""
        blk = tl.load(TABLE + b * stb + n // BS, mask=mask, other=0).to(tl.int64)
        return blk, n % BS

    @triton.jit
    def _page_bounds(start, end, BS: tl.constexpr, PP: tl.constexpr):
        """Paged loops step over the ring's blocks each padded to PP slots (a whole number of
        tiles), so that a tile never straddles two blocks: the padded range covering [start, end)."""
        return (start // BS) * PP, ((end + BS - 1) // BS) * PP

    @triton.jit
    def _page_tile(TABLE, b, stb, n0, offs_n, start, end, BS: tl.constexpr, PP: tl.constexpr):
        """The tile at padded offset n0: its ring slots n, which to read (in the block, in
        [start, end)), its pool block (one table read a tile; int64: pools pass 2^31 elements) and
        the slots' place w in that block."""
        j = n0 // PP
        w = n0 % PP + offs_n
        n = j * BS + w
        return n, (w < BS) & (n >= start) & (n < end), tl.load(TABLE + b * stb + j).to(tl.int64), w

    @triton.jit
    def _attn_split_kernel(Q, KN, VN, K, V, SP, POS, EXEC, ORDER, OUT, M_TMP, L_TMP, ACC_TMP,
                           H, S, context, qk_scale,
                           sq_b, sq_h, skn_b, skn_h, svn_b, svn_h,
                           sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, ssp_b, so_b, so_h, TABLE, stb,
                           D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                           NUM_SPLITS: tl.constexpr, HAS_CONTEXT: tl.constexpr, FINAL: tl.constexpr,
                           IEEE: tl.constexpr, STAGES: tl.constexpr, HAS_ORDER: tl.constexpr,
                           WRITE: tl.constexpr = False, HAS_EXEC: tl.constexpr = False,
                           PAGED: tl.constexpr = False, BS: tl.constexpr = 1):
        # bf16 / fp32 caches. The one query row is repeated over M = 16 rows so that both
        # products run as tensor-core dots (whose operand loads Triton pipelines); only row 0 is
        # stored. (fp8 caches: _attn_fp8_kernel.) PAGED: K, V are pools [blocks, H, BS, D] and
        # slot n of row b is at block TABLE[b, n // BS], slot n % BS (sk_b, sv_b: block strides);
        # the loop walks block by block (_page_bounds), one table read a tile.
        M: tl.constexpr = 16
        PP: tl.constexpr = (BS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        bh, split, b, h, qpos, n_valid, cur = _attn_program(ORDER, POS, H, S, HAS_ORDER)
        d = tl.arange(0, D)
        rows = tl.arange(0, M)
        q = tl.load(Q + b * sq_b + h * sq_h + d[None, :] + 0 * rows[:, None])  # [M, D]
        offs_n = tl.arange(0, BLOCK_N)
        k_base = K + b * sk_b + h * sk_h
        v_base = V + b * sv_b + h * sv_h
        sp_base = SP + b * ssp_b
        start = split * SPLIT
        end = tl.minimum(start + SPLIT, n_valid)
        acc = tl.zeros([M, D], dtype=tl.float32)
        m_i = tl.full([M], -1.0e30, tl.float32)
        l_i = tl.zeros([M], tl.float32)
        if PAGED:
            lo, hi = _page_bounds(start, end, BS, PP)
        else:
            lo, hi = start, end
        for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
            if PAGED:
                n, inb, blk, w = _page_tile(TABLE, b, stb, n0, offs_n, start, end, BS, PP)
                k = tl.load(K + blk * sk_b + h * sk_h + w[:, None] * sk_s + d[None, :], mask=inb[:, None], other=0.0)
                v = tl.load(V + blk * sv_b + h * sv_h + w[:, None] * sv_s + d[None, :], mask=inb[:, None], other=0.0)
            else:
                n = n0 + offs_n
                inb = n < end
                k = tl.load(k_base + n[:, None] * sk_s + d[None, :], mask=inb[:, None], other=0.0)
                v = tl.load(v_base + n[:, None] * sv_s + d[None, :], mask=inb[:, None], other=0.0)
            sp = tl.load(sp_base + n, mask=inb, other=-1)
            valid = inb & (sp >= 0) & (sp <= qpos) & (n != cur)
            if HAS_CONTEXT:
                valid = valid & (qpos - sp < context)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        row0 = rows == 0
        if FINAL:
            qf = tl.load(Q + b * sq_b + h * sq_h + d).to(tl.float32)
            s_new, vn = _new_key(qf, KN, VN, b, h, d, skn_b, skn_h, svn_b, svn_h, qk_scale)
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            acc = acc * alpha[:, None] + p_new[:, None] * vn[None, :]
            l_i = l_i * alpha + p_new
            out = acc / l_i[:, None]
            tl.store(OUT + b * so_b + h * so_h + d[None, :] + 0 * rows[:, None], out.to(OUT.dtype.element_ty),
                     mask=row0[:, None])
            if WRITE:
                # The new key and value go to slot `cur` (executing rows only) after the loop,
                # which never used that slot: no other program touches this (row, head).
                w = d >= 0
                if HAS_EXEC:  # (the flag compared as a [D] tensor: the interpreter takes no scalar in a mask)
                    w = w & (tl.load(EXEC + b) + 0 * d != 0)
                if PAGED:  # (never into the null block)
                    blk, off = _page(TABLE, b, stb, cur + 0 * d, w, BS)
                    w = w & (blk != 0)
                    k_at = K + blk * sk_b + h * sk_h + off * sk_s + d
                    v_at = V + blk * sv_b + h * sv_h + off * sv_s + d
                else:
                    k_at = K + b * sk_b + h * sk_h + cur * sk_s + d
                    v_at = V + b * sv_b + h * sv_h + cur * sv_s + d
                tl.store(k_at, tl.load(KN + b * skn_b + h * skn_h + d), mask=w)
                tl.store(v_at, tl.load(VN + b * svn_b + h * svn_h + d), mask=w)
        else:
            # Splits past the filled window store nothing: the reduce reads only filled splits.
            idx = bh * NUM_SPLITS + split
            st = row0 & (start + 0 * rows < n_valid)  # (a tensor: the interpreter takes no scalar in a mask)
            tl.store(M_TMP + idx + 0 * rows, m_i, mask=st)
            tl.store(L_TMP + idx + 0 * rows, l_i, mask=st)
            tl.store(ACC_TMP + idx * D + d[None, :] + 0 * rows[:, None], acc, mask=st[:, None])

    @triton.jit
    def _attn_fp8_kernel(Q, KN, VN, K, V, KS, VS, SP, POS, ORDER, OUT, M_TMP, L_TMP, ACC_TMP,
                         H, S, context, qk_scale,
                         sq_b, sq_h, skn_b, skn_h, svn_b, svn_h,
                         sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sks_b, sks_h, ssp_b, so_b, so_h, TABLE, stb,
                         D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, HAS_CONTEXT: tl.constexpr, FINAL: tl.constexpr,
                         STAGES: tl.constexpr, HAS_ORDER: tl.constexpr,
                         PAGED: tl.constexpr = False, BS: tl.constexpr = 1):
        # fp8 caches on CUDA cores: with one query row, tensor-core dots need the row repeated 16
        # times and a converted 128 x 128 tile in registers (195+ registers, 2 programs an SM,
        # issue-bound at ~2.9 TB/s on the H200); elementwise fp32 products over small blocks keep
        # ~128 registers and read ~4 TB/s (benchmarks/fp8_attention_variants.py, cc_lazy).
        # Each slot lane of the block keeps its own value sum and denominator (summed once at the
        # end), and the running max moves only when a block's max exceeds it by more than 2^8, so
        # most blocks skip the rescale (p stays <= 256: no fp32 overflow). PAGED: as in
        # _attn_split_kernel, the scales pools [blocks, H, BS] too (sks_b: their block stride).
        PP: tl.constexpr = (BS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        bh, split, b, h, qpos, n_valid, cur = _attn_program(ORDER, POS, H, S, HAS_ORDER)
        d = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + h * sq_h + d).to(tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        k_base = K + b * sk_b + h * sk_h
        v_base = V + b * sv_b + h * sv_h
        sp_base = SP + b * ssp_b
        ks_base = KS + b * sks_b + h * sks_h
        vs_base = VS + b * sks_b + h * sks_h
        start = split * SPLIT
        end = tl.minimum(start + SPLIT, n_valid)
        acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_N], tl.float32)
        m_i = tl.full([], -1.0e30, tl.float32)
        if PAGED:
            lo, hi = _page_bounds(start, end, BS, PP)
        else:
            lo, hi = start, end
        for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
            if PAGED:
                n, inb, blk, w = _page_tile(TABLE, b, stb, n0, offs_n, start, end, BS, PP)
                sp = tl.load(sp_base + n, mask=inb, other=-1)
                k_sc = tl.load(KS + blk * sks_b + h * sks_h + w, mask=inb, other=0.0)
                v_sc = tl.load(VS + blk * sks_b + h * sks_h + w, mask=inb, other=0.0)
            else:
                n = n0 + offs_n
                inb = n < end
                sp = tl.load(sp_base + n, mask=inb, other=-1)
                k_sc = tl.load(ks_base + n, mask=inb, other=0.0)
                v_sc = tl.load(vs_base + n, mask=inb, other=0.0)
            valid = inb & (sp >= 0) & (sp <= qpos) & (n != cur)
            if HAS_CONTEXT:
                valid = valid & (qpos - sp < context)
            if PAGED:
                k = tl.load(K + blk * sk_b + h * sk_h + w[:, None] * sk_s + d[None, :], mask=inb[:, None], other=0.0)
            else:
                k = tl.load(k_base + n[:, None] * sk_s + d[None, :], mask=inb[:, None], other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * (k_sc * qk_scale)
            s = tl.where(valid, s, float("-inf"))
            m_blk = tl.max(s, axis=0)
            if m_blk > m_i + 8.0:
                alpha = tl.exp2(m_i - m_blk)
                acc = acc * alpha
                l_i = l_i * alpha
                m_i = m_blk
            p = tl.exp2(s - m_i)
            if PAGED:
                v = tl.load(V + blk * sv_b + h * sv_h + w[:, None] * sv_s + d[None, :], mask=inb[:, None], other=0.0)
            else:
                v = tl.load(v_base + n[:, None] * sv_s + d[None, :], mask=inb[:, None], other=0.0)
            acc += (p * v_sc)[:, None] * v.to(tl.float32)
            l_i += p
        acc_d = tl.sum(acc, axis=0)
        l_s = tl.sum(l_i, axis=0)
        if FINAL:
            s_new, vn = _new_key(q, KN, VN, b, h, d, skn_b, skn_h, svn_b, svn_h, qk_scale)
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            out = (acc_d * alpha + p_new * vn) / (l_s * alpha + p_new)
            tl.store(OUT + b * so_b + h * so_h + d, out.to(OUT.dtype.element_ty))
        else:
            # Splits past the filled window store nothing: the reduce reads only filled splits.
            idx = bh * NUM_SPLITS + split
            st = start < n_valid
            tl.store(M_TMP + idx, m_i, mask=st)
            tl.store(L_TMP + idx, l_s, mask=st)
            tl.store(ACC_TMP + idx * D + d, acc_d, mask=(start + 0 * d) < n_valid)

    @triton.jit
    def _attn_reduce_kernel(Q, KN, VN, POS, OUT, M_TMP, L_TMP, ACC_TMP, H, S, qk_scale,
                            sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, so_b, so_h,
                            D: tl.constexpr, SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
                            NS_P2: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        d = tl.arange(0, D)
        sidx = tl.arange(0, NS_P2)
        n_valid = tl.minimum(tl.load(POS + b), S)
        smask = (sidx < NUM_SPLITS) & (sidx * SPLIT < n_valid)
        m = tl.load(M_TMP + bh * NUM_SPLITS + sidx, mask=smask, other=-1.0e30)
        l = tl.load(L_TMP + bh * NUM_SPLITS + sidx, mask=smask, other=0.0)
        acc = tl.load(ACC_TMP + (bh * NUM_SPLITS + sidx)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
        q = tl.load(Q + b * sq_b + h * sq_h + d).to(tl.float32)
        s_new, vn = _new_key(q, KN, VN, b, h, d, skn_b, skn_h, svn_b, svn_h, qk_scale)
        m_all = tl.maximum(tl.max(m, axis=0), s_new)
        w = tl.exp2(m - m_all)
        p_new = tl.exp2(s_new - m_all)
        denom = tl.sum(l * w, axis=0) + p_new
        num = tl.sum(acc * w[:, None], axis=0) + p_new * vn
        tl.store(OUT + b * so_b + h * so_h + d, (num / denom).to(OUT.dtype.element_ty))

    @triton.jit
    def _rope_write_kernel(QKV, COS, SIN, POS, EXEC, QO, KO, K, V, KS, VS,
                           H, S, T, s_qkv_b, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sks_b, sks_h, TABLE, stb,
                           D: tl.constexpr, HAS_ROPE: tl.constexpr, HAS_EXEC: tl.constexpr,
                           KV_FP8: tl.constexpr, PAGED: tl.constexpr = False, BS: tl.constexpr = 1):
        # One program per (row step bt = b * T + t, head): step t of row b is at position POS[b] + t.
        # PAGED: the slot is written through the block table (never into the null block 0).
        bh = tl.program_id(0)
        bt = bh // H
        h = bh % H
        b = bt // T
        HALF: tl.constexpr = D // 2
        HD = H * D
        base = QKV + bt * s_qkv_b + h * D
        i = tl.arange(0, HALF)
        qpos = tl.load(POS + b) + bt % T
        slot = qpos % S
        write = i >= 0
        if HAS_EXEC:  # (the flag compared as a tensor: the interpreter takes no scalar in a mask)
            write = write & (tl.load(EXEC + b) + 0 * i != 0)
        out_ty = QO.dtype.element_ty
        qr = tl.load(base + 2 * i)
        qi = tl.load(base + 2 * i + 1)
        kr = tl.load(base + HD + 2 * i)
        ki = tl.load(base + HD + 2 * i + 1)
        if HAS_ROPE:
            c = tl.load(COS + bt * HALF + i)
            s = tl.load(SIN + bt * HALF + i)
            qr32, qi32 = qr.to(tl.float32), qi.to(tl.float32)
            kr32, ki32 = kr.to(tl.float32), ki.to(tl.float32)
            qr = (qr32 * c - qi32 * s).to(out_ty)
            qi = (qr32 * s + qi32 * c).to(out_ty)
            kr = (kr32 * c - ki32 * s).to(out_ty)
            ki = (kr32 * s + ki32 * c).to(out_ty)
        o = (bt * H + h) * D
        tl.store(QO + o + 2 * i, qr)
        tl.store(QO + o + 2 * i + 1, qi)
        tl.store(KO + o + 2 * i, kr)
        tl.store(KO + o + 2 * i + 1, ki)
        if PAGED:
            blk, off = _page(TABLE, b, stb, slot + 0 * i, write, BS)
            write = write & (blk != 0)
            kc = K + blk * sk_b + h * sk_h + off * sk_s
            vc = V + blk * sv_b + h * sv_h + off * sv_s
            so = blk * sks_b + h * sks_h + off
        else:
            kc = K + b * sk_b + h * sk_h + slot * sk_s
            vc = V + b * sv_b + h * sv_h + slot * sv_s
            so = b * sks_b + h * sks_h + slot
        vr = tl.load(base + 2 * HD + 2 * i)
        vi = tl.load(base + 2 * HD + 2 * i + 1)
        if KV_FP8:
            # Per (row, head, slot) scale: the vector's max |x| maps to e4m3's largest value 448.
            cache_ty = K.dtype.element_ty
            k_sc = tl.maximum(tl.maximum(tl.max(tl.abs(kr.to(tl.float32)), axis=0),
                                         tl.max(tl.abs(ki.to(tl.float32)), axis=0)) / 448.0, 1e-30)
            v_sc = tl.maximum(tl.maximum(tl.max(tl.abs(vr.to(tl.float32)), axis=0),
                                         tl.max(tl.abs(vi.to(tl.float32)), axis=0)) / 448.0, 1e-30)
            tl.store(kc + 2 * i, tl.clamp(kr.to(tl.float32) / k_sc, -448.0, 448.0).to(cache_ty), mask=write)
            tl.store(kc + 2 * i + 1, tl.clamp(ki.to(tl.float32) / k_sc, -448.0, 448.0).to(cache_ty), mask=write)
            tl.store(vc + 2 * i, tl.clamp(vr.to(tl.float32) / v_sc, -448.0, 448.0).to(cache_ty), mask=write)
            tl.store(vc + 2 * i + 1, tl.clamp(vi.to(tl.float32) / v_sc, -448.0, 448.0).to(cache_ty), mask=write)
            row0 = i == 0
            tl.store(KS + so + 0 * i, k_sc + 0.0 * i, mask=write & row0)
            tl.store(VS + so + 0 * i, v_sc + 0.0 * i, mask=write & row0)
        else:
            tl.store(kc + 2 * i, kr, mask=write)
            tl.store(kc + 2 * i + 1, ki, mask=write)
            tl.store(vc + 2 * i, vr, mask=write)
            tl.store(vc + 2 * i + 1, vi, mask=write)

    @triton.jit
    def _add_rms_norm_kernel(X, U, LS, ALPHA, RES, Y, N, eps, sx, su, sr, sy,
                             BLOCK: tl.constexpr, HAS_U: tl.constexpr, HAS_LS: tl.constexpr):
        b = tl.program_id(0)
        o = tl.arange(0, BLOCK)
        msk = o < N
        x = tl.load(X + b * sx + o, mask=msk, other=0.0).to(tl.float32)
        if HAS_U:
            res_ty = RES.dtype.element_ty
            u = tl.load(U + b * su + o, mask=msk, other=0.0).to(tl.float32)
            if HAS_LS:
                u = (tl.load(LS + o, mask=msk, other=0.0).to(tl.float32) * u).to(res_ty).to(tl.float32)
            xr = (x + u).to(res_ty)
            tl.store(RES + b * sr + o, xr, mask=msk)
            x = xr.to(tl.float32)
        var = eps + tl.sum(x * x, axis=0) / N
        a = tl.load(ALPHA + o, mask=msk, other=0.0).to(tl.float32)
        y = x * (a * (1.0 / tl.sqrt(var)))
        tl.store(Y + b * sy + o, y.to(Y.dtype.element_ty), mask=msk)

    @triton.jit
    def _silu_mul_kernel(Hx, OUT, F, sh, so, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        msk = o < F
        a = tl.load(Hx + b * sh + o, mask=msk, other=0.0).to(tl.float32)
        g = tl.load(Hx + b * sh + F + o, mask=msk, other=0.0).to(tl.float32)
        ty = OUT.dtype.element_ty
        act = (a / (1.0 + tl.exp(-a))).to(ty).to(tl.float32)
        tl.store(OUT + b * so + o, (act * g).to(ty), mask=msk)

    @triton.jit
    def _sample_kernel(LOGITS, NOISE, TEMP, TOPK, OUT, V, sl, sn, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        o = tl.arange(0, BLOCK)
        msk = o < V
        x = tl.load(LOGITS + b * sl + o, mask=msk, other=float("-inf")).to(tl.float32)
        greedy = tl.argmax(x, axis=0)
        temp = tl.load(TEMP + b).to(tl.float32)
        k = tl.load(TOPK + b).to(tl.int64)
        k = tl.where((k > 0) & (k < V), k, V)
        # Order-preserving int32 keys of the fp32 logits; padding gets the smallest key.
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        key = tl.where(msk, key, -2147483648)
        # Largest t with count(key >= t) >= k: the k-th largest key (bisection, 32 steps).
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            cnt = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
            ok = cnt >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        keep = msk & (key >= lo.to(tl.int32))
        t = tl.where(temp > 0, temp, 1.0)
        mx = tl.max(x, axis=0)
        p = tl.where(keep, tl.exp((x - mx) / t), 0.0)
        noise = tl.load(NOISE + b * sn + o, mask=msk, other=1.0)
        sampled = tl.argmax(p / noise, axis=0)
        tl.store(OUT + b, tl.where(temp > 0, sampled, greedy).to(tl.int64))


# ---------------------------------------------------------------------------------------------
# Wrappers


class AttentionLaunch(NamedTuple):
    block_n: int  # slots per loop iteration
    blocks: int  # loop iterations per program: a program covers block_n * blocks slots of a row's window
    stages: int  # software-pipelining depth of the loop's loads
    warps: int


def attention_launch(B: int, H: int, S: int, fp8: bool) -> AttentionLaunch:
    """Programs per (row, head): enough to fill the GPU at small B, long enough loops at large B.

    From benchmarks/attention_kernel.py on the H200 (docs/figures/attention_sweep*.json), with
    2048 or more (row, head) pairs: one program per pair over the whole ring (no reduce pass,
    and nothing to do past the filled window), in 64-slot blocks for bf16 (4.5 TB/s at full
    windows). fp8 caches run on CUDA cores in 16-slot blocks, 2 warps, 4 stages deep
    (benchmarks/fp8_attention_variants.py: 4.0 TB/s at B = 128 full), with the same split lengths."""
    if B * H >= 2048 and S > 64:
        if fp8:
            return AttentionLaunch(16, triton.cdiv(S, 16), 4, 2)
        return AttentionLaunch(64, triton.cdiv(S, 64), 3, 4)
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
    B, H, D = q.shape
    S = slot_pos.shape[1]
    paged = _paging(block_table, cache_k, B, S)
    _check_attention_strides(q, k_new, v_new, cache_k, cache_v, slot_pos)
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    block_n, blocks, stages, warps = launch or attention_launch(B, H, S, k_scale is not None)
    split = block_n * blocks
    num_splits = triton.cdiv(S, split)
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
                 PAGED=paged, BS=cache_k.shape[2] if paged else 1)
    if fp8:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1
        _attn_fp8_kernel[(B * H, num_splits)](
            q, k_new, v_new, cache_k, cache_v, k_scale, v_scale, slot_pos, pos, rows, out, m_tmp, l_tmp, acc_tmp,
            H, S, ctx, qk_scale, *common, *strides, k_scale.stride(0), k_scale.stride(1), slot_pos.stride(0),
            out.stride(0), out.stride(1), *table, **shape)
    else:
        _attn_split_kernel[(B * H, num_splits)](
            q, k_new, v_new, cache_k, cache_v, slot_pos, pos, ex, rows, out, m_tmp, l_tmp, acc_tmp,
            H, S, ctx, qk_scale, *common, *strides, slot_pos.stride(0), out.stride(0), out.stride(1), *table,
            IEEE=ieee, WRITE=write and final, HAS_EXEC=exec_mask is not None, **shape)
    if final:
        return out
    _attn_reduce_kernel[(B * H,)](
        q, k_new, v_new, pos, out, m_tmp, l_tmp, acc_tmp, H, S, qk_scale, *common, out.stride(0), out.stride(1),
        D=D, SPLIT=split, NUM_SPLITS=num_splits, NS_P2=_pow2(num_splits), num_warps=4)
    if write:  # after every split has read the ring
        _write_kv(k_new, v_new, pos, exec_mask, cache_k, cache_v, block_table)
    return out


def _check_attention_strides(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache_k: torch.Tensor,
                             cache_v: torch.Tensor, slot_pos: torch.Tensor) -> None:
    """`decode_attention`'s layout: unit stride along the head dim (and slots), a power-of-two head dim."""
    D = q.shape[2]
    assert cache_k.stride(3) == 1 and cache_v.stride(3) == 1 and q.stride(2) == 1
    assert k_new.stride(2) == 1 and v_new.stride(2) == 1 and slot_pos.stride(1) == 1
    assert D == _pow2(D), f"head dim {D} must be a power of two"


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
    assert S % bs == 0 and block_table.shape == (B, S // bs), f"a block table [{B}, {S} // {bs}] for this ring"
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    return True


def _write_kv(k_new: torch.Tensor, v_new: torch.Tensor, pos: torch.Tensor, exec_mask: torch.Tensor | None,
              cache_k: torch.Tensor, cache_v: torch.Tensor, block_table: torch.Tensor | None = None) -> None:
    """cache[b, :, pos[b] % S] = new[b] for executing rows (rope_write's store without RoPE); paged
    caches through the block table, never into the null block 0."""
    B, H, D = k_new.shape
    keep = exec_mask if exec_mask is not None else torch.ones_like(pos, dtype=torch.bool)
    if block_table is not None:
        bs = cache_k.shape[2]
        slot = pos % (block_table.shape[1] * bs)
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
               block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, 3*H*D] -> q, k (rotated, [B, H, D]), v (a view); k, v written to slot pos % S of
    executing rows' caches (fp8 caches: quantized with a per-(row, head, slot) scale, written to
    `k_scale` / `v_scale` [B, H, S]; see `quantize_kv`).

    `steps` T > 1: qkv [R * T, 3*H*D] holds T consecutive steps of each of R rows (row-major), step
    t of row r at position pos[r] + t (written to slot (pos[r] + t) % S), with cos_sin per step
    ([R * T, D / 2]); exec_mask and pos stay per row [R]; q and k come back [R * T, H, D].

    `block_table` [R, S // bs] int32: paged caches (see `decode_attention`), S = its columns * bs."""
    B = qkv.shape[0]
    S = cache_k.shape[2] if block_table is None else block_table.shape[1] * cache_k.shape[2]
    paged = _paging(block_table, cache_k, pos.shape[0], S)
    assert B % steps == 0 and pos.shape[0] * steps == B, "qkv must hold `steps` steps of every row"
    assert qkv.stride(1) == 1 and cache_k.stride(3) == 1 and cache_v.stride(3) == 1
    q_out = torch.empty(B, H, D, dtype=qkv.dtype, device=qkv.device)
    k_out = torch.empty_like(q_out)
    cos, sin = cos_sin if cos_sin is not None else (qkv, qkv)
    ex = exec_mask.view(torch.uint8) if exec_mask is not None else qkv
    fp8 = k_scale is not None
    if fp8:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1
    ks, vs = (k_scale, v_scale) if fp8 else (qkv, qkv)
    _rope_write_kernel[(B * H,)](
        qkv, cos, sin, pos, ex, q_out, k_out, cache_k, cache_v, ks, vs, H, S, steps, qkv.stride(0),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(0), cache_v.stride(1), cache_v.stride(2),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        *((block_table, block_table.stride(0)) if paged else (pos, 0)),
        D=D, HAS_ROPE=cos_sin is not None, HAS_EXEC=exec_mask is not None, KV_FP8=fp8, num_warps=1,
        PAGED=paged, BS=cache_k.shape[2] if paged else 1)
    v = qkv[:, 2 * H * D:].view(B, H, D)
    return q_out, k_out, v


def rms_norm(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, N] (last dim contiguous) -> x * alpha / sqrt(eps + mean(x^2)), in fp32, cast back."""
    assert x.stride(-1) == 1
    B, N = x.shape
    y = torch.empty_like(x)
    _add_rms_norm_kernel[(B,)](x, x, x, alpha, x, y, N, eps, x.stride(0), 0, 0, y.stride(0),
                               BLOCK=_pow2(N), HAS_U=False, HAS_LS=False, num_warps=8)
    return y


def add_rms_norm(res: torch.Tensor, upd: torch.Tensor, scale: torch.Tensor | None, alpha: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """new = res + scale * upd (rounded to upd's dtype, as the layer does; no scale: + upd), and
    rms_norm(new, alpha, eps)."""
    assert res.stride(-1) == 1 and upd.stride(-1) == 1
    B, N = upd.shape
    new = torch.empty_like(upd)
    y = torch.empty_like(upd)
    _add_rms_norm_kernel[(B,)](res, upd, scale if scale is not None else upd, alpha, new, y, N, eps,
                               res.stride(0), upd.stride(0), new.stride(0), y.stride(0),
                               BLOCK=_pow2(N), HAS_U=True, HAS_LS=scale is not None, num_warps=8)
    return new, y


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    B, F2 = h.shape
    F = F2 // 2
    out = torch.empty(B, F, dtype=h.dtype, device=h.device)
    block = 1024
    _silu_mul_kernel[(B, triton.cdiv(F, block))](h, out, F, h.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           noise: torch.Tensor) -> torch.Tensor:
    B, V = logits.shape
    assert logits.stride(1) == 1 and noise.stride(1) == 1
    assert temperature.stride(0) == 1 and top_k.stride(0) == 1  # the kernel reads them as flat [B]
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    block = _pow2(V)
    num_warps = 32 if block >= 16384 else (16 if block >= 4096 else 8)
    _sample_kernel[(B,)](logits, noise, temperature, top_k, out, V, logits.stride(0), noise.stride(0),
                         BLOCK=block, num_warps=num_warps)
    return out
