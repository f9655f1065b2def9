"""Kyutai DSM TTS (`kyutai/tts-1.6b-en_fr` layout) on Parley's own transformer, sampler and Mimi.

    cfg = TtsConfig.from_dict(config_json)          # LM shapes + TTS keys (ConfigError on anything odd)
    lm = TtsLM(cfg)                                 # state dict = the published file's keys
    gen = TtsGen(lm, batch, max_entries, max_tokens)
    gen.start(row, entries, voice_embeddings, cfg_value="2.0", padding_bonus=0.0)   # host, at admission
    out = gen.step(active[B], full=True)            # one frame for every active row; no host sync
    out.frame [B, 1 + n_q] (de-delayed tokens), out.valid [B], gen.dsm.word_step / end_step
    gen.leading_rows(n).step(active[:n])            # the same step over rows [0, n) only (a row bucket)

What differs from the duplex LM (models/lm.py), all from config.json:
- every audio stream is generated (n_q = dep_q), text leads audio by `audio_delay` (16 frames);
- the text input is two muxed streams, `(second + 1) * (text_card + 1) + main`, embedded as
  `out1(E[main]) + out2(E[second])` (`demux_second_stream`); the second stream carries the words
  `second_stream_ahead` ahead (models/dsm.py decides what is fed);
- depformer token embeddings are low rank (`depformer_low_rank_embeddings`: E [card + 1, r] then
  a [dim, r] projection), and depformer weights follow `depformer_weights_per_step_schedule`;
- conditioners (kept in fp32, as the reference loader does): `sum` ones (LUTs: `control`, `cfg`)
  add one vector to every step's input; `cross` ones (`speaker_wavs`, a tensor conditioner) give
  the cross-attention source, with sinusoidal positions, attended by every backbone layer;
- a padding bonus (the speed knob) is added to the PAD logit before text sampling.

The per-frame loop equals moshi 0.2.13 `TTSModel.generate` (see tests/test_tts_model.py), made
per row: each row has its own offset, script, conditions and cross keys, so rows start and end
independently. A step is `full` when the depformer runs; rows still inside the audio delay get
their audio forced to -1 either way, so a text-only step (no depformer) is exact for them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from .config import UNGENERATED_TOKEN, ZERO_TOKEN, ConditionerConfig, ConfigError, LMConfig, parse_conditioners
from .dsm import DsmRows, DsmTokens, WordEntry
from .host_rows import copy_from_host
from .conditioning import ConditionProvider, Embedding
from .lm import ZeroEmbedding
from .lm_gen import ring_inputs
from .row_views import leading_rows
from .sampling import sample_tokens
from .transformer import StreamingTransformer, TransformerState, make_norm

VOICE_KEY = "speaker_wavs"  # the tensor a voice file holds, [1, dim, frames]
TTS_KEYS = ("text_card_out", "demux_second_stream", "depformer_low_rank_embeddings", "cross_attention",
            "conditioners", "fuser")
FRAME_RATE = 12.5


@dataclass(frozen=True)
class TtsConfig:
    lm: LMConfig
    text_card_out: int
    demux_second_stream: bool
    low_rank: int | None
    cross_attention: bool
    conditioners: tuple[ConditionerConfig, ...]
    fuse_sum: tuple[str, ...]
    fuse_cross: tuple[str, ...]
    cross_pos_emb: bool
    cross_pos_emb_scale: float
    audio_delay_frames: int
    second_stream_ahead: int
    voice_suffix: str  # ".<sig>@<epoch>.safetensors": voice files made for this model

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TtsConfig":
        tts = raw.get("tts_config")
        if not isinstance(tts, dict) or "audio_delay" not in tts:
            raise ConfigError("config.json has no tts_config.audio_delay: not a DSM TTS checkpoint")
        if tts.get("multistream"):
            raise ConfigError("tts_config.multistream (dialogue TTS) is not supported")
        lm = LMConfig.from_dict({k: v for k, v in raw.items() if k not in TTS_KEYS})
        if lm.dep_q != lm.n_q:
            raise ConfigError(f"dep_q {lm.dep_q} must equal n_q {lm.n_q} for a TTS model (no input audio)")
        conditioners = parse_conditioners(raw)
        fuser = dict(raw.get("fuser") or {})
        if fuser.get("prepend"):
            raise ConfigError("fuser.prepend is not supported")
        names = {c.name for c in conditioners}
        fuse_sum, fuse_cross = tuple(fuser.get("sum", ())), tuple(fuser.get("cross", ()))
        unknown = [n for n in (*fuse_sum, *fuse_cross) if n not in names]
        if unknown:
            raise ConfigError(f"fuser names unknown conditioner(s) {unknown}")
        if bool(fuse_cross) != bool(raw.get("cross_attention", False)):
            raise ConfigError("cross_attention and fuser.cross must be given together")
        if fuse_cross and [c.kind for c in conditioners if c.name in fuse_cross] != ["tensor"]:
            raise ConfigError("fuser.cross must name exactly one tensor conditioner (the speaker voice)")
        model_id = raw.get("model_id") or {}
        suffix = f".{model_id['sig']}@{model_id['epoch']}.safetensors" if "sig" in model_id else ".safetensors"
        return cls(
            lm=lm, text_card_out=int(raw.get("text_card_out") or lm.text_card),
            demux_second_stream=bool(raw.get("demux_second_stream", False)),
            low_rank=raw.get("depformer_low_rank_embeddings"), cross_attention=bool(raw.get("cross_attention")),
            conditioners=tuple(conditioners), fuse_sum=fuse_sum, fuse_cross=fuse_cross,
            cross_pos_emb=bool(fuser.get("cross_attention_pos_emb", False)),
            cross_pos_emb_scale=float(fuser.get("cross_attention_pos_emb_scale", 1.0)),
            audio_delay_frames=round(float(tts["audio_delay"]) * FRAME_RATE),
            second_stream_ahead=int(tts.get("second_stream_ahead", 0)), voice_suffix=suffix)

    @property
    def speaker(self) -> ConditionerConfig | None:
        return next((c for c in self.conditioners if c.name in self.fuse_cross), None)

    def lut_values(self, name: str) -> tuple[str, ...]:
        return next(c.possible_values for c in self.conditioners if c.name == name)


# ---------------------------------------------------------------------------------------------
# Embeddings


class DemuxEmbedding(nn.Module):
    """Two text streams in one id: `(second + 1) * num_embeddings + main`, -1 embeds to zero.
    `weight` [n, r]; `out1` / `out2` [dim, r] project main and second; `low_rank` (present in
    the published depformer file, unused by the demux path) is kept for the key layout."""

    def __init__(self, num_embeddings: int, dim: int, low_rank: int | None, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        rank = low_rank or dim
        self.num_embeddings = num_embeddings
        self.weight = nn.Parameter(torch.empty(num_embeddings, rank, **factory))
        if low_rank is not None:
            self.low_rank = nn.Linear(low_rank, dim, bias=False, **factory)
        self.out1 = nn.Linear(rank, dim, bias=False, **factory)
        self.out2 = nn.Linear(rank, dim, bias=False, **factory)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        is_zero = (tokens == ZERO_TOKEN)[..., None]
        tokens = tokens.clamp(min=0)
        main = tokens % self.num_embeddings
        second = tokens // self.num_embeddings - 1
        zero = torch.zeros((), dtype=self.weight.dtype, device=tokens.device)
        y = self.out1(self.weight[main])
        y = y + torch.where((second < 0)[..., None], zero, self.out2(self.weight[second.clamp(min=0)]))
        return torch.where(is_zero, zero, y)


class LowRankEmbedding(nn.Module):
    """E [n, r] then a [dim, r] projection; -1 embeds to zero, other negatives read row 0."""

    def __init__(self, num_embeddings: int, dim: int, rank: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, rank, device=device, dtype=dtype))
        self.low_rank = nn.Linear(rank, dim, bias=False, device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y = self.weight[tokens.clamp(min=0)]
        y = torch.where((tokens == ZERO_TOKEN)[..., None], torch.zeros((), dtype=y.dtype, device=y.device), y)
        return self.low_rank(y)


def _embedding(num: int, dim: int, demux: bool, low_rank: int | None, factory: dict) -> nn.Module:
    if demux:
        return DemuxEmbedding(num, dim, low_rank, **factory)
    if low_rank is not None:
        return LowRankEmbedding(num, dim, low_rank, **factory)
    return ZeroEmbedding(num, dim, **factory)


# ---------------------------------------------------------------------------------------------
# The cross-attention source's positions


def sinusoids(length: int, dim: int, max_period: float = 10_000.0, device=None) -> torch.Tensor:
    """[1, length, dim] fp32: cos then sin of position / max_period ** (i / (dim / 2 - 1))."""
    half = dim // 2
    positions = torch.arange(length, device=device).view(1, -1, 1).float()
    freqs = torch.arange(half, device=device, dtype=torch.float32).view(1, 1, -1)
    phase = positions / (torch.full([], max_period, device=device) ** (freqs / (half - 1)))
    return torch.cat([torch.cos(phase), torch.sin(phase)], dim=-1)


# ---------------------------------------------------------------------------------------------
# The model


class TtsLM(nn.Module):
    def __init__(self, cfg: TtsConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        lm = cfg.lm
        factory = {"device": device, "dtype": dtype}
        self.emb = nn.ModuleList([ZeroEmbedding(lm.card + 1, lm.dim, **factory) for _ in range(lm.n_q)])
        self.text_emb = _embedding(lm.text_card + 1, lm.dim, cfg.demux_second_stream, None, factory)
        self.transformer = StreamingTransformer(
            lm.dim, lm.num_heads, lm.num_layers, int(lm.hidden_scale * lm.dim), causal=lm.causal,
            context=lm.context, norm=lm.norm, gating=lm.gating, layer_scale=lm.layer_scale,
            positional_embedding=lm.positional_embedding, max_period=lm.max_period,
            cross_attention=cfg.cross_attention, **factory)
        self.out_norm = make_norm(lm.norm, lm.dim, **factory)
        self.text_linear = nn.Linear(lm.dim, cfg.text_card_out, bias=False, **factory)
        schedule = lm.depformer_weights_per_step_schedule
        num_in = (max(schedule) + 1 if schedule else lm.dep_q) if lm.depformer_multi_linear else 1
        ddim = lm.depformer_dim
        self.depformer_in = nn.ModuleList([nn.Linear(lm.dim, ddim, bias=False, **factory) for _ in range(num_in)])
        self.depformer_emb = nn.ModuleList(
            [_embedding(lm.card + 1, ddim, False, cfg.low_rank, factory) for _ in range(lm.dep_q - 1)])
        self.depformer_text_emb = _embedding(lm.text_card + 1, ddim, cfg.demux_second_stream, cfg.low_rank,
                                             factory)
        self.depformer = StreamingTransformer(
            ddim, lm.depformer_num_heads, lm.depformer_num_layers, lm.depformer_dim_feedforward,
            causal=lm.causal, context=None, capacity=lm.dep_q, norm=lm.norm, gating=lm.depformer_gating,
            layer_scale=lm.depformer_layer_scale, positional_embedding=lm.depformer_pos_emb,
            max_period=lm.depformer_max_period, weights_per_step=lm.dep_q if lm.depformer_weights_per_step else 0,
            weights_per_step_schedule=schedule, **factory)
        self.linears = nn.ModuleList([nn.Linear(ddim, lm.card, bias=False, **factory) for _ in range(lm.dep_q)])
        self.condition_provider = ConditionProvider(cfg.conditioners, lm.dim, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.text_linear.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [..., n_q + 1] (text first) -> the summed input: audio streams, then text."""
        x = self.emb[0](tokens[..., 1])
        for k in range(1, self.cfg.lm.n_q):
            x = x + self.emb[k](tokens[..., k + 1])
        return x + self.text_emb(tokens[..., 0])

    def condition_sum(self, values: dict[str, str | None]) -> torch.Tensor:
        """The `sum` conditions (e.g. {"control": "ok", "cfg": "2.0"}) -> [dim] in the model dtype."""
        total = self.condition_provider.sum_of(self.cfg.fuse_sum, values)
        if total is None:
            return torch.zeros(self.cfg.lm.dim, dtype=self.dtype, device=self.text_linear.weight.device)
        return total[0, 0].to(self.dtype)

    def cross_source(self, voices: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """voices [1, S, dim_in] fp32, mask [1, S] -> the cross-attention source [1, S, dim]."""
        spec = self.cfg.speaker
        cond = self.condition_provider.conditioners[spec.name](voices, mask)
        if self.cfg.cross_pos_emb:
            cond = cond + self.cfg.cross_pos_emb_scale * sinusoids(cond.shape[1], cond.shape[-1], device=cond.device)
        return cond.to(self.dtype)

    def temporal(self, x: torch.Tensor, state: TransformerState, exec_mask: torch.Tensor,
                 cross_kv: list[tuple[torch.Tensor, torch.Tensor]] | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.out_norm(self.transformer(x, state, exec_mask, cross_kv=cross_kv))
        return hidden, self.text_linear(hidden)

    def depformer_logits(self, k: int, hidden: torch.Tensor, prev: torch.Tensor,
                         state: TransformerState) -> torch.Tensor:
        lm = self.cfg.lm
        index = k
        if lm.depformer_weights_per_step_schedule is not None:
            index = lm.depformer_weights_per_step_schedule[k]
        x = self.depformer_in[index if lm.depformer_multi_linear else 0](hidden)
        x = x + (self.depformer_text_emb(prev) if k == 0 else self.depformer_emb[k - 1](prev))
        out = self.depformer(x[:, None], state, step=k)
        return self.linears[k](out[:, 0])


# ---------------------------------------------------------------------------------------------
# Voices


MAX_SPEAKERS = 5  # cross-attention slots of the published model; unused slots read learnt padding


def speaker_inputs(voices: Sequence[torch.Tensor], frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Voice embeddings (each [1, dim, frames], a voice file's `speaker_wavs`) -> the speaker
    conditioner's input [1, MAX_SPEAKERS * frames, dim] and mask [1, MAX_SPEAKERS * frames]."""
    if not 1 <= len(voices) <= MAX_SPEAKERS:
        raise ValueError(f"{len(voices)} voices: between 1 and {MAX_SPEAKERS}")
    dim = voices[0].shape[1]
    x = torch.zeros(1, MAX_SPEAKERS, frames, dim)
    mask = torch.zeros(1, MAX_SPEAKERS, frames, dtype=torch.bool)
    for i, voice in enumerate(voices):
        x[0, i] = voice[0].transpose(0, 1).float()
        mask[0, i] = True
    return x.view(1, -1, dim), mask.view(1, -1)


# ---------------------------------------------------------------------------------------------
# Generation, per row


@dataclass
class TtsStepOutput:
    frame: torch.Tensor  # [B, 1 + n_q] long: de-delayed text + audio tokens of one frame
    valid: torch.Tensor  # [B] bool: a complete frame came out for that row
    frame_index: torch.Tensor  # [B] long: which frame of the row `frame` is (its offset - max_delay - 1)


MAX_CONDITION_SUMS = 64  # distinct `sum` conditions a TtsGen keeps (the published LUTs give 16)


@dataclass(frozen=True)
class TtsSampling:
    """A TTS row's sampling unless its request says otherwise: the published TTSModel's defaults
    (<= 0: greedy / no top-k). The one source of these numbers (TtsGen, engine/tts_pool.py)."""

    text_temperature: float = 0.6
    text_top_k: int = 25
    audio_temperature: float = 0.6
    audio_top_k: int = 250


class TtsGen:
    """Rows of independent TTS requests over one `TtsLM`; all state in tensors.

    Sampling: temperature and top-k per row for text and audio (<= 0: greedy / no top-k);
    `TtsSampling` until a row's `begin` says otherwise.
    """

    def __init__(self, lm: TtsLM, batch: int, max_entries: int, max_tokens: int, *,
                 max_padding: int = 8, initial_padding: int = 2, generator: torch.Generator | None = None,
                 kv_dtype: torch.dtype | None = None, voice_frames: int | None = None):
        self.lm = lm
        cfg = self.cfg = lm.cfg
        self.generator = generator
        self.batch = batch
        device = lm.text_linear.weight.device
        self.device = device
        n = cfg.lm.num_codebooks
        self.delays = torch.tensor(cfg.lm.delays, dtype=torch.long, device=device)
        self.max_delay = cfg.lm.max_delay
        self.ring_size = self.max_delay + 2
        self.initial = torch.full((n,), cfg.lm.card, dtype=torch.long, device=device)
        self.initial[0] = cfg.lm.text_card
        # Audio of stream q is forced to -1 while the row's offset < audio delay + delays[q].
        self.audio_from = cfg.audio_delay_frames + self.delays[1:]
        self.transformer = lm.transformer.init_state(batch, device, kv_dtype=kv_dtype)
        self.depformer = lm.depformer.init_state(batch, device)
        self.ring = torch.full((batch, n, self.ring_size), UNGENERATED_TOKEN, dtype=torch.long, device=device)
        self.offsets = torch.zeros(batch, dtype=torch.long, device=device)
        self.cond_sum = torch.zeros(batch, cfg.lm.dim, dtype=lm.dtype, device=device)
        # Cross-attention keys / values per layer [B, H, S, D]: allocated now when `voice_frames` is
        # known (a CUDA graph needs them before capture), else at the first start.
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if cfg.cross_attention and voice_frames is not None:
            lm_cfg = cfg.lm
            shape = (batch, lm_cfg.num_heads, MAX_SPEAKERS * voice_frames, lm_cfg.dim // lm_cfg.num_heads)
            self.cross = [(torch.zeros(shape, dtype=lm.dtype, device=device),
                           torch.zeros(shape, dtype=lm.dtype, device=device)) for _ in range(lm_cfg.num_layers)]
        # Sampling settings as rows of one float and one long tensor (each setting stays contiguous
        # over the batch: the sampling kernel reads it so); `begin` writes a row's column of each.
        self._bind_settings(
            torch.tensor([[0.0], [TtsSampling.text_temperature], [TtsSampling.audio_temperature]],
                         dtype=torch.float32, device=device).repeat(1, batch),
            torch.tensor([[TtsSampling.text_top_k], [TtsSampling.audio_top_k]], dtype=torch.long,
                         device=device).repeat(1, batch))
        # `condition_sum` per distinct conditions: the LUT values are a closed set, so a few entries
        # cover every request. The weights never change after load, so an entry never goes stale.
        self._condition_sums: OrderedDict[tuple[str | None, ...], torch.Tensor] = OrderedDict()
        self.dsm = DsmRows(batch, max_entries, max_tokens, DsmTokens(card=cfg.lm.text_card + 1),
                           second_stream_ahead=cfg.second_stream_ahead, max_padding=max_padding,
                           initial_padding=initial_padding, device=device)

    def _bind_settings(self, float_settings: torch.Tensor, long_settings: torch.Tensor) -> None:
        self.float_settings, self.long_settings = float_settings, long_settings
        self.padding_bonus, self.text_temp, self.audio_temp = float_settings
        self.text_topk, self.audio_topk = long_settings

    def leading_rows(self, n: int) -> "TtsGen":
        """A TtsGen over rows [0, n) of this one (a row bucket): every per-row tensor is a view of
        the lowest n rows (the settings' columns: each setting row stays contiguous, as sampling
        needs), so `step` through it costs n rows, updates rows [0, n) in place and never reads or
        writes the rows above. Nothing is copied; model, generator and condition cache are shared."""
        if not 1 <= n <= self.batch:
            raise ValueError(f"a view of {n} rows of a {self.batch}-row TtsGen")
        if self.cfg.cross_attention and self.cross is None:  # (a view would never see them allocated)
            raise ValueError("row views need the cross-attention keys allocated: give TtsGen voice_frames")
        view = copy.copy(self)
        view.batch = n
        view.transformer = leading_rows(self.transformer, n)
        view.depformer = leading_rows(self.depformer, n)
        view.ring, view.offsets, view.cond_sum = self.ring[:n], self.offsets[:n], self.cond_sum[:n]
        view.cross = leading_rows(self.cross, n)
        view._bind_settings(self.float_settings[:, :n], self.long_settings[:, :n])
        view.dsm = self.dsm.leading_rows(n)
        return view

    # -- admission (host side, outside any captured graph) ----------------------------------------

    @torch.no_grad()
    def start(self, row: int, entries: Sequence[WordEntry], voices: Sequence[torch.Tensor] = (),
              conditions: dict[str, str | None] | None = None, padding_bonus: float = 0.0,
              text_temp: float = TtsSampling.text_temperature, text_topk: int = TtsSampling.text_top_k,
              audio_temp: float = TtsSampling.audio_temperature, audio_topk: int = TtsSampling.audio_top_k) -> None:
        """Reset `row` and load one request: its script, voice(s) and conditions. The same as
        `voice_inputs` (host), `reset_rows` (device only: a pool captures it in a CUDA graph) and
        `begin` (host -> device)."""
        voice = self.voice_inputs(voices)
        self.dsm.check(entries)  # (before anything changes: a refused script leaves the row as it was)
        mask = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
        mask[row] = True
        self.reset_rows(mask, torch.tensor([row], device=self.device), *voice)
        self.begin(row, entries, conditions, padding_bonus, text_temp, text_topk, audio_temp, audio_topk)

    def voice_inputs(self, voices: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The `reset_rows` voice arguments of a request (host tensors; none without cross-attention)."""
        if not self.cfg.cross_attention:
            return ()
        if not voices:
            raise ValueError("this model needs a voice (speaker embedding)")
        frames = voices[0].shape[-1]
        if self.cross is not None and MAX_SPEAKERS * frames != self.cross[0][0].shape[2]:
            raise ValueError(f"voice has {frames} frames; this pool's voices have "
                             f"{self.cross[0][0].shape[2] // MAX_SPEAKERS}")
        return speaker_inputs(voices, frames)

    @torch.no_grad()
    def reset_rows(self, mask: torch.Tensor, index: torch.Tensor, voice: torch.Tensor | None = None,
                   voice_mask: torch.Tensor | None = None) -> None:
        """Device only (no host sync, so a CUDA graph can hold it): the rows in `mask` start
        over, and with cross-attention row `index` ([1] long) attends to `voice_inputs`' voices."""
        self.transformer.reset(mask)
        self.ring.masked_fill_(mask[:, None, None], UNGENERATED_TOKEN)
        self.offsets.masked_fill_(mask, 0)
        if self.cfg.cross_attention:
            source = self.lm.cross_source(voice.to(self.device), voice_mask.to(self.device))
            kv = self.lm.transformer.cross_kv(source)
            if self.cross is None:  # (eager only: a graphed pool allocates them at construction)
                self.cross = [(k.new_zeros((self.batch, *k.shape[1:])), v.new_zeros((self.batch, *v.shape[1:])))
                              for k, v in kv]
            for (k_all, v_all), (k, v) in zip(self.cross, kv):
                k_all.index_copy_(0, index, k)
                v_all.index_copy_(0, index, v)

    @torch.no_grad()
    def begin(self, row: int, entries: Sequence[WordEntry], conditions: dict[str, str | None] | None = None,
              padding_bonus: float = 0.0, text_temp: float = TtsSampling.text_temperature,
              text_topk: int = TtsSampling.text_top_k, audio_temp: float = TtsSampling.audio_temperature,
              audio_topk: int = TtsSampling.audio_top_k) -> None:
        """Load `row`'s script, conditions and sampling (after `reset_rows`)."""
        self.dsm.load(row, entries)
        self.cond_sum[row] = self.condition_sum(conditions or {})
        copy_from_host(self.float_settings[:, row], np.array([padding_bonus, text_temp, audio_temp], dtype=np.float32))
        copy_from_host(self.long_settings[:, row], np.array([text_topk, audio_topk], dtype=np.int64))

    @torch.no_grad()
    def condition_sum(self, values: dict[str, str | None]) -> torch.Tensor:
        """`TtsLM.condition_sum`, computed once per distinct `sum` conditions (bounded, least
        recently used dropped). Only the fused names count: other keys do not change the sum."""
        key = tuple(values.get(name) for name in self.cfg.fuse_sum)
        total = self._condition_sums.get(key)
        if total is None:
            total = self.lm.condition_sum(values)  # (raises on a value outside the LUT: nothing cached)
            if len(self._condition_sums) >= MAX_CONDITION_SUMS:
                self._condition_sums.popitem(last=False)
            self._condition_sums[key] = total
        else:
            self._condition_sums.move_to_end(key)
        return total

    # -- one frame ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, active: torch.Tensor, full: bool = True) -> TtsStepOutput:
        """One frame for every `active` row; `full=False` skips the depformer (valid only when every
        active row is still inside the audio delay: their audio is forced to -1 anyway)."""
        cfg, lm = self.cfg, self.lm
        offsets = self.offsets
        n = cfg.lm.num_codebooks
        tokens = ring_inputs(self.ring, offsets, self.delays, self.initial, active)
        x = lm.embed(tokens) + self.cond_sum
        hidden, logits = lm.temporal(x[:, None], self.transformer, active, self.cross)
        hidden, logits = hidden[:, 0], logits[:, 0].float()
        logits[:, self.dsm.ids.pad] += self.padding_bonus
        text = sample_tokens(logits, self.text_temp, self.text_topk, self.generator)
        text = self.dsm.step(offsets, text, active)

        if full:
            self.depformer.clear()
            prev, codes = text, []
            for k in range(cfg.lm.dep_q):
                token = sample_tokens(lm.depformer_logits(k, hidden, prev, self.depformer).float(),
                                      self.audio_temp, self.audio_topk, self.generator)
                codes.append(token)
                prev = token
            audio = torch.stack(codes, dim=1)
        else:
            audio = torch.full((self.batch, cfg.lm.dep_q), ZERO_TOKEN, dtype=torch.long, device=self.device)
        audio = torch.where(offsets[:, None] < self.audio_from[None], ZERO_TOKEN, audio)

        new_offsets = torch.where(active, offsets + 1, offsets)
        generated = torch.cat([text[:, None], audio], dim=1)
        index = (new_offsets % self.ring_size)[:, None, None].expand(-1, n, 1)
        old = self.ring.gather(2, index)
        self.ring.scatter_(2, index, torch.where(active[:, None, None], generated[..., None], old))
        self.offsets.copy_(new_offsets)

        read = (new_offsets[:, None] - self.max_delay + self.delays[None]) % self.ring_size
        frame = self.ring.gather(2, read[..., None])[..., 0]
        valid = (new_offsets > self.max_delay) & active
        return TtsStepOutput(frame=frame, valid=valid, frame_index=new_offsets - self.max_delay - 1)


def replace_lm_config(cfg: TtsConfig, **changes: Any) -> TtsConfig:
    """A TtsConfig with some LM fields changed (tests, benchmarks)."""
    return dataclasses.replace(cfg, lm=dataclasses.replace(cfg.lm, **changes))

