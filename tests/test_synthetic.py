"""Parley's own test checkpoints: the tiny random ones load and behave non-trivially, and the
constructed echo checkpoint repeats the user's codes with `ECHO_DELAY_FRAMES` delay."""

from __future__ import annotations

import math

import pytest
import torch

from parley.models.checkpoint import load_checkpoint
from parley.models.config import LM_FILE, MIMI_FILE, tiny_lm_config
from parley.models.lm_gen import LMGen
from parley.models.synthetic import (
    ECHO_DELAY_FRAMES, ECHO_FIRST_FRAME, code_features, echo_text_token, echo_words, write_echo_checkpoint,
    write_tiny_checkpoint,
)


def _run(gen: LMGen, user: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step user codes [F, B, 8] through LMGen -> (text [F, B], audio [F, B, 8], valid [F, B])."""
    state = gen.init_state(user.shape[1])
    run = torch.ones(user.shape[1], dtype=torch.bool)
    outs = [gen.step(state, frame, run) for frame in user]
    return (torch.stack([o.text for o in outs]), torch.stack([o.audio for o in outs]),
            torch.stack([o.valid for o in outs]))


def _random_user_codes(frames: int, batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2048, (frames, batch, 8), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- tiny checkpoints


@pytest.mark.parametrize("kind, dep_q", [("moshi", 8), ("personaplex", 16)])
def test_tiny_checkpoints_load_with_tiny_shapes(tiny_moshi_dir, tiny_personaplex_dir, kind, dep_q):
    ckpt = load_checkpoint(tiny_moshi_dir if kind == "moshi" else tiny_personaplex_dir)
    assert ckpt.model_type == kind
    assert ckpt.lm_config == tiny_lm_config(dep_q=dep_q)
    assert ckpt.mimi_config.seanet.dimension == 32
    assert next(ckpt.lm.parameters()).dtype == torch.bfloat16


def test_tiny_lm_outputs_depend_on_the_input(tiny_moshi_dir):
    ckpt = load_checkpoint(tiny_moshi_dir, dtype=torch.float32)
    text, audio, valid = _run(LMGen(ckpt.lm, text_temp=0, audio_temp=0), _random_user_codes(40, 2))
    assert valid[1:].all()
    assert text[1:].unique().numel() > 10
    for k in range(8):
        assert audio[1:, :, k].unique().numel() > 10
    assert not torch.equal(audio[5:, 0], audio[5:, 1])  # different users, different answers


def test_tiny_mimi_codes_follow_the_audio(tiny_moshi_dir):
    mimi = load_checkpoint(tiny_moshi_dir).mimi
    noise = 0.1 * torch.randn(2, 10 * 1920, generator=torch.Generator().manual_seed(0))
    codes = mimi.encode(noise)
    assert codes.shape == (2, 8, 10)
    assert codes[0, 0].unique().numel() > 5
    assert not torch.equal(codes[0], codes[1])
    t = torch.arange(10 * 1920) / 24_000
    tone = mimi.encode(0.3 * torch.sin(2 * math.pi * 300 * t)[None])
    assert not torch.equal(tone[0, :, 5:], codes[0, :, 5:])
    assert mimi.decode(codes).abs().max() > 1e-3


def test_tiny_checkpoint_weights_are_deterministic(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=3)
    b = write_tiny_checkpoint(tmp_path / "b", seed=3)
    c = write_tiny_checkpoint(tmp_path / "c", seed=4)
    for name in (LM_FILE, MIMI_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / LM_FILE).read_bytes() != (c / LM_FILE).read_bytes()


# --------------------------------------------------------------------------- echo


def test_code_features_separate_every_code():
    feats = code_features(torch.arange(2048))
    scores = feats @ feats.T  # what linears[k] computes against an input code's features
    best = scores.argmax(dim=1)
    assert torch.equal(best, torch.arange(2048))
    runner_up = scores.masked_fill(torch.eye(2048, dtype=torch.bool), -1).max(dim=1).values
    assert (scores.diagonal() - runner_up).min() > 0.07


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_echo_repeats_user_codes_one_frame_later_greedy(echo_dir, dtype):
    ckpt = load_checkpoint(echo_dir, dtype=dtype)
    frames = 3 * ckpt.lm_config.context  # well past the KV window: the echo must not depend on it
    user = _random_user_codes(frames, 2, seed=1)
    text, audio, valid = _run(LMGen(ckpt.lm, text_temp=0, audio_temp=0), user)
    assert ECHO_DELAY_FRAMES == 1
    first = ECHO_FIRST_FRAME
    assert valid[first:].all()
    assert torch.equal(audio[first:], user[first - ECHO_DELAY_FRAMES:-ECHO_DELAY_FRAMES])
    words = echo_words(ckpt.tokenizer)
    assert torch.equal(text[first:], echo_text_token(user[first - 1:-1, :, 0], words))
    assert all(ckpt.tokenizer.piece(w).strip() for w in words)  # real words, never dropped as padding


def test_echo_survives_default_sampling(echo_dir):
    ckpt = load_checkpoint(echo_dir)
    gen = LMGen(ckpt.lm, generator=torch.Generator().manual_seed(0))  # temps 0.7 / 0.8, top-k
    user = _random_user_codes(60, 3, seed=2)
    text, audio, _ = _run(gen, user)
    assert torch.equal(audio[ECHO_FIRST_FRAME:], user[ECHO_FIRST_FRAME - 1:-1])
    assert torch.equal(text[ECHO_FIRST_FRAME:], echo_text_token(user[ECHO_FIRST_FRAME - 1:-1, :, 0],
                                                                echo_words(ckpt.tokenizer)))


def test_personaplex_echo_after_a_voice_prompt(tmp_path):
    src = write_echo_checkpoint(tmp_path / "echo_pp", kind="personaplex")
    ckpt = load_checkpoint(src, dtype=torch.float32)
    assert ckpt.model_type == "personaplex" and sorted(p.name for p in ckpt.voices_dir.iterdir())
    gen = LMGen(ckpt.lm, text_temp=0, audio_temp=0)
    state = gen.init_state(1)
    gen.prefill(state, 0, torch.zeros(12, ckpt.lm_config.dim))  # a prompt's worth of frames
    user = _random_user_codes(20, 1, seed=4)
    run = torch.ones(1, dtype=torch.bool)
    audio = torch.stack([gen.step(state, user[f], run).audio for f in range(20)])
    assert torch.equal(audio[ECHO_FIRST_FRAME:], user[ECHO_FIRST_FRAME - 1:-1])


def test_echo_row_reset_starts_a_fresh_echo(echo_dir):
    ckpt = load_checkpoint(echo_dir, dtype=torch.float32)
    gen = LMGen(ckpt.lm, text_temp=0, audio_temp=0)
    state = gen.init_state(2)
    run = torch.ones(2, dtype=torch.bool)
    user = _random_user_codes(30, 2, seed=3)
    for f in range(10):
        gen.step(state, user[f], run)
    gen.reset(state, torch.tensor([True, False]))
    out = [gen.step(state, user[f], run).audio for f in range(10, 30)]
    audio = torch.stack(out)  # row 0 restarted at frame 10, row 1 kept going
    assert torch.equal(audio[ECHO_FIRST_FRAME:, 0], user[10 + ECHO_FIRST_FRAME - 1:-1, 0])
    assert torch.equal(audio[:, 1], user[9:-1, 1])
