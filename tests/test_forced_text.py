"""Forced text (spoken commentary): the per-row queue (models/forced_text.py), LMGen.step with it,
and Engine.force_text through the real backend."""

from __future__ import annotations

import asyncio

import pytest
import torch

from parley.engine import Engine, FrameOut, OptionsError, SamplingOptions, SessionOptions
from parley.engine.backend import ModelBackend
from parley.models.config import TEXT_EPAD, TEXT_PAD, tiny_lm_config
from parley.models.forced_text import ForcedText
from parley.models.lm import LMModel
from parley.models.lm_gen import LMGen

from live_checkpoints import PAUSE_GAIN, write_pausing_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAUSES = torch.tensor([TEXT_PAD, TEXT_EPAD])
ALL = torch.ones(3, dtype=torch.bool)


def test_queued_tokens_wait_for_a_pause_then_run_contiguously():
    forced = ForcedText.empty(3, 8, "cpu")
    assert forced.push(1, [101, 102, 103])
    steps = [torch.tensor([50, 51, 52]), torch.tensor([TEXT_PAD, 53, 54]), torch.tensor([55, TEXT_EPAD, 56]),
             torch.tensor([57, 58, 59]), torch.tensor([60, TEXT_PAD, 61]), torch.tensor([62, 63, 64])]
    got = [forced.apply(sampled, ALL, PAUSES).tolist() for sampled in steps]
    # Row 1 waits for its pause (step 2), then forces on every frame until its queue is empty.
    assert [g[1] for g in got] == [51, 53, 101, 102, 103, 63]
    assert [g[0] for g in got] == [s[0].item() for s in steps]  # rows with nothing queued: untouched
    assert [g[2] for g in got] == [s[2].item() for s in steps]


def test_a_row_not_executing_keeps_its_queue_and_its_streak():
    forced = ForcedText.empty(1, 4, "cpu")
    forced.push(0, [7, 8])
    one, off = torch.tensor([True]), torch.tensor([False])
    assert forced.apply(torch.tensor([TEXT_PAD]), off, PAUSES).tolist() == [TEXT_PAD]
    assert forced.apply(torch.tensor([TEXT_PAD]), one, PAUSES).tolist() == [7]
    assert forced.apply(torch.tensor([40]), off, PAUSES).tolist() == [40]
    assert forced.apply(torch.tensor([41]), one, PAUSES).tolist() == [8]  # the streak survived the pause


def test_a_full_queue_refuses_the_whole_push_and_reset_empties_it():
    forced = ForcedText.empty(2, 4, "cpu")
    assert forced.push(0, [1, 2, 3])
    assert not forced.push(0, [4, 5])
    assert forced.pending(0) == 3
    assert forced.push(0, [4])
    forced.apply(torch.tensor([TEXT_PAD, 9]), torch.tensor([True, True]), PAUSES)  # takes one: room for one
    assert forced.push(0, [5]) and forced.pending(0) == 4
    # The ring wraps: what comes out is what went in, in order.
    out = [forced.apply(torch.tensor([9, 9]), torch.tensor([True, True]), PAUSES)[0].item() for _ in range(4)]
    assert out == [2, 3, 4, 5]
    forced.push(1, [6])
    forced.reset(torch.tensor([False, True]))
    assert forced.pending(1) == 0


def pausing_model() -> LMModel:
    torch.manual_seed(0)
    model = LMModel(tiny_lm_config()).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.text_linear.weight[TEXT_PAD] *= PAUSE_GAIN
    return model


def run(model: LMModel, frames: int, queue: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Text [frames, 3] and audio [frames, 3, n_agent] of three rows (sampled, seeded generator)."""
    gen = LMGen(model, generator=torch.Generator().manual_seed(5))
    state = gen.init_state(3)
    for row, ids in queue.items():
        state.forced.push(row, ids)
    codes = torch.randint(0, 2048, (frames, 3, 8), generator=torch.Generator().manual_seed(1))
    texts, audios = [], []
    for f in range(frames):
        out = gen.step(state, codes[f], ALL)
        texts.append(out.text.clone())
        audios.append(out.audio.clone())
    return torch.stack(texts), torch.stack(audios)


def test_lm_step_forces_from_the_next_pause_and_leaves_other_rows_bit_identical():
    model = pausing_model()
    ids = [150, 151, 152, 153]
    base_text, base_audio = run(model, 24, {})
    text, audio = run(model, 24, {1: ids})
    # Same shapes, same device, same generator: rows 0 and 2 are bit for bit what they were.
    assert torch.equal(text[:, [0, 2]], base_text[:, [0, 2]])
    assert torch.equal(audio[:, [0, 2]], base_audio[:, [0, 2]])
    row, base = text[:, 1].tolist(), base_text[:, 1].tolist()
    first = next(f for f in range(len(row)) if row[f] != base[f])
    assert base[first] in (TEXT_PAD, TEXT_EPAD)  # it started where the model paused
    assert row[first:first + len(ids)] == ids  # and ran on, one token a frame


def test_engine_force_text_comes_out_in_the_session_frames(tmp_path):
    backend = ModelBackend.load(write_pausing_checkpoint(tmp_path / "ckpt"), 2, seed=0)
    engine = Engine(backend)
    text = "hello world"
    ids = backend.text_tokens(text)
    greedy = SessionOptions(sampling=SamplingOptions(text_temperature=0.0, audio_temperature=0.0))

    async def main():
        session = engine.open_nowait(greedy)
        engine.run_ticks(1)
        await session.ready
        said = asyncio.ensure_future(engine.force_text(session, text))
        await asyncio.sleep(0)
        engine.run_ticks(1)
        assert await said == len(ids)
        frames = [e for e in session.events.drain() if isinstance(e, FrameOut)]
        for _ in range(30):
            engine.run_ticks(1)
            frames += [e for e in session.events.drain() if isinstance(e, FrameOut)]
        session.close()
        engine.run_ticks(1)
        with pytest.raises(OptionsError, match="ended"):
            later = asyncio.ensure_future(engine.force_text(session, text))
            await asyncio.sleep(0)
            engine.run_ticks(1)
            await later
        return [f.text_token for f in frames]

    tokens = asyncio.run(main())
    engine.shutdown()
    assert ids[0] == TEXT_EPAD and len(ids) > 1  # an end-of-padding token says a word follows
    assert holds(tokens, ids)


def holds(stream: list[int], run_of: list[int]) -> bool:
    """`run_of` appears in `stream` as one contiguous run."""
    return any(stream[i:i + len(run_of)] == run_of for i in range(len(stream) - len(run_of) + 1))


def forced_run(checkpoint, device: str, graphs: bool, frames: int = 40) -> tuple[list, list[int]]:
    """Greedy text tokens of three live rows of four, "hello world" queued on row 2 before the first step."""
    backend = ModelBackend.load(checkpoint, 4, device=device, dtype=torch.float32, cuda_graphs=graphs, seed=3)
    for row in range(4):
        backend.set_sampling(row, SamplingOptions.greedy())
    ids = backend.text_tokens("hello world")
    assert backend.force_text(2, ids)
    mask = torch.tensor([True, True, True, False])
    inputs = torch.randn(frames, 4, 1920, generator=torch.Generator().manual_seed(0)) * 0.1
    outs = [backend.step(inputs[t], mask).to_host().text_tokens.tolist() for t in range(frames)]
    backend.close()
    return outs, ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forced_text_inside_the_cuda_graph_equals_eager(tmp_path):
    checkpoint = write_pausing_checkpoint(tmp_path / "ckpt")
    (eager, ids), (graphed, _) = forced_run(checkpoint, "cuda", False), forced_run(checkpoint, "cuda", True)
    assert eager == graphed
    assert holds([tokens[2] for tokens in graphed], ids)
