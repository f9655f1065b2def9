"""Checkpoints Parley writes, in the exact published layout: for its own tests, and for the
built-in demo (`parley serve` with no --model serves them: realtime/server/demo_model.py), which is why
this lives in the product package.

`write_tiny_checkpoint(dir, kind)`: random weights for `tiny_lm_config()` / `tiny_mimi_config()`,
a tiny SentencePiece tokenizer (vocab = text_card) and config.json; PersonaPlex also a voices.tgz
(NATF0 and NATM0 unless `voices` names others).

`write_tiny_hibiki_checkpoint(dir, kind)`: a tiny random Hibiki-Zero- ('hibiki-zero') or
Hibiki-shaped ('hibiki') checkpoint, model_type hibiki (`tiny_hibiki_config` says what differs).

`write_echo_checkpoint(dir)`: an LM whose weights are *constructed* so that greedy decoding
repeats the user's audio codes with a fixed one-frame delay, `ECHO_DELAY_FRAMES`:

    agent codes of frame f == user codes of frame f - 1, every codebook, for f >= 2.

Derivation (against `models/lm_gen.py`). At step s the LM reads ring column s: user semantic
of frame s (delay 0) and user acoustic of frame s - 1 (delay 1); the text and agent codes it
generates go to column s + 1, i.e. agent semantic of frame s + 1 and agent acoustic of frame s.
If depformer step k outputs the user code of codebook k found in its *input* column, then agent
semantic(s + 1) = user semantic(s) and agent acoustic(s) = user acoustic(s - 1): every agent
codebook of frame f equals the user's frame f - 1. LMGen returns frame s at step s (text and
semantic from column s, acoustic from s + 1). Frame 1 is not an echo: at steps 0 and 1 the
streams whose delay has not elapsed read the initial token, not the user's frame 0.

Construction (dim 64, 8 user codebooks):
- Every transformer weight (temporal and depformer) is zero except the norms, so each layer
  adds exactly 0 to its residual input: the temporal stack and the depformer are identities.
- Text and agent-audio embeddings (temporal and depformer) are zero: the temporal input is a
  function of the user codes only.
- User codebook j writes code c into its own 6 dims [6j, 6j + 6) as three angles: c is split in
  base-(8, 16, 16) digits and digit d of base n becomes (cos 2πd/n, sin 2πd/n). Every user
  embedding row also holds 1 in dim `_CONST_DIM`. Each block has squared norm 3 whatever the
  code, so the RMS of the summed input is a constant and out_norm (RMSNorm, alpha 1) is a fixed
  scale: hidden = x / sqrt(mean(x^2)).
- `depformer_in[k]` copies user codebook k's 6 dims to depformer dims 0..5 with gain
  `_GAIN`; `linears[k]` row c is the same 6-d code of c, so
  logit_c ∝ Σ_digits cos(angle_c - angle_in): uniquely maximal at the input code, with a margin
  of at least 1 - cos(2π/16) ≈ 0.076 of one digit (x `_GAIN` / RMS ≈ 16 logits): greedy is
  exact and temperature sampling almost surely agrees; it also survives bf16 weights.
- Text echoes too: `text_linear` row `words[d]` reads the angle of the top (base-8) digit d of
  the user's semantic code, so the frame's text token is `words[semantic(f - 1) // 256]`, with
  `words = echo_words(tokenizer)`: eight word pieces of the checkpoint's tokenizer
  (`echo_text_token`). Text arrives every frame, exactly predictable from the input.
- The initial-token rows (index card) of the user embeddings hold the code of 0.
Mimi is the tiny random Mimi. The LM file is fp32.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .checkpoint import lm_config_dict, mimi_config_dict, write_checkpoint
from .config import (
    MIMI_FILE, TOKENIZER_FILE, ConditionerConfig, LMConfig, MimiConfig, SamplingDefaults, tiny_lm_config,
    tiny_mimi_config,
)
from .lm import LMModel
from .mimi.codec import Mimi
from .persona_prompt import voice_to_pt
from .tokenizer import TextTokenizer, train_tiny_tokenizer
from .tts import TtsConfig, TtsLM
from .tts_checkpoint import write_tts_lm, write_voice
from .voices import VoicePrompt, save_voice_pt

ECHO_DELAY_FRAMES = 1  # agent frame f repeats user frame f - 1
ECHO_FIRST_FRAME = 2  # the first frame (as returned by LMGen) that is an exact echo

_DIGIT_BASES = (8, 16, 16)  # 8 * 16 * 16 = 2048 codes; each digit is one angle (2 dims)
_CODE_DIMS = 2 * len(_DIGIT_BASES)  # 6 dims per user codebook
_GAIN = 256.0  # depformer_in gain: sets the logit scale (margin ≈ 16 logits)
_TEXT_GAIN = 64.0  # text_linear gain on the top digit: margin (1 - cos 2π/8) x 64 / RMS ≈ 16 logits
_ECHO_WORDS = _DIGIT_BASES[0]  # one word per value of the semantic code's top digit
_VOICE_NAMES = ("NATF0", "NATM0")  # voices.tgz of the tiny PersonaPlex
_VOICE_FRAMES = 8


@torch.no_grad()
def randomize_mimi_state_(state: dict[str, torch.Tensor], seed: int) -> None:
    """A Mimi state_dict (ours or the reference's: the same buffer names) made non-trivial in
    place: unit-gain Gaussian weights keep the audio near +-1, Gaussian centroids give diverse
    codes, layer scales large enough for the transformer to matter."""
    generator = torch.Generator().manual_seed(seed)
    for key, t in state.items():
        if key.endswith("embedding_sum"):
            t.normal_(generator=generator)
        elif key.endswith("cluster_usage"):
            t.uniform_(0.5, 2.0, generator=generator)
        elif key.endswith("_initialized"):
            t.fill_(1.0)
        elif key.endswith("layer_scale_1.scale") or key.endswith("layer_scale_2.scale"):
            t.uniform_(0.1, 0.5, generator=generator)
        elif t.dim() >= 2:
            t.normal_(0.0, 1.0 / math.sqrt(t[0].numel()), generator=generator)
        else:
            t.normal_(0.0, 0.1, generator=generator)


@torch.no_grad()
def quantizer_inputs(mimi: Mimi, pcm: torch.Tensor) -> list[tuple[nn.Module, torch.Tensor]]:
    """Each residual quantizer (semantic, acoustic) with the latent it projects from `pcm`'s
    encode, [B, dim, frames]: what its codebooks quantize (read by hooks on its input projection,
    called once a frame)."""
    rvqs = (mimi.quantizer.rvq_first, mimi.quantizer.rvq_rest)
    latents: dict[nn.Module, list[torch.Tensor]] = {rvq.input_proj: [] for rvq in rvqs}
    hooks = [rvq.input_proj.register_forward_hook(lambda mod, args, out: latents[mod].append(out))
             for rvq in rvqs]
    try:
        mimi.encode(pcm)
    finally:
        for hook in hooks:
            hook.remove()
    return [(rvq, torch.cat(latents[rvq.input_proj], dim=-1)) for rvq in rvqs]


@torch.no_grad()
def fit_codebooks_(mimi: Mimi, pcm: torch.Tensor, seed: int) -> None:
    """Codebooks as a trained codec's lie, among the data: each level's centroids drawn from that
    level's residuals of `pcm`'s latents (one draw, no k-means steps; needs at least `bins` latent
    frames). Random centroids lie far from the latents and hide near-ties (every precision then
    picks the same code); these show them (benchmarks/mimi_quality.py, tests/test_mimi.py)."""
    g = torch.Generator().manual_seed(seed)
    for rvq, latent in quantizer_inputs(mimi, pcm):
        residual = latent.transpose(1, 2).reshape(-1, latent.shape[1])
        if residual.shape[0] < mimi.cardinality:
            raise ValueError(f"{residual.shape[0]} latent frames cannot seed {mimi.cardinality} centroids")
        for level in rvq.vq.layers:
            book = level._codebook
            pick = torch.randperm(residual.shape[0], generator=g)[:mimi.cardinality].to(residual.device)
            book.embedding_sum.copy_(residual[pick])
            book.cluster_usage.fill_(1.0)
            book._initialized.fill_(1.0)
            book.refresh_embedding()
            residual = residual - book.decode(book.encode(residual))


@torch.no_grad()
def _tiny_mimi_state(cfg: MimiConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random tiny Mimi whose codes follow its input.

    Conv / linear weights ~ N(0, 1 / fan_in) and zero biases keep the signal's scale through
    SEANet (PyTorch's default init shrinks it until the biases alone decide the latent), and
    each codebook's centroids are drawn at the scale of the latent it quantizes, measured on
    a fixed noise signal, so different audio gives different codes.
    """
    generator = torch.Generator().manual_seed(seed + 1)
    mimi = Mimi(cfg)
    for name, p in mimi.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(math.prod(p.shape[1:])))
        elif name.endswith("bias") and ".norm" not in name:
            p.zero_()
    for rvq, latent in quantizer_inputs(mimi, 0.1 * torch.randn(1, 4 * cfg.frame_size, generator=generator)):
        scale = latent.std().item()
        for level in rvq.vq.layers:
            book = level._codebook
            book.embedding_sum.copy_(scale * torch.randn(book.embedding_sum.shape, generator=generator))
            book.cluster_usage.fill_(1.0)
            book._initialized.fill_(1.0)
    return mimi.state_dict()


@torch.no_grad()
def _random_lm(cfg: LMConfig, seed: int) -> LMModel:
    """Weights ~ N(0, 1 / fan_in) clipped at 3 sigma (as `LMModel.init_weights`, but a vectorised
    draw: several times faster on CPU); norms keep alpha = 1. Logits come out with std ~1."""
    generator = torch.Generator().manual_seed(seed)
    lm = LMModel(cfg)
    for name, p in lm.named_parameters():
        if name.endswith("alpha") or ".norm" in name:
            continue
        std = 1 / math.sqrt(p.shape[-1])
        p.copy_(torch.randn(p.shape, generator=generator).clamp_(-3, 3) * std)
    return lm


def _config_json(cfg: LMConfig) -> dict:
    return {**lm_config_dict(cfg), "lm_gen_config": SamplingDefaults().to_lm_gen_config()}


def _tiny_layout(directory: str | Path, kind: str, mimi_levels: int | None = None,
                 context: int | None = None) -> tuple[Path, LMConfig, MimiConfig]:
    """The directory (created) and the tiny shapes of a `kind` checkpoint."""
    if kind not in ("moshi", "personaplex"):
        raise ValueError(f"kind must be 'moshi' or 'personaplex', got {kind!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = tiny_lm_config(dep_q=16 if kind == "personaplex" else 8)
    if context is not None:
        cfg = dataclasses.replace(cfg, context=context)
    return directory, cfg, tiny_mimi_config(levels=mimi_levels)


def write_tiny_checkpoint(directory: str | Path, kind: str = "moshi", seed: int = 0,
                          dtype: torch.dtype = torch.float32, mimi_levels: int | None = None,
                          voices: Sequence[str] = _VOICE_NAMES, context: int | None = None) -> Path:
    """A tiny random checkpoint (`kind` 'moshi' or 'personaplex'), LM stored in `dtype`.
    `mimi_levels`: codebooks in its Mimi (default 8, what the LM reads; more lets an STT
    checkpoint sharing this Mimi read extra codebooks, as the real 32-codebook Mimi does).
    `voices`: the PersonaPlex voice names in its voices.tgz. `context`: the temporal
    transformer's context in frames (default `tiny_lm_config`'s 40; a persona prompt must fit)."""
    if kind != "personaplex" and tuple(voices) != _VOICE_NAMES:
        raise ValueError("voices are for kind='personaplex'; a Moshi checkpoint takes no voice prompt")
    directory, cfg, mimi_cfg = _tiny_layout(directory, kind, mimi_levels, context)
    lm = _random_lm(cfg, seed)
    tokenizer = train_tiny_tokenizer(directory / ".tiny_tokenizer.model", cfg.text_card)
    voices = _write_voices(directory, lm, seed, voices) if kind == "personaplex" else {}
    write_checkpoint(directory, lm.state_dict(), _tiny_mimi_state(mimi_cfg, seed), tokenizer,
                     _config_json(cfg), voices, lm_dtype=dtype, mimi_config=mimi_config_dict(mimi_cfg))
    for path in (tokenizer, *voices.values()):  # scratch files, now inside the layout's files
        path.unlink()
    return directory


@torch.no_grad()
def _write_voices(directory: Path, lm: LMModel, seed: int, names: Sequence[str] = _VOICE_NAMES) -> dict[str, Path]:
    """Random-code voice prompts in PersonaPlex's `.pt` form, embedded with this LM."""
    generator = torch.Generator().manual_seed(seed + 2)
    voices = {}
    for name in names:
        codes = torch.randint(0, lm.cfg.card, (_VOICE_FRAMES, lm.cfg.n_agent), generator=generator)
        voice = voice_to_pt(VoicePrompt(source=name, codes=codes), lm.embed, lm.cfg)
        voices[name] = directory / f".{name}.pt"
        save_voice_pt(voices[name], voice)
    return voices


# ---------------------------------------------------------------------------------------------
# Echo


def code_features(codes: torch.Tensor) -> torch.Tensor:
    """codes [...] long in [0, 2048) -> [..., 6]: (cos, sin) of each base-(8, 16, 16) digit."""
    feats = []
    rest = codes
    for i, base in enumerate(_DIGIT_BASES):
        below = math.prod(_DIGIT_BASES[i + 1:])
        digit = torch.div(rest, below, rounding_mode="floor")
        rest = rest - digit * below
        angle = 2 * math.pi * digit.double() / base
        feats += [torch.cos(angle), torch.sin(angle)]
    return torch.stack(feats, dim=-1).float()


def echo_words(tokenizer: TextTokenizer) -> list[int]:
    """The eight text ids the echo speaks: the tokenizer's first word pieces ('▁' + letters)."""
    words = [i for i in range(tokenizer.vocab_size)
             if not tokenizer.is_special(i) and tokenizer.piece(i).startswith(" ") and len(tokenizer.piece(i)) > 2]
    if len(words) < _ECHO_WORDS:
        raise ValueError(f"the tokenizer has {len(words)} word pieces; the echo needs {_ECHO_WORDS}")
    return words[:_ECHO_WORDS]


def echo_text_token(semantic_code: torch.Tensor, words: list[int]) -> torch.Tensor:
    """The echo's text token for a user semantic code (the frame before)."""
    top = torch.div(semantic_code, math.prod(_DIGIT_BASES[1:]), rounding_mode="floor")
    return torch.tensor(words, device=semantic_code.device)[top]


def echo_lm_state(cfg: LMConfig, words: list[int]) -> dict[str, torch.Tensor]:
    """Constructed echo weights for `cfg` speaking `words` (see the module docstring)."""
    n_user = cfg.n_user
    const_dim = n_user * _CODE_DIMS
    if const_dim >= cfg.dim or _CODE_DIMS > cfg.depformer_dim or cfg.card > math.prod(_DIGIT_BASES):
        raise ValueError("echo weights need dim > 6 * n_user, depformer_dim >= 6 and card <= 2048")
    shapes = {k: t.shape for k, t in LMModel(cfg).state_dict().items()}  # tiny: CPU is cheap
    state = {k: torch.ones(s) if k.endswith("alpha") else torch.zeros(s) for k, s in shapes.items()}

    codes = torch.arange(cfg.card + 1)
    codes[cfg.card] = 0  # initial-token row: the code of 0
    feats = code_features(codes)  # [card + 1, 6]
    for j in range(n_user):
        emb = state[f"emb.{cfg.n_agent + j}.weight"]
        emb[:, j * _CODE_DIMS:(j + 1) * _CODE_DIMS] = feats
        emb[:, const_dim] = 1.0
    # User codebook 0 is the semantic one; its dims 0..1 hold the top digit's angle.
    top = torch.arange(_ECHO_WORDS, dtype=torch.float64) * 2 * math.pi / _ECHO_WORDS
    state["text_linear.weight"][words, 0] = (_TEXT_GAIN * torch.cos(top)).float()
    state["text_linear.weight"][words, 1] = (_TEXT_GAIN * torch.sin(top)).float()

    for k in range(cfg.dep_q):
        j = k % n_user  # PersonaPlex steps >= 8 predict user codebook k - 8: also an echo of it
        w_in = state[f"depformer_in.{k}.weight"]
        w_in[torch.arange(_CODE_DIMS), j * _CODE_DIMS + torch.arange(_CODE_DIMS)] = _GAIN
        state[f"linears.{k}.weight"][:, :_CODE_DIMS] = feats[:cfg.card]
    return state


def write_echo_checkpoint(directory: str | Path, kind: str = "moshi", seed: int = 0) -> Path:
    """The echo checkpoint (tiny shapes, fp32 LM). `kind='personaplex'` gives dep_q 16 (steps
    8..15 echo the user codebooks too) and a voices.tgz; the echo holds after any prompt, since
    no layer looks at past frames."""
    directory, cfg, mimi_cfg = _tiny_layout(directory, kind)
    tokenizer = train_tiny_tokenizer(directory / ".tiny_tokenizer.model", cfg.text_card)
    lm = LMModel(cfg)
    lm.load_state_dict(echo_lm_state(cfg, echo_words(TextTokenizer(tokenizer))))
    voices = _write_voices(directory, lm, seed) if kind == "personaplex" else {}
    write_checkpoint(directory, lm.state_dict(), _tiny_mimi_state(mimi_cfg, seed), tokenizer,
                     _config_json(cfg), voices, lm_dtype=torch.float32, mimi_config=mimi_config_dict(mimi_cfg))
    for path in (tokenizer, *voices.values()):
        path.unlink()
    return directory


# ---------------------------------------------------------------------------------------------
# Tiny Hibiki and Hibiki-Zero (model_type hibiki: 16 codebooks a stream)

HIBIKI_KINDS = ("hibiki-zero", "hibiki")
HIBIKI_TOKENIZER_FILE = "tokenizer_spm_48k_multi6_2.model"  # the 48k multilingual SentencePiece's name
HIBIKI_DESCRIPTIONS = ("very_bad", "bad", "neutral", "good", "very_good")


def tiny_hibiki_config(kind: str = "hibiki-zero", context: int = 40) -> LMConfig:
    """Toy shapes with a Hibiki's structure: 32 audio streams (16 source, 16 translated), acoustic
    delay 2, the `description` LUT summed into the input. `hibiki-zero` adds what Hibiki-Zero 3B
    has over Hibiki 2B: grouped KV heads (kv_repeat 2, the depformer's too), RoPE on head halves
    (`rope_concat`, max period 20000), a depformer weight schedule (9 weight slices for 16 steps)
    and a norm before each step's output head."""
    if kind not in HIBIKI_KINDS:
        raise ValueError(f"kind must be one of {HIBIKI_KINDS}, got {kind!r}")
    stream = (0,) + (2,) * 15  # semantic, then 15 acoustic codebooks two frames behind
    zero = kind == "hibiki-zero"
    return dataclasses.replace(
        tiny_lm_config(dep_q=16), n_q=32, context=context, depformer_context=16, delays=(0,) + stream + stream,
        kv_repeat=2 if zero else 1, positional_embedding="rope_concat" if zero else "rope",
        max_period=20_000.0 if zero else 10_000.0,
        depformer_weights_per_step_schedule=tuple(min(k, 8) for k in range(16)) if zero else None,
        depformer_norm="rms_norm_f32" if zero else None,
        conditioners=(ConditionerConfig("description", "lut", 8, len(HIBIKI_DESCRIPTIONS), HIBIKI_DESCRIPTIONS),),
        fuse_sum=("description",))


def write_tiny_hibiki_checkpoint(directory: str | Path, kind: str = "hibiki-zero", seed: int = 0,
                                 dtype: torch.dtype = torch.float32, context: int = 40) -> Path:
    """A tiny random Hibiki (`kind` 'hibiki-zero' or 'hibiki') in the published layout: config.json
    with model_type hibiki, the conditioners and fuser, lm_gen_config and the file names; the LM
    (stored in `dtype`), a Mimi with 32 levels of which the model reads 16, the tokenizer under
    the 48k model's name."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = tiny_hibiki_config(kind, context)
    lm = _random_lm(cfg, seed)
    mimi_cfg = tiny_mimi_config(num_codebooks=16, levels=32)
    tokenizer = train_tiny_tokenizer(directory / ".tiny_tokenizer.model", cfg.text_card)
    config = {**_config_json(cfg), "model_type": "hibiki", "tokenizer_name": HIBIKI_TOKENIZER_FILE}
    write_checkpoint(directory, lm.state_dict(), _tiny_mimi_state(mimi_cfg, seed), tokenizer, config,
                     lm_dtype=dtype, mimi_config=mimi_config_dict(mimi_cfg))
    (directory / TOKENIZER_FILE).rename(directory / HIBIKI_TOKENIZER_FILE)
    tokenizer.unlink()
    return directory


# ---------------------------------------------------------------------------------------------
# Tiny DSM TTS (the `kyutai/tts-1.6b-en_fr` layout at toy shapes)

TINY_TTS_VOICES = ("tiny/alpha", "tiny/bravo", "tiny/charlie")
TINY_TTS_SUFFIX = ".tiny0000@0.safetensors"
_TINY_TTS_VOICE_DIM, _TINY_TTS_VOICE_FRAMES = 16, 10
_WORD_LOGIT_GAIN = 3.0  # scales the NEW_WORD and PAD rows of text_linear so both get sampled


def tiny_tts_config(n_q: int = 4) -> dict:
    """config.json of a tiny DSM TTS: every key the published 1.6B has, at toy shapes."""
    cfg = {
        "dim": 64, "text_card": 200, "existing_text_padding_id": 3, "n_q": n_q, "dep_q": n_q, "card": 2048,
        "num_heads": 4, "num_layers": 2, "hidden_scale": 4.125, "causal": True, "layer_scale": None,
        "context": 40, "max_period": 10000, "gating": "silu", "norm": "rms_norm_f32",
        "positional_embedding": "rope", "depformer_dim": 32, "depformer_dim_feedforward": 96,
        "depformer_num_heads": 2, "depformer_num_layers": 2, "depformer_layer_scale": None,
        "depformer_multi_linear": True, "depformer_context": n_q, "depformer_max_period": 10000,
        "depformer_gating": "silu", "depformer_pos_emb": "none", "depformer_weights_per_step": True,
        "depformer_weights_per_step_schedule": [min(k, n_q - 2) for k in range(n_q)],
        "depformer_low_rank_embeddings": 8, "demux_second_stream": True, "cross_attention": True,
        "delays": [0, 0] + [2] * (n_q - 1),
        "conditioners": {
            "speaker_wavs": {"type": "tensor", "tensor": {"dim": _TINY_TTS_VOICE_DIM}},
            "cfg": {"type": "lut", "lut": {"n_bins": 7, "dim": 4, "tokenizer": "noop",
                                           "possible_values": ["1.0", "1.5", "2.0", "2.5", "3.0", "3.5", "4.0"]}},
            "control": {"type": "lut", "lut": {"n_bins": 1, "dim": 8, "tokenizer": "noop",
                                               "possible_values": ["ok"]}},
        },
        "fuser": {"sum": ["control", "cfg"], "cross": ["speaker_wavs"], "cross_attention_pos_emb": True,
                  "cross_attention_pos_emb_scale": 1},
        "tts_config": {"audio_delay": 1.28, "second_stream_ahead": 2},
        "model_id": {"sig": "tiny0000", "epoch": 0},
        "lm_gen_config": {"temp": 0.6, "temp_text": 0.6, "top_k": 250, "top_k_text": 50},
        "moshi_name": "dsm_tts_tiny0000@0.safetensors", "mimi_name": MIMI_FILE,
        "tokenizer_name": "tokenizer_spm_tiny.model",
    }
    return cfg


@torch.no_grad()
def random_tts_lm(lm: TtsLM, generator: torch.Generator) -> TtsLM:
    """`lm`'s weights drawn in place, on its device (`generator` there): N(0, 1 / fan_in) clipped at
    3 sigma, norms as built, cross-attention norms the identity, and the NEW_WORD and PAD rows of
    text_linear scaled so both get sampled (random text logits would rarely pick either)."""
    for name, p in lm.named_parameters():
        if name.endswith("alpha"):
            continue
        if name.endswith("norm_cross.weight"):
            p.fill_(1.0)
        elif name.endswith("norm_cross.bias"):
            p.zero_()
        elif not p.is_meta:  # meta: a layout at real shapes, nothing to draw
            p.copy_(torch.randn(p.shape, generator=generator, device=p.device).clamp_(-3, 3) / math.sqrt(p.shape[-1]))
    lm.text_linear.weight[[0, 3]] *= _WORD_LOGIT_GAIN
    return lm


@torch.no_grad()
def write_tiny_tts_checkpoint(directory: str | Path, seed: int = 0, n_q: int = 4,
                              voices_dir: str | Path | None = None) -> Path:
    """A tiny random DSM TTS checkpoint (fp32) and its voices (default: `directory/voices`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = tiny_tts_config(n_q)
    mimi_cfg = tiny_mimi_config(num_codebooks=n_q)
    raw["mimi_config_name"] = "mimi_config.json"
    (directory / "mimi_config.json").write_text(json.dumps(mimi_config_dict(mimi_cfg), indent=2))
    lm = random_tts_lm(TtsLM(TtsConfig.from_dict(raw)), torch.Generator().manual_seed(seed))
    write_tts_lm(directory / raw["moshi_name"], lm, torch.float32)
    save_file({k: v.contiguous() for k, v in _tiny_mimi_state(mimi_cfg, seed).items()},
              str(directory / raw["mimi_name"]))
    train_tiny_tokenizer(directory / raw["tokenizer_name"], raw["text_card"])
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    voices = Path(voices_dir) if voices_dir is not None else directory / "voices"
    for i, name in enumerate(TINY_TTS_VOICES):
        emb = torch.randn(1, _TINY_TTS_VOICE_DIM, _TINY_TTS_VOICE_FRAMES,
                          generator=torch.Generator().manual_seed(seed + 10 + i))
        write_voice(voices / f"{name}{TINY_TTS_SUFFIX}", emb)
    return directory


# ---------------------------------------------------------------------------------------------
# Speech-to-text (Kyutai DSM STT layout)

# File names as the published kyutai/stt-1b-en_fr config.json names them (moshi_name, mimi_name,
# tokenizer_name), so the loader is exercised on names other than Moshi's defaults.
STT_LM_FILE = "model.safetensors"
STT_MIMI_FILE = "mimi-pytorch-e351c8d8@125.safetensors"
STT_TOKENIZER_FILE = "tokenizer_en_fr_audio_8000.model"
TINY_STT_SETTINGS = {"audio_silence_prefix_seconds": 0.16, "audio_delay_seconds": 0.24}  # 2 and 3 frames


def tiny_stt_config(n_q: int = 8, text_delay: int = 2) -> LMConfig:
    """A few-megabyte STT LM (dep_q 0, 4 extra heads of 6 like the published 1B)."""
    return dataclasses.replace(tiny_lm_config(), n_q=n_q, dep_q=0, delays=(text_delay,) + (0,) * n_q,
                               extra_heads_num_heads=4, extra_heads_dim=6)


def write_tiny_stt_checkpoint(directory: str | Path, seed: int = 0, n_q: int = 8,
                              mimi_from: str | Path | None = None) -> Path:
    """A tiny random STT checkpoint (fp32). `mimi_from`: a checkpoint directory whose Mimi (file
    and mimi config) is reused, so the STT reads the same codes as that duplex model (paired
    transcription needs one Mimi); otherwise a tiny random Mimi with `n_q` codebooks."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = tiny_stt_config(n_q)
    lm = _random_lm(cfg, seed)
    tokenizer = train_tiny_tokenizer(directory / ".tiny_tokenizer.model", cfg.text_card)
    if mimi_from is not None:
        mimi_raw, mimi_state = checkpoint_mimi(mimi_from)
    else:
        mimi_cfg = tiny_mimi_config(n_q)
        mimi_raw, mimi_state = mimi_config_dict(mimi_cfg), _tiny_mimi_state(mimi_cfg, seed)
    write_stt_checkpoint(directory, lm.state_dict(), cfg, tokenizer, mimi_raw, mimi_state, lm_dtype=torch.float32)
    tokenizer.unlink()
    return directory


def checkpoint_mimi(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A checkpoint's Mimi: its config in the reference layout ({} for the built-in defaults,
    when config.json names none or there is no config.json) and its weights."""
    directory = Path(directory)
    raw = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else {}
    mimi_raw = json.loads((directory / raw["mimi_config_name"]).read_text()) if raw.get("mimi_config_name") else {}
    return mimi_raw, load_file(str(directory / raw.get("mimi_name", MIMI_FILE)))


def write_stt_checkpoint(directory: str | Path, lm_state: dict[str, torch.Tensor], cfg: LMConfig,
                         tokenizer: Path, mimi_raw: dict, mimi_state: dict[str, torch.Tensor], *,
                         settings: dict | None = None, lm_dtype: torch.dtype = torch.bfloat16) -> Path:
    """An STT checkpoint in the kyutai/stt layout (its file names, config.json with model_type
    stt and `settings` as stt_config, default TINY_STT_SETTINGS); `mimi_raw` {}: no mimi config
    file, the built-in Mimi, as the published STT repos ship it."""
    directory = Path(directory)
    config = {**lm_config_dict(cfg), "model_type": "stt", "stt_config": dict(settings or TINY_STT_SETTINGS),
              "moshi_name": STT_LM_FILE, "mimi_name": STT_MIMI_FILE, "tokenizer_name": STT_TOKENIZER_FILE}
    write_checkpoint(directory, lm_state, mimi_state, tokenizer, config, lm_dtype=lm_dtype,
                     mimi_config=mimi_raw or None)
    (directory / MIMI_FILE).rename(directory / STT_MIMI_FILE)
    (directory / TOKENIZER_FILE).rename(directory / STT_TOKENIZER_FILE)
    return directory
