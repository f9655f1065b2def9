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


def paired_outputs(dirs, graphs: bool, in_frame: bool | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per tick: the STT outputs of the live rows and the duplex pcm. in_frame None: no STT."""
    duplex, stt_dir = dirs
    paired = None
    if in_frame is not None:
        paired = PairedTranscription(load_stt_checkpoint(stt_dir, device="cuda", dtype=torch.float32), SLOTS,
                                     cuda_graphs=graphs, in_frame=in_frame)
        assert paired.graphed == (graphs and not in_frame)
    backend = ModelBackend(load_checkpoint(duplex, device="cuda", dtype=torch.float32), SLOTS, seed=3,
                           encode_codebooks=12 if in_frame is False else None, cuda_graphs=graphs,
                           side_work=paired.frame_work if paired is not None else None)
    loop = asyncio.new_event_loop()
    for row in (0, 2, 5):
        if paired is not None:
            paired.enable(row, f"r{row}", loop)
    stt, pcm = [], []
    for t, live in enumerate(LIVE):
        mask = torch.zeros(SLOTS, dtype=torch.bool)
        mask[live] = True
        plan = TickPlan(tick=t, request_ids=[f"r{i}" if mask[i] else None for i in range(SLOTS)], live_mask=mask,
                        frames=frames(t), underruns=0, released=[],
                        arrivals=[0.0 if mask[i] else None for i in range(SLOTS)])
        if paired is not None:
            paired.prepare(plan)
        out = backend.step(plan.frames, plan.live_mask)
        if paired is not None:
            paired.step(plan, out)
            stt.append(paired._out.cpu().numpy()[live].copy())
        pcm.append(out.to_host().pcm.copy())
        if paired is not None:
            paired.publish()
    if paired is not None:
        paired.close()
    backend.close()
    loop.close()
    return stt, pcm


def assert_same_stt(reference: list[np.ndarray], other: list[np.ndarray], what: str) -> None:
    for a, b in zip(reference, other, strict=True):
        np.testing.assert_array_equal(a[:, :2], b[:, :2], err_msg=what)  # text tokens, valid flags
        np.testing.assert_allclose(a[:, 2], b[:, 2], rtol=1e-5, err_msg=what)  # end-of-turn


def test_paired_graphs_equal_eager(dirs):
    """After the frame (the server's way): the graphed STT steps give the eager outputs."""
    eager, _ = paired_outputs(dirs, False, False)
    assert any(o[:, 1].any() for o in eager)  # some rows got past the text delay
    assert_same_stt(eager, paired_outputs(dirs, True, False)[0], "after the frame, graphed")


def test_paired_in_frame_equals_after_frame(dirs):
    """In the frame (a side stream inside the frame's graph), eager and graphed, the STT gives what
    it gives after the frame; the duplex audio is bit-identical with and without it."""
    reference, _ = paired_outputs(dirs, False, False)
    assert_same_stt(reference, paired_outputs(dirs, False, True)[0], "in the frame, eager")
    graphed, pcm = paired_outputs(dirs, True, True)
    assert_same_stt(reference, graphed, "in the frame, graphed")
    _, plain = paired_outputs(dirs, True, None)
    assert all(np.array_equal(a, b) for a, b in zip(plain, pcm, strict=True))


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
    assert [list(map(content, g)) for g in graphed] == [list(map(content, e)) for e in eager]
    for g, e in zip(graphed, eager, strict=True):  # end-of-turn probabilities, as in the paired test
        np.testing.assert_allclose([x.end_of_turn for x in g if hasattr(x, "end_of_turn")],
                                   [x.end_of_turn for x in e if hasattr(x, "end_of_turn")], rtol=1e-5)


def content(event) -> str:
    """An event without what differs between two runs by design: its input's arrival time
    (`input_at`, time.monotonic()) and the float end-of-turn probability (compared to a tolerance)."""
    if not hasattr(event, "input_at"):
        return repr(event)  # the terminal event
    return repr((event.text, event.words, event.audio_s, event.input_at is None))
