"""FlashInfer's paged decode through page lists (models/paged_decode.py `FlashInferDecode`) on a
GPU, against Parley's Triton paged kernel on a copy of the same state, bf16, Moshi's head size:
the engine's KV pool under the shrink policy plans each step (rows pausing, blocks taken from the
longest row, rings wrapping). Then under a CUDA graph: captured once on idle lists, replayed after
each step's plan, equal to eager. Skipped without CUDA or without flashinfer-python installed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parley.engine.kv_blocks import KvBlockPool, KvLayout
from parley.models import paged_kv
from parley.models.paged_decode import FlashInferDecode, flashinfer_module
from parley.models.transformer import StreamingTransformer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(flashinfer_module() is None, reason="flashinfer-python is not installed")]

B, HEADS, HEAD_DIM, CONTEXT, BLOCK = 3, 2, 128, 40, 8
IDS = [lambda t: "s0", lambda t: "s1" if t % 3 != 1 else None, lambda t: "s2" if t >= 5 else None]


def setup(states: int):
    torch.manual_seed(0)
    tr = StreamingTransformer(HEADS * HEAD_DIM, HEADS, 2, 512, context=CONTEXT, norm="rms_norm_f32",
                              gating="silu", device="cuda", dtype=torch.bfloat16).eval()
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


def flashinfer(buckets=(B,)) -> FlashInferDecode:
    return FlashInferDecode(list(buckets), HEADS, HEAD_DIM, BLOCK, paged_kv.ring_blocks(CONTEXT, BLOCK),
                            torch.device("cuda"))


def test_flashinfer_reads_what_the_triton_kernel_reads():
    tr, pool, (fi_state, kernel_state) = setup(2)
    fi_state.page_decode = flashinfer()
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
