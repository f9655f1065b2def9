"""TTS row buckets: a step runs only the lowest rows holding the rows it steps (engine/tts_pool.py,
`TtsGen.leading_rows`), exactly as the whole batch would for those rows, leaving the rows above untouched."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from parley.engine.slack import CostModel, SlackRunner
from parley.engine.stream import Status, Terminal
from parley.engine.tts_pool import TtsAudio, TtsPool, TtsRequest, TtsWord, step_key
from parley.models.dsm import split_words
from parley.models.synthetic import TINY_TTS_VOICES
from parley.models.tts import TtsGen
from parley.models.tts_checkpoint import VoiceStore, load_tts_checkpoint

TEXTS = ["Hello there, how are you?", "The quick brown fox jumps.", "Good morning!", "See you tomorrow.",
         "Tell me a story.", "Yes, of course."]
CONDITIONS = {"control": "ok", "cfg": "2.0"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load(tiny_tts_dir, device="cpu"):
    ck = load_tts_checkpoint(tiny_tts_dir, device=device, dtype=torch.float32)
    return ck, VoiceStore.open(tiny_tts_dir / "voices", ck.config.voice_suffix, 16)


@pytest.fixture(scope="module")
def tts(tiny_tts_dir):
    return load(tiny_tts_dir)


def request(tts, text, voice=0):
    ck, store = tts
    return TtsRequest(tuple(split_words(text, ck.tokenizer.encode, 12.5)), (store.load(TINY_TTS_VOICES[voice]),),
                      CONDITIONS, text_temperature=0.0, audio_temperature=0.0)  # greedy: no shared noise


def gen_state(gen: TtsGen) -> list[torch.Tensor]:
    """Every per-row tensor of a TtsGen, rows on dim 0."""
    t, d = gen.transformer, gen.depformer
    return [gen.ring, gen.offsets, gen.cond_sum, gen.float_settings.T, gen.long_settings.T, gen.dsm.state,
            t.pos, t.slot_pos, *t.keys, *t.values, d.pos, d.slot_pos, *d.keys, *d.values,
            *(x for kv in gen.cross for x in kv)]


def loaded_gen(tts, batch: int) -> TtsGen:
    ck, store = tts
    gen = TtsGen(ck.lm, batch, 64, 256, voice_frames=10)
    for row in range(batch):
        req = request(tts, TEXTS[row % len(TEXTS)], row % 3)
        gen.start(row, req.entries, req.voices, CONDITIONS, text_temp=0.0, audio_temp=0.0)
    return gen


def test_a_leading_rows_view_steps_its_rows_as_the_whole_batch_does_and_nothing_above(tts):
    """Steps over the view of rows [0, 2) of a 5-row TtsGen give those rows the tokens, offsets
    and DSM state the full 5-row step gives them (rows 2..4 inactive there; keys and values equal
    up to the rounding a batch-size change brings), and leave rows 2..4 bit-identical."""
    full, bucketed = loaded_gen(tts, 5), loaded_gen(tts, 5)
    view = bucketed.leading_rows(2)
    assert view.batch == 2 and view.text_temp.stride(0) == 1 and view.audio_topk.shape == (2,)
    above = [x[2:].clone() for x in gen_state(bucketed)]
    active = torch.tensor([True, True, False, False, False])
    outputs = 0
    for step in range(30):
        text_only = step < full.cfg.audio_delay_frames  # text steps inside the audio delay, then full ones
        a = full.step(active, full=not text_only)
        b = view.step(active[:2], full=not text_only)
        assert torch.equal(a.frame[:2], b.frame) and torch.equal(a.valid[:2], b.valid)
        assert torch.equal(a.frame_index[:2], b.frame_index)
        outputs += int(b.valid.sum())
    assert outputs > 0  # frames came out, so the comparison covered real tokens
    for x, y in zip(gen_state(full), gen_state(bucketed)):
        if x.is_floating_point():  # keys and values: a batch-size change may round the last bits
            torch.testing.assert_close(x[:2], y[:2], rtol=0, atol=1e-5)
        else:
            assert torch.equal(x[:2], y[:2])
    assert all(torch.equal(x[2:], y) for x, y in zip(gen_state(bucketed), above))
    assert torch.equal(full.dsm.word_step[:2], bucketed.dsm.word_step[:2])


def test_every_per_row_tensor_of_a_view_is_a_view_of_the_lowest_rows(tts):
    """A guard for later fields: every tensor a 6-row TtsGen holds with a 6-row axis is, in the
    3-row view, the same storage cut to 3 rows on that axis (none is left whole, none copied)."""
    gen = loaded_gen(tts, 6)
    view = gen.leading_rows(3)
    per_row = []
    for name, value in vars(gen).items():
        if isinstance(value, torch.Tensor) and 6 in value.shape:
            axis = value.shape.index(6)
            got = getattr(view, name)
            assert got.shape[axis] == 3 and got.data_ptr() == value.data_ptr(), name
            per_row.append(name)
    assert {"ring", "offsets", "cond_sum", "float_settings", "long_settings", "text_temp"} <= set(per_row)
    assert view.dsm.state.shape[0] == 3 and view.dsm.state.data_ptr() == gen.dsm.state.data_ptr()
    assert view.dsm.end_step.shape == (3,) and view.dsm.tokens.data_ptr() == gen.dsm.tokens.data_ptr()


def test_a_view_refuses_row_counts_it_cannot_hold(tts):
    gen = loaded_gen(tts, 2)
    for n in (0, 3):
        with pytest.raises(ValueError, match="rows"):
            gen.leading_rows(n)


def run_pool(pool: TtsPool, reqs: list[TtsRequest], keys: list | None = None) -> list[tuple[list, np.ndarray]]:
    """Run `reqs` together to the end on `pool` (items back to back); words and PCM per request.
    `keys`: the cost key of every step item run is appended."""
    async def main():
        jobs = [pool.submit(r, asyncio.get_running_loop()) for r in reqs]
        events = [[] for _ in jobs]
        costs = CostModel()
        for _ in range(400):
            item = pool.offer(None, costs)
            if item is not None:
                if keys is not None and item.key[1] != "admit":
                    keys.append(item.key)
                item.run()
            for job, got in zip(jobs, events):
                got += job.stream.drain()
            if all(job.stream.finished for job in jobs):
                break
        assert all(got[-1] == Terminal(Status.COMPLETED) for got in events)
        return [([(w.text, w.start_s, w.stop_s) for w in got if isinstance(w, TtsWord)],
                 np.concatenate([e.pcm for e in got if isinstance(e, TtsAudio)])) for got in events]
    return asyncio.run(main())


def test_bucketed_pool_speaks_as_the_whole_batch_pool(tts):
    """Two requests (rows 0 and 1) in an 8-slot pool: steps run bucket 2 (1 once the shorter one
    ends), with the words (and their times) of a pool stepping all 8 rows, and its PCM up to the
    rounding a batch-size change brings (~1e-7 here)."""
    ck, _ = tts
    reqs = [request(tts, TEXTS[0]), request(tts, TEXTS[2], 1)]
    keys = []
    bucketed = run_pool(TtsPool(ck.lm, ck.mimi, 8, voice_frames=10, row_buckets=True), reqs, keys)
    plain_pool = TtsPool(ck.lm, ck.mimi, 8, voice_frames=10)
    assert plain_pool.buckets == [8]  # CPU default: no buckets
    plain = run_pool(plain_pool, reqs)
    assert {k[2] for k in keys} == {1, 2} and keys[0][2] == 2 and keys[-1][2] == 1
    for (words_b, pcm_b), (words_p, pcm_p) in zip(bucketed, plain):
        assert words_b == words_p and len(words_b) >= 2
        np.testing.assert_allclose(pcm_b, pcm_p, rtol=0, atol=1e-5)  # (the batch size's rounding)


def test_the_smallest_bucket_holding_the_stepped_rows_runs(tts):
    """Rows 0 and 5 live of 8: bucket 8; row 0 alone: bucket 1. The offered item's cost key names it."""
    ck, _ = tts
    pool = TtsPool(ck.lm, ck.mimi, 8, voice_frames=10, row_buckets=True)
    assert pool.buckets == [1, 2, 4, 8]
    assert [pool.bucket(rows) for rows in ([0], [1], [0, 2], [3], [4], [0, 5], [7])] == [1, 2, 4, 4, 8, 8, 8]

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [pool.submit(request(tts, "a sentence long enough to keep its row busy"), loop) for _ in range(6)]
        costs = CostModel()
        for _ in range(6):  # the admissions: rows 0..5, lowest first
            pool.offer(None, costs).run()
        assert pool.live == 6
        for job in jobs[1:5]:
            job.cancel()
        item = pool.offer(None, costs)  # rows 1..4 are freed: rows 0 and 5 step
        assert item.key == step_key("text", 8)
        item.run()
        jobs[5].cancel()
        item = pool.offer(None, costs)
        assert item.key == step_key("text", 1)
        item.run()
        jobs[0].cancel()
    asyncio.run(main())


class RecordingCosts(CostModel):
    def __init__(self) -> None:
        super().__init__()
        self.seeded: list = []
        self.recorded: list = []

    def seed(self, key, seconds, units=1):
        self.seeded.append(key)
        super().seed(key, seconds, units)

    def record(self, key, seconds, units=1):
        self.recorded.append(key)
        super().record(key, seconds, units)


def test_every_bucket_key_is_measured_before_the_first_live_item(tts):
    """warm_up and slack_prepare seed each (kind, bucket) key, so every step item a live pool
    runs has an estimate; each item's cost is recorded under its own bucket's key."""
    ck, _ = tts
    pool = TtsPool(ck.lm, ck.mimi, 4, voice_frames=10, row_buckets=True, warm_conditions=CONDITIONS)
    assert set(pool.step_keys) == {step_key(kind, n) for kind in ("text", "full") for n in (1, 2, 4)}
    runner = SlackRunner(lambda: 0.0, lambda: None, guard_s=0.0)
    runner.costs = costs = RecordingCosts()
    pool.warm_up(costs)
    runner.add_source(pool)
    pool.slack_prepare(costs)
    assert set(costs.seeded) >= set(pool.step_keys) and all(costs.estimate(k) > 0 for k in pool.step_keys)
    assert costs.recorded == []  # warm-up costs are seeds, not live costs
    offered = []
    real_offer = pool.offer

    def offer(left_s, cost_model):
        item = real_offer(left_s, cost_model)
        if item is not None:
            assert cost_model.estimate(item.key) is not None, f"{item.key} runs unmeasured"
            offered.append(item.key)
        return item

    pool.offer = offer

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [pool.submit(request(tts, text), loop) for text in TEXTS[:3]]
        for _ in range(300):
            runner.run_until(None)
            for job in jobs:
                job.stream.drain()
            if all(job.stream.finished for job in jobs):
                break
        assert all(job.stream.terminal == Terminal(Status.COMPLETED) for job in jobs)
    asyncio.run(main())
    steps = [k for k in offered if k[1] != "admit"]
    assert {k[2] for k in steps} >= {4}  # three rows live: bucket 4
    assert costs.recorded == offered  # each item recorded under its own key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_bucket_steps_equal_eager_ones(tiny_tts_dir):
    """Three requests in an 8-slot pool (rows 0..2: bucket 4, smaller ones as rows end), graphed
    per (kind, bucket) and eager: the same steps, words, and PCM to float rounding."""
    tts = load(tiny_tts_dir, "cuda")
    ck, _ = tts
    reqs = [request(tts, TEXTS[0]), request(tts, TEXTS[3], 1), request(tts, TEXTS[1], 2)]
    runs = []
    for graphs in (False, True):
        pool = TtsPool(ck.lm, ck.mimi, 8, voice_frames=10, cuda_graphs=graphs, warm_conditions=CONDITIONS)
        assert pool.buckets == [1, 2, 4, 8]  # the CUDA default
        pool.warm_up(CostModel())
        assert pool.graphed == graphs
        keys = []
        runs.append((run_pool(pool, reqs, keys), keys))
    (eager, eager_keys), (graphed, graphed_keys) = runs
    assert graphed_keys == eager_keys and {k[2] for k in eager_keys} >= {4}
    for (eager_words, eager_pcm), (graphed_words, graphed_pcm) in zip(eager, graphed):
        assert [w[0] for w in graphed_words] == [w[0] for w in eager_words]
        np.testing.assert_allclose(graphed_pcm, eager_pcm, atol=1e-4)
