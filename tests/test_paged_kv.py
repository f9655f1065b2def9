"""Paged KV rings (models/paged_kv.py, TransformerState with a block table) on the CPU.

The paged eager path gathers each row's ring through the table into a dense copy and runs the
dense math on it, so on the same shapes and device it must equal the dense state bit for bit:
outputs, positions, and every written slot's keys, values and fp8 scales. The fused kernels'
paged addressing is checked in the Triton interpreter (tests/interpreted_kernels.py) and on a
GPU (tests/test_paged_kv_cuda.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from parley.engine.backend import ModelBackend
from parley.models import paged_kv
from parley.models.config import FRAME_SAMPLES, tiny_lm_config
from parley.models.lm import LMModel
from parley.models.lm_gen import LMGen
from parley.models.transformer import TransformerState

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 8  # tiny ring: context 40 = 5 blocks of 8
# ... and blocks that do not divide the ring (40 = 3 x 12 + 4: the last block partly used), as
# Moshi's 3000 slots in the default 64-slot blocks.
BLOCKS = pytest.mark.parametrize("block", [BLOCK, 12], ids=["divides", "partial-last"])


def make_lm(dtype: torch.dtype = torch.float32) -> LMModel:
    torch.manual_seed(0)
    lm = LMModel(tiny_lm_config()).eval()
    lm.init_weights(torch.Generator().manual_seed(1))
    return lm.to(dtype)


class Blocks:
    """A stand-in for the engine's allocator: a row gets a fresh block (from the top of the pool,
    so the mapping is not the identity) before its first write to a logical block."""

    def __init__(self, state: TransformerState):
        self.state = state
        self.free = list(range(1, state.num_blocks))

    def cover(self, row: int, first: int, steps: int = 1) -> None:
        s = self.state
        held = s.block_table[row].tolist()
        wanted = {((first + t) % s.capacity) // s.block_size for t in range(steps)}
        new = sorted(j for j in wanted if held[j] == paged_kv.NULL_BLOCK)
        s.assign_blocks(row, new, [self.free.pop() for _ in new])

    def before_step(self, exec_mask: torch.Tensor, steps: int = 1) -> None:
        for row in exec_mask.nonzero().flatten().tolist():
            self.cover(row, int(self.state.pos[row]), steps)


def assert_same_rings(paged: TransformerState, dense: TransformerState) -> None:
    """Positions equal, and every written slot holds the same bytes in both."""
    assert torch.equal(paged.pos, dense.pos) and torch.equal(paged.slot_pos, dense.slot_pos)
    written = dense.slot_pos >= 0  # [B, S]
    pairs = list(zip(paged.keys + paged.values, dense.keys + dense.values))
    if dense.key_scales is not None:
        pairs += list(zip(paged.key_scales + paged.value_scales, dense.key_scales + dense.value_scales))
    for pool, ring in pairs:
        view = paged_kv.gather_ring(pool, paged.block_table, paged.capacity)
        a, b = view.transpose(1, 2)[written], ring.transpose(1, 2)[written]
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b)


@BLOCKS
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.float32, torch.float8_e4m3fn)],
                         ids=["fp32", "bf16", "fp8"])
def test_paged_steps_equal_dense_bit_for_bit(dtype, kv_dtype, block):
    """One-step calls past the window (the ring wraps), rows at different positions, a row that
    pauses (exec_mask) and one that never runs (no blocks: the null block)."""
    tr = make_lm(dtype).transformer
    B, frames = 4, 2 * tr.capacity + 7
    dense = tr.init_state(B, kv_dtype=kv_dtype)
    paged = tr.init_state(B, kv_dtype=kv_dtype, kv_blocks=1 + 3 * paged_kv.ring_blocks(tr.capacity, block),
                          block_size=block)
    blocks = Blocks(paged)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for t in range(frames):
            live = torch.tensor([True, t % 3 != 1, t >= 11, False])  # row 2 starts late; row 3 idles
            x = torch.randn(B, 1, tr.d_model, generator=g).to(dtype)
            blocks.before_step(live)
            assert torch.equal(tr(x, paged, live), tr(x, dense, live))
    assert_same_rings(paged, dense)
    for pool in paged.keys + paged.values:  # the null block: never written
        assert not pool[paged_kv.NULL_BLOCK].view(torch.uint8).any()


@BLOCKS
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_paged_multi_step_call_equals_dense(kv_dtype, block):
    """Calls of several steps (a prefill of one row, then calls that wrap the ring)."""
    tr = make_lm().transformer
    B = 2
    dense = tr.init_state(B, kv_dtype=kv_dtype)
    paged = tr.init_state(B, kv_dtype=kv_dtype, kv_blocks=1 + B * paged_kv.ring_blocks(tr.capacity, block),
                          block_size=block)
    blocks = Blocks(paged)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for T, live in ((13, [True, False]), (9, [True, True]), (30, [True, True]), (17, [False, True])):
            live = torch.tensor(live)
            x = torch.randn(B, T, tr.d_model, generator=g)
            blocks.before_step(live, T)
            assert torch.equal(tr(x, paged, live), tr(x, dense, live))
    assert_same_rings(paged, dense)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_lm_frames_and_prompt_adoption_paged_equal_dense(kv_dtype):
    """LMGen with a paged temporal state (the depformer stays dense): a prompt adopted from a dense
    prompt state into a row, then whole frames; the same tokens and the same rings."""
    lm = make_lm()
    gen = LMGen(lm, text_temp=0.0, audio_temp=0.0)
    B = 3
    dense = gen.init_state(B, kv_dtype=kv_dtype)
    paged = gen.init_state(B, kv_dtype=kv_dtype, kv_blocks=1 + B * lm.cfg.context // BLOCK, block_size=BLOCK)
    assert paged.transformer.paged and not paged.depformer.paged
    blocks = Blocks(paged.transformer)
    prompt = gen.prompt_state(kv_dtype)
    frames = 11
    with torch.no_grad():
        lm.transformer(torch.randn(1, 16, lm.cfg.dim, generator=torch.Generator().manual_seed(4)), prompt)
        with pytest.raises(ValueError, match="no block"):
            gen.adopt_prompt(paged, 1, prompt, frames)
        blocks.cover(1, 0, frames)
        for state in (dense, paged):
            gen.adopt_prompt(state, 1, prompt, frames)
        codes = torch.randint(0, lm.cfg.card, (50, B, lm.cfg.n_user), generator=torch.Generator().manual_seed(5))
        for f in range(codes.shape[0]):
            live = torch.tensor([True, True, f % 4 != 0])
            blocks.before_step(live)
            a, b = gen.step(paged, codes[f], live), gen.step(dense, codes[f], live)
            assert torch.equal(a.text, b.text) and torch.equal(a.audio, b.audio) and torch.equal(a.valid, b.valid)
    assert_same_rings(paged.transformer, dense.transformer)


@BLOCKS
def test_forgotten_block_is_never_attended_again(block):
    """A row that gives a block back mid-session (the engine's shrink policy) attends as a dense
    row whose slots in that block were emptied; the block's next lap takes a fresh block. The
    ring's last block too: where it is partly used, only its ring slots are emptied (the rest
    would be the next row's)."""
    tr = make_lm().transformer
    B = 2
    nb = paged_kv.ring_blocks(tr.capacity, block)
    dense = tr.init_state(B)
    paged = tr.init_state(B, kv_blocks=3 + B * nb, block_size=block)  # + the forgotten blocks' next laps
    blocks = Blocks(paged)
    live = torch.ones(B, dtype=torch.bool)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for t in range(tr.capacity + 12):
            if t == 20:  # row 1 forgets its logical block 1 (slots block .. 2 * block - 1)
                paged.forget_blocks(1, [1])
                dense.slot_pos[1, block:2 * block] = -1
                assert int(paged.block_table[1, 1]) == paged_kv.NULL_BLOCK
            if t == tr.capacity + 4:  # row 0 forgets its last block (the ring's last slots)
                paged.forget_blocks(0, [nb - 1])
                dense.slot_pos[0, (nb - 1) * block:] = -1
            blocks.before_step(live)
            x = torch.randn(B, 1, tr.d_model, generator=g)
            assert torch.equal(tr(x, paged, live), tr(x, dense, live))
    assert_same_rings(paged, dense)


def test_block_table_methods_and_views():
    tr = make_lm().transformer
    state = tr.init_state(3, kv_blocks=7, block_size=BLOCK)
    assert state.block_table.shape == (3, 5) and state.block_table.dtype == torch.int32
    assert state.keys[0].shape == (7, tr.num_heads, BLOCK, tr.d_model // tr.num_heads)
    state.assign_blocks(1, [0, 3], [6, 2])
    assert state.block_table[1].tolist() == [6, 0, 0, 2, 0]
    for logical, physical in (([5], [1]), ([0], [0]), ([0], [7]), ([0, 1], [1])):
        with pytest.raises(ValueError):
            state.assign_blocks(0, logical, physical)
    with pytest.raises(ValueError):
        state.forget_blocks(0, [5])
    # Views share the pools (they belong to every row) and slice the table.
    view = state.leading_rows(2)
    assert view.keys[0] is state.keys[0] and view.block_table.data_ptr() == state.block_table.data_ptr()
    one = state.row(1)
    assert one.batch_size == 1 and one.block_table[0].tolist() == [6, 0, 0, 2, 0]
    # Reset keeps a row's blocks; release gives them back and empties the row.
    state.pos[1] = 9
    state.slot_pos[1, :9] = torch.arange(9)
    state.reset(torch.tensor([False, True, False]))
    assert state.block_table[1].tolist() == [6, 0, 0, 2, 0] and int(state.pos[1]) == 0
    state.pos[1] = 4
    state.release_row(1)
    assert not state.block_table.any() and int(state.pos[1]) == 0 and (state.slot_pos[1] == -1).all()
    with pytest.raises(ValueError, match="dense"):
        tr.init_state(1).assign_blocks(0, [0], [1])


def test_block_size_default_and_checks():
    assert paged_kv.block_size_for(3000, None) == 64 and paged_kv.ring_blocks(3000, 64) == 47
    assert paged_kv.block_size_for(40, None) == 40 and paged_kv.ring_blocks(40, 40) == 1
    assert paged_kv.block_size_for(3000, 60) == 60 and paged_kv.ring_blocks(3000, 60) == 50
    assert paged_kv.block_size_for(3000, None, divides=True) == 60  # page lists: a block that divides
    assert paged_kv.block_size_for(40, None, divides=True) == 40 and paged_kv.block_size_for(100, None, True) == 50
    for bad in (0, 3001):
        with pytest.raises(ValueError, match="capacity 3000"):
            paged_kv.block_size_for(3000, bad)
    tr = make_lm().transformer
    with pytest.raises(ValueError, match="kv_blocks"):
        tr.init_state(1, block_size=8)
    with pytest.raises(ValueError, match="null block"):
        tr.init_state(1, kv_blocks=1)


def test_frame_benchmarks_paged_setup_runs_on_cpu():
    """The paged path of the CUDA-only frame benchmarks (frame_latency.py, profile_frame.py
    --kv-blocks) at tiny shapes: pool sizes, each row given its window's blocks, frames stepping."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import frame_setup
    lm, mimi, lm_cfg, mimi_cfg = frame_setup.random_models("tiny", "cpu", torch.float32)
    assert frame_setup.kv_pool(None, 3, ["spread"], lm_cfg, 8, 5) is None
    assert frame_setup.kv_pool("full", 3, ["spread"], lm_cfg, 8, 5) == (15, 8)
    assert frame_setup.kv_pool("7", 3, ["spread"], lm_cfg, None, 5) == (7, 40)
    blocks, frames = frame_setup.kv_pool("fit", 3, ["empty", "spread"], lm_cfg, 8, 5)
    assert (blocks, frames) == (1 + 4 + 5, 8)  # rows at 0, 20, 40 (wrapped: a whole window) + 5 frames
    backend = ModelBackend(frame_setup.bench_checkpoint(lm, mimi, lm_cfg, mimi_cfg), 3, cuda_graphs=False, seed=0,
                           kv_blocks=blocks, kv_block_frames=frames)
    state = backend._lm_state.transformer
    with pytest.raises(ValueError, match="need 15 KV blocks"):
        frame_setup.place_rows(backend._lm_state, "full", lm_cfg.context, ahead=5)
    frame_setup.place_rows(backend._lm_state, "spread", lm_cfg.context, ahead=5)
    assert [int((row != 0).sum()) for row in state.block_table] == [1, 4, 5]
    live = torch.ones(3, dtype=torch.bool)
    for _ in range(5):
        out = backend.step(torch.randn(3, FRAME_SAMPLES) * 0.1, live).to_host()
    assert state.pos.tolist() == [5, 25, 45] and out.valid.all()
    backend.close()


def test_decode_pages_are_the_slots_the_ring_holds():
    """`paged_kv.decode_pages` (FlashInfer's page-list layout) against the ring itself: the engine's
    KV block pool under the shrink policy (blocks taken from the longest row, rings wrapping,
    sessions ending and starting with prompts) drives a paged state that the model steps; after
    every step each row's pages hold exactly the slots whose slot_pos says written."""
    from parley.engine.kv_blocks import KvBlockPool, KvLayout

    tr = make_lm().transformer
    B, S = 3, tr.capacity
    total = 9  # 3 rows of 5-block windows in 9 blocks: shrink takes blocks once they grow
    pool = KvBlockPool(KvLayout(window_frames=S, block_frames=BLOCK, block_bytes=1), B, total, "shrink")
    state = tr.init_state(B, kv_blocks=1 + total, block_size=BLOCK)
    ids: list[str | None] = [None] * B
    g = torch.Generator().manual_seed(9)
    rng = np.random.default_rng(9)
    sessions = 0

    def apply(changes) -> None:
        state.map_blocks(changes.released, changes.forgotten, changes.assigned)

    with torch.no_grad():
        for t in range(4 * S):
            for row in range(B):
                if ids[row] is not None and rng.random() < 0.01:
                    pool.end(row, ids[row])
                    ids[row] = None
                if ids[row] is None and rng.random() < 0.2 and pool.admittable() > 0:
                    sessions += 1
                    rid, prompt = f"s{sessions}", int(rng.integers(0, 12))
                    pool.admit(row, rid)
                    apply(pool.start(row, rid, prompt))
                    one = torch.zeros(B, dtype=torch.bool)
                    one[row] = True
                    for _ in range(prompt):  # the prompt's frames, written before the row goes live
                        tr(torch.randn(B, 1, tr.d_model, generator=g), state, one)
                    ids[row] = rid
            apply(pool.step(ids))
            pos, taken_at = pool.decode_positions()
            stepping = pos >= 0
            assert np.array_equal(stepping, [rid is not None for rid in ids])
            assert np.array_equal(pos[stepping], state.pos.numpy()[stepping])  # the pool's positions are the model's
            tr(torch.randn(B, 1, tr.d_model, generator=g), state, torch.from_numpy(stepping))
            indptr, indices, last = paged_kv.decode_pages(state.table_host, pos, taken_at, S, BLOCK)
            for row in np.flatnonzero(pos >= 0):
                pages = indices[indptr[row]:indptr[row + 1]]
                read = {(int(p), k) for p in pages[:-1] for k in range(BLOCK)}
                read |= {(int(pages[-1]), k) for k in range(int(last[row]))}
                written = {(int(state.table_host[row, s // BLOCK]), s % BLOCK)
                           for s in np.flatnonzero(state.slot_pos[row].numpy() >= 0)}
                assert read == written, (t, row)
            assert all(last[pos < 0] == 1) and all(indices[indptr[:-1][pos < 0]] == paged_kv.NULL_BLOCK)
    assert pool.counters().shrinks > 0 and sessions > B  # shrink took blocks; rows were reused
    # Blocks given ahead of the positions that write them (as the frame benchmarks place rows) are
    # not read before; a row placed wrapped (taken before position 0: -1) reads its whole ring.
    table = np.array([[3, 5, 7, 9, 11], [2, 4, 6, 8, 10]], np.int32)
    taken = np.array([[0, 8, 16, 24, 32], [-1] * 5])
    indptr, indices, last = paged_kv.decode_pages(table, np.array([12, 47]), taken, 40, 8)
    assert indptr.tolist() == [0, 2, 7] and last.tolist() == [5, 8]
    assert indices.tolist() == [3, 5, 4, 6, 8, 10, 2]  # row 1 writes slot 7 (47 % 40): its block 0 goes last
    with pytest.raises(ValueError, match="divides"):  # a second partial page has no place in the list
        paged_kv.decode_pages(np.zeros((1, 4), np.int32), np.zeros(1, np.int64), np.zeros((1, 4), np.int64), 40, 12)
