"""Model shapes: the LM and Mimi configurations, with the published 7B defaults.

Field names follow the reference's `config.json` / `LMModel` kwargs, so a checkpoint's
`config.json` maps onto `LMConfig.from_dict` key for key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SAMPLE_RATE = 24_000
FRAME_RATE = 12.5
FRAME_SAMPLES = int(SAMPLE_RATE / FRAME_RATE)  # 1920: one 80 ms frame at 24 kHz

# Text special tokens (Moshi / PersonaPlex tokenizer conventions).
TEXT_EPAD = 0  # end of padding
TEXT_BOS = 1
TEXT_EOS = 2
TEXT_PAD = 3
ZERO_TOKEN = -1  # embeds to zero
UNGENERATED_TOKEN = -2  # "not generated yet" / teacher-forced slot left to the model

# Published file names in a checkpoint directory.
LM_FILE = "model.safetensors"
MIMI_FILE = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_FILE = "tokenizer_spm_32k_3.model"
VOICES_ARCHIVE = "voices.tgz"

# Keys in config.json that describe files or generation, not LM shapes.
NON_LM_KEYS = (
    "moshi_name", "mimi_name", "tokenizer_name", "mimi_config_name", "lora_name",
    "model_type", "lm_gen_config", "tts_config", "stt_config", "model_id",
)

# Hibiki: the conditioning every row gets (moshi 0.2.13 run_inference.get_condition_tensors), and
# the code written into every user codebook at the frame where the source audio ends.
HIBIKI_CONDITION = {"description": "very_good"}


class ConfigError(ValueError):
    """A configuration that cannot describe a model; the message says which field and why."""


@dataclass(frozen=True)
class ConditionerConfig:
    """One conditioner of config.json's `conditioners` (the reference's `lut` or `tensor` kinds)."""

    name: str
    kind: str  # "lut" or "tensor"
    dim: int  # input (tensor) or LUT embedding dim
    n_bins: int = 0
    possible_values: tuple[str, ...] = ()


def parse_conditioners(raw: dict[str, Any]) -> tuple[ConditionerConfig, ...]:
    """config.json's `conditioners` object; options other than their neutral values are refused."""
    conditioners = []
    for name, spec in (raw.get("conditioners") or {}).items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind not in ("lut", "tensor"):
            raise ConfigError(f"conditioner {name!r}: type {kind!r} is not supported (lut, tensor)")
        args = dict(spec.get(kind) or {})
        for key, neutral in (("force_linear", True), ("output_bias", False), ("learn_padding", True),
                             ("tokenizer", "noop")):
            if args.pop(key, neutral) != neutral:
                raise ConfigError(f"conditioner {name!r}: {key} other than {neutral!r} is not supported")
        args.pop("pad_empty", None)
        args.pop("init_scale", None)  # a training-time draw scale: the weights are read from the file
        values = tuple(args.pop("possible_values", None) or ())
        if kind == "lut" and not values:
            raise ConfigError(f"conditioner {name!r}: a LUT needs possible_values")
        cond = ConditionerConfig(name, kind, int(args.pop("dim")), int(args.pop("n_bins", 0)), values)
        if args:
            raise ConfigError(f"conditioner {name!r}: unsupported option(s) {sorted(args)}")
        conditioners.append(cond)
    return tuple(conditioners)


def conditioners_dict(conditioners: tuple[ConditionerConfig, ...]) -> dict[str, Any]:
    """The reference's config.json `conditioners` object for these conditioners."""
    out: dict[str, Any] = {}
    for c in conditioners:
        args: dict[str, Any] = {"dim": c.dim}
        if c.kind == "lut":
            args.update(n_bins=c.n_bins, tokenizer="noop", possible_values=list(c.possible_values))
        out[c.name] = {"type": c.kind, c.kind: args}
    return out


@dataclass(frozen=True)
class LMConfig:
    """Temporal transformer + depformer shapes. Defaults: Moshi 7B."""

    dim: int = 4096
    text_card: int = 32000
    existing_text_padding_id: int = TEXT_PAD
    existing_text_end_padding_id: int = TEXT_EPAD
    n_q: int = 16  # audio streams in the temporal input (agent + user)
    dep_q: int = 8  # depformer steps: 8 for Moshi, 16 for PersonaPlex
    card: int = 2048
    num_heads: int = 32
    num_layers: int = 32
    hidden_scale: float = 4.125
    causal: bool = True
    layer_scale: float | None = None
    context: int = 3000
    max_period: float = 10000.0
    gating: str = "silu"
    norm: str = "rms_norm_f32"
    positional_embedding: str = "rope"
    depformer_dim: int = 1024
    depformer_dim_feedforward: int = int(4.125 * 1024)
    depformer_num_heads: int = 16
    depformer_num_layers: int = 6
    depformer_layer_scale: float | None = None
    depformer_multi_linear: bool = True
    depformer_context: int = 8
    depformer_max_period: float = 10000.0
    depformer_gating: str = "silu"
    depformer_pos_emb: str = "none"
    depformer_weights_per_step: bool = True
    depformer_weights_per_step_schedule: tuple[int, ...] | None = None
    # Norm applied to the depformer's output before each step's `linears[k]` (Hibiki), None: none.
    depformer_norm: str | None = None
    # Grouped KV heads: num_heads / kv_repeat key-value heads, each shared by kv_repeat query heads.
    # The reference passes kv_repeat to the depformer too unless depformer_kv_repeat says otherwise.
    kv_repeat: int = 1
    depformer_kv_repeat: int | None = None
    # Conditioners whose outputs are summed into every temporal input (config.json's
    # `conditioners` with `fuser.sum`; Hibiki's `description`). Only the `sum` fuser is served.
    conditioners: tuple[ConditionerConfig, ...] = ()
    fuse_sum: tuple[str, ...] = ()
    delays: tuple[int, ...] = (0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1)
    # Extra linear heads on the normalised hidden state (Kyutai STT: end-of-turn / pause
    # prediction, see models/stt.py); dep_q 0 means no depformer at all (an STT model).
    extra_heads_num_heads: int = 0
    extra_heads_dim: int = 6

    def __post_init__(self) -> None:
        if len(self.delays) != self.n_q + 1:
            raise ConfigError(f"delays has {len(self.delays)} entries, expected n_q + 1 = {self.n_q + 1}")
        if self.dim % self.num_heads:
            raise ConfigError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.depformer_dim % self.depformer_num_heads:
            raise ConfigError(
                f"depformer_dim {self.depformer_dim} is not divisible by depformer_num_heads {self.depformer_num_heads}")
        if self.dep_q > self.n_q:
            raise ConfigError(f"dep_q {self.dep_q} exceeds n_q {self.n_q}")
        for name, heads, repeat in (("kv_repeat", self.num_heads, self.kv_repeat),
                                    ("depformer_kv_repeat", self.depformer_num_heads, self.depformer_repeat)):
            if repeat < 1 or heads % repeat:
                raise ConfigError(f"{name} {repeat} does not divide the {heads} heads")
        if self.depformer_weights_per_step_schedule is not None and (
                len(self.depformer_weights_per_step_schedule) != self.dep_q):
            raise ConfigError(f"depformer_weights_per_step_schedule has "
                              f"{len(self.depformer_weights_per_step_schedule)} entries, expected dep_q = {self.dep_q}")
        unknown = [n for n in self.fuse_sum if n not in {c.name for c in self.conditioners}]
        if unknown:
            raise ConfigError(f"fuser.sum names unknown conditioner(s) {unknown}")
        if any(c.kind != "lut" for c in self.conditioners):
            raise ConfigError("only LUT conditioners (text descriptions) are supported on a duplex LM")

    @property
    def depformer_repeat(self) -> int:
        """The depformer's kv_repeat (the temporal one unless depformer_kv_repeat is given)."""
        return self.kv_repeat if self.depformer_kv_repeat is None else self.depformer_kv_repeat

    @property
    def num_codebooks(self) -> int:
        """Streams in the token ring: text + n_q audio."""
        return self.n_q + 1

    @property
    def n_agent(self) -> int:
        """Agent audio codebooks (the first half of the audio streams)."""
        return self.n_q // 2

    @property
    def n_user(self) -> int:
        """User audio codebooks fed from Mimi-encoded input."""
        return self.n_q - self.n_agent

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def teacher_forced_user(self) -> bool:
        """PersonaPlex: the depformer also covers the user codebooks, which are forced."""
        return self.dep_q > self.n_agent

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "LMConfig":
        """Build from a reference-style config.json dict (file-name keys are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"conditioners", "fuse_sum"}
        kwargs: dict[str, Any] = _conditioning(raw)
        for key, value in raw.items():
            if key in NON_LM_KEYS or key in ("depformer_causal", "conditioners", "fuser"):
                continue
            if key not in known:
                # Extra reference kwargs that do not change inference shapes are tolerated
                # only when they hold their neutral value.
                if value in (None, False, 0, [], {}):
                    continue
                raise ConfigError(f"config.json: unsupported LM option {key!r} = {value!r}")
            if isinstance(value, list):
                value = tuple(value)
            kwargs[key] = value
        return cls(**kwargs)


def _conditioning(raw: dict[str, Any]) -> dict[str, Any]:
    """LMConfig's `conditioners` and `fuse_sum` from config.json's `conditioners` and `fuser`."""
    if not raw.get("conditioners"):
        return {}
    fuser = dict(raw.get("fuser") or {})
    for method in ("cross", "prepend"):
        if fuser.get(method):
            raise ConfigError(f"fuser.{method} is not supported for a duplex LM (only fuser.sum)")
    return {"conditioners": parse_conditioners(raw), "fuse_sum": tuple(fuser.get("sum", ()))}


# config.json's lm_gen_config keys (the reference's names) -> SamplingDefaults fields.
LM_GEN_CONFIG_KEYS = {"temp_text": "text_temperature", "top_k_text": "text_top_k",
                      "temp": "audio_temperature", "top_k": "audio_top_k"}


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling a session gets unless it asks for other: the reference LMGen's defaults,
    or a checkpoint's `lm_gen_config`. The one source of these numbers; temperature 0 is greedy."""

    text_temperature: float = 0.7
    text_top_k: int = 25
    audio_temperature: float = 0.8
    audio_top_k: int = 250

    @classmethod
    def from_lm_gen_config(cls, raw: dict[str, Any]) -> "SamplingDefaults":
        """Read config.json's `lm_gen_config`: keys it lacks keep the reference defaults,
        keys that are not sampling settings are ignored (as the reference loader does)."""
        values = {}
        for key, name in LM_GEN_CONFIG_KEYS.items():
            if key not in raw:
                continue
            value, integer = raw[key], name.endswith("top_k")
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
                raise ConfigError(f"lm_gen_config: {key} must be {'a whole number' if integer else 'a number'}, "
                                  f"got {value!r}")
            values[name] = value
        return cls(**values)

    def to_lm_gen_config(self) -> dict[str, Any]:
        """The `lm_gen_config` object a checkpoint's config.json would hold for these settings."""
        return {key: getattr(self, name) for key, name in LM_GEN_CONFIG_KEYS.items()}


@dataclass(frozen=True)
class SEANetConfig:
    channels: int = 1
    dimension: int = 512
    causal: bool = True
    n_filters: int = 64
    n_residual_layers: int = 1
    activation: str = "ELU"
    compress: int = 2
    dilation_base: int = 2
    disable_norm_outer_blocks: int = 0
    kernel_size: int = 7
    residual_kernel_size: int = 3
    last_kernel_size: int = 3
    norm: str = "none"
    pad_mode: str = "constant"
    ratios: tuple[int, ...] = (8, 6, 5, 4)
    true_skip: bool = True


@dataclass(frozen=True)
class QuantizerConfig:
    dimension: int = 256
    n_q: int = 32
    bins: int = 2048
    input_dimension: int = 512
    output_dimension: int = 512
    n_q_semantic: int = 1


@dataclass(frozen=True)
class MimiTransformerConfig:
    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 8
    causal: bool = True
    layer_scale: float | None = 0.01
    context: int = 250
    conv_layout: bool = True
    max_period: float = 10000.0
    gating: str = "none"
    norm: str = "layer_norm"
    positional_embedding: str = "rope"
    dim_feedforward: int = 2048
    input_dimension: int = 512
    output_dimensions: tuple[int, ...] = (512,)


@dataclass(frozen=True)
class MimiConfig:
    """Mimi codec shapes. Defaults: the published Mimi."""

    sample_rate: int = SAMPLE_RATE
    channels: int = 1
    frame_rate: float = FRAME_RATE
    seanet: SEANetConfig = field(default_factory=SEANetConfig)
    quantizer: QuantizerConfig = field(default_factory=QuantizerConfig)
    transformer: MimiTransformerConfig = field(default_factory=MimiTransformerConfig)
    num_codebooks: int = 8  # codebooks actually used (the LM's n_q / 2 for Moshi)

    @property
    def frame_size(self) -> int:
        return int(self.sample_rate / self.frame_rate)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], num_codebooks: int = 8) -> "MimiConfig":
        """Build from the reference's mimi config dict layout ({seanet, quantizer, transformer, ...})."""

        def sub(kind: type, data: dict[str, Any]) -> Any:
            known = {f.name for f in dataclasses.fields(kind)}
            unknown = set(data) - known
            if unknown:
                raise ConfigError(f"mimi config: unsupported {kind.__name__} option(s) {sorted(unknown)}")
            return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

        return cls(
            sample_rate=raw.get("sample_rate", SAMPLE_RATE),
            channels=raw.get("channels", 1),
            frame_rate=raw.get("frame_rate", FRAME_RATE),
            seanet=sub(SEANetConfig, raw.get("seanet", {})),
            quantizer=sub(QuantizerConfig, raw.get("quantizer", {})),
            transformer=sub(MimiTransformerConfig, raw.get("transformer", {})),
            num_codebooks=num_codebooks,
        )


def tiny_lm_config(dep_q: int = 8, card: int = 2048) -> LMConfig:
    """A few-megabyte LM with Moshi's structure, for CPU tests."""
    return LMConfig(
        dim=64, text_card=200, num_heads=4, num_layers=2, hidden_scale=4.125, context=40,
        dep_q=dep_q, card=card,
        depformer_dim=32, depformer_dim_feedforward=int(4.125 * 32), depformer_num_heads=2,
        depformer_num_layers=2,
    )


def tiny_mimi_config(num_codebooks: int = 8, levels: int | None = None) -> MimiConfig:
    """A small Mimi with the real hop (1920 samples per frame), for CPU tests. `levels`: codebooks
    in the weights (default `num_codebooks`; the real Mimi has 32 and Moshi uses 8)."""
    return MimiConfig(
        seanet=SEANetConfig(dimension=32, n_filters=4),
        quantizer=QuantizerConfig(dimension=16, n_q=levels or num_codebooks, bins=2048,
                                  input_dimension=32, output_dimension=32),
        transformer=MimiTransformerConfig(d_model=32, num_heads=2, num_layers=2, context=20,
                                          dim_feedforward=64, input_dimension=32,
                                          output_dimensions=(32,)),
        num_codebooks=num_codebooks,
    )
