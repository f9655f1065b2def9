"""Hibiki and Hibiki-Zero: the published layout (config.json model_type hibiki), loaded by
Parley and by moshi 0.2.13's own loader from the same files, and greedy output token for token
equal to the reference LMGen with the same conditioning (`description: very_good`), on the CPU.

Two tiny random checkpoints (models/synthetic.py `write_tiny_hibiki_checkpoint`): Hibiki-Zero-
shaped (grouped KV heads in both transformers, a depformer weight schedule, per-step depformer
norms) and Hibiki-shaped (plain heads, one weight slice a step). Both: 32 audio streams, acoustic
delay 2, the `description` LUT, a 40-frame context that the 64 test frames slide past, and the
input end-of-stream code written at a frame of some rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parley.models.checkpoint import CheckpointError, load_checkpoint
from parley.models.config import LM_FILE, MIMI_FILE, TEXT_EOS, TEXT_PAD
from parley.models.lm_gen import LMGen
from parley.models.synthetic import HIBIKI_KINDS, HIBIKI_TOKENIZER_FILE, write_tiny_hibiki_checkpoint

FRAMES = 64  # > the 40-frame context: the window slides
EOS_FRAME = 50  # rows 1.. get the input end-of-stream code here, then Mimi-silence-like codes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=HIBIKI_KINDS)
def hibiki_dir(request, tmp_path_factory) -> Path:
    return write_tiny_hibiki_checkpoint(tmp_path_factory.mktemp(request.param), kind=request.param)


def reference_checkpoint(directory: Path):
    loaders = pytest.importorskip("moshi.models.loaders")
    return loaders.CheckpointInfo.from_hf_repo(
        "parley/unused", moshi_weights=directory / LM_FILE, mimi_weights=directory / MIMI_FILE,
        tokenizer=directory / HIBIKI_TOKENIZER_FILE, config_path=directory / "config.json",
        mimi_config_path=directory / "mimi_config.json")


def source_codes(batch: int, eos_token: int) -> torch.Tensor:
    """[FRAMES, batch, 16]: random codes; rows 1.. end their source at EOS_FRAME (the end code
    there, one repeated code after, as silence encodes)."""
    codes = torch.randint(0, 2048, (FRAMES, batch, 16), generator=torch.Generator().manual_seed(7))
    codes[EOS_FRAME, 1:] = eos_token
    codes[EOS_FRAME + 1:, 1:] = 17
    return codes


def run_reference(directory: Path, codes: torch.Tensor) -> list[torch.Tensor | None]:
    from moshi.models.lm import LMGen as RefLMGen
    from moshi.run_inference import get_condition_tensors

    info = reference_checkpoint(directory)
    lm = info.get_moshi(device="cpu", dtype=torch.float32)
    assert info.model_type == "hibiki"
    batch = codes.shape[1]
    gen = RefLMGen(lm, use_sampling=False, cfg_coef=1.0,
                   condition_tensors=get_condition_tensors(info.model_type, lm, batch_size=batch, cfg_coef=1.0))
    outs = []
    with gen.streaming(batch):
        for frame in codes:
            out = gen.step(frame[..., None])
            outs.append(None if out is None else out[:, :, 0].clone())
    return outs


def run_ours(gen: LMGen, codes: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    state = gen.init_state(codes.shape[1])
    every_row = torch.ones(codes.shape[1], dtype=torch.bool)
    outs = []
    for frame in codes:
        out = gen.step(state, frame, every_row)
        outs.append((out.text.clone(), out.audio.clone(), out.valid.clone()))
    return outs


@pytest.mark.oracle
def test_greedy_matches_reference_lmgen(hibiki_dir):
    ckpt = load_checkpoint(hibiki_dir, dtype=torch.float32)
    assert ckpt.model_type == "hibiki"
    codes = source_codes(3, ckpt.lm.input_eos_token)
    ref = run_reference(hibiki_dir, codes)
    ours = run_ours(LMGen(ckpt.lm, text_temp=0.0, audio_temp=0.0), codes)
    assert len(ref) == len(ours)
    for f, ((text, audio, valid), expected) in enumerate(zip(ours, ref)):
        if expected is None:
            assert not valid.any(), f"frame {f}: the reference has no output yet"
            continue
        assert valid.all(), f"frame {f}"
        assert torch.equal(text, expected[:, 0]), f"frame {f}: text {text} != {expected[:, 0]}"
        assert torch.equal(audio, expected[:, 1:]), f"frame {f}: audio differs"
    texts = torch.stack([t for t, _, v in ours if v.all()])
    assert texts.unique().numel() > 1, "degenerate test: the text never changes"
    # The end code changed what the rows that got it translate (row 0 had none).
    after = torch.stack([a for _, a, v in ours[EOS_FRAME + 3:]])
    assert not torch.equal(after[:, 1], after[:, 0])


@pytest.mark.oracle
def test_reference_loader_reads_the_layout_key_for_key(hibiki_dir):
    ours = load_checkpoint(hibiki_dir, dtype=torch.float32)
    ref = reference_checkpoint(hibiki_dir).get_moshi(device="cpu", dtype=torch.float32)
    assert torch.equal(ref.text_emb.weight, ours.lm.text_emb.weight)
    cfg = ours.lm_config
    if cfg.kv_repeat > 1:  # grouped heads: dim query rows then dim / kv_repeat key and value rows
        rows = cfg.dim + 2 * cfg.dim // cfg.kv_repeat
        assert ref.transformer.layers[0].self_attn.in_projs[0].weight.shape == (rows, cfg.dim)
    if cfg.depformer_norm is not None:
        assert torch.equal(ref.depformer_norms[5].alpha, ours.lm.depformer_norms[5].alpha)
    provider = ref.condition_provider.conditioners["description"]
    assert torch.equal(provider.output_proj.weight, ours.lm.condition_provider.conditioners["description"].output_proj.weight)


def test_end_of_text_embeds_as_padding(hibiki_dir):
    """The reference loader's rule: an early end of text reads as padding while the source plays."""
    lm = load_checkpoint(hibiki_dir, dtype=torch.float32).lm
    assert torch.equal(lm.text_emb.weight[TEXT_EOS], lm.text_emb.weight[TEXT_PAD])
    assert not torch.equal(lm.depformer_text_emb.weight[TEXT_EOS], lm.depformer_text_emb.weight[TEXT_PAD])


def test_condition_is_very_good_and_kept_fp32_before_the_cast(hibiki_dir):
    ckpt = load_checkpoint(hibiki_dir, dtype=torch.bfloat16)
    lut = ckpt.lm.condition_provider.conditioners["description"]
    assert lut.output_proj.weight.dtype == torch.float32
    expected = lut.lut("very_good")[0, 0].to(torch.bfloat16)
    assert ckpt.lm.condition.dtype == torch.bfloat16 and torch.equal(ckpt.lm.condition, expected)


def test_classifier_free_guidance_is_refused_by_name(hibiki_dir, copy_checkpoint):
    with pytest.raises(CheckpointError, match="cfg_coef 3.0: classifier-free guidance is not served"):
        load_checkpoint(hibiki_dir, dtype=torch.float32, cfg_coef=3.0)
    src = copy_checkpoint(hibiki_dir)
    raw = json.loads((src / "config.json").read_text())
    raw["lm_gen_config"]["cfg_coef"] = 2.0
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="lm_gen_config.cfg_coef 2.0"):
        load_checkpoint(src, dtype=torch.float32)


def test_unconditioned_hibiki_loads_without_a_condition(hibiki_dir, copy_checkpoint):
    """No conditioners in config.json nor in the LM file: the reference conditions nothing (its
    get_condition_tensors needs conditioners), and neither do we."""
    src = copy_checkpoint(hibiki_dir)
    raw = json.loads((src / "config.json").read_text())
    del raw["conditioners"], raw["fuser"]
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="unexpected .*condition_provider"):
        load_checkpoint(src, dtype=torch.float32)  # the file still holds the LUT: refused, named
    weights = load_file(str(src / LM_FILE))
    save_file({k: v for k, v in weights.items() if not k.startswith("condition_provider.")}, str(src / LM_FILE))
    lm = load_checkpoint(src, dtype=torch.float32).lm
    assert lm.condition is None and torch.equal(lm.text_emb.weight[TEXT_EOS], lm.text_emb.weight[TEXT_PAD])


def test_conditioning_on_a_moshi_is_refused(hibiki_dir, copy_checkpoint):
    src = copy_checkpoint(hibiki_dir)
    raw = json.loads((src / "config.json").read_text())
    raw["model_type"] = "moshi"
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="conditioners are served for model_type 'hibiki' only"):
        load_checkpoint(src, dtype=torch.float32)
