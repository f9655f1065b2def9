"""CUDA-graphed STT steps (engine/stt_paired.py, engine/stt_pool.py) give the eager tokens.

On CUDA both the paired rows and the standalone pool replay one graph per row bucket; eagerly
the same code runs op by op. Greedy decoding on the tiny float32 STT: the text tokens, the
valid flags and the end-of-turn probabilities must match step for step, across bucket changes.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from parley.engine.backend import ModelBackend
from parley.engine.scheduler import TickPlan
from parley.engine.slack import CostModel
from parley.engine.stt_paired import PairedTranscription
from parley.engine.stt_pool import SttPool
from parley.models.checkpoint import load_checkpoint, load_stt_checkpoint
from parley.models.config import FRAME_SAMPLES
from parley.models.synthetic import write_tiny_checkpoint, write_tiny_stt_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLOTS = 8
# Live rows per tick: bucket 1, then 4 (rows 0 and 2), then 8 (row 5 joins), then back to 4.
LIVE = [[0]] * 3 + [[0, 2]] * 3 + [[0, 2, 5]] * 4 + [[0, 2]] * 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    duplex = write_tiny_checkpoint(tmp_path_factory.mktemp("duplex16"), mimi_levels=16)
    return duplex, write_tiny_stt_checkpoint(tmp_path_factory.mktemp("stt12"), n_q=12, mimi_from=duplex)


def frames(t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(t)
    return torch.randn(SLOTS, FRAME_SAMPLES, generator=g) * 0.2


def paired_outputs(dirs, graphs: bool) -> list[np.ndarray]:
    duplex, stt_dir = dirs
    backend = ModelBackend(load_checkpoint(duplex, device="cuda", dtype=torch.float32), SLOTS, seed=3,
                           encode_codebooks=12, cuda_graphs=graphs)
    paired = PairedTranscription(load_stt_checkpoint(stt_dir, device="cuda", dtype=torch.float32), SLOTS,
                                 cuda_graphs=graphs)
    assert paired.graphed == graphs
    loop = asyncio.new_event_loop()
    for row in (0, 2, 5):
        paired.enable(row, f"r{row}", loop)
    outs = []
    for t, live in enumerate(LIVE):
        mask = torch.zeros(SLOTS, dtype=torch.bool)
        mask[live] = True
        plan = TickPlan(tick=t, request_ids=[f"r{i}" if mask[i] else None for i in range(SLOTS)], live_mask=mask,
                        frames=frames(t), underruns=0, released=[])
        out = backend.step(plan.frames, plan.live_mask)
        paired.step(plan, out)
        outs.append(paired._out.cpu().numpy().copy())
        out.to_host()
        paired.publish()
    paired.close()
    backend.close()
    loop.close()
    return outs


def test_paired_graphs_equal_eager(dirs):
    eager, graphed = paired_outputs(dirs, False), paired_outputs(dirs, True)
    assert [len(o) for o in graphed] == [1] * 3 + [4] * 3 + [8] * 4 + [4] * 3
    for a, b in zip(eager, graphed):
        np.testing.assert_array_equal(a[:, :2], b[:, :2])  # text tokens and valid flags
        np.testing.assert_allclose(a[:, 2], b[:, 2], rtol=1e-5)
    assert any(o[:, 1].any() for o in graphed)  # some rows got past the text delay


def pool_transcripts(stt, graphs: bool) -> list[list]:
    async def main():
        pool = SttPool(stt, slots=4, cuda_graphs=graphs)
        pool.warm_up(CostModel())
        assert pool.graphed == graphs
        rng = np.random.default_rng(0)
        requests = [pool.submit() for _ in range(3)]
        for i, request in enumerate(requests):
            request.feed((0.2 * rng.standard_normal(int((0.5 + 0.4 * i) * 24_000))).astype(np.float32))
            request.end_input()
        pool.run_until_idle()
        await asyncio.sleep(0)
        return [request.events.drain() for request in requests]
    return asyncio.run(main())


def test_pool_graphs_equal_eager(dirs):
    stt = load_stt_checkpoint(dirs[1], device="cuda", dtype=torch.float32)
    eager, graphed = pool_transcripts(stt, False), pool_transcripts(stt, True)
    assert all(len(e) > 1 for e in eager)
    assert list(map(repr, graphed)) == list(map(repr, eager))  # text, words, probabilities, terminal
