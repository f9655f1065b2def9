"""The prefill warm-up a PersonaPlex backend runs at start on CUDA (engine/prompt_prefill.py), run here
on CPU: it leaves no trace in the state, so the first session is the same with or without it."""

from __future__ import annotations

import numpy as np
import torch

from parley.engine import SamplingOptions, SessionOptions
from parley.engine.backend import ModelBackend
from parley.models.config import FRAME_SAMPLES


def _session(backend: ModelBackend) -> list:
    options = SessionOptions(persona="Hi there", voice="NATF0", sampling=SamplingOptions.greedy())
    backend.reset_rows(torch.tensor([True, False]))
    backend.set_sampling(0, options.sampling)
    backend.prefill(0, options)
    outs = []
    for t in range(2):
        frames = torch.randn(2, FRAME_SAMPLES, generator=torch.Generator().manual_seed(t)) * 0.1
        host = backend.step(frames, torch.tensor([True, False])).to_host()
        outs.append((host.pcm[0].copy(), int(host.text_tokens[0]), bool(host.valid[0])))
    return outs


def test_warm_up_leaves_no_trace(tiny_personaplex_dir):
    warm = ModelBackend.load(tiny_personaplex_dir, 2, seed=0)
    warm.warm_up_prefill(chunks=(2, 8))
    state = warm._lm_state
    assert state.offsets.tolist() == [0, 0] and state.transformer.pos.tolist() == [0, 0]
    assert (state.transformer.slot_pos == -1).all() and (state.ring == -2).all()
    cold = ModelBackend.load(tiny_personaplex_dir, 2, seed=0)
    for (pa, ta, va), (pb, tb, vb) in zip(_session(warm), _session(cold)):
        assert np.array_equal(pa, pb) and ta == tb and va == vb
