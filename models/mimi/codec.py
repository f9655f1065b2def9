"""`Mimi`: the streaming audio codec, 1920 samples <-> `num_codebooks` codes per row and frame.

Encode:  pcm [B, 1920] -> SEANet encoder (hop 960: 2 latent steps at 25 Hz)
         -> encoder transformer -> learnt stride-2 conv (1 step at 12.5 Hz) -> split RVQ codes.
Decode:  codes -> RVQ centroids -> learnt stride-2 transposed conv (2 steps at 25 Hz)
         -> decoder transformer -> SEANet decoder -> pcm [B, 1920].

Parameter names and shapes equal the published `tokenizer-e351c8d8-checkpoint125.safetensors`,
which loads with `load_state_dict(strict=True)`: the reference `MimiModel`'s (moshi 0.2.13)
names, except that the attention projections are the file's `self_attn.in_proj_weight` /
`self_attn.out_proj.weight` (the reference renames those to `in_projs.0.weight` /
`out_projs.0.weight` in memory; `load_state_dict` accepts that naming too, see `model_key`).
The transformers are the shared `models.transformer.StreamingTransformer`.
Streaming results equal the reference's streaming mode: identical codes, decoded audio equal
up to float rounding.

Per-row state contract (docs/architecture.md): `init_state` allocates every buffer once;
`encode_step` / `decode_step` compute on every row with fixed shapes and commit state only
for rows whose `exec_mask` is True; `state.reset(mask)` returns rows to the fresh state.
No step reads a device value back to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from parley.models.config import ConfigError, MimiConfig, MimiTransformerConfig
from parley.models.mimi.conv import ConvDownsample1d, ConvState, ConvTrState, ConvTrUpsample1d, RowState, StateList
from parley.models.mimi.quantizer import LEGACY_CODEBOOK_KEYS, SplitResidualVectorQuantizer
from parley.models.mimi.seanet import SEANetDecoder, SEANetEncoder
from parley.models.transformer import StreamingTransformer, TransformerState

# The reference model's in-memory names of the attention projections (`self_attn.<old>`),
# mapped to the published file's names, which are ours (`self_attn.<new>`).
REFERENCE_ATTENTION_KEYS = {
    "in_projs.0.weight": "in_proj_weight",
    "out_projs.0.weight": "out_proj.weight",
}


def model_key(key: str) -> str:
    """The `Mimi.state_dict()` name of a tensor stored under `key` in a Mimi state dict or file.

    Our names are the published file's. This maps the other namings `load_state_dict` also
    accepts: the reference model's in-memory attention names (`self_attn.in_projs.0.weight`,
    `self_attn.out_projs.0.weight`) and older files' codebook buffer names.
    """
    head, _, leaf = key.rpartition(".")
    if head.endswith("._codebook") and leaf in LEGACY_CODEBOOK_KEYS:
        return f"{head}.{LEGACY_CODEBOOK_KEYS[leaf]}"
    for old, new in REFERENCE_ATTENTION_KEYS.items():
        if key.endswith(".self_attn." + old):
            return key[: -len(old)] + new
    return key


def _check_supported(cfg: MimiTransformerConfig) -> None:
    unsupported = []
    if not cfg.causal:
        unsupported.append("causal must be True")
    if cfg.norm != "layer_norm":
        unsupported.append(f"norm must be 'layer_norm', got {cfg.norm!r}")
    if cfg.gating != "none":
        unsupported.append(f"gating must be 'none', got {cfg.gating!r}")
    if cfg.positional_embedding != "rope":
        unsupported.append(f"positional_embedding must be 'rope', got {cfg.positional_embedding!r}")
    if not cfg.conv_layout:
        unsupported.append("conv_layout must be True")
    if cfg.context is None or cfg.context < 1:
        unsupported.append("context must be a positive number of steps")
    if cfg.d_model % cfg.num_heads:
        unsupported.append(f"d_model {cfg.d_model} must be divisible by num_heads {cfg.num_heads}")
    if unsupported:
        raise ConfigError("mimi transformer: " + "; ".join(unsupported))


class ProjectedTransformer(nn.Module):
    """The reference `ProjectedTransformer` in conv layout: [B, input_dimension, T] ->
    [B, output_dimensions[0], T] through the shared streaming transformer (pre-norm LayerNorm,
    plain GELU FFN, LayerScale, RoPE, attention over the last `context` steps).

    Keys: `transformer.layers.{i}...`, plus `input_proj.weight` / `output_projs.{k}.weight` only
    where a dimension differs from d_model. Mimi uses only the first output; the others are
    kept for checkpoint compatibility.
    """

    def __init__(self, cfg: MimiTransformerConfig):
        super().__init__()
        _check_supported(cfg)
        self.context = cfg.context
        self.transformer = StreamingTransformer(
            cfg.d_model, cfg.num_heads, cfg.num_layers, cfg.dim_feedforward, causal=True,
            context=cfg.context, norm=cfg.norm, gating=cfg.gating, layer_scale=cfg.layer_scale,
            positional_embedding=cfg.positional_embedding, max_period=cfg.max_period)
        self.input_proj = (nn.Linear(cfg.input_dimension, cfg.d_model, bias=False)
                           if cfg.input_dimension != cfg.d_model else None)
        self.output_projs = nn.ModuleList([
            nn.Identity() if dim == cfg.d_model else nn.Linear(cfg.d_model, dim, bias=False)
            for dim in cfg.output_dimensions
        ])
        self._register_load_state_dict_pre_hook(self._reference_names)

    @staticmethod
    def _reference_names(state_dict, prefix, *_) -> None:
        """Accept the reference model's in-memory attention names (as its own load hook does
        the other way round)."""
        for key in [k for k in state_dict if k.startswith(prefix)]:
            renamed = model_key(key)
            if renamed != key:
                state_dict[renamed] = state_dict.pop(key)

    def init_state(self, batch_size: int, device: torch.device | str) -> TransformerState:
        return self.transformer.init_state(batch_size, device)

    def step(self, x: Tensor, state: TransformerState, exec_mask: Tensor) -> Tensor:
        if x.shape[-1] > self.context:
            raise ValueError(f"chunk of {x.shape[-1]} steps exceeds the attention context {self.context}")
        x = x.transpose(1, 2)
        if self.input_proj is not None:
            x = self.input_proj(x)
        x = self.transformer(x, state, exec_mask)
        return self.output_projs[0](x).transpose(1, 2)


@dataclass
class MimiEncoderState(RowState):
    seanet: StateList
    transformer: TransformerState
    downsample: ConvState

    def reset(self, mask: Tensor) -> None:
        self.seanet.reset(mask)
        self.transformer.reset(mask)
        self.downsample.reset(mask)


@dataclass
class MimiDecoderState(RowState):
    upsample: ConvTrState
    transformer: TransformerState
    seanet: StateList

    def reset(self, mask: Tensor) -> None:
        self.upsample.reset(mask)
        self.transformer.reset(mask)
        self.seanet.reset(mask)


@dataclass
class MimiState(RowState):
    """Encoder and decoder states are independent: a row's input and output streams can be
    reset separately (`state.encoder.reset(mask)`, `state.decoder.reset(mask)`)."""

    encoder: MimiEncoderState
    decoder: MimiDecoderState

    def reset(self, mask: Tensor) -> None:
        self.encoder.reset(mask)
        self.decoder.reset(mask)


class Mimi(nn.Module):
    """Mimi codec with batched per-row streaming. Loaded in fp32 (the reference's precision);
    `compute_in(torch.bfloat16)` runs its convs and transformers in bf16 (faster at many rows,
    benchmarks/mimi_steps.py) within the tolerance `tests/test_mimi.py` states. Either way the steps take and return fp32 pcm."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        if cfg.seanet.dimension != cfg.quantizer.input_dimension:
            raise ConfigError("quantizer.input_dimension must equal seanet.dimension")
        if cfg.seanet.channels != cfg.channels or cfg.channels != 1:
            raise ConfigError("only mono Mimi (channels = 1) is supported")
        self.cfg = cfg
        self.frame_size = cfg.frame_size  # 1920 for 24 kHz at 12.5 Hz
        hop = math.prod(cfg.seanet.ratios)  # 960: SEANet latent rate 25 Hz
        if self.frame_size % hop:
            raise ConfigError(f"frame size {self.frame_size} is not a multiple of the SEANet hop {hop}")
        # Latent steps the learnt conv merges into one frame (25 Hz -> 12.5 Hz: 2).
        self.resample_stride = self.frame_size // hop
        dim = cfg.seanet.dimension

        # Registration order follows the reference so state_dict() lists keys in its order.
        self.encoder = SEANetEncoder(cfg.seanet)
        self.decoder = SEANetDecoder(cfg.seanet)
        self.encoder_transformer = ProjectedTransformer(cfg.transformer)
        self.decoder_transformer = ProjectedTransformer(cfg.transformer)
        self.quantizer = SplitResidualVectorQuantizer(cfg.quantizer, cfg.num_codebooks)
        self.downsample = ConvDownsample1d(self.resample_stride, dim)
        self.upsample = ConvTrUpsample1d(self.resample_stride, dim)
        self.eval()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype Mimi computes in (its convs' and transformers' weights')."""
        return self.encoder.model[0].torch_conv.weight.dtype

    def compute_in(self, dtype: torch.dtype) -> "Mimi":
        """Cast every weight but the quantizer's to `dtype`; states made after this follow it.
        The quantizer stays fp32: residual levels pick the nearest of 2048 centroids for ever
        smaller residuals, where bf16's rounding would flip many codes."""
        for name, child in self.named_children():
            if name != "quantizer":
                child.to(dtype)
        return self

    @property
    def num_codebooks(self) -> int:
        return self.quantizer.num_codebooks

    @property
    def cardinality(self) -> int:
        return self.quantizer.bins

    # ------------------------------------------------------------------ streaming

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> MimiState:
        """Fresh per-row state for `batch_size` rows, on `device` (default: the weights' device)."""
        if device is None:
            device = next(self.parameters()).device
        encoder = MimiEncoderState(
            seanet=self.encoder.init_state(batch_size, device),
            transformer=self.encoder_transformer.init_state(batch_size, device),
            downsample=self.downsample.init_state(batch_size, device),
        )
        decoder = MimiDecoderState(
            upsample=self.upsample.init_state(batch_size, device),
            transformer=self.decoder_transformer.init_state(batch_size, device),
            seanet=self.decoder.init_state(batch_size, device),
        )
        return MimiState(encoder, decoder)

    @torch.no_grad()
    def encode_step(self, pcm: Tensor, state: MimiState, exec_mask: Tensor,
                    num_codebooks: int | None = None) -> Tensor:
        """pcm [B, frame_size] float -> codes [B, num_codebooks] int64, one frame per row
        (`num_codebooks` overrides the configured count, up to `quantizer.levels`)."""
        return self.quantize(self.encode_latent_step(pcm, state, exec_mask), num_codebooks)

    @torch.no_grad()
    def encode_latent_step(self, pcm: Tensor, state: MimiState, exec_mask: Tensor) -> Tensor:
        """The first half of `encode_step`: pcm [B, frame_size] -> the latent [B, dim, 1] it quantizes."""
        if pcm.dim() != 2 or pcm.shape[-1] != self.frame_size:
            raise ValueError(f"encode_step takes pcm of shape [B, {self.frame_size}], got {tuple(pcm.shape)}")
        enc = state.encoder
        latent = self.encoder.step(pcm[:, None, :].to(self.dtype), enc.seanet, exec_mask)
        latent = self.encoder_transformer.step(latent, enc.transformer, exec_mask)
        return self.downsample.step(latent, enc.downsample, exec_mask)

    def quantize(self, latent: Tensor, num_codebooks: int | None = None) -> Tensor:
        """The second half: latent [B, dim, 1] -> codes [B, num_codebooks] int64. Residual quantization
        is sequential, so quantizing the same latent to more codebooks leaves the first ones as they are."""
        return self.quantizer.encode(latent.float(), num_codebooks)[:, :, 0]

    @torch.no_grad()
    def decode_step(self, codes: Tensor, state: MimiState, exec_mask: Tensor) -> Tensor:
        """codes [B, num_codebooks] int64 -> pcm [B, frame_size] float32, one frame per row.

        Codes must lie in [0, cardinality): they are not checked, to avoid a host sync.
        """
        if codes.dim() != 2 or codes.shape[-1] != self.num_codebooks:
            raise ValueError(f"decode_step takes codes of shape [B, {self.num_codebooks}], got {tuple(codes.shape)}")
        dec = state.decoder
        latent = self.quantizer.decode(codes[:, :, None]).to(self.dtype)
        latent = self.upsample.step(latent, dec.upsample, exec_mask)
        latent = self.decoder_transformer.step(latent, dec.transformer, exec_mask)
        return self.decoder.step(latent, dec.seanet, exec_mask)[:, 0, :].float()

    # ------------------------------------------------------------------ whole signals

    @torch.no_grad()
    def encode(self, pcm: Tensor) -> Tensor:
        """pcm [B, T] -> codes [B, num_codebooks, ceil(T / frame_size)], from a fresh state.

        The signal is zero-padded at the end to whole frames, like the reference.
        """
        batch, length = pcm.shape
        frames = max(1, -(-length // self.frame_size))
        pcm = F.pad(pcm, (0, frames * self.frame_size - length))
        state = self.init_state(batch, pcm.device)
        run = torch.ones(batch, dtype=torch.bool, device=pcm.device)
        codes = [self.encode_step(chunk, state, run) for chunk in pcm.split(self.frame_size, dim=-1)]
        return torch.stack(codes, dim=-1)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, num_codebooks, F] -> pcm [B, F * frame_size], from a fresh state."""
        batch = codes.shape[0]
        state = self.init_state(batch, codes.device)
        run = torch.ones(batch, dtype=torch.bool, device=codes.device)
        frames = [self.decode_step(codes[:, :, i], state, run) for i in range(codes.shape[-1])]
        return torch.cat(frames, dim=-1)
