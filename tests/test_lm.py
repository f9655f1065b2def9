"""LM tests: checkpoint layout, fidelity to the reference, per-row isolation, sampling, prefill.

The oracle is the published `moshi` package, version 0.2.13 (a test-only dependency): its
`LMModel` for the key layout and its greedy `LMGen` for token-for-token fidelity.
"""

from __future__ import annotations

import pytest
import torch

from parley.models.checkpoint import lm_config_dict
from parley.models.config import UNGENERATED_TOKEN, tiny_lm_config
from parley.models.lm import LMModel, published_state
from parley.models.lm_gen import LMGen
from parley.models.sampling import sample_tokens

FRAMES = 64  # > context 40 of tiny_lm_config: the KV window slides during the test


# Tiny matmuls: one thread is ~5x faster than two on a loaded 2-core machine (conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(dep_q: int = 8, seed: int = 0) -> LMModel:
    torch.manual_seed(seed)
    model = LMModel(tiny_lm_config(dep_q=dep_q)).eval()
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def user_codes(frames: int, batch: int, n_user: int = 8, card: int = 2048, seed: int = 1) -> torch.Tensor:
    """[frames, batch, n_user] random codes."""
    return torch.randint(0, card, (frames, batch, n_user), generator=torch.Generator().manual_seed(seed))


def greedy_gen(model: LMModel) -> LMGen:
    return LMGen(model, text_temp=0.0, audio_temp=0.0)


def run_ours(gen: LMGen, codes: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    frames, batch, _ = codes.shape
    state = gen.init_state(batch)
    exec_all = torch.ones(batch, dtype=torch.bool)
    outs = []
    for f in range(frames):
        out = gen.step(state, codes[f], exec_all)
        outs.append((out.text.clone(), out.audio.clone(), out.valid.clone()))
    return outs


# ---------------------------------------------------------------------------------------------
# Reference helpers


def reference_lm(model: LMModel):
    """The reference LMModel with the same config, loaded from our state dict (checkpoint layout)."""
    loaders = pytest.importorskip("moshi.models.loaders")
    kwargs = lm_config_dict(model.cfg)
    ref = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
    ref.load_state_dict(model.state_dict(), strict=True)  # its load hook splits the stacked weights
    return ref.eval()


def checkpoint_layout(ref_state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Reference in-memory keys (`in_projs.{i}.weight`) -> published keys (`in_proj_weight`, stacked)."""
    return {k: tuple(v.shape) for k, v in published_state(ref_state).items()}


def run_reference(ref_lm, codes: torch.Tensor, teacher_force_user: bool = False) -> list[torch.Tensor | None]:
    """Greedy reference LMGen; returns per frame [B, 1 + n_agent] or None.

    moshi 0.2.13's LMGen has no teacher-forced user streams for dep_q = 16 (it reads no user input
    then). For PersonaPlex we emulate them: write the user codes into its ring at their delayed
    columns before the step, and again after it (its depformer overwrote them with predictions).
    """
    from moshi.models.lm import LMGen as RefLMGen

    frames, batch, n_user = codes.shape
    gen = RefLMGen(ref_lm, use_sampling=False)
    n_agent = n_user
    outs = []
    with gen.streaming(batch):
        state = gen._streaming_state
        user_delays = torch.tensor(ref_lm.delays[1 + n_agent:])
        for f in range(frames):
            def force_user(offsets=state.offsets.clone(), f=f):
                cols = (offsets[:, None] + user_delays[None]) % state.cache.shape[2]
                state.cache[:, 1 + n_agent:].scatter_(2, cols[..., None], codes[f][..., None])
            if teacher_force_user:
                force_user()
            out = gen.step(codes[f][..., None])
            if teacher_force_user:
                force_user()
            outs.append(None if out is None else out[:, :1 + n_agent, 0].clone())
    return outs


# ---------------------------------------------------------------------------------------------
# Layout


@pytest.mark.parametrize("dep_q", [8, 16], ids=["moshi", "personaplex"])
def test_state_dict_matches_reference_layout(dep_q):
    model = make_model(dep_q)
    ref = reference_lm(model)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert ours == checkpoint_layout(ref.state_dict())


def test_constructible_on_meta_device():
    with torch.device("meta"):
        model = LMModel(tiny_lm_config())
    assert all(p.is_meta for p in model.parameters())
    real = make_model()
    model.load_state_dict(real.state_dict(), assign=True)
    assert not any(p.is_meta for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Fidelity to the reference (greedy, fp32)


def assert_same_as_reference(ours, ref, n_agent=8):
    assert len(ours) == len(ref)
    for f, ((text, audio, valid), expected) in enumerate(zip(ours, ref)):
        if expected is None:
            assert not valid.any(), f"frame {f}: reference has no output yet"
            continue
        assert valid.all(), f"frame {f}"
        assert torch.equal(text, expected[:, 0]), f"frame {f}: text {text} != {expected[:, 0]}"
        assert torch.equal(audio, expected[:, 1:1 + n_agent]), f"frame {f}: audio differs"


@pytest.mark.oracle
@pytest.mark.parametrize("batch", [1, 3], ids=["one_row", "three_rows"])
def test_greedy_matches_reference_moshi(batch):
    model = make_model(8)
    codes = user_codes(FRAMES, batch)
    ref = run_reference(reference_lm(model), codes)
    ours = run_ours(greedy_gen(model), codes)
    assert_same_as_reference(ours, ref)
    texts = torch.stack([t for t, _, v in ours if v.all()])
    assert texts.unique().numel() > 1, "degenerate test: text never changes"


@pytest.mark.oracle
def test_greedy_matches_reference_personaplex_teacher_forced_user():
    model = make_model(16)
    codes = user_codes(FRAMES, 2)
    ref = run_reference(reference_lm(model), codes, teacher_force_user=True)
    assert_same_as_reference(run_ours(greedy_gen(model), codes), ref)


def test_personaplex_later_depformer_steps_do_not_change_agent_codes():
    """Running all 16 depformer steps gives the same first 8 codes as running only 8."""
    model = make_model(16)
    hidden = torch.randn(3, model.cfg.dim)
    text = torch.tensor([5, 7, 11])
    codes = {}
    for steps in (8, 16):
        state = model.depformer.init_state(3)
        prev, out = text, []
        with torch.no_grad():
            for k in range(steps):
                prev = model.depformer_logits(k, hidden, prev, state).argmax(-1)
                out.append(prev)
        codes[steps] = torch.stack(out, 1)
    assert torch.equal(codes[16][:, :8], codes[8])


# ---------------------------------------------------------------------------------------------
# Per-row isolation


def test_rows_alone_equal_rows_in_batch():
    model = make_model()
    gen = greedy_gen(model)
    codes = user_codes(FRAMES, 3, seed=3)
    batched = run_ours(gen, codes)
    for row in range(3):
        alone = run_ours(gen, codes[:, row:row + 1])
        for f in range(FRAMES):
            assert torch.equal(alone[f][0], batched[f][0][row:row + 1]), f"row {row} frame {f}"
            assert torch.equal(alone[f][1], batched[f][1][row:row + 1]), f"row {row} frame {f}"


def test_reset_and_mask_of_one_row_leave_others_untouched():
    model = make_model()
    gen = greedy_gen(model)
    codes = user_codes(FRAMES, 3, seed=4)
    reset_at, masked = 20, range(30, 36)

    baseline_state = gen.init_state(3)
    state = gen.init_state(3)
    row1_valid = []
    for f in range(FRAMES):
        exec_mask = torch.tensor([True, f not in masked, True])
        if f == reset_at:
            gen.reset(state, torch.tensor([False, True, False]))
        base = gen.step(baseline_state, codes[f], torch.ones(3, dtype=torch.bool))
        out = gen.step(state, codes[f], exec_mask)
        for row in (0, 2):
            assert torch.equal(out.text[row], base.text[row]) and torch.equal(out.audio[row], base.audio[row])
        assert out.valid[1] == (f not in masked and f not in (0, reset_at))  # first frames: no output yet
        if f >= reset_at and f not in masked:
            row1_valid.append((out.text[1].clone(), out.audio[1].clone(), out.valid[1].clone()))
    for row in (0, 2):
        for layer in range(len(state.transformer.keys)):
            assert torch.equal(state.transformer.keys[layer][row], baseline_state.transformer.keys[layer][row])

    # Row 1 after its reset, skipping its masked frames, is a fresh session fed those frames.
    kept = [f for f in range(reset_at, FRAMES) if f not in masked]
    fresh = run_ours(gen, codes[kept][:, 1:2])
    for (text, audio, valid), (ftext, faudio, fvalid) in zip(row1_valid, fresh):
        assert valid == fvalid[0]
        assert torch.equal(text, ftext[0]) and torch.equal(audio, faudio[0])


def test_kv_window_slides_past_context():
    model = make_model()
    gen = greedy_gen(model)
    state = gen.init_state(1)
    codes = user_codes(3 * model.cfg.context, 1, seed=5)
    for f in range(codes.shape[0]):
        out = gen.step(state, codes[f], torch.ones(1, dtype=torch.bool))
        assert out.valid.all() == (f >= model.cfg.max_delay)
    assert int(state.transformer.pos) == 3 * model.cfg.context
    assert torch.isfinite(state.transformer.keys[0]).all()


# ---------------------------------------------------------------------------------------------
# Sampling


def test_sampling_temperature_zero_is_greedy():
    logits = torch.randn(4, 100)
    tokens = sample_tokens(logits, torch.zeros(4), torch.full((4,), 10))
    assert torch.equal(tokens, logits.argmax(-1))


def test_sampling_per_row_settings_in_one_batch():
    logits = torch.randn(1, 500).expand(4, -1)
    temp = torch.tensor([0.0, 1.0, 5.0, 1.0])
    top_k = torch.tensor([0, 1, 0, 3])
    gen = torch.Generator().manual_seed(0)
    greedy = logits[0].argmax()
    top3 = set(logits[0].topk(3).indices.tolist())
    seen_hot = set()
    for _ in range(200):
        tokens = sample_tokens(logits, temp, top_k, gen)
        assert tokens[0] == greedy and tokens[1] == greedy  # temp 0, and top_k 1
        assert tokens[3].item() in top3
        seen_hot.add(tokens[2].item())
    assert len(seen_hot) > 50  # temperature 5, no top-k: spread out


def test_sampling_seeded_is_deterministic():
    logits = torch.randn(8, 300)
    temp, top_k = torch.full((8,), 1.0), torch.full((8,), 50)
    a = sample_tokens(logits, temp, top_k, torch.Generator().manual_seed(7))
    b = sample_tokens(logits, temp, top_k, torch.Generator().manual_seed(7))
    c = sample_tokens(logits, temp, top_k, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sampling_never_leaves_top_k():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=gen)
    top_k = torch.randint(1, 20, (64,), generator=gen)
    allowed = [set(logits[i].topk(int(top_k[i])).indices.tolist()) for i in range(64)]
    counts = torch.zeros(64, 1000)
    for _ in range(100):
        tokens = sample_tokens(logits, torch.full((64,), 2.0), top_k, gen)
        counts[torch.arange(64), tokens] += 1
    for i in range(64):
        assert set(counts[i].nonzero().flatten().tolist()) <= allowed[i]
    assert (counts > 0).sum() > 64 * 3  # and it does sample within them


def test_lm_gen_sampling_settings_are_tensors_per_row():
    model = make_model()
    gen = LMGen(model, generator=torch.Generator().manual_seed(0))
    state = gen.init_state(2)
    state.set_sampling(torch.tensor([True, False]), text_temp=0.0, audio_temp=0.0)
    greedy_state = greedy_gen(model).init_state(1)
    codes = user_codes(10, 2, seed=6)
    for f in range(10):
        out = gen.step(state, codes[f], torch.ones(2, dtype=torch.bool))
        ref = greedy_gen(model).step(greedy_state, codes[f, :1], torch.ones(1, dtype=torch.bool))
        assert torch.equal(out.audio[0], ref.audio[0]) and torch.equal(out.text[0], ref.text[0])
    gen.reset(state, torch.tensor([True, False]))
    assert state.text_temp[0] == 0.7 and state.audio_topk[0] == 250


# ---------------------------------------------------------------------------------------------
# Forcing and prefill


def forced_frames(model: LMModel, frames: int, seed: int = 9):
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    text = torch.randint(0, cfg.text_card, (frames,), generator=g)
    audio = torch.randint(0, cfg.card, (frames, cfg.n_agent), generator=g)
    user = torch.randint(0, cfg.card, (frames + 1, cfg.n_user), generator=g)
    return text, audio, user


def delayed_columns(model: LMModel, text, audio, user) -> torch.Tensor:
    """[T + 1, n_q + 1]: the temporal input columns 0..T that stepping the forced frames reads."""
    cfg = model.cfg
    T = text.shape[0]
    initial = model.initial_tokens()
    cols = torch.full((T + 1, cfg.num_codebooks), UNGENERATED_TOKEN)
    for c in range(T + 1):
        generated = torch.cat([text[c - 1:c], audio[c - 1]]) if c >= 1 else initial[:1 + cfg.n_agent]
        cols[c, :1 + cfg.n_agent] = generated
        for j, d in enumerate(cfg.delays[1 + cfg.n_agent:]):
            frame = c - d
            cols[c, 1 + cfg.n_agent + j] = user[frame, j] if 0 <= frame < T else UNGENERATED_TOKEN
        delays = torch.tensor(cfg.delays)
        cols[c] = torch.where(c <= delays, initial, cols[c])
    return cols


def test_forced_tokens_are_returned():
    model = make_model()
    gen = greedy_gen(model)
    state = gen.init_state(1)
    text, audio, user = forced_frames(model, 6)
    outs = []
    for f in range(6):
        outs.append(gen.step(state, user[f:f + 1], torch.ones(1, dtype=torch.bool),
                             force_text=text[f:f + 1], force_audio=audio[f:f + 1]))
    for f in range(1, 6):  # frame returned at step f: text/semantic of step f-1, acoustic of step f
        assert outs[f].text[0] == text[f - 1] and outs[f].audio[0, 0] == audio[f - 1, 0]
        assert torch.equal(outs[f].audio[0, 1:], audio[f, 1:])


def test_prefill_equals_stepping_forced_frames():
    model = make_model()
    gen = greedy_gen(model)
    T, after = 12, 10
    text, audio, user = forced_frames(model, T)
    tail = user_codes(after, 1, seed=10)[:, 0]
    tail[0] = user[T]  # the frame after the prompt
    exec_one = torch.ones(1, dtype=torch.bool)

    stepped = gen.init_state(2)
    for f in range(T):
        gen.step(stepped, user[f:f + 1].expand(2, -1), torch.ones(2, dtype=torch.bool),
                 force_text=text[f:f + 1].expand(2), force_audio=audio[f:f + 1].expand(2, -1))

    prefilled = gen.init_state(2)
    other = gen.step(prefilled, user[:1].expand(2, -1), torch.tensor([False, True]))  # row 1 moves on
    row1_before = [t[1].clone() for t in prefilled.transformer.keys] + [prefilled.ring[1].clone()]
    cols = delayed_columns(model, text, audio, user)
    gen.prefill(prefilled, 0, gen.embed_frames(cols[:T]), ring_tokens=cols[T - 1:T + 1].T)
    row1_after = [t[1] for t in prefilled.transformer.keys] + [prefilled.ring[1]]
    assert all(torch.equal(a, b) for a, b in zip(row1_before, row1_after)), "prefill touched another row"
    assert int(prefilled.offsets[0]) == T and int(prefilled.transformer.pos[0]) == T
    for layer in range(len(stepped.transformer.keys)):
        torch.testing.assert_close(prefilled.transformer.keys[layer][0], stepped.transformer.keys[layer][0])
    del other

    for f in range(after):
        a = gen.step(stepped, tail[f:f + 1].expand(2, -1), torch.ones(2, dtype=torch.bool))
        b = gen.step(prefilled, tail[f:f + 1].expand(2, -1), torch.tensor([True, False]))
        assert a.valid[0] and b.valid[0]
        assert torch.equal(a.text[0], b.text[0]) and torch.equal(a.audio[0], b.audio[0]), f"frame {f}"
    del exec_one


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_step_on_cuda_bf16():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = make_model().to(device="cuda", dtype=torch.bfloat16)
    gen = LMGen(model)
    state = gen.init_state(4)
    codes = user_codes(5, 4).cuda()
    for f in range(5):
        out = gen.step(state, codes[f], torch.ones(4, dtype=torch.bool, device="cuda"))
    torch.cuda.synchronize()
    assert out.valid.all() and out.audio.shape == (4, model.cfg.n_agent)
    assert ((out.audio >= 0) & (out.audio < model.cfg.card)).all()


@pytest.mark.gpu
def test_step_is_cuda_graph_capturable():
    """A whole frame captures in one CUDA graph; replays equal eager steps, incl. masks and resets."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model().cuda()
    gen = greedy_gen(model)
    codes = user_codes(FRAMES, 3).cuda()
    codes_in = torch.zeros_like(codes[0])
    exec_in = torch.ones(3, dtype=torch.bool, device="cuda")
    warm, graphed, eager = gen.init_state(3), gen.init_state(3), gen.init_state(3)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            gen.step(warm, codes_in, exec_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gen.step(graphed, codes_in, exec_in)  # recorded, not run: `graphed` is still fresh

    for f in range(FRAMES):
        exec_mask = torch.tensor([True, f % 7 != 3, True], device="cuda")
        if f == 25:
            for state in (graphed, eager):
                state.reset(torch.tensor([True, False, False], device="cuda"))
        codes_in.copy_(codes[f])
        exec_in.copy_(exec_mask)
        graph.replay()
        expected = gen.step(eager, codes[f], exec_mask)
        assert torch.equal(out.valid, expected.valid), f"frame {f}"
        valid = expected.valid
        assert torch.equal(out.text[valid], expected.text[valid]), f"frame {f}"
        assert torch.equal(out.audio[valid], expected.audio[valid]), f"frame {f}"
