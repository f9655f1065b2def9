"""Checkpoint loading: a directory (or Hugging Face repo id) -> LM, Mimi, tokenizer, voices.

A checkpoint is the published layout (see `models/config.py` for the file names):

    model.safetensors                              the LM (bf16 as published)
    tokenizer-e351c8d8-checkpoint125.safetensors   Mimi (fp32)
    tokenizer_spm_32k_3.model                      SentencePiece text tokenizer
    config.json                                    optional: LMModel kwargs, file-name overrides
                                                   (moshi_name, mimi_name, tokenizer_name,
                                                   mimi_config_name) and lm_gen_config defaults
    voices.tgz                                     PersonaPlex: voices/NAME.pt prompts

Loading a 7B model never holds the weights twice: the model is built on the meta device, the
file's key set and every shape are checked against it before any tensor is read, then tensors
are read one by one with plain file reads (not mmap, so the file's pages never count as our
memory), converted, moved to the device and assigned in place of the meta parameters.

PersonaPlex (`dep_q` 16: the depformer also runs the 8 user codebooks) is detected from
config.json, from depformer keys for steps >= 8 in the file, or from a voices archive. Its
loader rule is kept: depformer weights for steps 8..15 that the file lacks are copied from steps
0..7 (`depformer_in.{k}`, `linears.{k}`, `depformer_emb.{k}`, `depformer.layers.{i}.gating.{k}`,
and the per-step rows stacked in `depformer.layers.{i}.self_attn.{in_proj_weight,out_proj.weight}`).

Hibiki and Hibiki-Zero (`model_type: hibiki` in config.json; kyutai/hibiki-*-pytorch-bf16 and
kyutai/hibiki-zero-3b-pytorch-bf16): n_q 32 (16 codebooks a stream), grouped KV heads (`kv_repeat`),
a depformer weight schedule and per-step norms, the `description` LUT conditioner (its weights
under `condition_provider.`, kept fp32). After loading, as the reference does: the text embedding
of end-of-text (2) is overwritten by padding's (3), and every row is conditioned on
`description: very_good`. Classifier-free guidance (`cfg_coef` other than 1) is refused by name.

Every failure is a `CheckpointError` whose message names the file and what was expected; the
CLI prints `str(err)` as is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import struct
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import RemoteEntryNotFoundError
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .config import (
    HIBIKI_CONDITION, LM_FILE, MIMI_FILE, TEXT_EOS, TEXT_PAD, TOKENIZER_FILE, VOICES_ARCHIVE, ConfigError, LMConfig,
    MimiConfig, SamplingDefaults, conditioners_dict,
)
from .lm import LMModel
from .mimi.codec import Mimi
from .mimi.precision import mimi_dtype_for
from .stt import SttSettings, check_stt_config
from .tokenizer import TextTokenizer, TokenizerError
from .voices import PersonaError, unpack_voices

CONFIG_FILE = "config.json"
MIMI_CONFIG_FILE = "mimi_config.json"  # what write_checkpoint names a Mimi config (mimi_config_name)
VOICES_DIR = "voices"
SUPPORTED_MODEL_TYPES = ("moshi", "personaplex", "hibiki")

ModelType = Literal["moshi", "personaplex", "hibiki"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and what was expected."""


@dataclass
class Checkpoint:
    lm: LMModel
    mimi: Mimi
    tokenizer: TextTokenizer
    lm_config: LMConfig
    mimi_config: MimiConfig
    voices_dir: Path | None  # extracted PersonaPlex voices (NAME.pt), None for Moshi
    sampling: SamplingDefaults  # config.json's lm_gen_config over the reference defaults
    model_type: ModelType
    path: Path  # the local checkpoint directory


# ---------------------------------------------------------------------------------------------
# Safetensors reading without mmap


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class _SafetensorsFile:
    """Header of a safetensors file (validated by `safe_open`) and tensor-at-a-time reads."""

    def __init__(self, path: Path, role: str) -> None:
        self.path = path
        self.role = role
        if not path.is_file():
            raise CheckpointError(f"{role} file {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:  # validates header, offsets and sizes
                keys = list(f.keys())
            with open(path, "rb") as fh:
                (header_len,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(header_len))
        except Exception as err:  # safetensors raises its own Rust-side error types
            raise CheckpointError(f"{role} file {path} is not a readable safetensors file: {err}") from err
        self._data_start = 8 + header_len
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key in keys:
            entry = header[key]
            if entry["dtype"] not in _ST_DTYPES:
                raise CheckpointError(f"{role} file {path}: tensor {key} has unsupported dtype {entry['dtype']}")
            begin, end = entry["data_offsets"]
            self._entries[key] = (_ST_DTYPES[entry["dtype"]], tuple(entry["shape"]), begin, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def read(self, key: str) -> torch.Tensor:
        dtype, shape, begin, end = self._entries[key]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb") as fh:
            fh.seek(self._data_start + begin)
            if fh.readinto(buf.numpy()) != end - begin:
                raise CheckpointError(f"{self.path}: tensor {key} is truncated")
        return buf.view(dtype).reshape(shape)  # safetensors data is little-endian, as are our hosts


# ---------------------------------------------------------------------------------------------
# Key plan: which file tensor fills each model parameter


@dataclass(frozen=True)
class _Source:
    key: str  # the file key read
    tile_steps: tuple[int, int] | None = None  # (file steps, model steps) for stacked per-step rows
    parts: tuple[str, ...] = ()  # file keys concatenated on dim 0 instead (the reference's unpacked names)


_STEP_KEY = re.compile(r"^(depformer_in|linears|depformer_emb)\.(\d+)\.(.*)$")
_GATING_KEY = re.compile(r"^(depformer\.layers\.\d+\.gating)\.(\d+)\.(.*)$")
_STACKED_KEY = re.compile(r"^depformer\.layers\.\d+\.self_attn\.(in_proj_weight|out_proj\.weight)$")
# Packed attention names and the reference's unpacked (per weight step) ones: in_projs.{i}.weight.
_PACKED_ATTENTION = re.compile(r"^(.*\.(?:self_attn|cross_attention))\.(in_proj_weight|out_proj\.weight)$")


def _unpacked_parts(key: str, file_keys: set[str]) -> tuple[str, ...]:
    """The file's `in_projs.{i}.weight` / `out_projs.{i}.weight` keys making up a packed key, in order."""
    match = _PACKED_ATTENTION.match(key)
    if match is None:
        return ()
    stem = "in_projs" if match.group(2) == "in_proj_weight" else "out_projs"
    parts = []
    while f"{match.group(1)}.{stem}.{len(parts)}.weight" in file_keys:
        parts.append(f"{match.group(1)}.{stem}.{len(parts)}.weight")
    return tuple(parts)


def _filled_from(key: str, file_steps: int) -> str | None:
    """PersonaPlex rule: the file key a missing per-step key k >= file_steps is copied from."""
    for pattern in (_STEP_KEY, _GATING_KEY):
        match = pattern.match(key)
        if match and int(match.group(2)) >= file_steps:
            return f"{match.group(1)}.{int(match.group(2)) - file_steps}.{match.group(3)}"
    return None


# Older Mimi files name the codebook statistics differently (the reference renames them on load).
_MIMI_LEGACY_NAMES = {"_initialized": ("inited",), "cluster_usage": ("cluster_size",),
                      "embedding_sum": ("embed_avg", "embed_sum")}


def _legacy_source(key: str, file_keys: set[str], legacy: dict[str, tuple[str, ...]]) -> str | None:
    prefix, _, name = key.rpartition(".")
    for old in legacy.get(name, ()):
        candidate = f"{prefix}.{old}" if prefix else old
        if candidate in file_keys:
            return candidate
    return None


def _format_keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:10])
    more = f" (and {len(keys) - 10} more)" if len(keys) > 10 else ""
    return f"{len(keys)} key(s): {shown}{more}"


def _plan(expected: dict[str, torch.Size], st: _SafetensorsFile, role: str, what: str,
          fill_steps: tuple[int, int] | None = None,
          legacy: dict[str, tuple[str, ...]] | None = None) -> dict[str, _Source]:
    """Match model parameters to file tensors; raise on missing/unexpected keys or wrong shapes.

    `fill_steps` = (file steps, model steps) enables the PersonaPlex depformer fill rule;
    `legacy` maps a parameter name to older names the file may use instead.
    """
    file_keys = set(st.keys())
    plan: dict[str, _Source] = {}
    missing: list[str] = []
    for key, shape in expected.items():
        want = tuple(shape)
        if key in file_keys:
            found = st.shape(key)
            if found == want:
                plan[key] = _Source(key)
                continue
            if (fill_steps and _STACKED_KEY.match(key) and len(found) == len(want) == 2
                    and found[1] == want[1] and found[0] * fill_steps[1] == want[0] * fill_steps[0]):
                plan[key] = _Source(key, tile_steps=fill_steps)
                continue
            raise CheckpointError(
                f"{role} file {st.path}: tensor {key} has shape {list(found)}, "
                f"but the {what} expects {list(want)}")
        parts = _unpacked_parts(key, file_keys)
        if parts:
            found_rows = sum(st.shape(part)[0] for part in parts)
            if any(st.shape(part)[1:] != want[1:] for part in parts) or found_rows != want[0]:
                raise CheckpointError(
                    f"{role} file {st.path}: tensors {parts[0]} .. {parts[-1]} stack to "
                    f"{[found_rows, *st.shape(parts[0])[1:]]}, but the {what} expects {list(want)} for {key}")
            plan[key] = _Source(parts[0], parts=parts)
            continue
        source = _filled_from(key, fill_steps[0]) if fill_steps else None
        if source is None and legacy:
            source = _legacy_source(key, file_keys, legacy)
        if source is not None and source in file_keys and st.shape(source) == want:
            plan[key] = _Source(source)
        else:
            missing.append(key)
    if missing:
        raise CheckpointError(f"{role} file {st.path} is missing {_format_keys(missing)} "
                              f"expected by the {what}")
    used = {source.key for source in plan.values()} | {part for source in plan.values() for part in source.parts}
    unexpected = sorted(file_keys - set(expected) - used)
    if unexpected:
        raise CheckpointError(f"{role} file {st.path} has unexpected {_format_keys(unexpected)} "
                              f"not in the {what}")
    return plan


# A load-progress callback: (what, tensors done, tensors in total), called after each tensor.
Progress = Callable[[str, int, int], None]


def _load_weights(model: nn.Module, st: _SafetensorsFile, plan: dict[str, _Source],
                  device: torch.device, dtype: torch.dtype, progress: Progress | None = None,
                  fp32_prefixes: tuple[str, ...] = ()) -> None:
    """Read each planned tensor, convert, move, and assign it over the meta parameter.

    Non-persistent buffers (not in the file) are materialised as zeros first; a module that
    derives them from loaded tensors (Mimi's codebook centroids) recomputes them in its load hook.
    """
    persistent = set(model.state_dict())
    for name, buf in list(model.named_buffers()):
        if buf.is_meta and name not in persistent:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, torch.zeros(buf.shape, dtype=buf.dtype, device=device))
    state: dict[str, torch.Tensor] = {}
    for done, (key, source) in enumerate(plan.items(), 1):
        tensor = torch.cat([st.read(part) for part in source.parts]) if source.parts else st.read(source.key)
        if source.tile_steps is not None:
            file_steps, model_steps = source.tile_steps
            rows = tensor.view(file_steps, -1, tensor.shape[1])
            index = torch.arange(model_steps) % file_steps  # step k reads step k mod file_steps
            tensor = rows[index].reshape(-1, tensor.shape[1])
        if device.type != "cpu":
            tensor = tensor.to(device)  # convert on the device: less host traffic and memory
        if tensor.dtype.is_floating_point:
            tensor = tensor.to(torch.float32 if key.startswith(fp32_prefixes) and fp32_prefixes else dtype)
        state[key] = tensor
        if progress is not None:
            progress(st.role, done, len(plan))
    model.load_state_dict(state, strict=True, assign=True)
    # device meta: the layout checked (config, files, keys, shapes), one tensor read at a time, none kept
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
                if t.is_meta and device.type != "meta"]
    if leftover:
        raise CheckpointError(f"{st.path}: model tensors left uninitialised after loading: {leftover[:10]}")
    model.requires_grad_(False)
    model.eval()


def _meta_shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {key: t.shape for key, t in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# Sources: directory or Hugging Face repo


_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _download(repo_id: str) -> Path:
    """Snapshot the files a checkpoint needs from a Hugging Face repo into the local cache."""
    try:
        try:
            config_path: Path | None = Path(hf_hub_download(repo_id, CONFIG_FILE))
        except RemoteEntryNotFoundError:  # no config.json: a Moshi 7B with the default names
            config_path = None
        raw = _read_json(config_path, "config.json") if config_path else {}
        names = [CONFIG_FILE, VOICES_ARCHIVE,
                 raw.get("moshi_name", LM_FILE), raw.get("mimi_name", MIMI_FILE),
                 raw.get("tokenizer_name", TOKENIZER_FILE)]
        if raw.get("mimi_config_name"):
            names.append(raw["mimi_config_name"])
        return Path(snapshot_download(repo_id, allow_patterns=names))
    except CheckpointError:
        raise
    except Exception as err:  # network, auth, offline mode, unknown repo: one message for all
        reason = f"{type(err).__name__}: {err}".strip().splitlines()[0]
        raise CheckpointError(
            f"could not download Hugging Face repo {repo_id!r} ({reason}). No local directory "
            f"{repo_id!r} exists either: pass a local checkpoint directory instead (holding "
            f"{LM_FILE}, {MIMI_FILE}, {TOKENIZER_FILE}).") from err


def _resolve_source(source: str | Path) -> Path:
    path = Path(source)
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} is a file; expected a directory holding "
                                  f"{LM_FILE}, {MIMI_FILE} and {TOKENIZER_FILE}")
        return path
    if isinstance(source, str) and _HF_REPO_ID.match(source) and not source.startswith("."):
        return _download(source)
    raise CheckpointError(f"checkpoint directory {path} does not exist (expected a directory holding "
                          f"{LM_FILE}, {MIMI_FILE} and {TOKENIZER_FILE}, or a Hugging Face repo id)")


def _file(directory: Path, override: str | Path | None, name: str, role: str) -> Path:
    """An explicit override (as given, else relative to the checkpoint) or the layout's file."""
    if override is not None:
        path = Path(override)
        if not path.is_absolute() and not path.exists():
            path = directory / path
    else:
        path = directory / name
    if not path.is_file():
        raise CheckpointError(f"{role} file {path} does not exist (expected {name} in {directory})"
                              if override is None else f"{role} file {path} does not exist")
    return path


def _read_json(path: Path, role: str) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{role} {path} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise CheckpointError(f"{role} {path} must hold a JSON object, found {type(raw).__name__}")
    return raw


# ---------------------------------------------------------------------------------------------
# Voices


def _voices_cache_dir(archive: Path) -> Path:
    stat = archive.stat()
    tag = hashlib.sha1(f"{archive.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "parley" / "voices"
    return base / tag


def _voices_dir(directory: Path) -> Path | None:
    """The checkpoint's voices/ folder; voices.tgz is unpacked once beside itself, or into a
    per-archive cache folder when the checkpoint directory is read-only."""
    existing = directory / VOICES_DIR
    if existing.is_dir():
        return existing
    archive = directory / VOICES_ARCHIVE
    if not archive.is_file():
        return None
    dest = directory if os.access(directory, os.W_OK) else _voices_cache_dir(archive)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        return unpack_voices(archive, dest)
    except OSError as err:
        raise CheckpointError(f"voices archive {archive} could not be unpacked into {dest}: {err}") from err
    except PersonaError as err:
        raise CheckpointError(str(err)) from err


# ---------------------------------------------------------------------------------------------
# Loading


def _is_personaplex_file(st: _SafetensorsFile, n_agent: int) -> bool:
    return f"depformer_in.{n_agent}.weight" in st.keys() or f"linears.{n_agent}.weight" in st.keys()


def _lm_config(raw: dict[str, Any], config_path: Path | None, personaplex_evidence: bool) -> LMConfig:
    model_type = raw.get("model_type", "moshi")
    where = f"config.json {config_path}" if config_path else "checkpoint"
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not supported "
                              f"(Parley serves {', '.join(SUPPORTED_MODEL_TYPES)})")
    if raw.get("lora_name"):
        raise CheckpointError(f"{where}: LoRA checkpoints (lora_name) are not supported")
    raw = dict(raw)
    if "dep_q" not in raw and (personaplex_evidence or model_type == "personaplex"):
        raw["dep_q"] = raw.get("n_q", LMConfig.n_q)
    try:
        return LMConfig.from_dict(raw)
    except (ConfigError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: {err}") from err


def load_checkpoint(source: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.bfloat16, *, lm_file: str | Path | None = None,
                    mimi_file: str | Path | None = None,
                    tokenizer_file: str | Path | None = None, progress: Progress | None = None,
                    mimi_dtype: torch.dtype | None = None, cfg_coef: float = 1.0) -> Checkpoint:
    """Load LM (in `dtype`), Mimi (read in fp32, then cast to `mimi_dtype`; None: auto, see
    mimi/precision.py), tokenizer and voices
    from a directory or HF repo id. `progress`, if given, is told after each tensor read (a large
    LM takes a while). `cfg_coef`: Hibiki's classifier-free guidance; only 1 (none) is served."""
    device = torch.device(device)
    directory = _resolve_source(source)

    config_path = directory / CONFIG_FILE
    raw = _read_json(config_path, "config.json") if config_path.is_file() else {}
    sampling = _sampling_defaults(raw, config_path)

    lm_path = _file(directory, lm_file, raw.get("moshi_name", LM_FILE), "LM weights")
    mimi_path = _file(directory, mimi_file, raw.get("mimi_name", MIMI_FILE), "Mimi weights")
    tok_path = _file(directory, tokenizer_file, raw.get("tokenizer_name", TOKENIZER_FILE), "tokenizer")
    lm_st = _SafetensorsFile(lm_path, "LM weights")
    mimi_st = _SafetensorsFile(mimi_path, "Mimi weights")

    has_voices = (directory / VOICES_ARCHIVE).is_file() or (directory / VOICES_DIR).is_dir()
    n_q = raw.get("n_q", LMConfig.n_q)
    n_agent_default = n_q // 2 if isinstance(n_q, int) else LMConfig.n_q // 2
    lm_config = _lm_config(raw, config_path if raw else None,
                           has_voices or _is_personaplex_file(lm_st, n_agent_default))
    model_type = _model_type(raw, lm_config, config_path)
    _check_cfg_coef(raw, cfg_coef, config_path)
    mimi_config, mimi_where = _mimi_config(directory, raw, lm_config)
    tokenizer = _tokenizer(tok_path, lm_config)
    voices_dir = _voices_dir(directory) if model_type == "personaplex" else None

    # Build on meta (no memory), check every key and shape, then read tensor by tensor.
    lm, mimi = _build_on_meta(lm_config, mimi_config,
                              f"{'config.json ' + str(config_path) if raw else 'checkpoint'}", mimi_where)
    fill = (lm_config.n_agent, lm_config.dep_q) if model_type == "personaplex" else None
    lm_plan = _plan(_meta_shapes(lm), lm_st, "LM weights", f"LM config ({_describe(lm_config)})", fill)
    mimi_plan = _plan(_meta_shapes(mimi), mimi_st, "Mimi weights", "Mimi config", legacy=_MIMI_LEGACY_NAMES)
    # Conditioners stay fp32, as the reference loader keeps them.
    _load_weights(lm, lm_st, lm_plan, device, dtype, progress, fp32_prefixes=("condition_provider.",))
    _load_weights(mimi, mimi_st, mimi_plan, device, torch.float32, progress)
    mimi.compute_in(mimi_dtype_for(mimi, mimi_dtype))  # convs and transformers; the quantizer stays fp32
    if model_type == "hibiki":
        _prepare_hibiki(lm, f"config.json {config_path}")

    return Checkpoint(
        lm=lm, mimi=mimi, tokenizer=tokenizer, lm_config=lm_config, mimi_config=mimi_config,
        voices_dir=voices_dir,
        sampling=sampling, model_type=model_type, path=directory,
    )


def _model_type(raw: dict, lm_config: LMConfig, config_path: Path) -> ModelType:
    """moshi, personaplex (a depformer over the user codebooks too) or hibiki (config.json says so);
    conditioning is refused on any model but Hibiki, as the reference's get_condition_tensors does."""
    if raw.get("model_type") == "hibiki":
        return "hibiki"
    if lm_config.conditioners:
        raise CheckpointError(f"config.json {config_path}: conditioners are served for model_type 'hibiki' only "
                              f"(found model_type {raw.get('model_type', 'moshi')!r})")
    return "personaplex" if lm_config.teacher_forced_user else "moshi"


def _check_cfg_coef(raw: dict, cfg_coef: float, config_path: Path) -> None:
    """Classifier-free guidance (Hibiki's `cfg_coef`, which doubles every row with `very_bad`
    conditioning) is not served: refused by name, from the caller or from lm_gen_config."""
    if cfg_coef != 1.0:
        raise CheckpointError(f"cfg_coef {cfg_coef}: classifier-free guidance is not served (only cfg_coef 1)")
    gen_config = raw.get("lm_gen_config")
    config_coef = gen_config.get("cfg_coef", 1.0) if isinstance(gen_config, dict) else 1.0
    if config_coef != 1.0:
        raise CheckpointError(f"config.json {config_path}: lm_gen_config.cfg_coef {config_coef}: classifier-free "
                              f"guidance is not served (only cfg_coef 1)")


@torch.no_grad()
def _prepare_hibiki(lm: LMModel, where: str) -> None:
    """What the reference does to a loaded Hibiki: the text embedding of end-of-text (2) becomes
    padding's (3), so an end of text sampled while the source still plays reads as padding; and
    every row is conditioned on `description: very_good` (run_inference.get_condition_tensors)."""
    lm.text_emb.weight[TEXT_EOS] = lm.text_emb.weight[TEXT_PAD]
    if not lm.cfg.conditioners:
        return  # nothing to condition on (the reference then passes no condition tensors)
    (name, value), = HIBIKI_CONDITION.items()
    spec = next((c for c in lm.cfg.conditioners if c.name == name), None)
    if spec is None or name not in lm.cfg.fuse_sum or value not in spec.possible_values:
        raise CheckpointError(f"{where}: a Hibiki model needs a LUT conditioner {name!r} summed by the fuser "
                              f"with the value {value!r}")
    lm.set_condition(HIBIKI_CONDITION)


def _sampling_defaults(raw: dict, config_path: Path) -> SamplingDefaults:
    """config.json's lm_gen_config (absent: the defaults), checked."""
    if not isinstance(raw.get("lm_gen_config", {}), dict):
        raise CheckpointError(f"config.json {config_path}: lm_gen_config must be an object")
    try:
        return SamplingDefaults.from_lm_gen_config(raw.get("lm_gen_config", {}))
    except ConfigError as err:
        raise CheckpointError(f"config.json {config_path}: {err}") from err


def _mimi_config(directory: Path, raw: dict, lm_config: LMConfig) -> tuple[MimiConfig, str]:
    """The Mimi config config.json names (else the built-in defaults), and where it came from."""
    mimi_raw: dict[str, Any] = {}
    mimi_where = f"Mimi config of {directory} (built-in defaults)"
    if raw.get("mimi_config_name"):
        mimi_config_path = _file(directory, None, raw["mimi_config_name"], "Mimi config")
        mimi_raw = _read_json(mimi_config_path, "Mimi config")
        mimi_where = f"Mimi config {mimi_config_path}"
    try:
        return MimiConfig.from_dict(mimi_raw, num_codebooks=lm_config.n_agent), mimi_where
    except (ConfigError, TypeError, ValueError) as err:
        raise CheckpointError(f"{mimi_where}: {err}") from err


def _tokenizer(tok_path: Path, lm_config: LMConfig) -> TextTokenizer:
    """The text tokenizer, refused when it has more pieces than the LM's text_card."""
    try:
        tokenizer = TextTokenizer(tok_path)
    except TokenizerError as err:
        raise CheckpointError(str(err)) from err
    if tokenizer.vocab_size > lm_config.text_card:
        raise CheckpointError(f"tokenizer {tok_path} has {tokenizer.vocab_size} pieces, "
                              f"more than the LM's text_card {lm_config.text_card}")
    return tokenizer


def _build_on_meta(lm_config: LMConfig, mimi_config: MimiConfig, lm_where: str,
                   mimi_where: str) -> tuple[LMModel, Mimi]:
    """The LM and Mimi modules on the meta device (no memory yet)."""
    with torch.device("meta"):
        try:
            lm = LMModel(lm_config)
        except (ConfigError, ValueError) as err:
            raise CheckpointError(f"{lm_where}: unsupported LM configuration: {err}") from err
        try:
            mimi = Mimi(mimi_config)
        except (ConfigError, ValueError) as err:
            raise CheckpointError(f"{mimi_where}: {err}") from err
    return lm, mimi


def _describe(cfg: LMConfig) -> str:
    return f"dim {cfg.dim}, {cfg.num_layers} layers, dep_q {cfg.dep_q}, card {cfg.card}, text_card {cfg.text_card}"


# ---------------------------------------------------------------------------------------------
# Writing


# LMConfig fields written only when they differ from these defaults (the reference's LMModel would
# take depformer_kv_repeat None as a head count), and the conditioning, written in the reference's form.
_OMITTED_DEFAULTS = {"kv_repeat": 1, "depformer_kv_repeat": None, "depformer_norm": None}


def lm_config_dict(cfg: LMConfig) -> dict[str, Any]:
    """An LMConfig as config.json LMModel kwargs (tuples as lists; conditioners as the reference's
    `conditioners` and `fuser` objects)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("conditioners", "fuse_sum") or _OMITTED_DEFAULTS.get(f.name, object()) == value:
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    if cfg.conditioners:
        out["conditioners"] = conditioners_dict(cfg.conditioners)
        out["fuser"] = {"sum": list(cfg.fuse_sum)}
    return out


def mimi_config_dict(cfg: MimiConfig) -> dict[str, Any]:
    """A MimiConfig in the reference's mimi config layout ({seanet, quantizer, transformer, ...})."""
    raw = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples -> lists
    raw.pop("num_codebooks")
    return raw


def _save(path: Path, state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> None:
    out = {}
    for key, t in state.items():
        t = t.detach() if t.is_meta else t.detach().to("cpu")
        if dtype is not None and t.dtype.is_floating_point:
            t = t.to(dtype)
        out[key] = t.contiguous().clone()  # no shared storage: safetensors refuses aliases
    save_tensors(path, out)


_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


def save_tensors(path: Path, state: dict[str, torch.Tensor]) -> None:
    """A safetensors file of `state`. Meta tensors (a layout at real shapes, checked without
    memory) are written as zeros never allocated: the header, then a sparse run of zero bytes."""
    if not any(t.is_meta for t in state.values()):
        save_file(state, str(path))
        return
    header, offset = {}, 0
    for key, t in state.items():
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        fh.truncate(8 + len(blob) + offset)


def write_checkpoint(directory: str | Path, lm_state: dict[str, torch.Tensor],
                     mimi_state: dict[str, torch.Tensor], tokenizer_model_path: str | Path,
                     config: dict[str, Any] | None = None, voices: dict[str, str | Path] | None = None,
                     *, lm_dtype: torch.dtype = torch.bfloat16,
                     mimi_config: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint in the published layout; returns the directory.

    `lm_state` keys are the published LM keys (LMModel's state_dict); the LM is stored in
    `lm_dtype` (bf16 as published; fp32 where tests need exact weights), Mimi in fp32.
    `config` becomes config.json; `mimi_config` (reference layout) is written to
    mimi_config.json and named by config.json's `mimi_config_name`. `voices` maps voice names
    to files packed as `voices/NAME.pt` into voices.tgz.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _save(directory / LM_FILE, lm_state, lm_dtype)
    _save(directory / MIMI_FILE, mimi_state, torch.float32)
    shutil.copyfile(tokenizer_model_path, directory / TOKENIZER_FILE)
    config = dict(config or {})
    if mimi_config is not None:
        (directory / MIMI_CONFIG_FILE).write_text(json.dumps(mimi_config, indent=2))
        config["mimi_config_name"] = MIMI_CONFIG_FILE
    if config:
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    if voices:
        with tarfile.open(directory / VOICES_ARCHIVE, "w:gz") as tar:
            for name, path in sorted(voices.items()):
                tar.add(str(path), arcname=f"{VOICES_DIR}/{name}.pt", recursive=False)
    return directory


# ---------------------------------------------------------------------------------------------
# For other checkpoint kinds (models/tts_checkpoint.py): the same checks, file handling and errors


def resolve_checkpoint_dir(source: str | Path) -> Path:
    """A local directory, or a Hugging Face repo id snapshotted into the cache."""
    return _resolve_source(source)


def checkpoint_file(directory: Path, override: str | Path | None, name: str, role: str) -> Path:
    """`override` (as given, else relative to the checkpoint) or `directory / name`; must exist."""
    return _file(directory, override, name, role)


def read_config_json(path: Path, role: str = "config.json") -> dict[str, Any]:
    return _read_json(path, role)


def load_module_weights(module: nn.Module, path: Path, role: str, what: str, device: torch.device,
                        dtype: torch.dtype, fp32_prefixes: tuple[str, ...] = (),
                        legacy: dict[str, tuple[str, ...]] | None = None) -> None:
    """Fill a meta-device `module` from a safetensors file: every key and shape checked first
    (packed or unpacked attention names), then tensor by tensor in `dtype`; keys starting with
    one of `fp32_prefixes` stay fp32. Failures are CheckpointErrors naming the file."""
    st = _SafetensorsFile(path, role)
    _load_weights(module, st, _plan(_meta_shapes(module), st, role, what, legacy=legacy), device, dtype,
                  fp32_prefixes=fp32_prefixes)


MIMI_LEGACY_NAMES = _MIMI_LEGACY_NAMES


# ---------------------------------------------------------------------------------------------
# Speech-to-text checkpoints (Kyutai DSM STT: kyutai/stt-1b-en_fr, kyutai/stt-2.6b-en)


@dataclass
class SttCheckpoint:
    lm: LMModel  # dep_q 0: temporal transformer, text head, extra heads
    mimi: Mimi  # encodes the n_q codebooks the LM reads
    tokenizer: TextTokenizer
    lm_config: LMConfig
    mimi_config: MimiConfig
    settings: SttSettings  # config.json's stt_config
    path: Path


def load_stt_checkpoint(source: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.bfloat16, mimi_dtype: torch.dtype | None = None) -> SttCheckpoint:
    """Load an STT checkpoint: config.json (LM kwargs with dep_q 0, `stt_config`, and the file
    names `moshi_name` / `mimi_name` / `tokenizer_name`), the LM file, Mimi and the tokenizer."""
    device = torch.device(device)
    directory = _resolve_source(source)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"STT checkpoint {directory} has no {CONFIG_FILE} (an STT model is described "
                              f"by its config.json: dep_q 0, delays, stt_config)")
    raw = _read_json(config_path, "config.json")
    where = f"config.json {config_path}"
    if raw.get("model_type", "stt") != "stt":
        raise CheckpointError(f"{where}: model_type {raw['model_type']!r} is not a speech-to-text model")
    if not isinstance(raw.get("stt_config", {}), dict):
        raise CheckpointError(f"{where}: stt_config must be an object")
    try:
        settings = SttSettings.from_dict(raw.get("stt_config", {}))
        lm_config = LMConfig.from_dict({k: v for k, v in raw.items() if k != "model_type"})
        check_stt_config(lm_config)
    except (ConfigError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: {err}") from err

    lm_st = _SafetensorsFile(_file(directory, None, raw.get("moshi_name", LM_FILE), "LM weights"), "LM weights")
    mimi_st = _SafetensorsFile(_file(directory, None, raw.get("mimi_name", MIMI_FILE), "Mimi weights"),
                               "Mimi weights")
    tok_path = _file(directory, None, raw.get("tokenizer_name", TOKENIZER_FILE), "tokenizer")
    mimi_raw: dict[str, Any] = {}
    if raw.get("mimi_config_name"):
        mimi_raw = _read_json(_file(directory, None, raw["mimi_config_name"], "Mimi config"), "Mimi config")
    try:
        mimi_config = MimiConfig.from_dict(mimi_raw, num_codebooks=lm_config.n_q)
        tokenizer = TextTokenizer(tok_path)
        with torch.device("meta"):
            lm, mimi = LMModel(lm_config), Mimi(mimi_config)
    except (ConfigError, TokenizerError, TypeError, ValueError) as err:
        raise CheckpointError(f"STT checkpoint {directory}: {err}") from err
    if tokenizer.vocab_size > lm_config.text_card:
        raise CheckpointError(f"tokenizer {tok_path} has {tokenizer.vocab_size} pieces, "
                              f"more than the LM's text_card {lm_config.text_card}")
    lm_plan = _plan(_meta_shapes(lm), lm_st, "LM weights", f"STT config ({_describe(lm_config)})")
    mimi_plan = _plan(_meta_shapes(mimi), mimi_st, "Mimi weights", "Mimi config", legacy=_MIMI_LEGACY_NAMES)
    _load_weights(lm, lm_st, lm_plan, device, dtype)
    _load_weights(mimi, mimi_st, mimi_plan, device, torch.float32)
    mimi.compute_in(mimi_dtype_for(mimi, mimi_dtype))
    return SttCheckpoint(lm=lm, mimi=mimi, tokenizer=tokenizer, lm_config=lm_config, mimi_config=mimi_config,
                         settings=settings, path=directory)
