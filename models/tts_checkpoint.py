"""DSM TTS checkpoints and voices: the published `kyutai/tts-1.6b-en_fr` layout.

A TTS checkpoint directory (or Hugging Face repo id) holds:

    config.json                                     LM kwargs + tts_config, conditioners, fuser,
                                                    model_id, moshi_name / mimi_name / tokenizer_name
    dsm_tts_<sig>@<epoch>.safetensors               the LM (bf16; condition_provider.* fp32), attention
                                                    weights under the reference's unpacked names
                                                    (`in_projs.{i}.weight`; packed names load too)
    tokenizer-e351c8d8-checkpoint125.safetensors    Mimi (the duplex model's file; 32 codebooks used)
    tokenizer_spm_8k_en_fr_audio.model              SentencePiece, 8k pieces

A voice set (`kyutai/tts-voices`, or any directory) holds `<name>.<sig>@<epoch>.safetensors`
files (the suffix is the model's `model_id`), each with `speaker_wavs` [1, dim, frames] fp32.
Every failure is a `CheckpointError` naming the file and what was expected.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint import (
    MIMI_LEGACY_NAMES, CheckpointError, checkpoint_file, load_module_weights, read_config_json,
    resolve_checkpoint_dir, save_tensors,
)
from .config import MIMI_FILE, ConfigError, MimiConfig
from .mimi.codec import Mimi
from .mimi.precision import mimi_dtype_for
from .tokenizer import TextTokenizer, TokenizerError
from .tts import VOICE_KEY, TtsConfig, TtsLM

CONFIG_FILE = "config.json"
TTS_LM_FILE = "model.safetensors"  # when config.json names none (moshi_name)
TTS_TOKENIZER_FILE = "tokenizer_spm_8k_en_fr_audio.model"
FP32_PREFIXES = ("condition_provider.",)


@dataclass
class TtsCheckpoint:
    lm: TtsLM
    mimi: Mimi
    tokenizer: TextTokenizer
    config: TtsConfig
    gen_defaults: dict[str, Any]  # config.json's lm_gen_config (TTSModel itself uses temp 0.6)
    path: Path


def load_tts_checkpoint(source: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.bfloat16, mimi_dtype: torch.dtype | None = None) -> TtsCheckpoint:
    device = torch.device(device)
    directory = resolve_checkpoint_dir(source)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"TTS checkpoint {directory} has no {CONFIG_FILE} (it holds tts_config)")
    raw = read_config_json(config_path)
    try:
        cfg = TtsConfig.from_dict(raw)
    except (ConfigError, TypeError, ValueError, KeyError) as err:
        raise CheckpointError(f"config.json {config_path}: {err}") from err
    lm_path = checkpoint_file(directory, None, raw.get("moshi_name", TTS_LM_FILE), "TTS LM weights")
    mimi_path = checkpoint_file(directory, None, raw.get("mimi_name", MIMI_FILE), "Mimi weights")
    tok_path = checkpoint_file(directory, None, raw.get("tokenizer_name", TTS_TOKENIZER_FILE), "tokenizer")
    mimi_raw = (read_config_json(checkpoint_file(directory, None, raw["mimi_config_name"], "Mimi config"),
                                 "Mimi config") if raw.get("mimi_config_name") else {})
    try:
        mimi_config = MimiConfig.from_dict(mimi_raw, num_codebooks=cfg.lm.n_q)
    except (ConfigError, TypeError, ValueError) as err:
        raise CheckpointError(f"Mimi config of {directory}: {err}") from err
    if mimi_config.quantizer.n_q < cfg.lm.n_q:
        raise CheckpointError(f"Mimi of {directory} has {mimi_config.quantizer.n_q} codebooks; "
                              f"the TTS LM generates {cfg.lm.n_q}")
    try:
        tokenizer = TextTokenizer(tok_path)
    except TokenizerError as err:
        raise CheckpointError(str(err)) from err
    if tokenizer.vocab_size > cfg.lm.text_card:
        raise CheckpointError(f"tokenizer {tok_path} has {tokenizer.vocab_size} pieces, "
                              f"more than the TTS LM's text_card {cfg.lm.text_card}")
    with torch.device("meta"):
        try:
            lm = TtsLM(cfg)
            mimi = Mimi(mimi_config)
        except (ConfigError, ValueError) as err:
            raise CheckpointError(f"config.json {config_path}: unsupported TTS configuration: {err}") from err
    what = f"TTS config (dim {cfg.lm.dim}, {cfg.lm.num_layers} layers, n_q {cfg.lm.n_q})"
    load_module_weights(lm, lm_path, "TTS LM weights", what, device, dtype, FP32_PREFIXES)
    load_module_weights(mimi, mimi_path, "Mimi weights", "Mimi config", device, torch.float32,
                        legacy=MIMI_LEGACY_NAMES)
    mimi.compute_in(mimi_dtype_for(mimi, mimi_dtype))  # as load_checkpoint does
    return TtsCheckpoint(lm=lm, mimi=mimi, tokenizer=tokenizer, config=cfg,
                         gen_defaults=dict(raw.get("lm_gen_config") or {}), path=directory)


# ---------------------------------------------------------------------------------------------
# Voices


class VoiceStore:
    """Voice embeddings by name: `<dir>/<name><suffix>` files (names may hold folders)."""

    def __init__(self, directory: Path, suffix: str, dim: int, aliases: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.suffix = suffix
        self.dim = dim
        self._names = sorted(str(p.relative_to(directory))[:-len(suffix)]
                             for p in directory.rglob(f"*{suffix}") if p.is_file())
        if not self._names:
            raise CheckpointError(f"voice set {directory} holds no '*{suffix}' voice files for this model")
        self.aliases = dict(aliases or {})
        missing = {alias: name for alias, name in self.aliases.items() if name not in self._names}
        if missing:
            raise CheckpointError(f"voice map names voices not in {directory}: {missing}")
        self._cache: dict[str, torch.Tensor] = {}

    @classmethod
    def open(cls, source: str | Path, suffix: str, dim: int, voice_map: str | Path | None = None) -> "VoiceStore":
        path = Path(source)
        if not path.is_dir():
            if path.exists() or not re.match(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", str(source)):
                raise CheckpointError(f"voice set {source} is not a directory or a Hugging Face repo id")
            try:
                path = Path(snapshot_download(str(source), allow_patterns=[f"*{suffix}"]))
            except Exception as err:  # network, auth, unknown repo: one message
                raise CheckpointError(f"could not download voice set {source!r}: {type(err).__name__}: {err}") from err
        aliases = None
        if voice_map is not None:
            try:
                aliases = json.loads(Path(voice_map).read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise CheckpointError(f"voice map {voice_map} is not a readable JSON file: {err}") from err
            if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
                raise CheckpointError(f"voice map {voice_map} must be a JSON object of name -> voice name")
        return cls(path, suffix, dim, aliases)

    def names(self) -> list[str]:
        """Aliases (e.g. OpenAI's voice names) first, then the voice files' names."""
        return [*self.aliases, *self._names]

    def __contains__(self, name: str) -> bool:
        return name in self.aliases or name in self._names

    def read_all(self) -> None:
        """Read every voice file now (a server does, at start): `load` then touches no file.
        CheckpointError names the first broken file."""
        for name in self._names:
            self.load(name)

    def load(self, name: str) -> torch.Tensor:
        """[1, dim, frames] fp32 (cached; after `read_all`, no file is read). KeyError for an unknown
        name, CheckpointError for a bad file."""
        name = self.aliases.get(name, name)
        if name not in self._names:
            raise KeyError(name)
        if name not in self._cache:
            self._cache[name] = read_voice(self.directory / f"{name}{self.suffix}", self.dim)
        return self._cache[name]


def read_voice(path: Path, dim: int) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as f:
            if VOICE_KEY not in f.keys():
                raise CheckpointError(f"voice file {path} has no {VOICE_KEY!r} tensor (keys: {list(f.keys())})")
            tensor = f.get_tensor(VOICE_KEY)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"voice file {path} is not a readable safetensors file: {err}") from err
    if tensor.dim() != 3 or tensor.shape[0] != 1 or tensor.shape[1] != dim or tensor.shape[2] < 1:
        raise CheckpointError(f"voice file {path}: {VOICE_KEY} has shape {list(tensor.shape)}, "
                              f"expected [1, {dim}, frames]")
    return tensor.float()


def write_voice(path: Path, embedding: torch.Tensor) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({VOICE_KEY: embedding.detach().float().contiguous()}, str(path))
    return path


# ---------------------------------------------------------------------------------------------
# Writing (tests, the demo)

_PACKED = re.compile(r"^(.*\.(?:self_attn|cross_attention))\.(in_proj_weight|out_proj\.weight)$")


def unpacked_state(lm: TtsLM) -> dict[str, torch.Tensor]:
    """`lm.state_dict()` under the published names: stacked attention weights split into
    `in_projs.{i}.weight` / `out_projs.{i}.weight` per weight step."""
    out = {}
    for key, value in lm.state_dict().items():
        match = _PACKED.match(key)
        if match is None:
            out[key] = value
            continue
        owner = lm.get_submodule(match.group(1))
        steps = value.shape[0] // (3 * owner.dim if match.group(2) == "in_proj_weight" else owner.dim)
        stem = "in_projs" if match.group(2) == "in_proj_weight" else "out_projs"
        for i, part in enumerate(value.chunk(steps)):
            out[f"{match.group(1)}.{stem}.{i}.weight"] = part
    return out


def write_tts_lm(path: Path, lm: TtsLM, dtype: torch.dtype) -> None:
    state = {}
    for key, t in unpacked_state(lm).items():
        t = t.detach() if t.is_meta else t.detach().cpu()
        if t.dtype.is_floating_point:
            t = t.float() if key.startswith(FP32_PREFIXES) else t.to(dtype)
        state[key] = t.contiguous().clone()
    save_tensors(path, state)  # meta tensors: a sparse file of zeros (models/checkpoint.py)
