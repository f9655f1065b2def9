"""Row buckets: a tick runs only the lowest rows that hold every live row (engine/backend.py on
engine/bucketed_step.py, whose own tests are in test_bucketed_step.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parley.engine import SamplingOptions
from parley.engine.backend import ModelBackend
from parley.models.config import FRAME_SAMPLES


def _frames(t: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(t)
    return torch.randn(rows, FRAME_SAMPLES, generator=g) * 0.1


def _run(backend: ModelBackend, masks: list[list[bool]], start: int = 0) -> list:
    """Step masks[start:] (frame t gets inputs seeded by t); (bucket, host output) per tick."""
    if start == 0:
        for row in range(backend.max_sessions):
            backend.set_sampling(row, SamplingOptions.greedy())
    outs = []
    for t in range(start, len(masks)):
        live = torch.tensor(masks[t] + [False] * (backend.max_sessions - len(masks[t])))
        outs.append((backend.bucket(live), backend.step(_frames(t, backend.max_sessions), live).to_host()))
    return outs


def test_one_live_row_runs_alone_and_equals_a_one_row_backend(tiny_moshi_dir):
    """A session in row 0 of a 4-row backend runs in bucket 1, bit for bit as in a 1-row backend;
    once row 2 goes live the tick runs all 4 rows, equal (up to the float rounding a batch size
    change brings) to a backend without buckets; rows above the bucket are reported not valid and
    their state is never touched."""
    masks = [[True]] * 4 + [[True, False, True]] * 3
    bucketed = ModelBackend.load(tiny_moshi_dir, 4, seed=0, row_buckets=True)
    state = bucketed._lm_state.transformer
    first = _run(bucketed, masks[:4])
    assert [n for n, _ in first] == [1] * 4
    assert state.pos.tolist() == [4, 0, 0, 0] and not state.keys[0][1:].any()
    single = _run(ModelBackend.load(tiny_moshi_dir, 1, seed=0), masks[:4])
    for (_, a), (_, b) in zip(first, single):
        assert np.array_equal(a.pcm[0], b.pcm[0]) and a.text_tokens[0] == b.text_tokens[0]
        assert a.pcm.shape == (4, FRAME_SAMPLES) and not a.valid[1:].any() and not a.pcm[1:].any()

    later = _run(bucketed, masks, start=4)
    assert [n for n, _ in later] == [4] * 3
    plain = _run(ModelBackend.load(tiny_moshi_dir, 4, seed=0, row_buckets=False), masks)
    assert any(b.valid[2] for _, b in plain[4:])
    for (_, a), (_, b) in zip(first + later, plain):
        assert np.array_equal(a.valid, b.valid)
        np.testing.assert_allclose(a.pcm[a.valid], b.pcm[b.valid], atol=1e-5)
        assert np.array_equal(a.text_tokens[a.valid], b.text_tokens[b.valid])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mask", [[True], [False, True], [True, False, False, True, False, True]])
def test_bucket_graphs_equal_eager(tiny_moshi_dir, mask):
    """Each bucket's CUDA graph computes what the same bucket computes eagerly."""
    def run(graphs: bool):
        backend = ModelBackend.load(tiny_moshi_dir, 8, device="cuda", dtype=torch.float32, cuda_graphs=graphs,
                                    seed=3)
        outs = _run(backend, [mask] * 5)
        backend.close()
        return outs

    eager, graphed = run(False), run(True)
    for (n0, a), (n1, b) in zip(eager, graphed):
        assert n0 == n1 == next(n for n in (1, 2, 4, 8) if n >= len(mask))
        np.testing.assert_array_equal(a.text_tokens, b.text_tokens)
        np.testing.assert_array_equal(a.valid, b.valid)
        np.testing.assert_allclose(a.pcm, b.pcm, atol=1e-5)
