"""One depformer step as one persistent CUDA kernel (Triton): the opt-in `--depformer persistent`.

The depformer runs n_agent steps a frame, each through its layers at B rows. Layer by layer
(`StreamingTransformer._forward_decode`) a step is ~55 small kernels, ~430 a frame, and costs
2.3-2.6 ms a frame at B = 1 to 128 on an H200 against 0.3 ms for reading its weights: it is
bound by kernel latency, not bandwidth. Here one launch runs a whole step. Its programs (at most
one per SM, all resident) walk through the step's phases and meet at a grid barrier between
them; inside a phase they share the work by output tiles:

    P0            x = depformer_in(hidden) + emb(prev)            (the residual stream)
    per layer l:
      P1 (5l + 1)  q, k, v = rms_norm1(x) @ W_qkv                  (k, v into the ring's slot)
      P2 (5l + 2)  a = attention(q; the ring's written slots)     (one program a row)
      P3 (5l + 3)  x = x + a @ W_out
      P4 (5l + 4)  g = silu(h_a) * h_b,  h = rms_norm2(x) @ W_in
      P5 (5l + 5)  x = x + g @ W_ffn_out                          (last layer: pos, slot_pos advance)

    layers = pack_layers(...)                   # once: weights stacked over layers (see below)
    y = depformer_step(hidden[B, dim], prev[B], w_in[C, dim], emb[V, C], layers, w, cache_k, cache_v,
                       slot_pos[B, S], pos[B], eps)      # -> y [B, C]; pos, slot_pos advanced

Same arithmetic as the layer-by-layer fused path, with the roundings at the same points (every
intermediate stored in the model dtype); only the matmuls' summation order differs (Triton dots,
not cuBLAS), and the RMSNorm's sum of squares is summed over column tiles. The norms' sums of
squares come from the phase that writes the residual (per column tile, summed in a fixed order:
deterministic, no float atomics).

`phase_by_phase=True` launches each phase as its own grid instead (no barrier): the same code,
for the Triton interpreter (TRITON_INTERPRET=1, whose programs run one after another, so a
barrier would wait forever) and as a fallback. The launch shapes (`DepformerLaunch`) are first
guesses, not yet swept on a GPU (benchmarks/depformer_kernel.py sweeps them).

A leaf module beside kernels.py (whose interpreter switch it reads): plain tensors and numbers
in, nothing else from Parley.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import kernels

try:  # as in kernels.py: CPU-only installs have no Triton
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    _HAVE_TRITON = False

# The Triton interpreter on CPU: bf16 dots run as fp32 ones there (the same products, exact in fp32).
_INTERPRETED = kernels.INTERPRETED
PHASES_PER_LAYER = 5
# A barrier that waited this many polls (~half a minute on a GPU; a phase takes microseconds,
# and programs held back by other work on the GPU wait for it, not for this) gives up and counts
# it in BAR[1], which the start-up check (persistent_depformer.check) and the backend's close
# read: a wrong result, never a hung GPU.
BARRIER_POLLS = 1 << 25


class PackedLayers(NamedTuple):
    """A depformer's layer weights stacked over layers (the parameters become views of these)."""

    qkv: torch.Tensor  # [L, W * 3C, C]: self_attn.in_proj_weight
    out: torch.Tensor  # [L, W * C, C]: self_attn.out_proj.weight
    ffn_in: torch.Tensor  # [L, W, 2F, C]: gating[w].linear_in.weight
    ffn_out: torch.Tensor  # [L, W, C, F]: gating[w].linear_out.weight
    norm1: torch.Tensor  # [L, C]: norm1.alpha
    norm2: torch.Tensor  # [L, C]: norm2.alpha


class DepformerLaunch(NamedTuple):
    block_m: int  # rows per tile (at least 16: Triton's dot)
    block_n: int  # output columns per tile of the C-wide phases (P0, P3, P5)
    block_n_wide: int  # output columns per tile of P1 (3C) and P4 (F)
    block_k: int  # reduction step
    block_k_long: int  # reduction step of the long reductions: P0 (the temporal width) and P5 (F)
    stages: int  # the compiler's software pipelining of the reduction loops on top (1: off)
    warps: int


def depformer_launch(B: int) -> DepformerLaunch:
    """First guesses, not yet swept on a GPU. Few rows: long reduction steps, so that a program
    has 8-32 KB of weight loads in flight (one SM's share of HBM's bandwidth-latency product is
    ~32 KB). Many rows: shorter steps, since the activation tile [block_m, block_k] grows with
    the rows."""
    block_m = min(128, max(16, kernels._pow2(B)))
    # (benchmarks/depformer_registers.py, Triton 3.9, Moshi's shapes: 244-250 registers and no
    # spills with 8 warps at these; block_k 256 at 16 rows, or 128 at 32, spilled.)
    block_k = {16: 128, 32: 64, 64: 64, 128: 32}[block_m]
    # P0 and P5 have one accumulator and 2.75-4x the reduction length of the others: twice the
    # step keeps more of their loads in flight.
    return DepformerLaunch(block_m, 16, 32, block_k, 2 * block_k, 1, 8)


if _HAVE_TRITON:

    @triton.jit
    def _sync(BAR, target, POLLS: tl.constexpr):
        """Grid barrier: wait until `target` programs have arrived (BAR[0] counts arrivals; a
        program that gave up waiting adds 1 to BAR[1])."""
        tl.debug_barrier()  # this program's threads are done with the phase
        tl.atomic_add(BAR, 1, sem="release", scope="gpu")
        polls = 0
        # (Once one program has given up, nobody waits any more: a broken launch ends in about
        # POLLS polls, not POLLS at each of its barriers.)
        while (tl.load(BAR, volatile=True) < target) & (polls < POLLS) & (tl.load(BAR + 1, volatile=True) == 0):
            polls += 1
        # Acquire: the other programs' stores of the phase are visible from here on. (Its result
        # is used, so the compiler keeps it: an unused add of 0 was dropped.)
        seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
        if seen < target:
            tl.atomic_add(BAR + 1, 1)
        tl.debug_barrier()

    @triton.jit
    def _dot(a, w, acc, IEEE: tl.constexpr):
        if IEEE:  # float32 operands (and the interpreter, whose bf16 dot is wrong: Triton 3.9)
            return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, w, acc)

    # Loads of what other programs wrote in this launch (activations, the ring, the sums of
    # squares) are ".cg": from L2, never a line this SM's L1 kept from an earlier phase. (The
    # barrier's acquire should already make them fresh; this does not rest on it.)

    @triton.jit
    def _load_operands(A, sa, rows, rmask, W, W2, sw, cols, cmask, k0, K, BK: tl.constexpr, TWO: tl.constexpr):
        """A[rows, k0:k0 + BK] and W[cols, k0:k0 + BK]^T (W2's too with TWO); nothing is read
        past K, so the prefetch after the last step costs no memory traffic."""
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        a = tl.load(A + rows[:, None] * sa + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0,
                    cache_modifier=".cg")
        wm = km[:, None] & cmask[None, :]
        w = tl.load(W + cols[None, :] * sw + kk[:, None], mask=wm, other=0.0)  # [BK, BN]
        w2 = w
        if TWO:
            w2 = tl.load(W2 + cols[None, :] * sw + kk[:, None], mask=wm, other=0.0)
        return a, w, w2

    @triton.jit
    def _dot_tile(A, sa, rows, rmask, W, sw, cols, cmask, K, ALPHA, rstd, W2,
                  NORM: tl.constexpr, TWO: tl.constexpr, IEEE: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
        """acc [BM, BN] = A[rows, :K] @ W[cols, :K]^T in fp32, and with TWO the same against W2.
        NORM: A's rows are first RMS-normalised (x * (alpha * rstd), rounded to W's dtype).
        The next step's operands are loaded before this step's dot (prefetch in registers: the
        loads are in flight during the dot without relying on the compiler's pipelining)."""
        acc = tl.zeros([BM, BN], tl.float32)
        acc2 = tl.zeros([BM, BN], tl.float32)
        a, w, w2 = _load_operands(A, sa, rows, rmask, W, W2, sw, cols, cmask, 0, K, BK, TWO)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            a_next, w_next, w2_next = _load_operands(A, sa, rows, rmask, W, W2, sw, cols, cmask, k0 + BK, K, BK, TWO)
            if NORM:
                kk = k0 + tl.arange(0, BK)
                al = tl.load(ALPHA + kk, mask=kk < K, other=0.0).to(tl.float32)
                a = (a.to(tl.float32) * (al[None, :] * rstd[:, None])).to(W.dtype.element_ty)
            acc = _dot(a, w, acc, IEEE)
            if TWO:
                acc2 = _dot(a, w2, acc2, IEEE)
            a, w, w2 = a_next, w_next, w2_next
        return acc, acc2

    @triton.jit
    def _rstd(SQ, rows, rmask, B, C, eps, NT: tl.constexpr, NT_P2: tl.constexpr):
        """1 / sqrt(eps + mean(x^2)) of the residual's rows, from the per-tile sums of squares
        SQ [NT, B] that the phase writing the residual left (summed in tile order)."""
        t = tl.arange(0, NT_P2)
        part = tl.load(SQ + t[:, None] * B + rows[None, :], mask=(t[:, None] < NT) & rmask[None, :], other=0.0,
                       cache_modifier=".cg")
        var = eps + tl.sum(part, axis=0) / C
        return 1.0 / tl.sqrt(var)

    @triton.jit
    def _store_res(RES, SQ, B, C, rows, rmask, cols, cmask, nt, new):
        """Store the residual tile (rounded to its dtype) and the tile's sums of squares."""
        m = rmask[:, None] & cmask[None, :]
        x = new.to(RES.dtype.element_ty)
        tl.store(RES + rows[:, None] * C + cols[None, :], x, mask=m)
        xf = tl.where(m, x.to(tl.float32), 0.0)
        tl.store(SQ + nt * B + rows, tl.sum(xf * xf, axis=1), mask=rmask)

    @triton.jit
    def _tile(t, n_m, B, N, BM: tl.constexpr, BN: tl.constexpr):
        """Tile t of a [B, N] output (row tiles vary fastest): its rows and columns, their
        masks, and its column tile."""
        nt = t // n_m
        rows = (t % n_m) * BM + tl.arange(0, BM)
        cols = nt * BN + tl.arange(0, BN)
        return rows, rows < B, cols, cols < N, nt

    @triton.jit
    def _residual_phase(A, K, W, RES, SQ, B, C, pid, nprog, n_m, NT: tl.constexpr, IEEE: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
        """x = x + A @ W^T (rounded as the layer rounds), over the residual's tiles (P3, P5)."""
        ty = RES.dtype.element_ty
        for t in range(pid, n_m * NT, nprog):
            rows, rmask, cols, cmask, nt = _tile(t, n_m, B, C, BM, BN)
            acc, _ = _dot_tile(A, K, rows, rmask, W, K, cols, cmask, K, W, 0.0, W,
                               False, False, IEEE, BM, BN, BK, STAGES)
            m = rmask[:, None] & cmask[None, :]
            old = tl.load(RES + rows[:, None] * C + cols[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
            _store_res(RES, SQ, B, C, rows, rmask, cols, cmask, nt, old + acc.to(ty).to(tl.float32))

    @triton.jit
    def _depformer_kernel(HID, s_hid, PREV, W0, EMB, RES, Q, ATT, G, SQ,
                          WQKV, s_qkv, WO, s_wo, WI, s_wi, WF, s_wf, A1, A2,
                          KC, VC, s_kl, s_kb, s_kh, s_ks, SP, s_sp, POS, BAR,
                          B, phase_lo, phase_hi, nprog, eps, qk_scale,
                          CT: tl.constexpr, C: tl.constexpr, F: tl.constexpr, H: tl.constexpr,
                          D: tl.constexpr, S: tl.constexpr, S_P2: tl.constexpr, LAYERS: tl.constexpr,
                          ZERO_TOKEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BNW: tl.constexpr,
                          BK: tl.constexpr, BKL: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr,
                          NT: tl.constexpr, NT_P2: tl.constexpr, PER_LAYER: tl.constexpr,
                          BARRIER: tl.constexpr, POLLS: tl.constexpr):
        # NT: the residual's column tiles (C / BN); PER_LAYER: phases a layer (5).
        pid = tl.program_id(0)
        n_m = tl.cdiv(B, BM)
        ty = RES.dtype.element_ty
        for ph in range(phase_lo, phase_hi):
            layer = (ph - 1) // PER_LAYER
            kind = ph - 1 - layer * PER_LAYER
            if ph == 0:  # P0: x = depformer_in(hidden) + emb(prev)
                for t in range(pid, n_m * NT, nprog):
                    rows, rmask, cols, cmask, nt = _tile(t, n_m, B, C, BM, BN)
                    acc, _ = _dot_tile(HID, s_hid, rows, rmask, W0, CT, cols, cmask, CT, W0, 0.0, W0,
                                       False, False, IEEE, BM, BN, BKL, STAGES)
                    tok = tl.load(PREV + rows, mask=rmask, other=0)
                    m = rmask[:, None] & cmask[None, :]
                    e = tl.load(EMB + tl.maximum(tok, 0)[:, None] * C + cols[None, :], mask=m, other=0.0)
                    e = tl.where((tok == ZERO_TOKEN)[:, None], 0.0, e.to(tl.float32))
                    _store_res(RES, SQ, B, C, rows, rmask, cols, cmask, nt,
                               acc.to(ty).to(tl.float32) + e.to(ty).to(tl.float32))
            elif kind == 0:  # P1: q, k, v of rms_norm1(x); k and v go to the ring's slot pos % S
                for t in range(pid, n_m * tl.cdiv(3 * C, BNW), nprog):
                    rows, rmask, cols, cmask, nt = _tile(t, n_m, B, 3 * C, BM, BNW)
                    c0 = nt * BNW
                    rstd = _rstd(SQ, rows, rmask, B, C, eps, NT, NT_P2)
                    acc, _ = _dot_tile(RES, C, rows, rmask, WQKV + layer * s_qkv, C, cols, cmask, C,
                                       A1 + layer * C, rstd, WQKV, True, False, IEEE, BM, BNW, BK, STAGES)
                    y = acc.to(ty)
                    m = rmask[:, None] & cmask[None, :]
                    which = c0 // C  # a tile lies in one of q, k, v (C % BNW == 0)
                    if which == 0:
                        tl.store(Q + rows[:, None] * C + cols[None, :], y, mask=m)
                    else:
                        c = cols - which * C
                        cur = tl.load(POS + rows, mask=rmask, other=0) % S
                        off = (layer * s_kl + rows[:, None] * s_kb + (c // D)[None, :] * s_kh
                               + cur[:, None] * s_ks + (c % D)[None, :])
                        if which == 1:
                            tl.store(KC + off, y, mask=m)
                        else:
                            tl.store(VC + off, y, mask=m)
            elif kind == 1:  # P2: attention of each row's heads over its ring's written slots
                h = tl.arange(0, H)
                n = tl.arange(0, S_P2)
                d = tl.arange(0, D)
                for b in range(pid, B, nprog):
                    qpos = tl.load(POS + b)
                    sp = tl.load(SP + b * s_sp + n, mask=n < S, other=-1)
                    # Written before this step and not in the future, or this step's own slot.
                    valid = (n < S) & (((sp >= 0) & (sp <= qpos)) | (n == qpos % S))  # [S_P2]
                    q = tl.load(Q + b * C + h[:, None] * D + d[None, :], cache_modifier=".cg").to(tl.float32)  # [H, D]
                    off = (layer * s_kl + b * s_kb + h[:, None, None] * s_kh + n[None, :, None] * s_ks
                           + d[None, None, :])
                    vm = valid[None, :, None] & (d[None, None, :] < D)
                    k = tl.load(KC + off, mask=vm, other=0.0, cache_modifier=".cg").to(tl.float32)  # [H, S_P2, D]
                    s = tl.sum(q[:, None, :] * k, axis=2) * qk_scale  # [H, S_P2], log2 units
                    s = tl.where(valid[None, :], s, float("-inf"))
                    p = tl.exp2(s - tl.max(s, axis=1)[:, None])
                    v = tl.load(VC + off, mask=vm, other=0.0, cache_modifier=".cg").to(tl.float32)
                    o = tl.sum(p[:, :, None] * v, axis=1) / tl.sum(p, axis=1)[:, None]  # [H, D]
                    tl.store(ATT + b * C + h[:, None] * D + d[None, :], o.to(ty))
            elif kind == 2:  # P3: x = x + a @ W_out
                _residual_phase(ATT, C, WO + layer * s_wo, RES, SQ, B, C, pid, nprog, n_m, NT, IEEE,
                                BM, BN, BK, STAGES)
            elif kind == 3:  # P4: g = silu(h_a) * h_b of h = rms_norm2(x) @ W_in (W_a, W_b stacked)
                for t in range(pid, n_m * tl.cdiv(F, BNW), nprog):
                    rows, rmask, cols, cmask, nt = _tile(t, n_m, B, F, BM, BNW)
                    rstd = _rstd(SQ, rows, rmask, B, C, eps, NT, NT_P2)
                    w = WI + layer * s_wi
                    ha, hb = _dot_tile(RES, C, rows, rmask, w, C, cols, cmask, C, A2 + layer * C, rstd, w + F * C,
                                       True, True, IEEE, BM, BNW, BK, STAGES)
                    ha = ha.to(ty).to(tl.float32)
                    act = (ha / (1.0 + tl.exp(-ha))).to(ty).to(tl.float32)
                    g = act * hb.to(ty).to(tl.float32)
                    tl.store(G + rows[:, None] * F + cols[None, :], g.to(ty), mask=rmask[:, None] & cmask[None, :])
            else:  # P5: x = x + g @ W_ffn_out
                _residual_phase(G, F, WF + layer * s_wf, RES, SQ, B, C, pid, nprog, n_m, NT, IEEE,
                                BM, BN, BKL, STAGES)
                if (layer == LAYERS - 1) & (pid == 0):
                    # Every program is past its last read of pos (P2): the step is written.
                    for r0 in range(0, B, BM):
                        r = r0 + tl.arange(0, BM)
                        rm = r < B
                        p = tl.load(POS + r, mask=rm, other=0)
                        tl.store(SP + r * s_sp + p % S, p, mask=rm)
                        tl.store(POS + r, p + 1, mask=rm)
            if BARRIER:
                if ph + 1 < phase_hi:
                    _sync(BAR, (ph + 1 - phase_lo) * nprog, POLLS)


def pack_layers(qkv: list[torch.Tensor], out: list[torch.Tensor], ffn_in: list[list[torch.Tensor]],
                ffn_out: list[list[torch.Tensor]], norm1: list[torch.Tensor],
                norm2: list[torch.Tensor]) -> PackedLayers:
    """Stack each weight kind over layers (ffn_in / ffn_out: [layer][weight step]); the caller
    re-points its parameters at the returned tensors' slices, so nothing is held twice."""
    return PackedLayers(
        qkv=torch.stack(qkv), out=torch.stack(out),
        ffn_in=torch.stack([torch.stack(per_step) for per_step in ffn_in]),
        ffn_out=torch.stack([torch.stack(per_step) for per_step in ffn_out]),
        norm1=torch.stack([a.reshape(-1) for a in norm1]), norm2=torch.stack([a.reshape(-1) for a in norm2]))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small number of programs
    return torch.cuda.get_device_properties(device).multi_processor_count


def depformer_step(hidden: torch.Tensor, prev: torch.Tensor, w_in: torch.Tensor, emb: torch.Tensor,
                   layers: PackedLayers, w: int, cache_k: torch.Tensor, cache_v: torch.Tensor,
                   slot_pos: torch.Tensor, pos: torch.Tensor, eps: float, zero_token: int = -1,
                   launch: DepformerLaunch | None = None, phase_by_phase: bool = False,
                   barrier: torch.Tensor | None = None) -> torch.Tensor:
    """One depformer step for every row (all rows execute, as the depformer always does).

    hidden [B, dim]: the temporal output; prev [B] long: the previous token (the text token at
    step 0); w_in [C, dim] and emb [V, C]: this step's input projection and embedding table
    (`zero_token` embeds to zero, negative tokens read row 0); layers: `pack_layers`; w: the
    step's weight index; cache_k / cache_v [L, B, H, S, D]: the rings (this step's k, v go to
    slot pos % S); slot_pos [B, S] and pos [B] are advanced as the layer path does.
    `barrier` (int32 [2]): its arrival counter [0] is zeroed here, its give-up count [1] only
    grows (default: a fresh one, whose count nobody reads)."""
    B, CT = hidden.shape
    L, _, C = layers.qkv.shape
    F = layers.ffn_out.shape[-1]
    _, _, H, S, D = cache_k.shape
    assert H * D == C and D == kernels._pow2(D) and H == kernels._pow2(H), "head count and head dim must be powers of two"
    assert cache_k.stride() == cache_v.stride() and cache_k.stride(4) == 1 and cache_k.shape[1] == B
    assert hidden.stride(1) == 1 and prev.stride(0) == 1 and pos.stride(0) == 1 and slot_pos.stride(1) == 1
    assert w_in.is_contiguous() and emb.is_contiguous() and all(t.is_contiguous() for t in layers)
    launch = launch or depformer_launch(B)
    bm, bn, bnw, bk, bkl, stages, warps = launch
    assert C % bnw == 0 and C % bn == 0, f"the depformer width {C} must be a multiple of {bnw}"
    dev = hidden.device
    ty = hidden.dtype
    res = torch.empty(B, C, dtype=ty, device=dev)
    q = torch.empty(B, C, dtype=ty, device=dev)
    att = torch.empty(B, C, dtype=ty, device=dev)
    g = torch.empty(B, F, dtype=ty, device=dev)
    nt = triton.cdiv(C, bn)  # the residual's column tiles: one partial sum of squares each
    sq = torch.empty(nt, B, dtype=torch.float32, device=dev)
    bar = torch.zeros(2, dtype=torch.int32, device=dev) if barrier is None else barrier
    if barrier is not None:
        bar[0].zero_()
    n_m = triton.cdiv(B, bm)
    tiles = max(n_m * triton.cdiv(3 * C, bnw), n_m * triton.cdiv(F, bnw), n_m * triton.cdiv(C, bn), B)
    nprog = min(_num_sms(dev), tiles)
    ffn_in = layers.ffn_in[:, w]
    args = (hidden, hidden.stride(0), prev, w_in, emb, res, q, att, g, sq,
            layers.qkv[:, w * 3 * C:], layers.qkv.stride(0), layers.out[:, w * C:], layers.out.stride(0),
            ffn_in, layers.ffn_in.stride(0), layers.ffn_out[:, w], layers.ffn_out.stride(0),
            layers.norm1, layers.norm2,
            cache_k, cache_v, cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), cache_k.stride(3),
            slot_pos, slot_pos.stride(0), pos, bar, B)
    shape = dict(CT=CT, C=C, F=F, H=H, D=D, S=S, S_P2=kernels._pow2(S), LAYERS=L, ZERO_TOKEN=zero_token,
                 BM=bm, BN=bn, BNW=bnw, BK=bk, BKL=bkl, STAGES=stages, IEEE=ty == torch.float32 or _INTERPRETED,
                 NT=nt, NT_P2=kernels._pow2(nt), PER_LAYER=PHASES_PER_LAYER, POLLS=BARRIER_POLLS, num_warps=warps)
    qk_scale = (D ** -0.5) * 1.4426950408889634
    phases = 1 + PHASES_PER_LAYER * L
    if phase_by_phase or _INTERPRETED:  # (the interpreter runs programs one by one: no barrier can work)
        for ph in range(phases):
            _depformer_kernel[(nprog,)](*args, ph, ph + 1, nprog, eps, qk_scale, BARRIER=False, **shape)
    else:
        _depformer_kernel[(nprog,)](*args, 0, phases, nprog, eps, qk_scale, BARRIER=True, **shape)
    return res
