"""The Moshi / PersonaPlex language model: weights and the per-frame forward pieces.

    model = LMModel(cfg, device=None, dtype=None)   # also under torch.device("meta")
    x = model.embed(tokens[..., n_q + 1])           # summed temporal input [..., dim]
    hidden, text_logits = model.temporal(x[B, T, dim], state, exec_mask)
    logits = model.depformer_logits(k, hidden[B, dim], prev_token[B], dep_state)

State dict keys and shapes are the published checkpoint's (moshi 0.2.13 layout): `emb.{i}`,
`text_emb`, `text_linear`, `out_norm.alpha`, `transformer.layers.*`, `depformer_in.{k}`,
`depformer_emb.{k}`, `depformer_text_emb`, `depformer.layers.*`, `linears.{k}`; Hibiki adds
`depformer_norms.{k}` (a norm before each `linears[k]`) and `condition_provider.*` (its
`description` LUT, fp32). A conditioned model adds `condition` (its summed conditions, [dim],
set by `set_condition` once the weights are loaded) to every temporal input, after the streams,
as the reference adds its `sum_condition`. `kv_repeat` > 1: grouped KV heads (models/transformer.py).
Sampling and the token ring live in `models/lm_gen.py`.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from .conditioning import ConditionProvider, Embedding
from .config import ZERO_TOKEN, LMConfig
from .transformer import StreamingTransformer, TransformerState, make_norm


_REFERENCE_ATTENTION = re.compile(r"(.*\.(?:self_attn|cross_attention))\.(in_projs|out_projs)\.(\d+)\.weight$")


def published_state(reference_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference model's in-memory state dict (per-step `self_attn.{in,out}_projs.{k}.weight`)
    in the published layout `LMModel` uses (`self_attn.in_proj_weight` / `out_proj.weight`,
    steps stacked on dim 0). A single part is passed through, not copied."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in reference_state.items():
        m = _REFERENCE_ATTENTION.match(key)
        if m is None:
            out[key] = value
            continue
        name = f"{m.group(1)}.in_proj_weight" if m.group(2) == "in_projs" else f"{m.group(1)}.out_proj.weight"
        stacks.setdefault(name, {})[int(m.group(3))] = value
    for name, parts in stacks.items():
        tensors = [parts[i] for i in sorted(parts)]
        out[name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, 0)
    return out


class ZeroEmbedding(Embedding):
    """An embedding where index -1 (ZERO_TOKEN) gives an exact zero vector.

    Other negative ids (-2, "not generated") are clamped to row 0, as in the reference.
    """

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y = super().forward(tokens.clamp(min=0))
        return torch.where((tokens == ZERO_TOKEN)[..., None], torch.zeros((), dtype=y.dtype, device=y.device), y)


class LMModel(nn.Module):
    def __init__(self, cfg: LMConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        factory = {"device": device, "dtype": dtype}
        dim, ddim = cfg.dim, cfg.depformer_dim

        # Temporal ("Helium") transformer over the summed stream embeddings.
        self.emb = nn.ModuleList([ZeroEmbedding(cfg.card + 1, dim, **factory) for _ in range(cfg.n_q)])
        self.text_emb = ZeroEmbedding(cfg.text_card + 1, dim, **factory)
        self.transformer = StreamingTransformer(
            dim, cfg.num_heads, cfg.num_layers, int(cfg.hidden_scale * dim), causal=cfg.causal,
            context=cfg.context, norm=cfg.norm, gating=cfg.gating, layer_scale=cfg.layer_scale,
            positional_embedding=cfg.positional_embedding, max_period=cfg.max_period,
            kv_repeat=cfg.kv_repeat, **factory)
        self.out_norm = make_norm(cfg.norm, dim, **factory)
        self.text_linear = nn.Linear(dim, cfg.text_card, bias=False, **factory)

        # Extra heads (STT end-of-turn), applied by their user to the normalised hidden state.
        self.extra_heads = nn.ModuleList([nn.Linear(dim, cfg.extra_heads_dim, bias=False, **factory)
                                          for _ in range(cfg.extra_heads_num_heads)])
        self.condition: torch.Tensor | None = None  # summed conditions [dim] (set_condition)
        if cfg.dep_q == 0:  # a speech-to-text model: text only, no depformer (as the reference)
            return

        # Depformer: one step per codebook, its KV spans the steps of one frame only. The reference
        # ignores `depformer_context` (it forces context None, ring capacity dep_q), and so do we.
        schedule = cfg.depformer_weights_per_step_schedule
        num_in = (max(schedule) + 1 if schedule else cfg.dep_q) if cfg.depformer_multi_linear else 1
        self.depformer_in = nn.ModuleList([nn.Linear(dim, ddim, bias=False, **factory) for _ in range(num_in)])
        self.depformer_emb = nn.ModuleList(
            [ZeroEmbedding(cfg.card + 1, ddim, **factory) for _ in range(cfg.dep_q - 1)])
        self.depformer_text_emb = ZeroEmbedding(cfg.text_card + 1, ddim, **factory)
        self.depformer = StreamingTransformer(
            ddim, cfg.depformer_num_heads, cfg.depformer_num_layers, cfg.depformer_dim_feedforward,
            causal=cfg.causal, context=None, capacity=cfg.dep_q, norm=cfg.norm, gating=cfg.depformer_gating,
            layer_scale=cfg.depformer_layer_scale, positional_embedding=cfg.depformer_pos_emb,
            max_period=cfg.depformer_max_period,
            weights_per_step=cfg.dep_q if cfg.depformer_weights_per_step else 0,
            weights_per_step_schedule=schedule, kv_repeat=cfg.depformer_repeat, **factory)
        if cfg.depformer_norm is not None:
            self.depformer_norms = nn.ModuleList([make_norm(cfg.depformer_norm, ddim, **factory)
                                                  for _ in range(cfg.dep_q)])
        self.linears = nn.ModuleList([nn.Linear(ddim, cfg.card, bias=False, **factory) for _ in range(cfg.dep_q)])
        if cfg.conditioners:  # last: parameters() starts with the model-dtype embeddings
            self.condition_provider = ConditionProvider(cfg.conditioners, dim, device=device)

    def set_condition(self, values: dict[str, str]) -> None:
        """Compute the summed `fuser.sum` conditions of `values` (fp32, as the reference) and keep
        them in the model dtype, added to every temporal input from now on."""
        total = self.condition_provider.sum_of(self.cfg.fuse_sum, values)
        self.condition = None if total is None else total[0, 0].to(self.text_linear.weight.dtype)

    # -- tokens ---------------------------------------------------------------------------------

    @property
    def audio_initial_token(self) -> int:
        return self.cfg.card

    @property
    def text_initial_token(self) -> int:
        return self.cfg.text_card

    @property
    def input_eos_token(self) -> int:
        """Hibiki's end of the source: this code in every user codebook of the frame where the
        source audio ends (hibiki_zero's `add_input_eos` writes Mimi's cardinality, == card)."""
        return self.cfg.card

    def initial_tokens(self, device: torch.device | None = None) -> torch.Tensor:
        """[n_q + 1] long: what a stream reads before its delay has elapsed."""
        tokens = torch.full((self.cfg.num_codebooks,), self.audio_initial_token, dtype=torch.long, device=device)
        tokens[0] = self.text_initial_token
        return tokens

    # -- forward pieces -------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Temporal input for tokens [..., n_q + 1] (text first): the sum of the 17 embeddings.

        Audio streams are summed first and text added last, the reference's order (fp32 bit-exact).
        """
        x = self.emb[0](tokens[..., 1])
        for k in range(1, self.cfg.n_q):
            x = x + self.emb[k](tokens[..., k + 1])
        x = x + self.text_emb(tokens[..., 0])
        return x if self.condition is None else x + self.condition.to(x)

    def temporal(self, x: torch.Tensor, state: TransformerState | None,
                 exec_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, dim] -> (normalised hidden [B, T, dim], text logits [B, T, text_card])."""
        hidden = self.out_norm(self.transformer(x, state, exec_mask))
        return hidden, self.text_linear(hidden)

    def depformer_logits(self, step: int, hidden: torch.Tensor, prev_token: torch.Tensor,
                         state: TransformerState) -> torch.Tensor:
        """One depformer step. hidden [B, dim]; prev_token [B] (text for step 0) -> logits [B, card]."""
        cfg = self.cfg
        schedule = cfg.depformer_weights_per_step_schedule
        in_index = (schedule[step] if schedule else step) if cfg.depformer_multi_linear else 0
        x = self.depformer_in[in_index](hidden[:, None])
        if step == 0:
            x = x + self.depformer_text_emb(prev_token[:, None])
        else:
            x = x + self.depformer_emb[step - 1](prev_token[:, None])
        y = self.depformer(x, state, step=step)
        if self.cfg.depformer_norm is not None:
            y = self.depformer_norms[step](y)
        return self.linears[step](y[:, 0])

    # -- weights --------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Truncated-normal init with std 1/sqrt(fan_in), like the reference (for synthetic checkpoints)."""
        for name, p in self.named_parameters():
            if name.endswith(("alpha", "scale")) or ".norm" in name:
                continue  # norms and layer scales keep their constructed values
            std = 1 / math.sqrt(p.shape[-1])
            p.copy_(torch.nn.init.trunc_normal_(torch.empty(p.shape, dtype=torch.float32), std=std,
                                                a=-3 * std, b=3 * std, generator=generator).to(p))
