"""Fused decode kernels (models/kernels.py) against the plain PyTorch path, on a CUDA device."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from parley.models import kernels as fa
from parley.models.transformer import (LayerScale, RMSNorm, StreamingTransformer, apply_rope, dequantize_kv, rope_cos_sin,
                                quantize_kv, ring_slot_positions)

pytestmark = pytest.mark.gpu


def _need_cuda():
    if not torch.cuda.is_available() or not fa.have_triton():
        pytest.skip("needs a CUDA device and Triton")


def _window_positions(B: int, S: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows spread over the window (row 0 empty, row 1 partly filled): positions and slot positions."""
    pos = torch.randint(0, 3 * S, (B,), device="cuda", generator=g)
    pos[0] = 0
    if B > 1:
        pos[1] = min(S - 1, 5)
    return pos, ring_slot_positions(pos, S)


def _random_ring(B: int, H: int, S: int, D: int, g: torch.Generator):
    """A random bf16 ring with rows spread over the window, and a query with its new key and value:
    (cache_k, cache_v, pos, slot_pos, q, k_new, v_new)."""
    dt = torch.bfloat16
    ck = torch.randn(B, H, S, D, device="cuda", generator=g).to(dt)
    cv = torch.randn(B, H, S, D, device="cuda", generator=g).to(dt)
    pos, sp = _window_positions(B, S, g)
    q, kn, vn = (torch.randn(B, H, D, device="cuda", generator=g).to(dt) for _ in range(3))
    return ck, cv, pos, sp, q, kn, vn


def _sdpa_reference(q, kn, vn, ck, cv, sp, pos, context):
    B, H, S, D = ck.shape
    rows = torch.arange(B, device=q.device)
    ck, cv, sp = ck.clone(), cv.clone(), sp.clone()
    slot = pos % S
    ck[rows, :, slot] = kn
    cv[rows, :, slot] = vn
    sp[rows, slot] = pos
    delta = pos[:, None] - sp
    valid = (sp >= 0) & (delta >= 0)
    if context is not None:
        valid &= delta < context
    return F.scaled_dot_product_attention(q[:, :, None].float(), ck.float(), cv.float(),
                                          valid[:, None, None])[:, :, 0]


@pytest.mark.parametrize("B,H,S,D,context", [(1, 32, 3000, 128, 3000), (7, 4, 3000, 128, 3000),
                                             (5, 16, 8, 64, None), (6, 2, 500, 64, 300)])
def test_decode_attention_matches_sdpa(B, H, S, D, context):
    _need_cuda()
    g = torch.Generator("cuda").manual_seed(0)
    ck, cv, pos, sp, q, kn, vn = _random_ring(B, H, S, D, g)
    out = fa.decode_attention(q, kn, vn, ck, cv, sp, pos, context)
    ref = _sdpa_reference(q, kn, vn, ck, cv, sp, pos, context)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("B,H,S,D", [(5, 16, 8, 64), (3, 4, 3000, 128)])
def test_decode_attention_writes_the_new_key_and_value(B, H, S, D):
    """write=True (one program a ring, and split rings): the same output as without, and k_new /
    v_new stored at slot pos % S of executing rows only; nothing else in the ring changes."""
    _need_cuda()
    g = torch.Generator("cuda").manual_seed(3)
    ck, cv, pos, sp, q, kn, vn = _random_ring(B, H, S, D, g)
    ex = torch.arange(B, device="cuda") % 2 == 0
    plain = fa.decode_attention(q, kn, vn, ck, cv, sp, pos, None)
    wk, wv = ck.clone(), cv.clone()
    out = fa.decode_attention(q, kn, vn, wk, wv, sp, pos, None, write=True, exec_mask=ex)
    assert torch.equal(out, plain)
    slot = pos % S
    for b in range(B):
        want_k, want_v = ck[b].clone(), cv[b].clone()
        if ex[b]:
            want_k[:, slot[b]], want_v[:, slot[b]] = kn[b], vn[b]
        assert torch.equal(wk[b], want_k) and torch.equal(wv[b], want_v)


@pytest.mark.parametrize("launch", [(64, 47, 3, 4), (128, 24, 3, 4), (128, 4, 3, 8), (32, 16, 4, 4)])
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_launch_shapes_match_sdpa(launch, fp8):
    """Every launch shape (one split over the whole ring, wide blocks, narrow blocks) computes
    the same attention."""
    _need_cuda()
    g = torch.Generator("cuda").manual_seed(1)
    B, H, S, D, dt = 5, 4, 3000, 128, torch.bfloat16
    ck, cv, pos, sp, q, kn, vn = _random_ring(B, H, S, D, g)
    scales = ()
    if fp8:
        (ck, ks), (cv, vs) = quantize_kv(ck), quantize_kv(cv)
        scales = (ks, vs)
    out = fa.decode_attention(q, kn, vn, ck, cv, sp, pos, S, *scales, launch=fa.AttentionLaunch(*launch))
    if fp8:
        ck, cv = dequantize_kv(ck, ks, dt), dequantize_kv(cv, vs, dt)
    ref = _sdpa_reference(q, kn, vn, ck, cv, sp, pos, S)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_row_order_changes_only_the_schedule(fp8):
    """`row_order` (longest filled window first) where one program covers a (row, head): the
    outputs are bit-identical to plain row order; split launches get no order."""
    _need_cuda()
    g = torch.Generator("cuda").manual_seed(7)
    B, H, S, D = 64, 32, 512, 128
    ck, cv, pos, sp, q, kn, vn = _random_ring(B, H, S, D, g)
    scales = ()
    if fp8:
        (ck, ks), (cv, vs) = quantize_kv(ck), quantize_kv(cv)
        scales = (ks, vs)
    order = fa.row_order(pos, H, S, fp8)
    assert order is not None and sorted(order.tolist()) == list(range(B))
    filled = pos.clamp(max=S)[order]
    assert bool((filled[:-1] >= filled[1:]).all())
    plain = fa.decode_attention(q, kn, vn, ck, cv, sp, pos, S, *scales)
    assert torch.equal(fa.decode_attention(q, kn, vn, ck, cv, sp, pos, S, *scales, order=order), plain)
    assert fa.row_order(pos[:2], H, S, fp8) is None  # 64 (row, head) pairs: split launches


def test_rope_write_and_norms():
    _need_cuda()
    B, H, D, S = 3, 4, 128, 10
    qkv = torch.randn(B, 3 * H * D, device="cuda")
    pos = torch.tensor([0, 7, 23], device="cuda")
    freqs = torch.exp(torch.arange(D // 2, device="cuda", dtype=torch.float32) * (-math.log(1e4) * 2 / D))
    ang = freqs * pos.float()[:, None]
    ck, cv = torch.zeros(B, H, S, D, device="cuda"), torch.zeros(B, H, S, D, device="cuda")
    ex = torch.tensor([True, False, True], device="cuda")
    q, k, v = fa.rope_write(qkv, H, D, (ang.cos(), ang.sin()), pos, ex, ck, cv)
    q3, k3, v3 = qkv.view(B, 1, 3, H, D).permute(2, 0, 3, 1, 4)
    qr, kr = apply_rope(q3, k3, rope_cos_sin(pos[:, None], D, 1e4))
    torch.testing.assert_close(q, qr[:, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, kr[:, :, 0], atol=1e-5, rtol=1e-5)
    slot = pos % S
    assert torch.equal(ck[0, :, slot[0]], k[0]) and torch.equal(cv[2, :, slot[2]], v[2])
    assert ck[1].abs().max() == 0 and cv[1].abs().max() == 0

    norm = RMSNorm(4096, 1e-8, torch.float32, device="cuda")
    norm.alpha.data.uniform_(0.5, 1.5)
    x, u = torch.randn(4, 4096, device="cuda"), torch.randn(4, 4096, device="cuda")
    torch.testing.assert_close(fa.rms_norm(x, *norm.fused_params()), norm(x).view_as(x))
    ls = LayerScale(4096, 0.1, device="cuda")
    res, y = fa.add_rms_norm(x, u, ls.scale, *norm.fused_params())
    torch.testing.assert_close(res, x + ls(u))
    torch.testing.assert_close(y, norm(x + ls(u)).view_as(x))
    h = torch.randn(4, 2 * 1000, device="cuda")
    torch.testing.assert_close(fa.silu_mul(h), F.silu(h[:, :1000]) * h[:, 1000:])


def test_rope_write_few_steps():
    """steps=T: T consecutive steps of each row at pos[r] + t, written to their own slots; a row
    that does not execute keeps its ring."""
    _need_cuda()
    B, T, H, D, S = 3, 2, 4, 64, 10
    qkv = torch.randn(B * T, 3 * H * D, device="cuda")
    pos = torch.tensor([0, 7, 9], device="cuda")  # row 2 wraps: slots 9 and 0
    positions = pos[:, None] + torch.arange(T, device="cuda")
    cos, sin = rope_cos_sin(positions, D, 1e4)
    ck, cv = torch.zeros(B, H, S, D, device="cuda"), torch.zeros(B, H, S, D, device="cuda")
    ex = torch.tensor([True, False, True], device="cuda")
    q, k, v = fa.rope_write(qkv, H, D, (cos.reshape(B * T, -1), sin.reshape(B * T, -1)), pos, ex, ck, cv, steps=T)
    q3, k3, v3 = qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)  # [B, H, T, D]
    qr, kr = apply_rope(q3, k3, (cos, sin))
    torch.testing.assert_close(q.view(B, T, H, D), qr.transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.view(B, T, H, D), kr.transpose(1, 2), atol=1e-5, rtol=1e-5)
    for b in (0, 2):
        for t in range(T):
            slot = (pos[b] + t).item() % S
            assert torch.equal(ck[b, :, slot], k.view(B, T, H, D)[b, t])
            assert torch.equal(cv[b, :, slot], v3[b, :, t])
    assert ck[1].abs().max() == 0 and cv[1].abs().max() == 0
    assert ck[0, :, 2:].abs().max() == 0  # nothing past row 0's two slots


def test_transformer_few_steps_fused_write_matches_general_path():
    """Mimi's case (LayerNorm, fp32, 2 steps a call, a context): the fused RoPE + ring write gives
    the general path's outputs on executing rows and its ring; a row that does not execute keeps
    its ring exactly (the general path writes and restores it)."""
    _need_cuda()
    torch.manual_seed(0)
    tr = StreamingTransformer(128, 2, 2, 256, context=12, norm="layer_norm", layer_scale=0.1, device="cuda")
    B = 3
    exec_mask = torch.tensor([True, False, True], device="cuda")
    x = torch.randn(B, 20, 128, device="cuda")
    results = []
    with torch.no_grad():
        for fused in (True, False):
            st = tr.init_state(B)
            tr(x[:, :6], st)  # a prefix, every row
            before = [k.clone() for k in st.keys]
            with fa.enabled(fused):
                ys = [tr(x[:, 6 + 2 * i:8 + 2 * i], st, exec_mask) for i in range(7)]  # wraps the ring
            results.append((torch.cat(ys, 1), st, before))
    (y_f, s_f, before_f), (y_g, s_g, _) = results
    rows = exec_mask.nonzero().flatten()
    torch.testing.assert_close(y_f[rows], y_g[rows], atol=1e-4, rtol=1e-4)
    assert torch.equal(s_f.pos, s_g.pos) and torch.equal(s_f.slot_pos, s_g.slot_pos)
    for i in range(2):
        torch.testing.assert_close(s_f.keys[i][rows], s_g.keys[i][rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s_f.values[i][rows], s_g.values[i][rows], atol=1e-4, rtol=1e-4)
        assert torch.equal(s_f.keys[i][1], before_f[i][1])
        assert torch.equal(s_g.keys[i][1], s_f.keys[i][1])


@pytest.mark.parametrize("V", [2048, 32000])
def test_sample_matches_sort_path(V):
    _need_cuda()
    g = torch.Generator("cuda").manual_seed(1)
    B = 8
    logits = torch.randn(B, V, device="cuda", generator=g) * 3
    temp = torch.tensor([0.0, 0.7, 1.0, 0.8, 0.5, 1.0, 0.9, 2.0], device="cuda")
    topk = torch.tensor([5, 25, 0, 1, V, 3, 250, -1], device="cuda")
    noise = torch.empty(B, V, device="cuda").exponential_(1.0, generator=g)
    out = fa.sample(logits, temp, topk, noise)
    k = torch.where((topk > 0) & (topk < V), topk, torch.full_like(topk, V))
    kth = logits.sort(-1, descending=True).values.gather(-1, (k - 1)[:, None])
    masked = logits.masked_fill(logits < kth, float("-inf"))
    t = torch.where(temp > 0, temp, torch.ones_like(temp))
    ref = torch.where(temp > 0, (torch.softmax(masked / t[:, None], -1) / noise).argmax(-1), logits.argmax(-1))
    assert torch.equal(out, ref)


def _fused_and_general(kv_dtype=None, cross=False, rope=True, heads=2, kv_repeat=1, pe="rope", paged=False):
    """The same 15 decode steps (after a 30-frame prefix) through the fused T == 1 path and the
    general SDPA path, with row 1 not executing: ((y, state) fused, (y, state) general). `cross`:
    layers with a cross-attention block (DSM TTS) over a fixed per-row source; `rope=False`: no
    positional embedding (the depformer's case: the attention kernel writes the ring). `heads`
    (head dim 128), `kv_repeat`, `pe` ("rope" or "rope_concat"): Hibiki-Zero's attention. `paged`:
    the fused path steps a paged state (every row given its whole ring), the general one a dense one."""
    _need_cuda()
    torch.manual_seed(0)
    dim = 128 * heads
    tr = StreamingTransformer(dim, heads, 3, 4 * dim, context=40, norm="rms_norm_f32", gating="silu",
                              layer_scale=0.1, cross_attention=cross, device="cuda", dtype=torch.bfloat16,
                              positional_embedding=pe if rope else "none", kv_repeat=kv_repeat,
                              max_period=20_000.0 if pe == "rope_concat" else 10_000.0)
    B = 4
    states = [tr.init_state(B, kv_dtype=kv_dtype) for _ in range(2)]
    if paged:
        bs = 16  # (the 40-frame ring in 3 blocks, the last holding 8 slots)
        nb = -(-tr.capacity // bs)
        states[0] = tr.init_state(B, kv_dtype=kv_dtype, kv_blocks=1 + B * nb, block_size=bs)
        states[0].map_blocks(assigned=[(b, j, 1 + b * nb + j) for b in range(B) for j in range(nb)])
    exec_mask = torch.tensor([True, False, True, True], device="cuda")
    with torch.no_grad():
        for layer in tr.layers:  # a LayerNorm that is not the identity, so the test sees it
            if layer.cross_attention is not None:
                layer.norm_cross.weight.normal_(1.0, 0.2)
                layer.norm_cross.bias.normal_(0.0, 0.2)
        kv = tr.cross_kv(torch.randn(B, 20, dim, device="cuda", dtype=torch.bfloat16)) if cross else None
        warm = torch.randn(B, 45, dim, device="cuda", dtype=torch.bfloat16)
        for st in states:  # fill part of the ring with a prefix pass (T > 1, general path)
            tr(warm[:, :30], st, cross_kv=kv)
        outs = []
        for fused in (True, False):
            with fa.enabled(fused):
                st = states[0] if fused else states[1]
                ys = [tr(warm[:, 30 + t:31 + t], st, exec_mask, cross_kv=kv) for t in range(15)]
            outs.append((torch.cat(ys, 1), st))
    return outs


@pytest.mark.parametrize("cross,rope", [(False, True), (True, True), (False, False)])
def test_transformer_fused_step_matches_general_path(cross, rope):
    """Fused T == 1 decode vs the SDPA path: same outputs (bf16 tolerance) and same state, with a
    row that does not execute and rows spread over the window; with and without cross-attention,
    and without RoPE (the attention kernel writes the ring)."""
    (y_f, s_f), (y_g, s_g) = _fused_and_general(cross=cross, rope=rope)
    torch.testing.assert_close(y_f.float(), y_g.float(), atol=5e-2, rtol=5e-2)
    assert torch.equal(s_f.pos, s_g.pos) and torch.equal(s_f.slot_pos, s_g.slot_pos)
    torch.testing.assert_close(s_f.keys[2].float(), s_g.keys[2].float(), atol=5e-2, rtol=5e-2)
    assert torch.equal(s_f.keys[0][1], s_g.keys[0][1])  # the idle row's ring is untouched


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("B,H,S,D,context", [(1, 32, 3000, 128, 3000), (7, 4, 3000, 128, 3000),
                                             (6, 2, 500, 64, 300)])
def test_decode_attention_fp8_matches_sdpa(B, H, S, D, context):
    """fp8 ring + per-slot scales: equal (bf16 tolerance) to SDPA over the dequantized ring."""
    _need_cuda()
    g = torch.Generator("cuda").manual_seed(0)
    dt = torch.bfloat16
    ck8, ks = quantize_kv(torch.randn(B, H, S, D, device="cuda", generator=g) * 3)
    cv8, vs = quantize_kv(torch.randn(B, H, S, D, device="cuda", generator=g) * 0.1)
    pos, sp = _window_positions(B, S, g)
    q, kn, vn = (torch.randn(B, H, D, device="cuda", generator=g).to(dt) for _ in range(3))
    out = fa.decode_attention(q, kn, vn, ck8, cv8, sp, pos, context, ks, vs)
    ref = _sdpa_reference(q, kn, vn, dequantize_kv(ck8, ks, dt), dequantize_kv(cv8, vs, dt), sp, pos, context)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("B,H,launch", [(64, 32, None), (3, 4, None), (3, 4, (16, 8, 3, 2)), (2, 4, (64, 0, 4, 4))])
def test_decode_attention_fp8_follows_a_growing_max(B, H, launch):
    """The fp8 kernel moves its running max only when a block's max exceeds it by 2^8: keys whose
    scale grows along the ring (so the max moves many times, by more and less than that) give
    fp32 attention over the dequantized ring, for one program a ring (B * H >= 2048, the default
    launch at B = 64) and for split rings."""
    _need_cuda()
    g = torch.Generator("cuda").manual_seed(5)
    S, D = 3000, 128
    grow = torch.linspace(0.05, 12.0, S, device="cuda")[None, None, :, None]
    ck8, ks = quantize_kv(torch.randn(B, H, S, D, device="cuda", generator=g) * grow)
    cv8, vs = quantize_kv(torch.randn(B, H, S, D, device="cuda", generator=g))
    pos, sp = _window_positions(B, S, g)
    pos[-1] = 10 * S + 17  # a full ring that wrapped
    sp = ring_slot_positions(pos, S)
    q, kn, vn = (torch.randn(B, H, D, device="cuda", generator=g) for _ in range(3))
    blocks = launch and fa.AttentionLaunch(launch[0], launch[1] or S // launch[0] + 1, *launch[2:])
    out = fa.decode_attention(q, kn, vn, ck8, cv8, sp, pos, S, ks, vs, launch=blocks)
    ref = _sdpa_reference(q, kn, vn, dequantize_kv(ck8, ks, torch.float32), dequantize_kv(cv8, vs, torch.float32),
                          sp, pos, S)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_rope_write_fp8_matches_quantize_kv():
    _need_cuda()
    B, H, D, S = 3, 4, 64, 10
    qkv = (torch.randn(B, 3 * H * D, device="cuda") * 5).to(torch.bfloat16)
    pos = torch.tensor([0, 7, 23], device="cuda")
    ck, cv = torch.zeros(B, H, S, D, device="cuda", dtype=FP8), torch.zeros(B, H, S, D, device="cuda", dtype=FP8)
    ks, vs = torch.zeros(B, H, S, device="cuda"), torch.zeros(B, H, S, device="cuda")
    ex = torch.tensor([True, False, True], device="cuda")
    q, k, v = fa.rope_write(qkv, H, D, None, pos, ex, ck, cv, ks, vs)
    rows, slot = torch.arange(B, device="cuda"), pos % S
    for cache, scale, src in ((ck, ks, k), (cv, vs, v)):
        ref8, ref_scale = quantize_kv(src)
        torch.testing.assert_close(scale[rows, :, slot][ex], ref_scale[ex], rtol=1e-6, atol=0)
        got = dequantize_kv(cache[rows, :, slot], scale[rows, :, slot], torch.float32)
        want = dequantize_kv(ref8, ref_scale, torch.float32)
        torch.testing.assert_close(got[ex], want[ex], rtol=0.07, atol=1e-6)  # at most one fp8 step apart
        assert not cache[1].view(torch.uint8).any() and not scale[1].any()  # idle row untouched


def test_transformer_fused_step_fp8_matches_general_path():
    (y_f, s_f), (y_g, s_g) = _fused_and_general(kv_dtype=FP8)
    torch.testing.assert_close(y_f.float(), y_g.float(), atol=5e-2, rtol=5e-2)
    assert torch.equal(s_f.pos, s_g.pos) and torch.equal(s_f.slot_pos, s_g.slot_pos)
    torch.testing.assert_close(dequantize_kv(s_f.keys[2], s_f.key_scales[2], torch.float32),
                               dequantize_kv(s_g.keys[2], s_g.key_scales[2], torch.float32), atol=8e-2, rtol=8e-2)
    assert torch.equal(s_f.keys[0][1].view(torch.uint8), s_g.keys[0][1].view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# Grouped KV heads (query head h reads KV head h // r) and rope_concat: Hibiki-Zero 3B's attention
# (16 heads over 8 KV heads, head dim 128, a 3000-frame context)


@pytest.mark.parametrize("rep", [2, 4])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("launch", [None, (64, 47, 3, 4), (16, 188, 4, 2)])
def test_decode_attention_grouped_matches_sdpa(rep, fp8, launch):
    """H / r KV heads: equal (bf16 tolerance) to SDPA over the ring expanded to every query head,
    for split + reduce (the default at small B) and one program a ring; dense and paged."""
    _need_cuda()
    g = torch.Generator("cuda").manual_seed(11)
    B, H, S, D, dt = 5, 16, 3000, 128, torch.bfloat16
    ck, cv, pos, sp, q, kn, vn = _random_ring(B, H // rep, S, D, g)
    q = torch.randn(B, H, D, device="cuda", generator=g).to(dt)
    scales = ()
    if fp8:
        (ck, ks), (cv, vs) = quantize_kv(ck), quantize_kv(cv)
        scales = (ks, vs)
    blocks = launch and fa.AttentionLaunch(*launch)
    out = fa.decode_attention(q, kn, vn, ck, cv, sp, pos, S, *scales, launch=blocks)
    full_k, full_v = (dequantize_kv(ck, ks, dt), dequantize_kv(cv, vs, dt)) if fp8 else (ck, cv)
    expanded = [t.repeat_interleave(rep, 1) for t in (kn, vn, full_k, full_v)]
    torch.testing.assert_close(out.float(), _sdpa_reference(q, *expanded, sp, pos, S), atol=2e-2, rtol=2e-2)
    bs = 64
    nb = -(-S // bs)
    table = (1 + torch.arange(B * nb, device="cuda", dtype=torch.int32).view(B, nb).flip(1)).contiguous()
    pools = []
    for ring in (ck, cv, *scales):  # each row's ring in blocks of 64 slots, in reverse pool order
        raw = ring.view(torch.uint8) if ring.dtype == FP8 else ring  # (index ops on fp8's bytes)
        padded = torch.zeros(B, raw.shape[1], nb * bs, *raw.shape[3:], device="cuda", dtype=raw.dtype)
        padded[:, :, :S] = raw
        pool = torch.zeros(1 + B * nb, raw.shape[1], bs, *raw.shape[3:], device="cuda", dtype=raw.dtype)
        blocks_of = padded.view(B, raw.shape[1], nb, bs, *raw.shape[3:]).transpose(1, 2).flatten(0, 1)
        pool[table.flatten().long()] = blocks_of
        pools.append(pool.view(ring.dtype))
    paged = fa.decode_attention(q, kn, vn, *pools[:2], sp, pos, S, *pools[2:], launch=blocks, block_table=table)
    torch.testing.assert_close(paged, out, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_rope_write_grouped_heads(interleave, fp8):
    """rope_write of 16 query and 8 KV heads, RoPE on pairs or halves (rope_concat): q and k as
    apply_rope's, each KV head written once to executing rows' slots (fp8: quantize_kv's scales)."""
    _need_cuda()
    B, H, KVH, D, S = 3, 16, 8, 128, 10
    qkv = (torch.randn(B, (H + 2 * KVH) * D, device="cuda") * 3).to(torch.bfloat16)
    pos = torch.tensor([0, 7, 23], device="cuda")
    dt = FP8 if fp8 else torch.bfloat16
    ck, cv = torch.zeros(B, KVH, S, D, device="cuda", dtype=dt), torch.zeros(B, KVH, S, D, device="cuda", dtype=dt)
    scales = (torch.zeros(B, KVH, S, device="cuda"), torch.zeros(B, KVH, S, device="cuda")) if fp8 else ()
    ex = torch.tensor([True, False, True], device="cuda")
    q, k, v = fa.rope_write(qkv, H, D, rope_cos_sin(pos, D, 2e4), pos, ex, ck, cv, *scales, interleave=interleave)
    q0 = qkv[:, :H * D].view(B, H, 1, D)
    k0, v0 = qkv[:, H * D:].view(B, 2, KVH, 1, D).unbind(1)
    qr, kr = apply_rope(q0, k0, rope_cos_sin(pos[:, None], D, 2e4), interleave)
    torch.testing.assert_close(q, qr[:, :, 0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k, kr[:, :, 0], atol=1e-2, rtol=1e-2)
    assert torch.equal(v, v0[:, :, 0])
    rows, slot = torch.arange(B, device="cuda"), pos % S
    for cache, src, i in ((ck, k, 0), (cv, v, 1)):
        if fp8:
            got = dequantize_kv(cache[rows, :, slot], scales[i][rows, :, slot], torch.float32)
            want = dequantize_kv(*quantize_kv(src), torch.float32)
            torch.testing.assert_close(got[ex], want[ex], rtol=0.07, atol=1e-6)  # at most one fp8 step apart
        else:
            assert torch.equal(cache[rows, :, slot][ex], src[ex])
        assert not cache[1].view(torch.uint8).any()  # the idle row's ring untouched


@pytest.mark.parametrize("kv_repeat,pe", [(2, "rope_concat"), (4, "rope_concat"), (2, "rope")])
@pytest.mark.parametrize("kv_dtype", [None, FP8])
@pytest.mark.parametrize("paged", [False, True])
def test_transformer_fused_step_grouped_matches_general_path(kv_repeat, pe, kv_dtype, paged):
    """Hibiki-Zero's attention (8 heads of 128 over 8 / r KV heads, rope_concat with period 20000)
    takes the fused T == 1 decode, equal to the general path: outputs within bf16 tolerance, the same
    positions, the rings within it, the idle row's ring untouched; dense and paged rings, bf16 and fp8."""
    (y_f, s_f), (y_g, s_g) = _fused_and_general(kv_dtype=kv_dtype, heads=8, kv_repeat=kv_repeat, pe=pe, paged=paged)
    assert s_f.keys[0].shape[1] == 8 // kv_repeat
    torch.testing.assert_close(y_f.float(), y_g.float(), atol=5e-2, rtol=5e-2)
    assert torch.equal(s_f.pos, s_g.pos) and torch.equal(s_f.slot_pos, s_g.slot_pos)
    if not paged:
        ring = (lambda s, i: dequantize_kv(s.keys[i], s.key_scales[i], torch.float32)) if kv_dtype else \
            (lambda s, i: s.keys[i].float())
        torch.testing.assert_close(ring(s_f, 2), ring(s_g, 2), atol=8e-2, rtol=8e-2)
        assert torch.equal(s_f.keys[0][1].view(torch.uint8), s_g.keys[0][1].view(torch.uint8))
