"""The fused CUDA path in the Triton interpreter, float32, on the CPU: models/kernels.py's
kernels, then the transformer decode, LM frames and Mimi steps that use them (with
TRITON_INTERPRET=1, `kernels.available` is true for CPU tensors).

Run by tests/test_kernels_interpreted.py as `TRITON_INTERPRET=1 python tests/interpreted_kernels.py [GROUP]`
(the interpreter is chosen when the kernels are defined, so it needs a process of its own; GROUP
`moshi`, the default, or `grouped`: grouped KV heads and rope_concat).
Each check prints "ok <name>"; a failed one raises. float32 only: the interpreter's bf16 casts
truncate and its bf16 dots are wrong (Triton 3.9), so bf16 and fp8 stay with tests/test_kernels.py
on a GPU. Small shapes: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from parley.models import kernels
from parley.models.transformer import apply_rope, ring_slot_positions, rope_cos_sin
from test_kernels import _sdpa_reference  # (this script's folder is on the path: the GPU tests' reference)

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
torch.manual_seed(0)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * max(1.0, b.float().abs().max().item()), err


def check_decode_attention() -> None:
    B, H, S, D = 4, 2, 40, 16
    pos = torch.tensor([0, 5, 39, 97])  # empty, partly filled, just full, wrapped
    sp = ring_slot_positions(pos, S)
    ck, cv = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    q, kn, vn = (torch.randn(B, H, D) for _ in range(3))
    for context in (None, 30):
        expected = _sdpa_reference(q, kn, vn, ck, cv, sp, pos, context)
        for launch in (None, kernels.AttentionLaunch(16, 1, 1, 4), kernels.AttentionLaunch(16, 2, 1, 4)):
            close(kernels.decode_attention(q, kn, vn, ck, cv, sp, pos, context, launch=launch), expected)
        order = torch.argsort(pos.clamp(max=S), descending=True)
        close(kernels.decode_attention(q, kn, vn, ck, cv, sp, pos, context, order=order), expected)
    # write=: the executing rows' new key and value land in slot pos % S, the others' rings stay.
    live = torch.tensor([True, False, True, True])
    for launch in (None, kernels.AttentionLaunch(16, 1, 1, 4)):  # in the kernel; after a split launch
        k2, v2 = ck.clone(), cv.clone()
        out = kernels.decode_attention(q, kn, vn, k2, v2, sp, pos, None, launch=launch, write=True, exec_mask=live)
        close(out, _sdpa_reference(q, kn, vn, ck, cv, sp, pos, None))
        for b in range(B):
            slot = int(pos[b]) % S
            assert torch.equal(k2[b, :, slot], kn[b] if live[b] else ck[b, :, slot])
            assert torch.equal(v2[b, :, slot], vn[b] if live[b] else cv[b, :, slot])
    print("ok decode_attention")


def check_rope_write() -> None:
    B, H, D, S = 3, 2, 16, 10
    for steps in (1, 2):
        pos = torch.tensor([0, 4, 23])
        qkv = torch.randn(B * steps, 3 * H * D)
        positions = pos[:, None] + torch.arange(steps)
        cos_sin = tuple(c.reshape(B * steps, -1) for c in rope_cos_sin(positions, D, 10_000.0))
        live = torch.tensor([True, False, True])
        ck, cv = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
        k0, v0 = ck.clone(), cv.clone()
        q, k, v = kernels.rope_write(qkv, H, D, cos_sin, pos, live, ck, cv, steps=steps)
        x = qkv.view(B, steps, 3, H, D)
        rq, rk = apply_rope(x[:, :, 0].transpose(1, 2), x[:, :, 1].transpose(1, 2), rope_cos_sin(positions, D, 10_000.0))
        close(q.view(B, steps, H, D), rq.transpose(1, 2))
        close(k.view(B, steps, H, D), rk.transpose(1, 2))
        for b in range(B):
            for t in range(steps):
                slot = int(pos[b] + t) % S
                close(ck[b, :, slot], rk[b, :, t] if live[b] else k0[b, :, slot])
                close(cv[b, :, slot], x[b, t, 2] if live[b] else v0[b, :, slot])
    print("ok rope_write")


def check_norms_and_activation() -> None:
    x, u = torch.randn(3, 48), torch.randn(3, 48)
    alpha, scale, eps = torch.rand(48) + 0.5, torch.rand(48), 1e-8

    def rms(v):
        return v * (alpha * torch.rsqrt(eps + v.pow(2).mean(-1, keepdim=True)))

    close(kernels.rms_norm(x, alpha, eps), rms(x))
    new, y = kernels.add_rms_norm(x, u, scale, alpha, eps)
    close(new, x + scale * u)
    close(y, rms(x + scale * u))
    h = torch.randn(3, 2 * 40)
    close(kernels.silu_mul(h), F.silu(h[:, :40]) * h[:, 40:])
    print("ok norms")


def check_sample() -> None:
    B, V = 4, 300
    logits = torch.randn(B, V)
    noise = torch.rand(B, V) + 1e-3
    temperature = torch.tensor([0.0, 0.7, 1.0, 2.0])
    top_k = torch.tensor([5, 1, 25, 0])
    got = kernels.sample(logits, temperature, top_k, noise)
    for b in range(B):
        if temperature[b] <= 0:
            assert got[b] == logits[b].argmax(), b
            continue
        k = int(top_k[b]) if 0 < top_k[b] < V else V
        keep = logits[b] >= logits[b].topk(k).values[-1]
        p = torch.where(keep, torch.exp((logits[b] - logits[b].max()) / temperature[b]), 0.0)
        assert got[b] == (p / noise[b]).argmax(), b
    print("ok sample")


def check_fp8() -> None:
    """fp8 caches: attention (CUDA-core loop; one split and split + reduce) against SDPA over
    the dequantised ring; RoPE + write takes quantize_kv's per-vector scales. (Not the stored
    fp8 values: the interpreter's fp32 -> e4m3 cast halves some of them, a numpy conversion
    fault; tests/test_kernels.py checks them on a GPU.)"""
    from parley.models.transformer import dequantize_kv, quantize_kv
    B, H, S, D = 4, 2, 40, 16
    pos = torch.tensor([0, 5, 39, 97])
    sp = ring_slot_positions(pos, S)
    (k8, ks), (v8, vs) = quantize_kv(torch.randn(B, H, S, D)), quantize_kv(torch.randn(B, H, S, D) * 0.1)
    q, kn, vn = (torch.randn(B, H, D) for _ in range(3))
    expected = _sdpa_reference(q, kn, vn, dequantize_kv(k8, ks, torch.float32), dequantize_kv(v8, vs, torch.float32),
                              sp, pos, None)
    for launch in (None, kernels.AttentionLaunch(16, 1, 4, 2)):
        close(kernels.decode_attention(q, kn, vn, k8, v8, sp, pos, None, ks, vs, launch=launch), expected)
    qkv = torch.randn(B, 3 * H * D)
    cos_sin = rope_cos_sin(pos, D, 10_000.0)
    k8b, v8b, ksb, vsb = k8.clone(), v8.clone(), ks.clone(), vs.clone()
    _, k, v = kernels.rope_write(qkv, H, D, cos_sin, pos, None, k8b, v8b, ksb, vsb)  # all rows write
    for b in range(B):
        slot = int(pos[b]) % S
        for new, scales in ((k[b], ksb), (v[b], vsb)):
            close(scales[b, :, slot], quantize_kv(new)[1], 1e-6)
    print("ok fp8")


def tiny_models():
    from parley.models.config import tiny_lm_config, tiny_mimi_config
    from parley.models.lm import LMModel
    from parley.models.mimi import Mimi
    torch.manual_seed(0)
    lm = LMModel(tiny_lm_config()).eval()
    with torch.no_grad():
        lm.init_weights(torch.Generator().manual_seed(1))
    mimi = Mimi(tiny_mimi_config()).eval()
    return lm, mimi


def check_transformer_decode() -> None:
    """The fused one-step decode (_forward_decode) against the general path: the temporal LM
    (RoPE, a 40-frame window that wraps, rows that do not execute) and the depformer (weights
    per step, the ring written by the attention kernel)."""
    lm, _ = tiny_models()
    B = 3
    with torch.no_grad():
        for tr, steps, per_step in ((lm.transformer, 50, False), (lm.depformer, 8, True)):
            fused, plain = tr.init_state(B), tr.init_state(B)
            for t in range(steps):
                x = torch.randn(B, 1, tr.d_model)
                live = torch.tensor([True, t % 3 != 1, True])
                step = dict(step=t) if per_step else {}
                y = tr(x, fused, live, **step)
                with kernels.enabled(False):
                    expected = tr(x, plain, live, **step)
                close(y, expected)
                assert torch.equal(fused.pos, plain.pos) and torch.equal(fused.slot_pos, plain.slot_pos)
                for a, b in zip(fused.keys + fused.values, plain.keys + plain.values):
                    close(a, b)
    print("ok transformer_decode")


def check_frame() -> None:
    """A few whole LM frames (LMGen.step: fused sampler too, greedy) and Mimi steps (RoPE +
    ring write of 2 steps, the transposed conv as a matmul, the one-matmul codebook search)
    against the plain path: the same tokens and codes, audio within float rounding."""
    from parley.models.lm_gen import LMGen
    lm, mimi = tiny_models()
    B = 2
    with torch.no_grad():
        gen = LMGen(lm, text_temp=0.0, audio_temp=0.0)
        fused, plain = gen.init_state(B), gen.init_state(B)
        live = torch.ones(B, dtype=torch.bool)
        for _ in range(6):
            codes = torch.randint(0, lm.cfg.card, (B, lm.cfg.n_user))
            out = gen.step(fused, codes, live)
            with kernels.enabled(False):
                expected = gen.step(plain, codes, live)
            assert torch.equal(out.text, expected.text) and torch.equal(out.audio, expected.audio)
        fused, plain = mimi.init_state(B, "cpu"), mimi.init_state(B, "cpu")
        live = torch.ones(B, dtype=torch.bool)
        for _ in range(4):
            pcm = torch.randn(B, mimi.frame_size) * 0.1
            codes = mimi.encode_step(pcm, fused, live)
            with kernels.enabled(False):
                expected = mimi.encode_step(pcm, plain, live)
            assert torch.equal(codes, expected)
            audio = mimi.decode_step(codes[:, :lm.cfg.n_agent], fused, live)
            with kernels.enabled(False):
                expected = mimi.decode_step(codes[:, :lm.cfg.n_agent], plain, live)
            close(audio, expected, 1e-4)
    print("ok frame")


# ---------------------------------------------------------------------------------------------
# Paged rings (models/paged_kv.py): the same kernels addressing slots through a block table


def paged_layout(pos: torch.Tensor, S: int, bs: int) -> tuple[torch.Tensor, int]:
    """A block table giving each row blocks for the slots it has filled and the one it writes
    now (none at all for a row at position 0: it stays on the null block), drawn in a shuffled
    order; and the pool size. A block that does not divide S leaves the last one partly used."""
    B, nb = pos.shape[0], -(-S // bs)
    table = torch.zeros(B, nb, dtype=torch.int32)
    free = (torch.randperm(B * nb) + 1).tolist()
    for b in range(B):
        if int(pos[b]) > 0:
            for j in range(min(nb, int(pos[b]) // bs + 1)):
                table[b, j] = free.pop()
    return table, B * nb + 1


def paged_copy(ring: torch.Tensor, table: torch.Tensor, blocks: int, bs: int) -> torch.Tensor:
    """A pool [blocks, H, bs(, D)] holding dense `ring` [B, H, S(, D)]'s assigned blocks."""
    raw = ring.view(torch.uint8) if ring.dtype == torch.float8_e4m3fn else ring
    pool = torch.zeros(blocks, raw.shape[1], bs, *raw.shape[3:], dtype=raw.dtype)
    for b, j in table.nonzero().tolist():
        part = raw[b, :, j * bs:(j + 1) * bs]  # (the ring's last block: maybe fewer slots)
        pool[table[b, j], :, :part.shape[1]] = part
    return pool.view(ring.dtype)


def same_assigned(pool: torch.Tensor, ring: torch.Tensor, table: torch.Tensor) -> None:
    """Every assigned block of the pool holds the dense ring's bytes; the null block stays zero."""
    raw = (lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
    expected = paged_copy(ring, table, pool.shape[0], pool.shape[2])
    assert torch.equal(raw(pool), raw(expected)), (raw(pool).float() - raw(expected).float()).abs().max()


def check_paged_attention() -> None:
    """decode_attention over pools through a block table against the dense ring: bf16 / fp32 and
    fp8, rows empty / partly filled / full / wrapped, one split and split + reduce, a context,
    row order, and write= with rows not executing (and a row on the null block). Blocks that
    divide the ring (8) and do not (12: its last block holds 4 slots)."""
    for bs in (8, 12):
        _check_paged_attention(bs)
    print("ok paged_attention")


def _check_paged_attention(bs: int) -> None:
    from parley.models.transformer import quantize_kv
    B, H, S, D = 4, 2, 40, 16
    pos = torch.tensor([0, 5, 39, 97])
    sp = ring_slot_positions(pos, S)
    table, blocks = paged_layout(pos, S, bs)
    launches = (None, kernels.AttentionLaunch(16, 1, 1, 4))
    for dt in (torch.float32, torch.bfloat16):
        ck, cv = torch.randn(B, H, S, D).to(dt), torch.randn(B, H, S, D).to(dt)
        pk, pv = paged_copy(ck, table, blocks, bs), paged_copy(cv, table, blocks, bs)
        q, kn, vn = (torch.randn(B, H, D).to(dt) for _ in range(3))
        for context, launch in ((None, launches[0]), (30, launches[1]), (None, launches[1])):
            dense = kernels.decode_attention(q, kn, vn, ck, cv, sp, pos, context, launch=launch)
            close(kernels.decode_attention(q, kn, vn, pk, pv, sp, pos, context, launch=launch, block_table=table), dense)
        order = torch.argsort(pos.clamp(max=S), descending=True)
        close(kernels.decode_attention(q, kn, vn, pk, pv, sp, pos, None, order=order, block_table=table),
              kernels.decode_attention(q, kn, vn, ck, cv, sp, pos, None, order=order))
        live = torch.tensor([True, False, True, True])  # row 0 executes with no block: its write is dropped
        for launch in launches:  # written in the kernel; after a split launch
            k2, v2, pk2, pv2 = ck.clone(), cv.clone(), pk.clone(), pv.clone()
            dense = kernels.decode_attention(q, kn, vn, k2, v2, sp, pos, None, launch=launch, write=True, exec_mask=live)
            out = kernels.decode_attention(q, kn, vn, pk2, pv2, sp, pos, None, launch=launch, write=True,
                                           exec_mask=live, block_table=table)
            close(out, dense)
            same_assigned(pk2, k2, table)
            same_assigned(pv2, v2, table)
    (k8, ks), (v8, vs) = quantize_kv(torch.randn(B, H, S, D)), quantize_kv(torch.randn(B, H, S, D) * 0.1)
    paged = [paged_copy(t, table, blocks, bs) for t in (k8, v8, ks, vs)]
    q, kn, vn = (torch.randn(B, H, D) for _ in range(3))
    for launch in (None, kernels.AttentionLaunch(16, 1, 4, 2)):
        close(kernels.decode_attention(q, kn, vn, *paged[:2], sp, pos, 30, *paged[2:], launch=launch, block_table=table),
              kernels.decode_attention(q, kn, vn, k8, v8, sp, pos, 30, ks, vs, launch=launch))


def check_paged_rope_write() -> None:
    """rope_write through a block table: the same q, k and the same bytes stored (fp8: and scales)
    as into the dense ring, for one step and two, rows not executing, a row on the null block; in
    blocks that divide the ring and (4: the last holds 2 slots) do not."""
    B, H, D, S = 4, 2, 16, 10
    for steps, kv_fp8, bs in ((1, False, 5), (2, False, 5), (1, True, 5), (1, False, 4), (2, True, 4)):
        pos = torch.tensor([0, 4, 23, 9])
        table, blocks = paged_layout(pos + steps - 1, S, bs)
        table[0] = 0  # row 0 executes without blocks: nothing may land anywhere
        live = torch.tensor([True, False, True, True])
        qkv = torch.randn(B * steps, 3 * H * D)
        cos_sin = tuple(c.reshape(B * steps, -1) for c in rope_cos_sin(pos[:, None] + torch.arange(steps), D, 1e4))
        rings = [torch.randn(B, H, S, D), torch.randn(B, H, S, D)]
        if kv_fp8:
            from parley.models.transformer import quantize_kv
            (k8, ks), (v8, vs) = quantize_kv(rings[0]), quantize_kv(rings[1])
            rings = [k8, v8, ks, vs]
        pools = [paged_copy(r, table, blocks, bs) for r in rings]
        q, k, _ = kernels.rope_write(qkv, H, D, cos_sin, pos, live, *rings, steps=steps)
        qp, kp, _ = kernels.rope_write(qkv, H, D, cos_sin, pos, live, *pools, steps=steps, block_table=table,
                                       capacity=S)
        close(qp, q)
        close(kp, k)
        for pool, ring in zip(pools, rings):
            same_assigned(pool, ring, table)
    print("ok paged_rope_write")


def check_paged_transformer_decode() -> None:
    """The fused one-step decode (RoPE, fp32 RMSNorm, gated FFN, as the temporal LM) on a paged
    state against a dense one: rows at different positions, pausing, the window wrapping. fp32
    against the plain path; fp8 KV against the fused dense path (the interpreter's fp8 casts are
    off, the same in both). One small layer: the interpreter runs every program in numpy."""
    from parley.models.transformer import StreamingTransformer
    torch.manual_seed(0)
    tr = StreamingTransformer(32, 2, 1, 64, context=16, norm="rms_norm_f32", gating="silu").eval()
    B = 3
    with torch.no_grad():
        for kv_dtype, bs in ((None, 4), (torch.float8_e4m3fn, 4), (None, 5)):  # 5: the last block holds 1 slot
            dense = tr.init_state(B, kv_dtype=kv_dtype)
            paged = tr.init_state(B, kv_dtype=kv_dtype, kv_blocks=1 + B * -(-tr.capacity // bs), block_size=bs)
            free = list(range(1, paged.num_blocks))
            for t in range(22):
                live = torch.tensor([True, t % 3 != 1, t >= 5])
                for row in live.nonzero().flatten().tolist():
                    j = (int(paged.pos[row]) % tr.capacity) // bs
                    if int(paged.block_table[row, j]) == 0:
                        paged.assign_blocks(row, [j], [free.pop()])
                x = torch.randn(B, 1, tr.d_model)
                with kernels.enabled(kv_dtype is not None):
                    expected = tr(x, dense, live)
                close(tr(x, paged, live), expected)
                assert torch.equal(paged.pos, dense.pos) and torch.equal(paged.slot_pos, dense.slot_pos)
            for row, p in enumerate(paged.pos.tolist()):  # every row's written slots in blocks it holds
                assert (paged.block_table[row, :-(-min(p, tr.capacity) // bs)] != 0).all()
            assert (paged.block_table[0] != 0).all()  # (row 0 ran every step: its whole ring)
    print("ok paged_transformer_decode")


def check_page_list_decode(heads: int = 2, kv_repeat: int = 1, pe: str = "rope", steps: int = 40) -> None:
    """The fused decode reading the paged ring through page lists (`TransformerState.page_decode`,
    here `TorchPagedDecode`, FlashInfer's meaning in PyTorch) against the Triton paged kernel on a
    copy of the same state: the engine's KV pool under the shrink policy plans each step (rows
    pausing, blocks taken from the longest row, the ring wrapping). `heads` of 16 over
    heads / `kv_repeat` KV heads, `pe`: grouped heads and rope_concat read through page lists."""
    from parley.engine.kv_blocks import KvBlockPool, KvLayout
    from parley.models import paged_kv
    from parley.models.paged_decode import TorchPagedDecode
    from parley.models.transformer import StreamingTransformer
    torch.manual_seed(0)
    tr = StreamingTransformer(16 * heads, heads, 1, 64, context=16, norm="rms_norm_f32", gating="silu",
                              kv_repeat=kv_repeat, positional_embedding=pe).eval()
    B, bs = 3, 4
    pool = KvBlockPool(KvLayout(window_frames=tr.capacity, block_frames=bs, block_bytes=1), B, 7, "shrink")
    lists = tr.init_state(B, kv_blocks=8, block_size=bs)
    kernel = tr.init_state(B, kv_blocks=8, block_size=bs)
    lists.page_decode = TorchPagedDecode(heads, 16, bs, kv_heads=heads // kv_repeat)
    for row in range(B):
        pool.admit(row, f"s{row}")
        for state in (lists, kernel):
            state.map_blocks(assigned=pool.start(row, f"s{row}", 0).assigned)
    with torch.no_grad():
        for t in range(steps):
            ids = ["s0", "s1" if t % 3 != 1 else None, "s2" if t >= 5 else None]
            changes = pool.step(ids)
            for state in (lists, kernel):
                state.map_blocks(changes.released, changes.forgotten, changes.assigned)
            pos, taken_at = pool.decode_positions()
            lists.page_decode.plan(B, *paged_kv.decode_pages(lists.table_host, pos, taken_at, tr.capacity, bs))
            live = torch.from_numpy(pos >= 0)
            x = torch.randn(B, 1, tr.d_model)
            got, want = tr(x, lists, live), tr(x, kernel, live)
            close(got[live], want[live])  # (a row that does not step reads the null block: its output is unused)
    assert pool.counters().shrinks > 0
    print("ok page_list_decode" if kv_repeat == 1 and pe == "rope" else "ok grouped_page_list_decode")


# ---------------------------------------------------------------------------------------------
# Grouped KV heads (kv_repeat r: query head h reads KV head h // r) and rope_concat (Hibiki-Zero)


def grouped(*tensors: torch.Tensor, rep: int) -> list[torch.Tensor]:
    """KV tensors [B, H / r, ...] expanded to every query head [B, H, ...] (expand_kv's grouping)."""
    return [t.repeat_interleave(rep, dim=1) for t in tensors]


def check_grouped_attention() -> None:
    """decode_attention over H / r KV heads (r = 2, 4) against SDPA over the ring expanded to the
    H query heads: fp32 and fp8, one split and split + reduce, a context, dense and paged, and
    write= (each KV head stored once, the idle row's ring kept)."""
    from parley.models.transformer import dequantize_kv, quantize_kv
    B, H, S, D, bs = 4, 4, 40, 16, 12
    pos = torch.tensor([0, 5, 39, 97])
    sp = ring_slot_positions(pos, S)
    table, blocks = paged_layout(pos, S, bs)
    launches = (None, kernels.AttentionLaunch(16, 1, 1, 4))
    for rep in (2, 4):
        ck, cv = torch.randn(B, H // rep, S, D), torch.randn(B, H // rep, S, D)
        q, kn, vn = torch.randn(B, H, D), torch.randn(B, H // rep, D), torch.randn(B, H // rep, D)
        pk, pv = paged_copy(ck, table, blocks, bs), paged_copy(cv, table, blocks, bs)
        for context, launch in ((None, launches[0]), (30, launches[1])):
            expected = _sdpa_reference(q, *grouped(kn, vn, ck, cv, rep=rep), sp, pos, context)
            close(kernels.decode_attention(q, kn, vn, ck, cv, sp, pos, context, launch=launch), expected)
            close(kernels.decode_attention(q, kn, vn, pk, pv, sp, pos, context, launch=launch, block_table=table),
                  expected)
        live = torch.tensor([True, False, True, True])
        for launch in launches:
            k2, v2 = ck.clone(), cv.clone()
            out = kernels.decode_attention(q, kn, vn, k2, v2, sp, pos, None, launch=launch, write=True, exec_mask=live)
            close(out, _sdpa_reference(q, *grouped(kn, vn, ck, cv, rep=rep), sp, pos, None))
            for b in range(B):
                slot = int(pos[b]) % S
                assert torch.equal(k2[b, :, slot], kn[b] if live[b] else ck[b, :, slot])
                assert torch.equal(v2[b, :, slot], vn[b] if live[b] else cv[b, :, slot])
        (k8, ks), (v8, vs) = quantize_kv(ck), quantize_kv(cv * 0.1)
        paged = [paged_copy(t, table, blocks, bs) for t in (k8, v8, ks, vs)]
        expected = _sdpa_reference(q, *grouped(kn, vn, dequantize_kv(k8, ks, torch.float32),
                                               dequantize_kv(v8, vs, torch.float32), rep=rep), sp, pos, 30)
        for launch in (None, kernels.AttentionLaunch(16, 1, 4, 2)):
            close(kernels.decode_attention(q, kn, vn, k8, v8, sp, pos, 30, ks, vs, launch=launch), expected)
            close(kernels.decode_attention(q, kn, vn, *paged[:2], sp, pos, 30, *paged[2:], launch=launch,
                                           block_table=table), expected)
    print("ok grouped_attention")


def check_grouped_rope_write() -> None:
    """rope_write of H query and H / r KV heads (r = 1, 2, 4), RoPE on pairs and on halves
    (rope_concat): q, k as apply_rope's, each KV head written once to executing rows' slots; a
    paged ring gets the same bytes (fp8: and scales), one step and two."""
    B, H, D, S, bs = 4, 4, 16, 10, 4
    pos = torch.tensor([0, 4, 23, 9])
    live = torch.tensor([True, False, True, True])
    for rep, interleave, steps, kv_fp8 in ((2, False, 1, False), (4, True, 2, False), (2, True, 1, True),
                                           (1, False, 2, False), (4, False, 1, True)):
        kvh = H // rep
        qkv = torch.randn(B * steps, (H + 2 * kvh) * D)
        positions = pos[:, None] + torch.arange(steps)
        cos_sin = tuple(c.reshape(B * steps, -1) for c in rope_cos_sin(positions, D, 1e4))
        table, blocks = paged_layout(pos + steps - 1, S, bs)
        rings = [torch.randn(B, kvh, S, D), torch.randn(B, kvh, S, D)]
        if kv_fp8:
            from parley.models.transformer import quantize_kv
            (k8, ks), (v8, vs) = quantize_kv(rings[0]), quantize_kv(rings[1])
            rings = [k8, v8, ks, vs]
        before = [r.clone() for r in rings]
        pools = [paged_copy(r, table, blocks, bs) for r in rings]
        q, k, v = kernels.rope_write(qkv, H, D, cos_sin, pos, live, *rings, steps=steps, interleave=interleave)
        qp, kp, _ = kernels.rope_write(qkv, H, D, cos_sin, pos, live, *pools, steps=steps, block_table=table,
                                       capacity=S, interleave=interleave)
        x = qkv.view(B, steps, -1)
        q0 = x[..., :H * D].reshape(B, steps, H, D).transpose(1, 2)
        k0, v0 = x[..., H * D:].reshape(B, steps, 2, kvh, D).permute(2, 0, 3, 1, 4)
        rq, rk = apply_rope(q0, k0, rope_cos_sin(positions, D, 1e4), interleave)
        close(q.view(B, steps, H, D), rq.transpose(1, 2))
        close(k.view(B, steps, kvh, D), rk.transpose(1, 2))
        close(v.view(B, steps, kvh, D), v0.transpose(1, 2))
        close(qp, q)
        close(kp, k)
        if not kv_fp8:  # (fp8: the stored values are the GPU tests'; see check_fp8)
            for b in range(B):
                for t in range(steps):
                    slot = int(pos[b] + t) % S
                    close(rings[0][b, :, slot], rk[b, :, t] if live[b] else before[0][b, :, slot])
                    close(rings[1][b, :, slot], v0[b, :, t] if live[b] else before[1][b, :, slot])
        for pool, ring in zip(pools, rings):
            same_assigned(pool, ring, table)
    print("ok grouped_rope_write")


def check_grouped_transformer_decode() -> None:
    """The fused one-step decode of Hibiki-Zero's attention (grouped KV heads r = 2 and 4,
    rope_concat; and grouped without RoPE, the ring written by the attention kernel) against
    the general path, float32 within 1e-5 of the largest output: dense and paged rings, rows
    pausing, the window wrapping, the same states; then calls of 2 steps (the fused RoPE + ring
    write). fp8 KV: paged against dense, both fused (the interpreter's fp8 casts are off, the same
    in both)."""
    from parley.models.transformer import StreamingTransformer
    B, bs = 3, 3  # (3: the 8-slot ring's last block holds 2 slots)
    for rep, pe in ((2, "rope_concat"), (4, "rope"), (2, "none")):
        torch.manual_seed(0)
        tr = StreamingTransformer(64, 4, 1, 128, context=8, norm="rms_norm_f32", gating="silu", kv_repeat=rep,
                                  positional_embedding=pe).eval()
        assert tr._can_fuse(torch.empty(1)), (rep, pe)
        for kv_dtype in (None, torch.float8_e4m3fn) if pe == "rope_concat" else (None,):
            general, dense = tr.init_state(B, kv_dtype=kv_dtype), tr.init_state(B, kv_dtype=kv_dtype)
            paged = tr.init_state(B, kv_dtype=kv_dtype, kv_blocks=1 + B * -(-tr.capacity // bs), block_size=bs)
            free = list(range(1, paged.num_blocks))
            with torch.no_grad():
                for t in range(12):
                    live = torch.tensor([True, t % 3 != 1, t >= 2])
                    for row in live.nonzero().flatten().tolist():
                        j = (int(paged.pos[row]) % tr.capacity) // bs
                        if int(paged.block_table[row, j]) == 0:
                            paged.assign_blocks(row, [j], [free.pop()])
                    x = torch.randn(B, 1, tr.d_model)
                    y = tr(x, dense, live)
                    close(tr(x, paged, live), y)
                    if kv_dtype is None:
                        with kernels.enabled(False):
                            close(y, tr(x, general, live))
                        assert torch.equal(dense.pos, general.pos) and torch.equal(dense.slot_pos, general.slot_pos)
                        for a, b in zip(dense.keys + dense.values, general.keys + general.values):
                            close(a, b)
                    assert torch.equal(paged.pos, dense.pos) and torch.equal(paged.slot_pos, dense.slot_pos)
                if kv_dtype is None:  # calls of 2 steps: the fused RoPE + ring write, then attention over the ring
                    live = torch.tensor([True, False, True])
                    for _ in range(3):
                        x = torch.randn(B, 2, tr.d_model)
                        y = tr(x, dense, live)
                        with kernels.enabled(False):
                            close(y[live], tr(x, general, live)[live])
                        for a, b in zip(dense.keys + dense.values, general.keys + general.values):
                            close(a, b)
    print("ok grouped_transformer_decode")



# Two groups, each a process of its own (tests/test_kernels_interpreted.py runs them as two tests).
GROUPS = {
    "moshi": (check_decode_attention, check_rope_write, check_norms_and_activation, check_sample, check_fp8,
              check_transformer_decode, check_frame, check_paged_attention, check_paged_rope_write,
              check_paged_transformer_decode, check_page_list_decode),
    "grouped": (check_grouped_attention, check_grouped_rope_write, check_grouped_transformer_decode,
                lambda: check_page_list_decode(heads=4, kv_repeat=2, pe="rope_concat", steps=24)),
}

if __name__ == "__main__":
    import sys
    for check in GROUPS[sys.argv[1] if len(sys.argv) > 1 else "moshi"]:
        check()
