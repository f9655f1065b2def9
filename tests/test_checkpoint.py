"""Checkpoint loading, the text tokenizer and audio file I/O.

Checkpoints come from tests/conftest.py (written by models/synthetic.py in the published
layout); tests that damage one work on a copy.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from safetensors.torch import load_file, save_file

from parley.models import checkpoint as checkpoint_module
from parley.models.audio_io import AudioFileError, read_wav, resample, write_wav
from parley.models.checkpoint import CheckpointError, load_checkpoint, write_checkpoint
from parley.models.config import LM_FILE, MIMI_FILE, TEXT_EPAD, TEXT_PAD, TOKENIZER_FILE, LMConfig, SamplingDefaults
from parley.models.lm import LMModel
from parley.models.mimi import model_key
from parley.models.tokenizer import TextTokenizer, train_tiny_tokenizer
from parley.models.voices import load_voice_pt

REPO_ROOT = Path(__file__).resolve().parents[1]


def _assert_loaded_equals_file(module: torch.nn.Module, path: Path, dtype: torch.dtype) -> None:
    expected = load_file(str(path))
    state = module.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert state[key].dtype == dtype, key
        assert torch.equal(state[key], value.to(dtype)), key


# --------------------------------------------------------------------------- round trips


def test_tiny_moshi_round_trip_is_exact(tiny_moshi_dir):
    ckpt = load_checkpoint(tiny_moshi_dir, dtype=torch.float32)
    assert ckpt.model_type == "moshi"
    assert ckpt.lm_config.dep_q == 8 and ckpt.lm_config.dim == 64
    assert ckpt.voices_dir is None
    assert ckpt.sampling == SamplingDefaults(text_temperature=0.7, text_top_k=25, audio_temperature=0.8,
                                             audio_top_k=250)
    assert ckpt.tokenizer.vocab_size == ckpt.lm_config.text_card
    assert ckpt.path == tiny_moshi_dir
    _assert_loaded_equals_file(ckpt.lm, tiny_moshi_dir / LM_FILE, torch.float32)
    _assert_loaded_equals_file(ckpt.mimi, tiny_moshi_dir / MIMI_FILE, torch.float32)
    assert not any(p.requires_grad for p in ckpt.lm.parameters())
    assert not ckpt.lm.training


def test_tiny_personaplex_round_trip_with_voices(tiny_personaplex_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_personaplex_dir)
    ckpt = load_checkpoint(src, dtype=torch.float32)
    assert ckpt.model_type == "personaplex"
    assert ckpt.lm_config.dep_q == 16
    _assert_loaded_equals_file(ckpt.lm, src / LM_FILE, torch.float32)
    assert ckpt.voices_dir == src / "voices"
    assert sorted(p.name for p in ckpt.voices_dir.iterdir()) == ["NATF0.pt", "NATM0.pt"]
    voice = load_voice_pt(ckpt.voices_dir / "NATF0.pt")
    assert voice.embeddings.shape[1] == ckpt.lm_config.dim


def test_loads_in_bf16_with_mimi_kept_fp32(tiny_moshi_dir):
    ckpt = load_checkpoint(tiny_moshi_dir, dtype=torch.bfloat16)
    _assert_loaded_equals_file(ckpt.lm, tiny_moshi_dir / LM_FILE, torch.bfloat16)
    _assert_loaded_equals_file(ckpt.mimi, tiny_moshi_dir / MIMI_FILE, torch.float32)


def test_bf16_file_loads_as_published(tiny_moshi_dir, tmp_path):
    state = load_file(str(tiny_moshi_dir / LM_FILE))
    out = write_checkpoint(tmp_path / "bf16", state, load_file(str(tiny_moshi_dir / MIMI_FILE)),
                           tiny_moshi_dir / TOKENIZER_FILE,
                           json.loads((tiny_moshi_dir / "config.json").read_text()),
                           mimi_config=json.loads((tiny_moshi_dir / "mimi_config.json").read_text()))
    assert load_file(str(out / LM_FILE))["text_emb.weight"].dtype == torch.bfloat16  # the default
    ckpt = load_checkpoint(out, dtype=torch.bfloat16)
    _assert_loaded_equals_file(ckpt.lm, out / LM_FILE, torch.bfloat16)


def test_file_overrides_from_arguments_and_config(tiny_moshi_dir, copy_checkpoint, tmp_path):
    src = copy_checkpoint(tiny_moshi_dir)
    renamed = tmp_path / "elsewhere.safetensors"
    (src / LM_FILE).rename(renamed)
    ckpt = load_checkpoint(src, dtype=torch.float32, lm_file=renamed)
    _assert_loaded_equals_file(ckpt.lm, renamed, torch.float32)

    (src / "moshi.safetensors").write_bytes(renamed.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "moshi_name": "moshi.safetensors"}))
    load_checkpoint(src, dtype=torch.float32)


# --------------------------------------------------------------------------- PersonaPlex rules


def _drop_upper_steps(state: dict[str, torch.Tensor], steps: int = 8) -> dict[str, torch.Tensor]:
    """A Moshi-style 8-step depformer file: what the PersonaPlex loader rule must complete."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        for name in ("depformer_in", "linears", "depformer_emb", "gating"):
            if name in parts and parts[parts.index(name) + 1].isdigit():
                if int(parts[parts.index(name) + 1]) >= steps:
                    break
        else:
            if key.startswith("depformer.layers.") and key.endswith(("in_proj_weight", "out_proj.weight")):
                value = value[: value.shape[0] // 2]
            out[key] = value
    return out


def test_personaplex_missing_upper_depformer_steps_are_filled_from_lower(tiny_personaplex_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_personaplex_dir)
    full = load_file(str(src / LM_FILE))
    partial = _drop_upper_steps(full)
    assert "linears.11.weight" not in partial and "depformer_emb.7.weight" in partial
    save_file(partial, str(src / LM_FILE))

    lm = load_checkpoint(src, dtype=torch.float32).lm.state_dict()
    for k in range(8, 16):
        assert torch.equal(lm[f"linears.{k}.weight"], full[f"linears.{k - 8}.weight"])
        assert torch.equal(lm[f"depformer_in.{k}.weight"], full[f"depformer_in.{k - 8}.weight"])
        assert torch.equal(lm[f"depformer.layers.1.gating.{k}.linear_in.weight"],
                           full[f"depformer.layers.1.gating.{k - 8}.linear_in.weight"])
    for j in range(8, 15):
        assert torch.equal(lm[f"depformer_emb.{j}.weight"], full[f"depformer_emb.{j - 8}.weight"])
    assert torch.equal(lm["depformer_emb.7.weight"], full["depformer_emb.7.weight"])
    for name, per_step in (("in_proj_weight", 3 * 32), ("out_proj.weight", 32)):
        stacked = lm[f"depformer.layers.0.self_attn.{name}"]
        assert stacked.shape[0] == 16 * per_step
        assert torch.equal(stacked[8 * per_step:], full[f"depformer.layers.0.self_attn.{name}"][:8 * per_step])


def test_personaplex_fill_rule_has_no_source_for_depformer_emb_7(tiny_personaplex_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_personaplex_dir)
    partial = _drop_upper_steps(load_file(str(src / LM_FILE)))
    del partial["depformer_emb.7.weight"]
    save_file(partial, str(src / LM_FILE))
    with pytest.raises(CheckpointError, match=r"missing 1 key\(s\): depformer_emb\.7\.weight"):
        load_checkpoint(src)


def test_moshi_does_not_fill_missing_steps(tiny_moshi_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_moshi_dir)
    state = load_file(str(src / LM_FILE))
    del state["linears.3.weight"]
    save_file(state, str(src / LM_FILE))
    with pytest.raises(CheckpointError, match=r"linears\.3\.weight"):
        load_checkpoint(src)


def test_personaplex_detected_without_dep_q_in_config(tiny_personaplex_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_personaplex_dir)
    config = json.loads((src / "config.json").read_text())
    del config["dep_q"]
    (src / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(src).model_type == "personaplex"  # from voices.tgz

    (src / "voices.tgz").unlink()
    shutil.rmtree(src / "voices")
    ckpt = load_checkpoint(src)  # from the depformer keys for steps >= 8
    assert ckpt.model_type == "personaplex" and ckpt.voices_dir is None


def test_existing_voices_dir_is_used_as_is(tiny_personaplex_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_personaplex_dir)
    (src / "voices").mkdir()
    (src / "voices" / "MINE.pt").write_bytes(b"")
    assert load_checkpoint(src).voices_dir == src / "voices"
    assert [p.name for p in (src / "voices").iterdir()] == ["MINE.pt"]


def test_read_only_checkpoint_unpacks_voices_into_cache(tiny_personaplex_dir, copy_checkpoint, tmp_path,
                                                         monkeypatch):
    src = copy_checkpoint(tiny_personaplex_dir)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(checkpoint_module.os, "access", lambda path, mode: Path(path) != src)
    voices = load_checkpoint(src).voices_dir
    assert voices is not None and (tmp_path / "cache") in voices.parents
    assert sorted(p.name for p in voices.iterdir()) == ["NATF0.pt", "NATM0.pt"]
    assert not (src / "voices").exists()
    assert load_checkpoint(src).voices_dir == voices  # second load reuses the cache


def test_voices_archive_with_unsafe_member_is_refused(tiny_personaplex_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_personaplex_dir)
    with tarfile.open(src / "voices.tgz", "w:gz") as tar:
        data = b"evil"
        info = tarfile.TarInfo("../evil.pt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(CheckpointError, match=r"voices\.tgz.*evil\.pt"):
        load_checkpoint(src)
    assert not (src.parent / "evil.pt").exists()


# --------------------------------------------------------------------------- errors


def test_missing_directory(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(CheckpointError, match="does not exist") as err:
        load_checkpoint(missing)
    assert str(missing) in str(err.value) and LM_FILE in str(err.value)


@pytest.mark.parametrize("name", [LM_FILE, MIMI_FILE, TOKENIZER_FILE])
def test_missing_file_of_the_layout(tiny_moshi_dir, copy_checkpoint, name):
    src = copy_checkpoint(tiny_moshi_dir)
    (src / name).unlink()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(src)
    message = str(err.value)
    assert str(src / name) in message and "does not exist" in message and f"expected {name}" in message


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tiny_moshi_dir, copy_checkpoint, damage):
    src = copy_checkpoint(tiny_moshi_dir)
    path = src / LM_FILE
    data = path.read_bytes()
    path.write_bytes(b"\x00\x01 not a safetensors file" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as err:
        load_checkpoint(src)
    assert str(path) in str(err.value)


def test_missing_key(tiny_moshi_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_moshi_dir)
    state = load_file(str(src / LM_FILE))
    del state["transformer.layers.1.gating.linear_in.weight"]
    save_file(state, str(src / LM_FILE))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(src)
    message = str(err.value)
    assert str(src / LM_FILE) in message
    assert "missing 1 key(s): transformer.layers.1.gating.linear_in.weight" in message


def test_many_missing_keys_are_listed_up_to_ten(tiny_moshi_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_moshi_dir)
    state = {k: v for k, v in load_file(str(src / LM_FILE)).items() if not k.startswith("emb.")}
    save_file(state, str(src / LM_FILE))
    with pytest.raises(CheckpointError, match=r"missing 16 key\(s\): .*\(and 6 more\)"):
        load_checkpoint(src)


def test_unexpected_key(tiny_moshi_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_moshi_dir)
    state = load_file(str(src / MIMI_FILE))
    state["encoder.extra.weight"] = torch.zeros(3)
    save_file(state, str(src / MIMI_FILE))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(src)
    message = str(err.value)
    assert str(src / MIMI_FILE) in message and "unexpected 1 key(s): encoder.extra.weight" in message


def test_shape_mismatch(tiny_moshi_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_moshi_dir)
    state = load_file(str(src / LM_FILE))
    state["text_linear.weight"] = torch.zeros(150, 64)
    save_file(state, str(src / LM_FILE))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(src)
    message = str(err.value)
    assert str(src / LM_FILE) in message and "text_linear.weight" in message
    assert "[150, 64]" in message and "expects [200, 64]" in message


def test_legacy_mimi_codebook_names_load(tiny_moshi_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_moshi_dir)
    state = load_file(str(src / MIMI_FILE))
    renames = {"_initialized": "inited", "cluster_usage": "cluster_size", "embedding_sum": "embed_avg"}
    legacy = {}
    for key, value in state.items():
        prefix, _, name = key.rpartition(".")
        legacy[f"{prefix}.{renames.get(name, name)}"] = value
    save_file(legacy, str(src / MIMI_FILE))
    mimi = load_checkpoint(src).mimi
    _assert_loaded_equals_file(mimi, tiny_moshi_dir / MIMI_FILE, torch.float32)
    codebook = mimi.quantizer.rvq_first.codebook(0)
    assert torch.equal(codebook.embedding, codebook.embedding_sum / codebook.cluster_usage[:, None])


def test_checkpoint_without_config_expects_7b_shapes(tiny_moshi_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_moshi_dir)
    (src / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"dim 4096, 32 layers"):
        load_checkpoint(src)


def test_lm_gen_config_overrides_the_reference_sampling_key_by_key(tiny_moshi_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_moshi_dir)
    config = json.loads((src / "config.json").read_text())
    config["lm_gen_config"] = {"temp": 0.5, "top_k_text": 7, "cfg_coef": 1.0}  # not a sampling key: ignored
    (src / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(src).sampling == SamplingDefaults(text_top_k=7, audio_temperature=0.5)


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    (json.dumps({"dim": 64, "frobnicate": 3}), "unsupported LM option 'frobnicate'"),
    (json.dumps({"model_type": "tts"}), "model_type 'tts' is not supported"),
    (json.dumps({"num_heads": 5}), "not divisible by num_heads"),
    (json.dumps({"lm_gen_config": [1]}), "lm_gen_config must be an object"),
    (json.dumps({"lm_gen_config": {"top_k": 2.5}}), "lm_gen_config: top_k must be a whole number, got 2.5"),
    (json.dumps({"lm_gen_config": {"temp": "hot"}}), "lm_gen_config: temp must be a number, got 'hot'"),
], ids=["syntax", "not-object", "unknown-option", "model-type", "bad-shape", "gen-config", "gen-top-k", "gen-temp"])
def test_bad_config_json(tiny_moshi_dir, copy_checkpoint, content, expected):
    src = copy_checkpoint(tiny_moshi_dir)
    (src / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=expected) as err:
        load_checkpoint(src)
    assert str(src / "config.json") in str(err.value)


def test_unreadable_tokenizer(tiny_moshi_dir, copy_checkpoint):
    src = copy_checkpoint(tiny_moshi_dir)
    (src / TOKENIZER_FILE).write_bytes(b"not a sentencepiece model")
    with pytest.raises(CheckpointError, match="could not be loaded") as err:
        load_checkpoint(src)
    assert str(src / TOKENIZER_FILE) in str(err.value)


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["moshi", "personaplex"])
def test_reference_loader_reads_our_layout(tiny_moshi_dir, tiny_personaplex_dir, kind):
    """moshi 0.2.13's own loader (strict load_state_dict) accepts the files we write."""
    loaders = pytest.importorskip("moshi.models.loaders")
    src = tiny_moshi_dir if kind == "moshi" else tiny_personaplex_dir
    info = loaders.CheckpointInfo.from_hf_repo(
        "parley/unused", moshi_weights=src / LM_FILE, mimi_weights=src / MIMI_FILE,
        tokenizer=src / TOKENIZER_FILE, config_path=src / "config.json",
        mimi_config_path=src / "mimi_config.json")
    ref_lm = info.get_moshi(device="cpu", dtype=torch.float32)
    ref_mimi = loaders.get_mimi(src / MIMI_FILE, info.mimi_config, num_codebooks=8)
    ours = load_checkpoint(src, dtype=torch.float32)
    assert ref_lm.dep_q == ours.lm_config.dep_q
    assert torch.equal(ref_lm.linears[3].weight, ours.lm.linears[3].weight)
    assert torch.equal(ref_lm.depformer.layers[1].self_attn.in_projs[2].weight,
                       ours.lm.depformer.layers[1].self_attn.in_proj_weight[2 * 96:3 * 96])
    # The reference names the attention projections `in_projs.0` / `out_projs.0` in memory;
    # model_key maps them to ours (the file's names).
    ref_mimi_state = {model_key(k): v for k, v in ref_mimi.state_dict().items()}
    assert set(ref_mimi_state) == set(ours.mimi.state_dict())
    for key, value in ours.mimi.state_dict().items():
        assert torch.equal(ref_mimi_state[key], value), key


# --------------------------------------------------------------------------- Hugging Face


def test_hf_repo_id_offline_gives_one_clear_error(tmp_path):
    code = ("from parley.models.checkpoint import CheckpointError, load_checkpoint\n"
            "try:\n    load_checkpoint('parley-tests/no-such-repo')\n"
            "except CheckpointError as err:\n    print('ERR', err)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "could not download Hugging Face repo 'parley-tests/no-such-repo'" in out.stdout
    assert "pass a local checkpoint directory" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


def test_hf_repo_id_downloads_the_layout_files(tiny_moshi_dir, monkeypatch):
    calls = []

    def fake_hf_hub_download(repo_id, filename):
        calls.append(("file", repo_id, filename))
        return str(tiny_moshi_dir / filename)

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.append(("snapshot", repo_id, sorted(allow_patterns)))
        return str(tiny_moshi_dir)

    monkeypatch.setattr(checkpoint_module, "hf_hub_download", fake_hf_hub_download)
    monkeypatch.setattr(checkpoint_module, "snapshot_download", fake_snapshot_download)
    ckpt = load_checkpoint("someone/tiny-moshi", dtype=torch.float32)
    assert ckpt.path == tiny_moshi_dir
    assert calls[0] == ("file", "someone/tiny-moshi", "config.json")
    assert calls[1] == ("snapshot", "someone/tiny-moshi", sorted(
        ["config.json", "voices.tgz", LM_FILE, MIMI_FILE, TOKENIZER_FILE, "mimi_config.json"]))


# --------------------------------------------------------------------------- memory


_MEASURE_LOAD = """
import json, sys, torch
from parley.models.checkpoint import load_checkpoint
from parley.models.config import tiny_lm_config
from parley.models.lm import LMModel
with torch.device("meta"):
    LMModel(tiny_lm_config())  # first meta construction imports torch's meta kernels: not our memory
def status(field):  # kB -> bytes; VmHWM is this process's own peak (ru_maxrss also counts the parent's)
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024
try:
    open("/proc/self/clear_refs", "w").write("5")  # restart the peak from here
except OSError:
    pass
before = status("VmRSS")
ckpt = load_checkpoint(sys.argv[1], dtype=torch.bfloat16)
lm_bytes = sum(p.numel() * p.element_size() for p in ckpt.lm.parameters())
print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"), "lm_bytes": lm_bytes}))
"""


def test_bf16_load_of_fp32_file_holds_about_one_copy(tmp_path, tiny_moshi_dir):
    cfg = LMConfig(dim=768, text_card=2000, num_heads=12, num_layers=3, context=100,
                   depformer_dim=256, depformer_dim_feedforward=int(4.125 * 256),
                   depformer_num_heads=4, depformer_num_layers=2)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LMModel(cfg).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    lm_state = {k: torch.randn(s, generator=generator) for k, s in shapes.items()}
    fp32_bytes = sum(v.numel() * 4 for v in lm_state.values())
    assert 180e6 < fp32_bytes < 300e6
    write_checkpoint(tmp_path / "medium", lm_state, load_file(str(tiny_moshi_dir / MIMI_FILE)),
                     tiny_moshi_dir / TOKENIZER_FILE, checkpoint_module.lm_config_dict(cfg),
                     lm_dtype=torch.float32,
                     mimi_config=json.loads((tiny_moshi_dir / "mimi_config.json").read_text()))
    del lm_state

    out = subprocess.run([sys.executable, "-c", _MEASURE_LOAD, str(tmp_path / "medium")],
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["lm_bytes"] == fp32_bytes // 2
    assert m["after"] - m["before"] > 0.9 * m["lm_bytes"], m  # the weights are resident
    growth = m["peak"] - m["before"]  # an upper bound on the load's own peak
    print("load memory:", m)
    assert growth < 1.5 * m["lm_bytes"], m


# --------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    return TextTokenizer(train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "t.model", 200))


def test_tokenizer_reserves_moshi_special_ids(tokenizer):
    assert tokenizer.vocab_size == 200
    assert tokenizer.is_special(TEXT_EPAD) and tokenizer.is_special(TEXT_PAD)
    assert not tokenizer.is_special(1) and not tokenizer.is_special(5)
    assert all(tokenizer.piece(i) == "" for i in range(4))  # unk / bos / eos / pad
    assert all(i >= 4 for i in tokenizer.encode("Hello, how are you doing today?"))


def test_tokenizer_pieces_stream_back_to_text(tokenizer):
    text = "Hello, how are you doing today?"
    ids = tokenizer.encode(text)
    assert "".join(tokenizer.piece(i) for i in ids) == " " + text
    assert tokenizer.decode(ids + [TEXT_PAD, TEXT_EPAD]) == text
    assert tokenizer.piece(10_000) == ""


def test_tiny_tokenizer_training_is_deterministic(tmp_path):
    a = train_tiny_tokenizer(tmp_path / "a.model", 200)
    b = train_tiny_tokenizer(tmp_path / "b.model", 200)
    assert a.read_bytes() == b.read_bytes()


# --------------------------------------------------------------------------- audio files


def test_wav_round_trip_at_24k(tmp_path):
    pcm = 0.5 * torch.sin(torch.arange(24_000) * (2 * torch.pi * 440 / 24_000))
    write_wav(tmp_path / "a.wav", pcm)
    back = read_wav(tmp_path / "a.wav")
    assert back.dtype == torch.float32 and back.shape == pcm.shape
    assert (back - pcm).abs().max() < 1e-4  # 16-bit PCM


def test_read_wav_downmixes_and_resamples(tmp_path):
    t = np.arange(48_000) / 48_000
    left = 0.4 * np.sin(2 * np.pi * 300 * t)
    soundfile.write(tmp_path / "stereo.wav", np.stack([left, -left + 0.2], axis=1), 48_000, subtype="FLOAT")
    pcm = read_wav(tmp_path / "stereo.wav")
    assert pcm.shape == (24_000,)
    assert abs(pcm[1000:-1000].mean().item() - 0.1) < 1e-3  # mean of the channels is constant 0.1


def test_resample_changes_length_by_the_rate_ratio():
    assert resample(torch.zeros(16_000), 16_000, 24_000).shape == (24_000,)
    x = torch.randn(100)
    assert resample(x, 24_000, 24_000) is x


@pytest.mark.parametrize("content", [None, b"", b"RIFF garbage"], ids=["missing", "empty-file", "garbage"])
def test_unreadable_audio_files(tmp_path, content):
    path = tmp_path / "voice.wav"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(AudioFileError, match=str(path)):
        read_wav(path)


def test_audio_file_with_no_samples(tmp_path):
    path = tmp_path / "silence.wav"
    soundfile.write(path, np.zeros((0, 1)), 24_000)
    with pytest.raises(AudioFileError, match="no samples"):
        read_wav(path)
