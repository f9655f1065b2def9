"""FlashInfer's paged decode through page lists (models/paged_decode.py `FlashInferDecode`) on a
GPU, against Parley's Triton paged kernel on a copy of the same state, bf16, Moshi's head size:
the engine's KV pool under the shrink policy plans each step (rows pausing, blocks taken from the
longest row, rings wrapping). Then under a CUDA graph: captured once on idle lists, replayed after
each step's plan, equal to eager. Then through the engine (`--kv-attention flashinfer`): every
call checked against the window the rings hold, and graphed against eager. Skipped without CUDA
or without flashinfer-python installed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from parley.engine import SessionOptions
from parley.engine.kv_blocks import KvBlockPool, KvLayout
from parley.models import paged_kv
from parley.models.paged_decode import FlashInferDecode, flashinfer_module
from parley.models.transformer import StreamingTransformer
from test_paged_engine import conversation  # the same sessions: ending, reusing a row, wrapping

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(flashinfer_module() is None, reason="flashinfer-python is not installed")]

B, HEADS, HEAD_DIM, CONTEXT, BLOCK = 3, 2, 128, 40, 8
IDS = [lambda t: "s0", lambda t: "s1" if t % 3 != 1 else None, lambda t: "s2" if t >= 5 else None]


def setup(states: int, heads: int = HEADS, kv_repeat: int = 1, pe: str = "rope"):
    torch.manual_seed(0)
    tr = StreamingTransformer(heads * HEAD_DIM, heads, 2, 512, context=CONTEXT, norm="rms_norm_f32",
                              gating="silu", kv_repeat=kv_repeat, positional_embedding=pe, device="cuda",
                              dtype=torch.bfloat16).eval()
    pool = KvBlockPool(KvLayout(window_frames=CONTEXT, block_frames=BLOCK, block_bytes=1), B, 12, "shrink")
    made = [tr.init_state(B, kv_blocks=13, block_size=BLOCK) for _ in range(states)]
    for row in range(B):
        pool.admit(row, f"s{row}")
        assigned = pool.start(row, f"s{row}", 0).assigned
        for state in made:
            state.map_blocks(assigned=assigned)
    return tr, pool, made


def step_pool(pool: KvBlockPool, states, t: int):
    changes = pool.step([ids(t) for ids in IDS])
    for state in states:
        state.map_blocks(changes.released, changes.forgotten, changes.assigned)
    return pool.decode_positions()


def lists(state, pos, taken_at):
    return paged_kv.decode_pages(state.table_host, pos, taken_at, CONTEXT, BLOCK)


def flashinfer(buckets=(B,), heads: int = HEADS, kv_heads: int = HEADS) -> FlashInferDecode:
    return FlashInferDecode(list(buckets), heads, HEAD_DIM, BLOCK, paged_kv.ring_blocks(CONTEXT, BLOCK),
                            torch.device("cuda"), kv_heads=kv_heads)


@pytest.mark.parametrize("heads,kv_repeat,pe", [(HEADS, 1, "rope"), (8, 2, "rope_concat"), (8, 4, "rope_concat")])
def test_flashinfer_reads_what_the_triton_kernel_reads(heads, kv_repeat, pe):
    """Moshi's attention, and Hibiki-Zero's (grouped KV heads through FlashInfer's GQA decode,
    keys rotated on head halves by our kernel before FlashInfer reads the pages)."""
    tr, pool, (fi_state, kernel_state) = setup(2, heads, kv_repeat, pe)
    fi_state.page_decode = flashinfer(heads=heads, kv_heads=heads // kv_repeat)
    with torch.no_grad():
        for t in range(3 * CONTEXT):
            pos, taken_at = step_pool(pool, (fi_state, kernel_state), t)
            fi_state.page_decode.plan(B, *lists(fi_state, pos, taken_at))
            live = torch.from_numpy(pos >= 0).cuda()
            x = torch.randn(B, 1, tr.d_model, device="cuda", dtype=torch.bfloat16)
            got, want = tr(x, fi_state, live), tr(x, kernel_state, live)
            torch.testing.assert_close(got[live].float(), want[live].float(), atol=3e-2, rtol=3e-2)
    assert pool.counters().shrinks > 0


def test_flashinfer_decode_graph_equals_eager():
    tr, pool, (eager, graphed) = setup(2)
    eager.page_decode, graphed.page_decode = flashinfer(), flashinfer()
    idle = torch.zeros(B, dtype=torch.bool, device="cuda")
    static_x = torch.zeros(B, 1, tr.d_model, device="cuda", dtype=torch.bfloat16)
    static_live = idle.clone()
    nb = paged_kv.ring_blocks(CONTEXT, BLOCK)
    graphed.page_decode.plan(B, *paged_kv.decode_pages(graphed.table_host, np.full(B, -1), np.full((B, nb), -1),
                                                       CONTEXT, BLOCK))
    with torch.no_grad():
        tr(static_x, graphed, idle)  # warm-up: no row steps, nothing changes
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = tr(static_x, graphed, static_live)
        for t in range(3 * CONTEXT):
            pos, taken_at = step_pool(pool, (eager, graphed), t)
            for state in (eager, graphed):
                state.page_decode.plan(B, *lists(state, pos, taken_at))
            live = torch.from_numpy(pos >= 0).cuda()
            x = torch.randn(B, 1, tr.d_model, device="cuda", dtype=torch.bfloat16)
            static_x.copy_(x)
            static_live.copy_(live)
            graph.replay()
            want = tr(x, eager, live)
            assert torch.equal(static_out[live], want[live]), t
            assert torch.equal(graphed.pos, eager.pos)


def engine_with(tiny_moshi_dir, cuda_graphs: bool, check: bool = False, rows: int = 3, blocks: int = 9):
    """An engine as `parley serve --kv-attention flashinfer` builds it, over the tiny checkpoint
    with an LM of Moshi's head size (128) in bf16, a pool short of memory (the shrink policy takes
    blocks); `check`: its decode wrapped in `CheckedDecode` (eager), returned too."""
    from parley.engine import Engine, EngineConfig
    from parley.engine.backend import ModelBackend, kv_layout
    from parley.models.checkpoint import load_checkpoint
    from parley.models.lm import LMModel
    checkpoint = load_checkpoint(tiny_moshi_dir, "cuda", torch.bfloat16)
    cfg = dataclasses.replace(checkpoint.lm_config, dim=2 * HEAD_DIM, num_heads=2)
    torch.manual_seed(0)
    checkpoint = dataclasses.replace(checkpoint, lm=LMModel(cfg, device="cuda", dtype=torch.bfloat16).eval(),
                                     lm_config=cfg)
    layout = kv_layout(checkpoint, None, BLOCK, divides=True)
    backend = ModelBackend(checkpoint, rows, seed=0, cuda_graphs=cuda_graphs, kv_blocks=blocks,
                           kv_block_frames=layout.block_frames, paged_attention="flashinfer")
    checked = CheckedDecode(backend) if check else None
    pool = KvBlockPool(layout, rows, blocks, "shrink")
    return Engine(backend, EngineConfig(input_frames=256, output_events=1024), kv=pool), checked


class CheckedDecode:
    """FlashInfer's decode, each call checked against attention over the rows' rings as the state
    holds them (their slot positions within the window, the step's own slot at its position):
    what the Triton kernel reads, and the positions the pool planned against the state's. Eager only."""

    def __init__(self, backend) -> None:
        self.state = backend._lm_state.transformer
        self.decode, self.context = self.state.page_decode, backend.checkpoint.lm_config.context
        self._run = self.decode.run
        self.decode.run = self.run  # on the instance: the row buckets' state views hold this object
        self.stepping: np.ndarray | None = None
        self.checked = 0
        plan_step = backend.plan_kv_step

        def record(positions, taken_at):  # (before the Engine binds it)
            self.stepping = positions.copy()
            plan_step(positions, taken_at)
        backend.plan_kv_step = record

    def run(self, q, k_pool, v_pool):
        out = self._run(q, k_pool, v_pool)
        n, tr = q.shape[0], self.state
        pos = tr.pos[:n]
        rows = torch.from_numpy(self.stepping[:n] >= 0).cuda()
        assert torch.equal(pos[rows].cpu(), torch.from_numpy(self.stepping[:n][self.stepping[:n] >= 0]))
        slot_pos = tr.slot_pos[:n].clone()
        slot_pos[torch.arange(n, device="cuda"), pos % tr.capacity] = pos  # written this step, advanced after
        valid = (slot_pos >= 0) & (slot_pos > pos[:, None] - self.context) & (slot_pos <= pos[:, None])
        keys = paged_kv.gather_ring(k_pool, tr.block_table[:n], tr.capacity).float()
        values = paged_kv.gather_ring(v_pool, tr.block_table[:n], tr.capacity).float()
        scores = torch.einsum("bhd,bhsd->bhs", q.float(), keys) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~valid[:, None], float("-inf"))
        want = torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), values)
        torch.testing.assert_close(out[rows].float(), want[rows], atol=3e-2, rtol=3e-2)
        self.checked += int(rows.sum())
        return out


def test_the_engine_plans_the_pages_each_tick(tiny_moshi_dir):
    """Through the engine (its KV pool plans each tick, row buckets, rows ending and reused, the
    shrink policy, windows wrapping), every FlashInfer call reads the window the rings hold."""
    engine, checked = engine_with(tiny_moshi_dir, cuda_graphs=False, check=True)
    out = conversation(engine, SessionOptions())
    assert checked.checked > 0 and engine.counters()["kv_shrinks"] > 0
    assert all(len(frames) > 0 for frames in out.values())


def test_the_engine_under_graphs_equals_eager(tiny_moshi_dir):
    """The same conversation graphed (one graph per row bucket, planned lists in its buffers) and
    eager: text equal while the sessions' inputs agree, audio within bf16's step tolerance."""
    eager = conversation(engine_with(tiny_moshi_dir, cuda_graphs=False)[0], SessionOptions())
    graphed = conversation(engine_with(tiny_moshi_dir, cuda_graphs=True)[0], SessionOptions())
    for name in eager:
        assert len(graphed[name]) == len(eager[name]) > 0
        assert graphed[name][0][1] == eager[name][0][1], name
        np.testing.assert_allclose(np.frombuffer(graphed[name][0][0], np.float32),
                                   np.frombuffer(eager[name][0][0], np.float32), atol=2e-2)
