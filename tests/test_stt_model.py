"""Kyutai STT on Parley's models/ code, against the reference `moshi` 0.2.13 (test-only oracle).

The tiny checkpoint is written by Parley in the published STT layout (config.json with dep_q 0,
stt_config and file names) and loaded twice: by our loader and by the reference's own
CheckpointInfo / get_moshi / get_mimi. Greedy text tokens and the extra heads must agree.
"""

from __future__ import annotations

import json

import pytest
import torch

from parley.models.checkpoint import CheckpointError, load_stt_checkpoint
from parley.models.config import TEXT_EPAD, TEXT_PAD
from parley.models.stt import END_OF_TURN_HEAD, SttGen
from parley.models.stt_text import TextDelta, TranscriptDecoder, Word
from parley.models.synthetic import write_tiny_stt_checkpoint


# Tiny matmuls: one thread is ~5x faster than two on a loaded 2-core machine (conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stt_dir(tmp_path_factory):
    return write_tiny_stt_checkpoint(tmp_path_factory.mktemp("tiny_stt"), n_q=12)


def reference_checkpoint(directory):
    loaders = pytest.importorskip("moshi.models.loaders")
    raw = json.loads((directory / "config.json").read_text())
    return loaders.CheckpointInfo.from_hf_repo(
        "unused/local", moshi_weights=directory / raw["moshi_name"], mimi_weights=directory / raw["mimi_name"],
        tokenizer=directory / raw["tokenizer_name"], config_path=directory / "config.json",
        mimi_config_path=directory / raw["mimi_config_name"])


def run_ours(gen: SttGen, codes: torch.Tensor):
    frames, batch, _ = codes.shape
    state = gen.init_state(batch)
    run = torch.ones(batch, dtype=torch.bool)
    return [gen.step(state, codes[f], run) for f in range(frames)]


def test_greedy_tokens_and_end_of_turn_match_reference(stt_dir):
    from moshi.models.lm import LMGen as RefLMGen

    info = reference_checkpoint(stt_dir)
    assert info.stt_config == {"audio_silence_prefix_seconds": 0.16, "audio_delay_seconds": 0.24}
    ref_lm = info.get_moshi(device="cpu", dtype=torch.float32)
    ours = load_stt_checkpoint(stt_dir, dtype=torch.float32)
    assert set(ours.lm.state_dict()) == {k for k in ref_lm.state_dict() if "in_projs" not in k and
                                         "out_projs" not in k} | {k for k in ours.lm.state_dict() if "_proj" in k}

    batch, frames = 3, 14
    codes = torch.randint(0, 2048, (frames, batch, 12), generator=torch.Generator().manual_seed(3))
    outs = run_ours(SttGen(ours.lm), codes)
    ref_gen = RefLMGen(ref_lm, temp=0.0, temp_text=0.0)
    compared = 0
    with ref_gen.streaming(batch):
        for f in range(frames):
            ref = ref_gen.step_with_extra_heads(codes[f][..., None])
            if ref is None:
                assert not outs[f].valid.any()
                continue
            tokens, heads = ref
            assert outs[f].valid.all()
            assert torch.equal(outs[f].text, tokens[:, 0, 0]), f"frame {f}"
            torch.testing.assert_close(outs[f].end_of_turn, heads[END_OF_TURN_HEAD][:, 0, 0].float())
            compared += 1
    assert compared == frames - ours.lm_config.max_delay


def test_mimi_codes_match_reference_with_all_stt_codebooks(stt_dir):
    info = reference_checkpoint(stt_dir)
    ref_mimi = info.get_mimi(device="cpu")
    ours = load_stt_checkpoint(stt_dir, dtype=torch.float32)
    pcm = 0.1 * torch.randn(1, 3 * 1920, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref_codes = ref_mimi.encode(pcm[:, None])
    assert ref_codes.shape[1] == 12
    assert torch.equal(ours.mimi.encode(pcm), ref_codes)


def test_rows_are_independent_and_reset(stt_dir):
    ck = load_stt_checkpoint(stt_dir, dtype=torch.float32)
    gen = SttGen(ck.lm)
    codes = torch.randint(0, 2048, (8, 2, 12), generator=torch.Generator().manual_seed(4))
    alone = run_ours(gen, codes[:, :1])
    state = gen.init_state(2)
    run = torch.ones(2, dtype=torch.bool)
    for f in range(8):
        if f == 4:  # row 1 restarts mid-way; row 0 must not notice
            state.reset(torch.tensor([False, True]))
        out = gen.step(state, codes[f], run)
        assert torch.equal(out.text[:1], alone[f].text)
        torch.testing.assert_close(out.end_of_turn[:1], alone[f].end_of_turn)  # batch-size rounding only
    assert state.offsets.tolist() == [8, 4]


def test_loader_refuses_a_duplex_config(stt_dir, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(stt_dir, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["dep_q"] = 8
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="dep_q 0"):
        load_stt_checkpoint(bad, dtype=torch.float32)


class FakeTokenizer:
    pieces = {10: " hel", 11: "lo", 12: " world", 13: " again"}

    def piece(self, t):
        return self.pieces.get(t, "")

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)

    def is_special(self, t):
        return t in (TEXT_EPAD, TEXT_PAD)


def test_transcript_decoder_words_and_times():
    dec = TranscriptDecoder(FakeTokenizer(), text_delay=2)
    seq = [TEXT_PAD, TEXT_EPAD, 10, 11, TEXT_PAD, TEXT_EPAD, 12, TEXT_PAD, TEXT_PAD, TEXT_EPAD, 13]
    events = []
    for step, tok in enumerate(seq, start=2):  # valid outputs start at the delay
        events += dec.feed(tok, step)
    events += dec.flush(len(seq) + 2)
    deltas = "".join(e.text for e in events if isinstance(e, TextDelta))
    words = [e for e in events if isinstance(e, Word)]
    assert deltas == "hello world again" == dec.text
    t = lambda step: (step + 1 - 2) / 12.5  # noqa: E731
    assert words == [Word("hello", t(3), t(7)), Word("world", t(7), t(11)), Word("again", t(11), t(13))]
