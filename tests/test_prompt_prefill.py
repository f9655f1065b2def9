"""Prompts run on a state of their own and handed to the row (engine/prompt_prefill.py) leave the
row as a prefill on the row itself does: bit for bit at the chunk's own length, and, padded to
the chunk classes (what the CUDA graphs run), with the same tokens after it."""

from __future__ import annotations

import pytest
import torch

from parley.engine.prompt_prefill import PREFILL_CHUNKS, PromptPrefill, PromptRunner, chunk_class
from parley.models.config import tiny_lm_config
from parley.models.lm import LMModel
from parley.models.lm_gen import LMGen

CFG = tiny_lm_config()  # context 40: classes 8, 16 and 32 fit its ring
ROWS, ROW = 3, 1
PROMPT = 29  # frames


def _gen(device: str = "cpu", dtype: torch.dtype = torch.float32) -> LMGen:
    model = LMModel(CFG).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    return LMGen(model.to(device, dtype), text_temp=0.0, audio_temp=0.0)


def _inputs(gen: LMGen) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    cols = torch.randint(0, CFG.card, (PROMPT + 2, CFG.num_codebooks), generator=g)
    cols[:, 0] = torch.randint(0, CFG.text_card, (PROMPT + 2,), generator=g)
    device = gen.initial.device
    return gen.embed_frames(cols[:PROMPT].to(device)), cols[PROMPT - 1:PROMPT + 1].T.contiguous().to(device)


def _busy_state(gen: LMGen):
    """Every row has stepped a few frames: the prompt's row is reset first, the others must not move."""
    state = gen.init_state(ROWS)
    user = torch.randint(0, CFG.card, (5, ROWS, CFG.n_user), generator=torch.Generator().manual_seed(2))
    for t in range(5):
        gen.step(state, user[t].to(gen.initial.device), torch.ones(ROWS, dtype=torch.bool, device=gen.initial.device))
    gen.reset(state, torch.arange(ROWS, device=gen.initial.device) == ROW)
    return state


def _run_chunks(runner: PromptRunner, gen: LMGen, state, x, ring, chunks) -> None:
    finished = []
    job = PromptPrefill(runner, x, lambda job, frames: (runner.adopt(job, state, ROW, frames, ring),
                                                       finished.append(frames)))
    for n in chunks:
        job.run(n)
    assert job.frames_left == 0 and finished == [PROMPT]


def _snapshot(state) -> list[torch.Tensor]:
    t = state.transformer
    return [t.pos, t.slot_pos, state.offsets, state.ring, *t.keys, *t.values]


def _after(gen: LMGen, state, frames: int = 3) -> list[tuple[list, list]]:
    user = torch.randint(0, CFG.card, (frames, ROWS, CFG.n_user), generator=torch.Generator().manual_seed(3))
    live = torch.ones(ROWS, dtype=torch.bool, device=gen.initial.device)
    outs = [gen.step(state, user[t].to(gen.initial.device), live) for t in range(frames)]
    return [(o.text.tolist(), o.audio.tolist()) for o in outs]


@pytest.mark.parametrize("chunks", [[PROMPT], [8, 16, 5], [3, 11, 15]], ids=["whole", "classes", "odd"])
def test_prompt_on_its_own_state_equals_prefilling_the_row(chunks):
    gen = _gen()
    x, ring = _inputs(gen)
    direct = _busy_state(gen)
    for start, n in zip([0] + list(torch.tensor(chunks).cumsum(0)[:-1].tolist()), chunks):
        last = start + n == PROMPT
        gen.prefill(direct, ROW, x[start:start + n], ring_tokens=ring if last else None)
    adopted = _busy_state(gen)
    _run_chunks(PromptRunner(gen), gen, adopted, x, ring, chunks)
    for a, b in zip(_snapshot(direct), _snapshot(adopted)):
        assert torch.equal(a, b)
    assert _after(gen, direct) == _after(gen, adopted)


def test_padded_chunks_leave_the_row_as_unpadded_ones():
    """Chunks padded to their class (5 -> 8, 5 -> 8; 19 would pad to 32 past the ring's 40
    slots, so it runs at its length): the same positions, slots and tokens; keys equal up to
    rounding."""
    gen = _gen()
    x, ring = _inputs(gen)
    plain, padded = _busy_state(gen), _busy_state(gen)
    _run_chunks(PromptRunner(gen), gen, plain, x, ring, [5, 5, 19])
    _run_chunks(PromptRunner(gen, pad=True), gen, padded, x, ring, [5, 5, 19])
    for a, b in zip(_snapshot(plain)[:4], _snapshot(padded)[:4]):
        assert torch.equal(a, b)
    for a, b in zip(_snapshot(plain)[4:], _snapshot(padded)[4:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _after(gen, plain) == _after(gen, padded)


def test_prompts_run_one_at_a_time():
    gen = _gen()
    x, ring = _inputs(gen)
    state = _busy_state(gen)
    runner = PromptRunner(gen)
    first = PromptPrefill(runner, x, lambda job, frames: runner.adopt(job, state, ROW, frames, ring))
    second = PromptPrefill(runner, x, lambda job, frames: runner.adopt(job, state, ROW, frames, ring))
    first.run(8)
    second.run(8)  # takes the state over (as when the first's session closed mid-prompt)
    with pytest.raises(RuntimeError, match="one at a time"):
        first.run(8)


def test_chunk_classes():
    assert [chunk_class(n) for n in (1, 8, 9, 256, 300)] == [8, 8, 16, 256, 256]
    assert list(PREFILL_CHUNKS) == sorted(PREFILL_CHUNKS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_graphed_prompt_chunks_match_eager_prefill_on_the_row(kv_dtype):
    gen = _gen("cuda", torch.bfloat16)
    x, ring = _inputs(gen)

    def busy():
        state = gen.init_state(ROWS, kv_dtype=kv_dtype)
        gen.reset(state, torch.ones(ROWS, dtype=torch.bool, device="cuda"))
        return state

    eager = busy()
    gen.prefill(eager, ROW, x[:13])
    gen.prefill(eager, ROW, x[13:], ring_tokens=ring)
    graphed = busy()
    runner = PromptRunner(gen, kv_dtype, graphs=True)
    runner.warm_up(PREFILL_CHUNKS)
    _run_chunks(runner, gen, graphed, x, ring, [13, 16])
    for a, b in zip(_snapshot(eager)[:4], _snapshot(graphed)[:4]):
        assert torch.equal(a, b)
    t_e, t_g = eager.transformer, graphed.transformer
    for layer in range(len(t_e.keys)):
        filled = slice(0, PROMPT)
        a, b = t_e.keys[layer][ROW, :, filled].float(), t_g.keys[layer][ROW, :, filled].float()
        assert (a - b).abs().max() <= 0.05 * a.abs().max()
    assert _after(gen, eager) == _after(gen, graphed)
