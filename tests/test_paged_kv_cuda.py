"""Paged KV rings on a CUDA device: the fused kernels through a block table against the dense
ring (Moshi's 3000-slot ring in blocks of 64, the default, whose last block holds 56 slots, and
of 60, which divide it; bf16 and fp8), the fused decode of a paged state
against the dense one, and a paged duplex frame replayed from CUDA graphs against the same frame
run eagerly (the engine rewrites the table between replays) and against dense rows.

Tolerances are those of tests/test_kernels.py (bf16 2e-2 on attention outputs, 5e-2 through
layers; fp8 8e-2) and test_engine_models.py (graph vs eager audio 1e-5, fp32); the paged and dense
kernels run the same arithmetic in the same order, so they usually agree exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parley.engine import SamplingOptions
from parley.engine.backend import ModelBackend
from parley.engine.kv_blocks import KvChanges
from parley.models import kernels
from parley.models import paged_kv
from parley.models.config import FRAME_SAMPLES
from parley.models.transformer import StreamingTransformer, quantize_kv, ring_slot_positions, rope_cos_sin

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not kernels.have_triton(),
                                 reason="needs a CUDA device and Triton")]
FP8 = torch.float8_e4m3fn


def _table(pos: torch.Tensor, S: int, bs: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """A shuffled block table giving each row the blocks its window and next write use (none for
    a row at position 0), and the pool size."""
    B, nb = pos.shape[0], -(-S // bs)
    need = torch.clamp(pos // bs + 1, max=nb) * (pos > 0)  # blocks 0 .. pos // bs, or all once wrapped
    table = torch.zeros(B, nb, dtype=torch.int32, device="cuda")
    ids = (torch.randperm(B * nb, generator=g, device="cuda") + 1).int()
    cols = torch.arange(nb, device="cuda")
    table = torch.where(cols[None] < need[:, None], ids.view(B, nb), table)
    return table, B * nb + 1


def _to_pool(ring: torch.Tensor, table: torch.Tensor, blocks: int, bs: int) -> torch.Tensor:
    """A pool holding `ring` [B, H, S(, D)] through `table` (what a dense ring looks like paged)."""
    B, nb = table.shape
    raw = ring.view(torch.uint8) if ring.dtype == FP8 else ring
    padded = torch.zeros(B, raw.shape[1], nb * bs, *raw.shape[3:], dtype=raw.dtype, device="cuda")
    padded[:, :, :raw.shape[2]] = raw  # (a partial last block: zeros past the ring)
    pool = torch.zeros(blocks, raw.shape[1], bs, *raw.shape[3:], dtype=raw.dtype, device="cuda")
    parts = padded.view(B, raw.shape[1], nb, bs, *raw.shape[3:]).transpose(1, 2)  # [B, nb, H, bs(, D)]
    keep = table.flatten() != 0
    pool[table.flatten()[keep].long()] = parts.reshape(B * nb, *parts.shape[2:])[keep]
    return pool.view(ring.dtype)


@pytest.mark.parametrize("bs", [64, 60])
@pytest.mark.parametrize("B,H,fp8", [(7, 4, False), (7, 4, True), (64, 32, False), (64, 32, True)])
def test_paged_decode_attention_equals_dense(B, H, fp8, bs):
    """Moshi's ring (3000 slots, blocks of 64 or 60), rows empty / partly filled / wrapped; small B
    (split + reduce) and B * H >= 2048 (one program a row, in row order)."""
    S, D = 3000, 128
    g = torch.Generator("cuda").manual_seed(0)
    pos = torch.randint(0, 3 * S, (B,), device="cuda", generator=g)
    pos[0], pos[1] = 0, 5
    sp = ring_slot_positions(pos, S)
    table, blocks = _table(pos, S, bs, g)
    rings = [torch.randn(B, H, S, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    if fp8:
        (k8, ks), (v8, vs) = quantize_kv(rings[0]), quantize_kv(rings[1])
        rings = [k8, v8, ks, vs]
    pools = [_to_pool(r, table, blocks, bs) for r in rings]
    q, kn, vn = (torch.randn(B, H, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    order = kernels.row_order(pos, H, S, fp8)
    dense = kernels.decode_attention(q, kn, vn, *rings[:2], sp, pos, S, *rings[2:], order=order)
    paged = kernels.decode_attention(q, kn, vn, *pools[:2], sp, pos, S, *pools[2:], order=order, block_table=table)
    torch.testing.assert_close(paged.float(), dense.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bs", [64, 60])
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_rope_write_stores_what_dense_stores(fp8, bs):
    """The same q and k, the same bytes (and fp8 scales) in the row's blocks, rows not executing
    untouched, and nothing in the null block."""
    B, H, D, S = 6, 8, 128, 3000
    g = torch.Generator("cuda").manual_seed(1)
    pos = torch.randint(1, 3 * S, (B,), device="cuda", generator=g)
    table, blocks = _table(pos, S, bs, g)
    live = torch.arange(B, device="cuda") % 3 != 1
    qkv = torch.randn(B, 3 * H * D, device="cuda", generator=g).to(torch.bfloat16)
    cos_sin = rope_cos_sin(pos, D, 10_000.0)
    rings = [torch.zeros(B, H, S, D, device="cuda", dtype=FP8 if fp8 else torch.bfloat16) for _ in range(2)]
    if fp8:
        rings += [torch.zeros(B, H, S, device="cuda") for _ in range(2)]
    pools = [_to_pool(r, table, blocks, bs) for r in rings]
    q, k, _ = kernels.rope_write(qkv, H, D, cos_sin, pos, live, *rings)
    qp, kp, _ = kernels.rope_write(qkv, H, D, cos_sin, pos, live, *pools, block_table=table, capacity=S)
    assert torch.equal(qp, q) and torch.equal(kp, k)
    for pool, ring in zip(pools, rings):
        assert torch.equal(_raw(pool), _raw(_to_pool(ring, table, blocks, bs)))
        assert not _raw(pool)[paged_kv.NULL_BLOCK].any()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("bs", [64, 60])
@pytest.mark.parametrize("kv_dtype,tol", [(None, 5e-2), (FP8, 8e-2)], ids=["bf16", "fp8"])
def test_paged_fused_decode_equals_dense(kv_dtype, tol, bs):
    """A 300-frame window in blocks of 64 (5, the last holding 44 slots) or 60: a 250-frame prefix
    (the general path through the table), then 80 fused steps (the ring wraps), row 1 pausing
    every third step."""
    torch.manual_seed(0)
    tr = StreamingTransformer(256, 2, 2, 1024, context=300, norm="rms_norm_f32", gating="silu", layer_scale=0.1,
                              device="cuda", dtype=torch.bfloat16)
    B = 4
    dense = tr.init_state(B, kv_dtype=kv_dtype)
    paged = tr.init_state(B, kv_dtype=kv_dtype, kv_blocks=1 + B * 5, block_size=bs)
    for row in range(B):  # every row its whole window, shuffled
        paged.assign_blocks(row, list(range(5)), [1 + 5 * ((row + 1) % B) + j for j in reversed(range(5))])
    x = torch.randn(B, 330, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ys = [(tr(x[:, :250], paged), tr(x[:, :250], dense))]
        for t in range(250, 330):
            live = torch.tensor([True, t % 3 != 1, True, True], device="cuda")
            ys.append((tr(x[:, t:t + 1], paged, live), tr(x[:, t:t + 1], dense, live)))
    for a, b in ys:
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    assert torch.equal(paged.pos, dense.pos) and torch.equal(paged.slot_pos, dense.slot_pos)


def _duplex_run(ckpt_dir, paged: bool, graphs: bool, frames: int = 50) -> list:
    """A 4-row tiny Moshi backend (40-frame window, blocks of 8), rows starting at different
    ticks and one pausing; a paged one gets each block just before the tick that first writes it
    (as the engine's pool does), between graph replays."""
    kv = dict(kv_blocks=4 * 5, kv_block_frames=8) if paged else {}
    backend = ModelBackend.load(ckpt_dir, 4, device="cuda", dtype=torch.float32, cuda_graphs=graphs, seed=3, **kv)
    for row in range(4):
        backend.set_sampling(row, SamplingOptions.greedy())
    steps, free, held, outs = [0] * 4, list(range(1, 21)), set(), []
    rng = np.random.default_rng(0)
    for t in range(frames):
        live = torch.tensor([True, t >= 3, t % 4 != 2, t >= 9])
        changes = KvChanges()
        for row in live.nonzero().flatten().tolist():
            block = (steps[row] % 40) // 8
            if (row, block) not in held:
                held.add((row, block))
                changes.assigned.append((row, block, free.pop()))
            steps[row] += 1
        if paged and changes:
            backend.map_kv_blocks(changes)
        pcm = torch.from_numpy(rng.standard_normal((4, FRAME_SAMPLES)).astype(np.float32) * 0.1)
        host = backend.step(pcm, live).to_host()
        outs.append((host.pcm.copy(), host.text_tokens.copy(), host.valid.copy()))
    backend.close()
    return outs


def test_paged_duplex_frame_graphs_equal_eager_and_dense(tiny_moshi_dir):
    eager, graphed, dense = (_duplex_run(tiny_moshi_dir, True, False), _duplex_run(tiny_moshi_dir, True, True),
                             _duplex_run(tiny_moshi_dir, False, True))
    for (p0, t0, v0), (p1, t1, v1), (p2, t2, v2) in zip(eager, graphed, dense):
        np.testing.assert_array_equal(t0, t1)
        np.testing.assert_array_equal(v0, v1)
        np.testing.assert_allclose(p0, p1, atol=1e-5)
        np.testing.assert_array_equal(t1, t2)
        np.testing.assert_array_equal(v1, v2)
        np.testing.assert_allclose(p1, p2, atol=1e-5)
