"""The Triton kernels behind models/kernels.py and models/sampling.py, in a module of their own
so that Triton is imported only when a fused path is first taken (`kernels.triton_kernels()`: a
CUDA tensor, or the interpreter): a CPU server never imports it. The launchers, their shapes and
the kernels' semantics are documented in models/kernels.py; sampling's seeded noise in
models/sampling.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def attn_split_kernel(Q, KN, VN, K, V, SP, POS, EXEC, ORDER, OUT, M_TMP, L_TMP, ACC_TMP,
                       H, S, context, qk_scale,
                       sq_b, sq_h, skn_b, skn_h, svn_b, svn_h,
                       sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, ssp_b, so_b, so_h, TABLE, stb,
                       D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, HAS_CONTEXT: tl.constexpr, FINAL: tl.constexpr,
                       IEEE: tl.constexpr, STAGES: tl.constexpr, HAS_ORDER: tl.constexpr,
                       WRITE: tl.constexpr = False, HAS_EXEC: tl.constexpr = False,
                       PAGED: tl.constexpr = False, BS: tl.constexpr = 1, KV_REP: tl.constexpr = 1):
    # bf16 / fp32 caches. The one query row is repeated over M = 16 rows so that both
    # products run as tensor-core dots (whose operand loads Triton pipelines); only row 0 is
    # stored. (fp8 caches: attn_fp8_kernel.) PAGED: K, V are pools [blocks, H, BS, D] and
    # slot n of row b is at block TABLE[b, n // BS], slot n % BS (sk_b, sv_b: block strides);
    # the loop walks block by block (_page_bounds), one table read a tile. KV_REP r > 1: grouped
    # KV heads, query head h reads KV head h // r (the caches, KN and VN hold H / r heads).
    M: tl.constexpr = 16
    PP: tl.constexpr = (BS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    bh, split, b, h, qpos, n_valid, cur = _attn_program(ORDER, POS, H, S, HAS_ORDER)
    hk = h // KV_REP
    d = tl.arange(0, D)
    rows = tl.arange(0, M)
    q = tl.load(Q + b * sq_b + h * sq_h + d[None, :] + 0 * rows[:, None])  # [M, D]
    offs_n = tl.arange(0, BLOCK_N)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
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
            k = tl.load(K + blk * sk_b + hk * sk_h + w[:, None] * sk_s + d[None, :], mask=inb[:, None], other=0.0)
            v = tl.load(V + blk * sv_b + hk * sv_h + w[:, None] * sv_s + d[None, :], mask=inb[:, None], other=0.0)
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
        s_new, vn = _new_key(qf, KN, VN, b, hk, d, skn_b, skn_h, svn_b, svn_h, qk_scale)
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
            # which never used that slot: no other program touches this (row, KV head) (grouped:
            # the group's first query head writes it; the others' loops skip that slot too).
            w = (d >= 0) & (h % KV_REP + 0 * d == 0)
            if HAS_EXEC:  # (the flag compared as a [D] tensor: the interpreter takes no scalar in a mask)
                w = w & (tl.load(EXEC + b) + 0 * d != 0)
            if PAGED:  # (never into the null block)
                blk, off = _page(TABLE, b, stb, cur + 0 * d, w, BS)
                w = w & (blk != 0)
                k_at = K + blk * sk_b + hk * sk_h + off * sk_s + d
                v_at = V + blk * sv_b + hk * sv_h + off * sv_s + d
            else:
                k_at = K + b * sk_b + hk * sk_h + cur * sk_s + d
                v_at = V + b * sv_b + hk * sv_h + cur * sv_s + d
            tl.store(k_at, tl.load(KN + b * skn_b + hk * skn_h + d), mask=w)
            tl.store(v_at, tl.load(VN + b * svn_b + hk * svn_h + d), mask=w)
    else:
        # Splits past the filled window store nothing: the reduce reads only filled splits.
        idx = bh * NUM_SPLITS + split
        st = row0 & (start + 0 * rows < n_valid)  # (a tensor: the interpreter takes no scalar in a mask)
        tl.store(M_TMP + idx + 0 * rows, m_i, mask=st)
        tl.store(L_TMP + idx + 0 * rows, l_i, mask=st)
        tl.store(ACC_TMP + idx * D + d[None, :] + 0 * rows[:, None], acc, mask=st[:, None])


@triton.jit
def attn_fp8_kernel(Q, KN, VN, K, V, KS, VS, SP, POS, ORDER, OUT, M_TMP, L_TMP, ACC_TMP,
                     H, S, context, qk_scale,
                     sq_b, sq_h, skn_b, skn_h, svn_b, svn_h,
                     sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sks_b, sks_h, ssp_b, so_b, so_h, TABLE, stb,
                     D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                     NUM_SPLITS: tl.constexpr, HAS_CONTEXT: tl.constexpr, FINAL: tl.constexpr,
                     STAGES: tl.constexpr, HAS_ORDER: tl.constexpr,
                     PAGED: tl.constexpr = False, BS: tl.constexpr = 1, KV_REP: tl.constexpr = 1):
    # fp8 caches on CUDA cores: with one query row, tensor-core dots need the row repeated 16
    # times and a converted 128 x 128 tile in registers (so few programs an SM that the kernel
    # is issue-bound); elementwise fp32 products over small blocks keep far fewer registers and
    # read faster (benchmarks/fp8_attention_variants.py compares them, cc_lazy).
    # Each slot lane of the block keeps its own value sum and denominator (summed once at the
    # end), and the running max moves only when a block's max exceeds it by more than 2^8, so
    # most blocks skip the rescale (p stays <= 256: no fp32 overflow). PAGED: as in
    # attn_split_kernel, the scales pools [blocks, H, BS] too (sks_b: their block stride).
    # KV_REP: grouped KV heads, as in attn_split_kernel (the scales per KV head too).
    PP: tl.constexpr = (BS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    bh, split, b, h, qpos, n_valid, cur = _attn_program(ORDER, POS, H, S, HAS_ORDER)
    hk = h // KV_REP
    d = tl.arange(0, D)
    q = tl.load(Q + b * sq_b + h * sq_h + d).to(tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    sp_base = SP + b * ssp_b
    ks_base = KS + b * sks_b + hk * sks_h
    vs_base = VS + b * sks_b + hk * sks_h
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
            k_sc = tl.load(KS + blk * sks_b + hk * sks_h + w, mask=inb, other=0.0)
            v_sc = tl.load(VS + blk * sks_b + hk * sks_h + w, mask=inb, other=0.0)
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
            k = tl.load(K + blk * sk_b + hk * sk_h + w[:, None] * sk_s + d[None, :], mask=inb[:, None], other=0.0)
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
            v = tl.load(V + blk * sv_b + hk * sv_h + w[:, None] * sv_s + d[None, :], mask=inb[:, None], other=0.0)
        else:
            v = tl.load(v_base + n[:, None] * sv_s + d[None, :], mask=inb[:, None], other=0.0)
        acc += (p * v_sc)[:, None] * v.to(tl.float32)
        l_i += p
    acc_d = tl.sum(acc, axis=0)
    l_s = tl.sum(l_i, axis=0)
    if FINAL:
        s_new, vn = _new_key(q, KN, VN, b, hk, d, skn_b, skn_h, svn_b, svn_h, qk_scale)
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
def attn_reduce_kernel(Q, KN, VN, POS, OUT, M_TMP, L_TMP, ACC_TMP, H, S, qk_scale,
                        sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, so_b, so_h,
                        D: tl.constexpr, SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        NS_P2: tl.constexpr, KV_REP: tl.constexpr = 1):
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
    s_new, vn = _new_key(q, KN, VN, b, h // KV_REP, d, skn_b, skn_h, svn_b, svn_h, qk_scale)
    m_all = tl.maximum(tl.max(m, axis=0), s_new)
    w = tl.exp2(m - m_all)
    p_new = tl.exp2(s_new - m_all)
    denom = tl.sum(l * w, axis=0) + p_new
    num = tl.sum(acc * w[:, None], axis=0) + p_new * vn
    tl.store(OUT + b * so_b + h * so_h + d, (num / denom).to(OUT.dtype.element_ty))


@triton.jit
def _rotate(xr, xi, c, s, out_ty: tl.constexpr):
    # RoPE on one (real, imaginary) half pair, in float32, back to out_ty
    xr32, xi32 = xr.to(tl.float32), xi.to(tl.float32)
    return (xr32 * c - xi32 * s).to(out_ty), (xr32 * s + xi32 * c).to(out_ty)


@triton.jit
def _fp8_store_pair(P, lo, hi, xr, xi, mask, cache_ty: tl.constexpr):
    # One (row, head, slot) vector as e4m3: its max |x| maps to e4m3's largest value 448; the
    # scale is returned for the caller to store.
    sc = tl.maximum(tl.maximum(tl.max(tl.abs(xr.to(tl.float32)), axis=0),
                               tl.max(tl.abs(xi.to(tl.float32)), axis=0)) / 448.0, 1e-30)
    tl.store(P + lo, tl.clamp(xr.to(tl.float32) / sc, -448.0, 448.0).to(cache_ty), mask=mask)
    tl.store(P + hi, tl.clamp(xi.to(tl.float32) / sc, -448.0, 448.0).to(cache_ty), mask=mask)
    return sc


@triton.jit
def rope_write_kernel(QKV, COS, SIN, POS, EXEC, QO, KO, K, V, KS, VS,
                       H, S, T, s_qkv_b, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sks_b, sks_h, TABLE, stb,
                       D: tl.constexpr, HAS_ROPE: tl.constexpr, HAS_EXEC: tl.constexpr,
                       KV_FP8: tl.constexpr, PAGED: tl.constexpr = False, BS: tl.constexpr = 1,
                       KV_REP: tl.constexpr = 1, INTERLEAVE: tl.constexpr = True):
    # One program per (row step bt = b * T + t, query head h): step t of row b is at position
    # POS[b] + t. A row step of qkv holds H query heads, then H / KV_REP key and as many value
    # heads; the program of query head h also rotates and writes KV head h / KV_REP when h is
    # the first of its group. INTERLEAVE: RoPE rotates pairs (x[2i], x[2i + 1]); else the
    # halves (x[i], x[i + D / 2]) (rope_concat). PAGED: the slot is written through the block
    # table (never into the null block 0).
    bh = tl.program_id(0)
    bt = bh // H
    h = bh % H
    b = bt // T
    HALF: tl.constexpr = D // 2
    HKV = H // KV_REP
    hk = h // KV_REP
    base = QKV + bt * s_qkv_b
    i = tl.arange(0, HALF)
    if INTERLEAVE:
        lo = 2 * i
        hi = 2 * i + 1
    else:
        lo = i
        hi = i + HALF
    out_ty = QO.dtype.element_ty
    qr = tl.load(base + h * D + lo)
    qi = tl.load(base + h * D + hi)
    if HAS_ROPE:
        c = tl.load(COS + bt * HALF + i)
        s = tl.load(SIN + bt * HALF + i)
        qr, qi = _rotate(qr, qi, c, s, out_ty)
    o = (bt * H + h) * D
    tl.store(QO + o + lo, qr)
    tl.store(QO + o + hi, qi)
    if h % KV_REP == 0:
        kb = base + H * D + hk * D
        vb = base + (H + HKV) * D + hk * D
        kr = tl.load(kb + lo)
        ki = tl.load(kb + hi)
        if HAS_ROPE:
            kr, ki = _rotate(kr, ki, c, s, out_ty)
        ok = (bt * HKV + hk) * D
        tl.store(KO + ok + lo, kr)
        tl.store(KO + ok + hi, ki)
        qpos = tl.load(POS + b) + bt % T
        slot = qpos % S
        write = i >= 0
        if HAS_EXEC:  # (the flag compared as a tensor: the interpreter takes no scalar in a mask)
            write = write & (tl.load(EXEC + b) + 0 * i != 0)
        if PAGED:
            blk, off = _page(TABLE, b, stb, slot + 0 * i, write, BS)
            write = write & (blk != 0)
            kc = K + blk * sk_b + hk * sk_h + off * sk_s
            vc = V + blk * sv_b + hk * sv_h + off * sv_s
            so = blk * sks_b + hk * sks_h + off
        else:
            kc = K + b * sk_b + hk * sk_h + slot * sk_s
            vc = V + b * sv_b + hk * sv_h + slot * sv_s
            so = b * sks_b + hk * sks_h + slot
        vr = tl.load(vb + lo)
        vi = tl.load(vb + hi)
        if KV_FP8:
            cache_ty = K.dtype.element_ty
            k_sc = _fp8_store_pair(kc, lo, hi, kr, ki, write, cache_ty)
            v_sc = _fp8_store_pair(vc, lo, hi, vr, vi, write, cache_ty)
            row0 = i == 0
            tl.store(KS + so + 0 * i, k_sc + 0.0 * i, mask=write & row0)
            tl.store(VS + so + 0 * i, v_sc + 0.0 * i, mask=write & row0)
        else:
            tl.store(kc + lo, kr, mask=write)
            tl.store(kc + hi, ki, mask=write)
            tl.store(vc + lo, vr, mask=write)
            tl.store(vc + hi, vi, mask=write)


@triton.jit
def add_rms_norm_kernel(X, U, LS, ALPHA, RES, Y, N, eps, sx, su, sr, sy,
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
def silu_mul_kernel(Hx, OUT, F, sh, so, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    msk = o < F
    a = tl.load(Hx + b * sh + o, mask=msk, other=0.0).to(tl.float32)
    g = tl.load(Hx + b * sh + F + o, mask=msk, other=0.0).to(tl.float32)
    ty = OUT.dtype.element_ty
    act = (a / (1.0 + tl.exp(-a))).to(ty).to(tl.float32)
    tl.store(OUT + b * so + o, (act * g).to(ty), mask=msk)


@triton.jit
def sample_kernel(LOGITS, NOISE, TEMP, TOPK, OUT, V, sl, sn, BLOCK: tl.constexpr):
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


# ---- models/sampling.py: seeded noise (splitmix64, as sampling.hashed_noise)


@triton.jit
def _mix_tl(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def seeded_noise_kernel(NOISE, SEEDS, COUNTER, V, sn, stream, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    seed = tl.load(SEEDS + b)
    if seed >= 0:
        counter = tl.load(COUNTER + b).to(tl.uint64)
        key = _mix_tl(seed.to(tl.uint64) * 0x9E3779B97F4A7C15 + _mix_tl(counter * 131 + (stream + 1)))
        for start in range(0, V, BLOCK):
            o = start + tl.arange(0, BLOCK)
            h = _mix_tl(key + (o + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
            uniform = ((h >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            tl.store(NOISE + b * sn + o, -tl.log(uniform), mask=o < V)
