"""Variants of the fp8 decode-attention loop, timed against each other on one layer of Moshi-7B
shapes: a place to test a hypothesis about what limits `models/kernels.py`'s fp8 kernel before
changing it. Each variant is the tensor-core loop production ran until `bf4ce96` (one program
per (row, head) over the whole ring, the softmax on the one query row) with one thing changed,
or (cc, cc_lazy) a loop without tensor cores; cc_lazy is what `models/kernels.py`'s
`_attn_fp8_kernel` runs since `bf4ce96`. It prints time, bandwidth over
the bytes read, relative error against fp32 attention over the dequantised cache, and the
compiled kernel's registers, spills and shared memory. CUDA only.

    python benchmarks/fp8_attention_variants.py --batches 128,64 --windows full
    python benchmarks/fp8_attention_variants.py --variants fp16,split_d --shapes 128x3x4,128x2x4,64x4x4
    python benchmarks/fp8_attention_variants.py --variants fp16 --shapes 128x3x4,128x3x4x168,128x2x4x128
    python benchmarks/fp8_attention_variants.py --batches 128 --windows full --variants fp16,cc,cc_lazy \
        --shapes 128x3x4,16x4x2

Variants: fp16 (the tensor-core arithmetic: e4m3 -> fp16, fp16 dots), fp8_qk (the first dot on
fp8 operands, the query quantised to e4m3: no key conversion), fp8_qk2 (the query as two e4m3
parts, hi + lo / 16), fp8_qkpv (both dots on fp8 operands), fp8_qkpv2 (fp8 first dot, the
probabilities as two e4m3 parts), split_d (fp16 dots over the two halves of the head dim, so
fewer converted values need to be live at once), v_t (fp16 dots, the values stored slots-contiguous
[D, S] so the second dot's operand is K-major), swap / swap_v_t (both dots transposed so the key
and value tiles are the 128-row first operands, of the values as stored / stored [D, S]),
cc / cc_lazy (no tensor cores: fp32 elementwise products, the scales folded, the denominator per
slot lane; cc_lazy rescales only when the max grows by more than 2^8; the plainer cuda_core loop,
which rescaled and summed every block, was measured at `bf4ce96` and removed after).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_setup import H200_COPY_TBPS, WINDOWS, window_positions  # noqa: E402

from parley.models.transformer import quantize_kv, ring_slot_positions  # noqa: E402

VARIANTS = ("fp16", "fp8_qk", "fp8_qk2", "fp8_qkpv", "fp8_qkpv2", "split_d", "v_t", "swap", "swap_v_t", "cc", "cc_lazy")
H, S, D = 32, 3000, 128

try:
    import triton
    import triton.language as tl
    import triton.testing
except ImportError:  # (CPU boxes without Triton: main() says so)
    triton = None

if triton is not None:

    @triton.jit
    def _program(POS, H, S):
        """This program's row b and head h; the row's query position, filled slots, current slot."""
        bh = tl.program_id(0)
        b = bh // H
        qpos = tl.load(POS + b)
        return b, bh % H, qpos, tl.minimum(qpos, S), qpos % S

    @triton.jit
    def _block(SPB, ksb, vsb, n, n_valid, qpos, cur):
        """One block's slots n: in the window, valid to attend, and their key and value scales."""
        inb = n < n_valid
        sp = tl.load(SPB + n, mask=inb, other=-1)
        k_sc = tl.load(ksb + n, mask=inb, other=0.0)
        v_sc = tl.load(vsb + n, mask=inb, other=0.0)
        return n, inb, inb & (sp >= 0) & (sp <= qpos) & (n != cur), k_sc, v_sc

    @triton.jit
    def _loop(Q, K, V, KS, VS, SP, POS, OUT, H, S, qk_scale, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sv_d,
              sks_b, sks_h, ssp_b,
              D: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, VAR: tl.constexpr):
        M: tl.constexpr = 16  # the query row repeated so both products run as tensor-core dots
        HD: tl.constexpr = D // 2
        b, h, qpos, n_valid, cur = _program(POS, H, S)
        d = tl.arange(0, D)
        dh = tl.arange(0, HD)
        rows = tl.arange(0, M)
        qb = Q + (b * H + h) * D
        qf = tl.load(qb + d[None, :] + 0 * rows[:, None]).to(tl.float32)
        q16 = qf.to(tl.float16)
        q_sc = tl.maximum(tl.max(tl.max(tl.abs(qf), axis=1), axis=0) / 448.0, 1e-30)
        q_hi = (qf / q_sc).to(tl.float8e4nv)
        q_lo = ((qf / q_sc - q_hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
        qa = tl.load(qb + dh[None, :] + 0 * rows[:, None]).to(tl.float16)
        qz = tl.load(qb + HD + dh[None, :] + 0 * rows[:, None]).to(tl.float16)
        offs = tl.arange(0, BLOCK_N)
        kb, vb = K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h
        ksb, vsb = KS + b * sks_b + h * sks_h, VS + b * sks_b + h * sks_h
        acc = tl.zeros([M, D], tl.float32)
        acc_a = tl.zeros([M, HD], tl.float32)
        acc_z = tl.zeros([M, HD], tl.float32)
        m_i = tl.full([M], -1.0e30, tl.float32)
        l_i = tl.zeros([M], tl.float32)
        for n0 in tl.range(0, n_valid, BLOCK_N, num_stages=STAGES):
            n, inb, valid, k_sc, v_sc = _block(SP + b * ssp_b, ksb, vsb, n0 + offs, n_valid, qpos, cur)
            if VAR == 5:
                ka = tl.load(kb + n[:, None] * sk_s + dh[None, :], mask=inb[:, None], other=0.0)
                s = tl.dot(qa, tl.trans(ka.to(tl.float16)))
                kz = tl.load(kb + n[:, None] * sk_s + HD + dh[None, :], mask=inb[:, None], other=0.0)
                s = tl.dot(qz, tl.trans(kz.to(tl.float16)), s)
            else:
                k = tl.load(kb + n[:, None] * sk_s + d[None, :], mask=inb[:, None], other=0.0)
                if VAR == 0:
                    s = tl.dot(q16, tl.trans(k.to(tl.float16)))
                elif VAR == 2:
                    s = (tl.dot(q_hi, tl.trans(k)) + tl.dot(q_lo, tl.trans(k)) * (1.0 / 16.0)) * q_sc
                else:
                    s = tl.dot(q_hi, tl.trans(k)) * q_sc
            s1 = tl.where(valid, tl.max(s, axis=0) * k_sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s1, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p1 = tl.exp2(s1 - tl.max(m_new, axis=0))
            pv = p1 * (v_sc * 448.0)
            if VAR == 5:
                p16 = tl.broadcast_to(pv.to(tl.float16)[None, :], (M, BLOCK_N))
                va = tl.load(vb + n[:, None] * sv_s + dh[None, :] * sv_d, mask=inb[:, None], other=0.0)
                acc_a = acc_a * alpha[:, None] + tl.dot(p16, va.to(tl.float16))
                vz = tl.load(vb + n[:, None] * sv_s + (HD + dh[None, :]) * sv_d, mask=inb[:, None], other=0.0)
                acc_z = acc_z * alpha[:, None] + tl.dot(p16, vz.to(tl.float16))
            else:
                v = tl.load(vb + n[:, None] * sv_s + d[None, :] * sv_d, mask=inb[:, None], other=0.0)
                if VAR == 3:
                    acc = acc * alpha[:, None] + tl.dot(tl.broadcast_to(pv.to(tl.float8e4nv)[None, :], (M, BLOCK_N)), v)
                elif VAR == 4:
                    p_hi = pv.to(tl.float8e4nv)
                    p_lo = ((pv - p_hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
                    acc = acc * alpha[:, None] + (tl.dot(tl.broadcast_to(p_hi[None, :], (M, BLOCK_N)), v)
                                                  + tl.dot(tl.broadcast_to(p_lo[None, :], (M, BLOCK_N)), v) / 16.0)
                else:
                    acc = acc * alpha[:, None] + tl.dot(tl.broadcast_to(pv.to(tl.float16)[None, :], (M, BLOCK_N)),
                                                        v.to(tl.float16))
            l_i = l_i * alpha + tl.sum(p1, axis=0)
            m_i = m_new
        ob = OUT + (b * H + h) * D
        row0 = (rows == 0)[:, None]
        if VAR == 5:
            tl.store(ob + dh[None, :] + 0 * rows[:, None], acc_a / l_i[:, None] / 448.0, mask=row0)
            tl.store(ob + HD + dh[None, :] + 0 * rows[:, None], acc_z / l_i[:, None] / 448.0, mask=row0)
        else:
            tl.store(ob + d[None, :] + 0 * rows[:, None], acc / l_i[:, None] / 448.0, mask=row0)

    @triton.jit
    def _loop_swap(Q, K, V, KS, VS, SP, POS, OUT, H, S, qk_scale, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sv_d,
                   sks_b, sks_h, ssp_b,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, VAR: tl.constexpr):
        # The products transposed: the key tile [BLOCK_N, D] and the value tile read as [D, BLOCK_N]
        # are the dots' first operands (M = 128 rows: Hopper's warp-group MMA), the query and the
        # probabilities the second ([*, 16] columns, all equal).
        M: tl.constexpr = 16
        b, h, qpos, n_valid, cur = _program(POS, H, S)
        d = tl.arange(0, D)
        cols = tl.arange(0, M)
        qt = tl.load(Q + (b * H + h) * D + d[:, None] + 0 * cols[None, :]).to(tl.float16)  # [D, M]
        offs = tl.arange(0, BLOCK_N)
        kb, vb = K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h
        ksb, vsb = KS + b * sks_b + h * sks_h, VS + b * sks_b + h * sks_h
        acc = tl.zeros([D, M], tl.float32)
        m_i = tl.full([M], -1.0e30, tl.float32)
        l_i = tl.zeros([M], tl.float32)
        for n0 in tl.range(0, n_valid, BLOCK_N, num_stages=STAGES):
            n, inb, valid, k_sc, v_sc = _block(SP + b * ssp_b, ksb, vsb, n0 + offs, n_valid, qpos, cur)
            k = tl.load(kb + n[:, None] * sk_s + d[None, :], mask=inb[:, None], other=0.0)
            st = tl.dot(k.to(tl.float16), qt)  # [BLOCK_N, M]
            s1 = tl.where(valid, tl.max(st, axis=1) * k_sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s1, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p1 = tl.exp2(s1 - tl.max(m_new, axis=0))
            pt = tl.broadcast_to((p1 * (v_sc * 448.0)).to(tl.float16)[:, None], (BLOCK_N, M))
            vt = tl.load(vb + d[:, None] * sv_d + n[None, :] * sv_s, mask=inb[None, :], other=0.0)  # [D, BLOCK_N]
            acc = acc * alpha[None, :] + tl.dot(vt.to(tl.float16), pt)
            l_i = l_i * alpha + tl.sum(p1, axis=0)
            m_i = m_new
        tl.store(OUT + (b * H + h) * D + d[:, None] + 0 * cols[None, :], acc / l_i[None, :] / 448.0,
                 mask=(cols == 0)[None, :])

    @triton.jit
    def _loop_cc(Q, K, V, KS, VS, SP, POS, OUT, H, S, qk_scale, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sv_d,
                 sks_b, sks_h, ssp_b,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, VAR: tl.constexpr):
        # No tensor cores: fp32 elementwise products, the key scale and qk_scale folded into one
        # multiply a slot, the denominator kept per slot lane (summed once at the end), and (VAR 1) the
        # running max moved only when it grows by more than 2^8, so most blocks skip the rescale.
        b, h, qpos, n_valid, cur = _program(POS, H, S)
        d = tl.arange(0, D)
        q = tl.load(Q + (b * H + h) * D + d).to(tl.float32)
        offs = tl.arange(0, BLOCK_N)
        kb, vb = K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h
        ksb, vsb = KS + b * sks_b + h * sks_h, VS + b * sks_b + h * sks_h
        acc = tl.zeros([BLOCK_N, D], tl.float32)
        m_i = tl.max(tl.full([BLOCK_N], -1.0e30, tl.float32), axis=0)
        l_i = tl.zeros([BLOCK_N], tl.float32)
        for n0 in tl.range(0, n_valid, BLOCK_N, num_stages=STAGES):
            n, inb, valid, k_sc, v_sc = _block(SP + b * ssp_b, ksb, vsb, n0 + offs, n_valid, qpos, cur)
            k = tl.load(kb + n[:, None] * sk_s + d[None, :], mask=inb[:, None], other=0.0)
            s = tl.where(valid, tl.sum(k.to(tl.float32) * q[None, :], axis=1) * (k_sc * qk_scale), float("-inf"))
            m_blk = tl.max(s, axis=0)
            if VAR == 1:
                if m_blk > m_i + 8.0:
                    alpha = tl.exp2(m_i - m_blk)
                    acc = acc * alpha
                    l_i = l_i * alpha
                    m_i = m_blk
            else:
                m_new = tl.maximum(m_i, m_blk)
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha
                l_i = l_i * alpha
                m_i = m_new
            p = tl.exp2(s - m_i)
            v = tl.load(vb + n[:, None] * sv_s + d[None, :] * sv_d, mask=inb[:, None], other=0.0)
            acc += (p * v_sc)[:, None] * v.to(tl.float32)
            l_i += p
        tl.store(OUT + (b * H + h) * D + d, tl.sum(acc, axis=0) / tl.sum(l_i, axis=0))


def reference(q, ck8, ks, cv8, vs, sp, pos) -> torch.Tensor:
    """fp32 attention over the dequantised valid slots (the new token left out, as in the loop)."""
    kf, vf = ck8.float() * ks[..., None], cv8.float() * vs[..., None]
    n = torch.arange(S, device=q.device)
    valid = (sp >= 0) & (sp <= pos[:, None]) & (n[None] != (pos % S)[:, None]) & (n[None] < pos.clamp(max=S)[:, None])
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), kf) * D ** -0.5
    return torch.einsum("bhs,bhsd->bhd", scores.masked_fill(~valid[:, None], float("-inf")).softmax(-1), vf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="128,64")
    parser.add_argument("--windows", default="full,spread")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shapes", default="128x3x4", help="launch shapes BLOCK_NxSTAGESxWARPS[xMAXNREG], "
                        "comma-separated (MAXNREG: a cap on registers a thread, so more programs fit an SM)")
    args = parser.parse_args()
    if not re.fullmatch(r"\d+(,\d+)*", args.batches) or not set(args.windows.split(",")) <= set(WINDOWS):
        parser.error(f"--batches {args.batches!r} / --windows {args.windows!r}: expected counts, and windows "
                     f"among {', '.join(WINDOWS)}")
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}: expected some of {', '.join(VARIANTS)}")
    if not re.fullmatch(r"\d+x\d+x\d+(x\d+)?(,\d+x\d+x\d+(x\d+)?)*", args.shapes):
        parser.error(f"--shapes {args.shapes!r}: expected BLOCK_NxSTAGESxWARPS[xMAXNREG], comma-separated")
    shapes = [(tuple(int(x) for x in s.split("x")) + (0,))[:4] for s in args.shapes.split(",")]
    if triton is None or not torch.cuda.is_available():
        sys.exit("fp8_attention_variants.py needs a CUDA device and Triton")
    g = torch.Generator("cuda").manual_seed(0)
    for B in (int(b) for b in args.batches.split(",")):
        ck8, ks = quantize_kv(torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16))
        cv8, vs = quantize_kv(torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16) * 0.1)
        cv8_t = cv8.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, slots contiguous
        q = torch.randn(B, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
        for window in args.windows.split(","):
            pos = window_positions(B, window, S, "cuda")
            sp = ring_slot_positions(pos, S)
            ref = reference(q, ck8, ks, cv8, vs, sp, pos)
            filled = pos.clamp(max=S).sum().item()
            nbytes = filled * H * (2 * D + 8)  # keys and values (1 byte each) and their two fp32 scales
            for name in variants:
                for block_n, stages, warps, maxnreg in shapes:
                    cap = {"maxnreg": maxnreg} if maxnreg else {}
                    out = torch.empty(B, H, D, device="cuda")

                    kernel = {"swap": _loop_swap, "swap_v_t": _loop_swap, "cc": _loop_cc,
                              "cc_lazy": _loop_cc}.get(name, _loop)
                    cv = cv8_t if name.endswith("v_t") else cv8
                    var = {"v_t": 0, "cc": 0, "cc_lazy": 1}.get(name, VARIANTS.index(name))

                    def run():
                        return kernel[(B * H,)](q, ck8, cv, ks, vs, sp, pos, out, H, S, D ** -0.5 * 1.4426950408889634,
                                                ck8.stride(0), ck8.stride(1), ck8.stride(2),
                                                cv.stride(0), cv.stride(1), cv.stride(2), cv.stride(3),
                                                ks.stride(0), ks.stride(1), sp.stride(0), D=D, BLOCK_N=block_n,
                                                STAGES=stages, VAR=var, num_warps=warps, **cap)
                    try:
                        compiled = run()
                        torch.cuda.synchronize()
                        live = pos.clamp(max=S) > 1  # (a row with nothing filled has no attention output)
                        err = ((out - ref)[live].abs().max() / ref[live].abs().max()).item()
                        ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                    except Exception as exc:  # a shape the GPU cannot run (shared memory)
                        print(f"B={B} {window} {name} {block_n}x{stages}x{warps}x{maxnreg}: {type(exc).__name__}")
                        continue
                    label = f"{block_n}x{stages}x{warps}" + (f"x{maxnreg}" if maxnreg else "")
                    print(f"B={B} {window:6} {name:9} {label}: {ms:.3f} ms "
                          f"{nbytes / ms / 1e9:.2f} TB/s (of {H200_COPY_TBPS}), rel. error {err:.1e}, "
                          f"{compiled.n_regs} registers, {compiled.n_spills} spills, "
                          f"{compiled.metadata.shared} B shared", flush=True)


if __name__ == "__main__":
    main()
