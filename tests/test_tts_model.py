"""The native DSM TTS against the reference package: the tiny checkpoint (published layout,
unpacked attention names) loads into moshi's own `LMModel` strictly, and greedy generation gives
the same tokens, word timings and end of speech as `moshi.models.tts.TTSModel.generate` -- with
rows started at different steps. Also the loader's errors."""

import inspect
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parley.models.checkpoint import CheckpointError
from parley.models.dsm import split_words
from parley.models.synthetic import TINY_TTS_SUFFIX, TINY_TTS_VOICES
from parley.models.tts import TtsGen, TtsSampling
from parley.models.tts_checkpoint import VoiceStore, load_tts_checkpoint

# the reference package (the test extra)
loaders = pytest.importorskip("moshi.models.loaders")
ref_tts = pytest.importorskip("moshi.models.tts")

TEXTS = ["Hello, how are you doing today?", "The quick brown fox <break time=\"0.3s\"/> jumps over."]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reference_model(directory: Path) -> ref_tts.TTSModel:
    raw = json.loads((directory / "config.json").read_text())
    lm_config = {k: v for k, v in raw.items() if k not in (
        "moshi_name", "mimi_name", "tokenizer_name", "mimi_config_name", "lm_gen_config", "tts_config", "model_id")}
    info = loaders.CheckpointInfo(
        moshi_weights=directory / raw["moshi_name"], mimi_weights=directory / raw["mimi_name"],
        tokenizer=directory / raw["tokenizer_name"], lm_config=lm_config, raw_config=raw,
        mimi_config=json.loads((directory / raw["mimi_config_name"]).read_text()),
        tts_config=raw["tts_config"], model_id=raw["model_id"], lm_gen_config=raw["lm_gen_config"])
    return ref_tts.TTSModel.from_checkpoint_info(info, voice_repo=str(directory / "voices"), device="cpu",
                                                 dtype=torch.float32, n_q=raw["n_q"])


def test_greedy_tokens_equal_the_reference(tiny_tts_dir):
    ref = _reference_model(tiny_tts_dir)
    voices = [tiny_tts_dir / "voices" / f"{name}{TINY_TTS_SUFFIX}" for name in TINY_TTS_VOICES[:2]]
    entries = [ref.prepare_script([t], padding_between=1) for t in TEXTS]
    attributes = [ref.make_condition_attributes([v], cfg_coef=2.0) for v in voices]
    result = ref.generate(entries, attributes, use_sampling=False)
    want = torch.stack([f[:, :, 0] for f in result.frames], dim=1)  # [B, frames, 1 + n_q]

    ck = load_tts_checkpoint(tiny_tts_dir, dtype=torch.float32)
    store = VoiceStore.open(tiny_tts_dir / "voices", ck.config.voice_suffix, 16)
    ours = [split_words(t, ck.tokenizer.encode, 12.5, padding_between=1) for t in TEXTS]
    assert [[(list(e.tokens), e.padding) for e in es] for es in ours] == \
        [[(e.tokens, e.padding) for e in es] for es in entries]
    gen = TtsGen(ck.lm, batch=3, max_entries=32, max_tokens=64)
    delay = ck.config.audio_delay_frames
    starts = [0, 5]  # row 1 starts five steps later: rows are independent
    frames = [[] for _ in TEXTS]
    for t in range(want.shape[1] + 2 + max(starts)):
        for b, start in enumerate(starts):
            if t == start:
                gen.start(b, ours[b], [store.load(TINY_TTS_VOICES[b])], {"control": "ok", "cfg": "2.0"},
                          text_temp=0.0, audio_temp=0.0)
        active = torch.tensor([t >= s for s in starts] + [False])
        full = bool(((gen.offsets >= delay) & active).any())  # text-only while every row is warming up
        out = gen.step(active, full=full)
        for b in range(len(TEXTS)):
            if out.valid[b]:
                frames[b].append(out.frame[b].clone())
    for b in range(len(TEXTS)):
        got = torch.stack(frames[b][:want.shape[1]])
        assert torch.equal(got, want[b]), f"row {b}: first mismatch at frame {(got != want[b]).any(1).nonzero()[:1]}"
        assert int(gen.dsm.end_step[b]) == result.end_steps[b]
        steps = [int(s) for s, e in zip(gen.dsm.word_step[b], ours[b]) if e.tokens]
        assert steps == [step for _, step in result.all_transcripts[b]]
    assert (want[:, delay + 2:, 1:] >= 0).all()  # real audio codes came out after the delay


def test_layout_loads_strictly_into_the_reference(tiny_tts_dir):
    ref = _reference_model(tiny_tts_dir)  # get_moshi_lm loads the file with strict key checking
    state = load_file(str(tiny_tts_dir / json.loads((tiny_tts_dir / "config.json").read_text())["moshi_name"]))
    assert set(state) == set(ref.lm.state_dict())
    assert any(".self_attn.in_projs.2.weight" in k for k in state)  # unpacked per-step names


def test_packed_attention_names_load_too(tiny_tts_dir, tmp_path):
    import shutil
    copy = tmp_path / "packed"
    shutil.copytree(tiny_tts_dir, copy)
    name = json.loads((copy / "config.json").read_text())["moshi_name"]
    ck = load_tts_checkpoint(copy, dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in ck.lm.state_dict().items()}, str(copy / name))
    again = load_tts_checkpoint(copy, dtype=torch.float32)
    for (k, a), b in zip(ck.lm.state_dict().items(), again.lm.state_dict().values()):
        assert torch.equal(a, b), k


def test_checkpoint_errors_name_the_problem(tiny_tts_dir, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_tts_dir, bad)
    raw = json.loads((bad / "config.json").read_text())
    state = load_file(str(bad / raw["moshi_name"]))
    state.pop("text_emb.out2.weight")
    state["text_linear.weight"] = state["text_linear.weight"][:10]
    save_file(state, str(bad / raw["moshi_name"]))
    with pytest.raises(CheckpointError, match="text_linear.weight has shape"):
        load_tts_checkpoint(bad)
    del state["text_linear.weight"]
    save_file(state, str(bad / raw["moshi_name"]))
    with pytest.raises(CheckpointError, match="missing .*text_emb.out2.weight"):
        load_tts_checkpoint(bad)
    raw.pop("tts_config")
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="tts_config"):
        load_tts_checkpoint(bad)


def test_voice_errors(tiny_tts_dir, tmp_path):
    store = VoiceStore.open(tiny_tts_dir / "voices", TINY_TTS_SUFFIX, 16)
    assert store.names() == list(TINY_TTS_VOICES)
    with pytest.raises(KeyError):
        store.load("nobody")
    bad = tmp_path / "v"
    bad.mkdir()
    save_file({"other": torch.zeros(1)}, str(bad / f"x{TINY_TTS_SUFFIX}"))
    with pytest.raises(CheckpointError, match="no 'speaker_wavs'"):
        VoiceStore.open(bad, TINY_TTS_SUFFIX, 16).load("x")
    save_file({"speaker_wavs": torch.zeros(1, 8, 10)}, str(bad / f"x{TINY_TTS_SUFFIX}"))
    with pytest.raises(CheckpointError, match=r"expected \[1, 16, frames\]"):
        VoiceStore.open(bad, TINY_TTS_SUFFIX, 16).load("x")
    with pytest.raises(CheckpointError, match="voice map names voices not in"):
        VoiceStore(tiny_tts_dir / "voices", TINY_TTS_SUFFIX, 16, {"alloy": "nope"})


def test_condition_sums_are_cached_per_distinct_conditions(tiny_tts_dir):
    ck = load_tts_checkpoint(tiny_tts_dir, dtype=torch.float32)
    gen = TtsGen(ck.lm, batch=2, max_entries=4, max_tokens=8)
    with torch.no_grad():
        fresh = ck.lm.condition_sum({"control": "ok", "cfg": "2.0"})
        other = ck.lm.condition_sum({"control": "ok", "cfg": "3.0"})
    first = gen.condition_sum({"control": "ok", "cfg": "2.0"})
    again = gen.condition_sum({"cfg": "2.0", "control": "ok", "unrelated": "x"})  # order and other keys: same entry
    assert torch.equal(first, fresh) and again is first
    assert torch.equal(gen.condition_sum({"control": "ok", "cfg": "3.0"}), other)
    assert not torch.equal(fresh, other)
    assert not torch.equal(gen.condition_sum({"cfg": "2.0"}), fresh)  # an absent value reads the LUT's "none"
    with pytest.raises(ValueError, match="cfg value '9.9'"):
        gen.condition_sum({"cfg": "9.9"})
    gen.begin(1, [], {"control": "ok", "cfg": "3.0"}, padding_bonus=1.5, text_temp=0.0, text_topk=7,
              audio_temp=0.9, audio_topk=40)
    assert torch.equal(gen.cond_sum[1], other) and not gen.cond_sum[0].any()
    assert (gen.padding_bonus.tolist(), gen.text_temp.tolist(), gen.audio_temp.tolist()) == \
        ([0.0, 1.5], [pytest.approx(0.6), 0.0], [pytest.approx(0.6), pytest.approx(0.9)])
    assert (gen.text_topk.tolist(), gen.audio_topk.tolist()) == ([25, 7], [250, 40])


def test_sampling_defaults_are_the_reference_ones_and_written_once(tiny_tts_dir):
    """TtsSampling is the published TTSModel's sampling (temp for text and audio, LMGen's top-ks);
    a fresh TtsGen row, `begin` without settings and a TtsRequest all take it."""
    from moshi.models.lm import LMGen as RefLMGen

    from parley.engine.tts_pool import TtsRequest

    ref = inspect.signature(RefLMGen.__init__).parameters
    temp = ref_tts.TTSModel.__dataclass_fields__["temp"].default
    assert TtsSampling() == TtsSampling(temp, ref["top_k_text"].default, temp, ref["top_k"].default)
    ck = load_tts_checkpoint(tiny_tts_dir, dtype=torch.float32)
    gen = TtsGen(ck.lm, batch=2, max_entries=4, max_tokens=8)

    def settings(row: int) -> tuple:
        return (gen.text_temp[row].item(), gen.text_topk[row].item(), gen.audio_temp[row].item(),
                gen.audio_topk[row].item())

    expected = (pytest.approx(temp), TtsSampling.text_top_k, pytest.approx(temp), TtsSampling.audio_top_k)
    assert settings(0) == expected
    gen.begin(1, [], {"control": "ok", "cfg": "2.0"}, text_temp=0.0, text_topk=7, audio_temp=0.9, audio_topk=40)
    gen.begin(1, [], {"control": "ok", "cfg": "2.0"})
    assert settings(1) == expected
    request = TtsRequest((), (), {})
    assert (request.text_temperature, request.text_top_k, request.audio_temperature, request.audio_top_k) == \
        (temp, TtsSampling.text_top_k, temp, TtsSampling.audio_top_k)
