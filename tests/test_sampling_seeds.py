"""Per-session seeds: a seeded row's sampling depends only on its seed, its step and its input,
never on the shared generator or the other rows; unseeded rows sample exactly as before."""

from __future__ import annotations

import numpy as np
import torch

from parley.engine import SamplingOptions
from parley.engine.backend import ModelBackend
from parley.models.config import FRAME_SAMPLES
from parley.models.sampling import UNSEEDED, hashed_noise, sample_tokens, seed_noise_

HOT = SamplingOptions(text_temperature=1.0, text_top_k=1000, audio_temperature=1.0, audio_top_k=1000)


def test_hashed_noise_is_exponential_and_keyed_by_seed_step_and_stream():
    n = hashed_noise(torch.tensor([3, 3, 3, 4]), torch.tensor([0, 1, 0, 0]), 0, 40000)
    assert torch.allclose(n.mean(1), torch.ones(4), atol=0.03) and torch.allclose(n.std(1), torch.ones(4), atol=0.03)
    assert (n > 0).all() and torch.isfinite(n).all()
    distinct = [n[0], n[1], n[3], hashed_noise(torch.tensor([3]), torch.tensor([0]), 1, 40000)[0]]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(distinct[i], distinct[j])
    assert torch.equal(n[0], hashed_noise(torch.tensor([3]), torch.tensor([0]), 0, 40000)[0])


def test_only_seeded_rows_are_rewritten():
    noise = torch.full((3, 10), -1.0)
    seed_noise_(noise, torch.tensor([UNSEEDED, 9, UNSEEDED]), torch.tensor([0, 2, 0]), 1)
    assert (noise[[0, 2]] == -1).all()
    assert torch.equal(noise[1], hashed_noise(torch.tensor([9]), torch.tensor([2]), 1, 10)[0])


def test_seeded_rows_ignore_the_generator_and_unseeded_rows_keep_it():
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(0))
    logits[2] = logits[0]
    temp, top_k = torch.full((4,), 1.0), torch.zeros(4, dtype=torch.long)
    seeds, counter = torch.tensor([11, UNSEEDED, 11, UNSEEDED]), torch.tensor([5, 5, 5, 5])
    draws = [sample_tokens(logits, temp, top_k, torch.Generator().manual_seed(g), seeds=seeds, counter=counter)
             for g in range(20)]
    assert len({int(d[0]) for d in draws}) == 1 and all(d[0] == d[2] for d in draws)  # seeded: fixed
    assert len({int(d[1]) for d in draws}) > 5  # unseeded: random
    plain = sample_tokens(logits, temp, top_k, torch.Generator().manual_seed(3))
    assert plain[1] == draws[3][1] and plain[3] == draws[3][3]  # unseeded rows: exactly as without seeds


def run_rows(backend: ModelBackend, inputs: list[np.ndarray], steps: int) -> list[list[tuple]]:
    rows = len(inputs)
    live = torch.ones(rows, dtype=torch.bool)
    out: list[list[tuple]] = [[] for _ in range(rows)]
    for t in range(steps):
        frames = torch.from_numpy(np.stack([x[t * FRAME_SAMPLES:(t + 1) * FRAME_SAMPLES] for x in inputs]))
        res = backend.step(frames, live)
        for r in range(rows):
            out[r].append((int(res.text_tokens[r]), tuple(res.agent_codes[r].tolist())))
    return out


def test_seeded_session_reproduces_its_output_whatever_its_neighbours_do(tiny_moshi_dir):
    rng = np.random.default_rng(0)
    speech = (0.2 * rng.standard_normal(FRAME_SAMPLES * 12)).astype(np.float32)
    other = (0.2 * rng.standard_normal(FRAME_SAMPLES * 12)).astype(np.float32)

    first = ModelBackend.load(tiny_moshi_dir, 3, seed=0)
    first.reset_rows(torch.ones(3, dtype=torch.bool))
    for row, seed in ((0, 7), (1, 7), (2, 8)):
        first.set_sampling(row, SamplingOptions(**{**HOT.__dict__, "text_seed": seed, "audio_seed": seed}))
    a = run_rows(first, [speech, speech, speech], 12)
    assert a[0] == a[1]  # same seed, same input: same tokens
    assert a[0] != a[2]  # another seed: other tokens

    second = ModelBackend.load(tiny_moshi_dir, 3, seed=123)  # another shared generator state
    second.reset_rows(torch.ones(3, dtype=torch.bool))
    second.set_sampling(1, SamplingOptions(**{**HOT.__dict__, "text_seed": 7, "audio_seed": 7}))
    second.set_sampling(0, HOT)  # an unseeded neighbour, hearing something else
    b = run_rows(second, [other, speech, other], 12)
    assert b[1] == a[0]

    second.reset_rows(torch.tensor([False, True, False]))  # the session ends: the row forgets its seed
    second.set_sampling(1, HOT)
    c = run_rows(second, [other, speech, other], 12)
    assert c[1] != a[0]


def test_cpu_top_k_keeps_each_rows_k_largest_as_a_full_sort_does():
    """The CPU reads each row's k-th largest value from a partial sort of the largest k any row
    asks for: every row keeps exactly the values a full sort would keep (ties included), so the
    same generator draws the same tokens."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen).round(decimals=1)  # many ties at the cut
    top_k = torch.tensor([1, 7, 0, 300, 40])  # 0 and the vocabulary size: no cut
    temp = torch.tensor([1.0, 0.7, 1.0, 1.3, 0.0])
    k = torch.where((top_k > 0) & (top_k < 300), top_k, torch.full_like(top_k, 300))
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    kept = logits >= kth
    for seed in range(20):
        tokens = sample_tokens(logits, temp, top_k, torch.Generator().manual_seed(seed))
        assert kept.gather(-1, tokens[:, None]).all()
        probs = torch.softmax(logits.masked_fill(~kept, float("-inf")) / torch.where(temp > 0, temp, 1.0)[:, None], -1)
        noise = torch.empty_like(probs).exponential_(1.0, generator=torch.Generator().manual_seed(seed))
        expected = torch.where(temp > 0, (probs / noise).argmax(-1), logits.argmax(-1))
        assert torch.equal(tokens, expected)
    assert sample_tokens(logits[:0], temp[:0], top_k[:0]).shape == (0,)
