"""Conditioners: fixed vectors (or projected tensors) a model adds to its inputs, in fp32.

    provider = ConditionProvider(cfg.conditioners, out_dim)       # config.ConditionerConfig specs
    cond = provider.conditioners["description"].lut("very_good")  # [1, 1, out_dim] fp32

Parameter names are the published checkpoint keys under `condition_provider.`:
`conditioners.{name}.embed.weight` (LUTs: n_bins + 1 rows, the last one "no value"),
`conditioners.{name}.output_proj.weight`, `conditioners.{name}.learnt_padding`. The arithmetic is
the reference's (moshi 0.2.13 `conditioners/base.py`): project, then masked positions replaced by
the learnt padding, in fp32 (the reference keeps its conditioners in fp32 whatever the model dtype).
Used by the DSM TTS (`models/tts.py`) and by Hibiki's `description` (`models/lm.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ConditionerConfig


class Embedding(nn.Embedding):
    """nn.Embedding that draws no weights on the meta device, where the checkpoint loaders build
    (then load the weights): there is nothing to draw, and drawing there imports torch._dynamo and
    with it Triton (~1.5 s at every start, on a CPU server too)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Conditioner(nn.Module):
    """`output_proj` then masked positions replaced by `learnt_padding`. A LUT has `embed`
    (its last row is the "no value" entry); a tensor conditioner projects its input."""

    def __init__(self, spec: ConditionerConfig, out_dim: int, device=None):
        super().__init__()
        self.spec = spec
        if spec.kind == "lut":
            self.embed = Embedding(spec.n_bins + 1, spec.dim, device=device)
        self.output_proj = nn.Linear(spec.dim, out_dim, bias=False, device=device)
        self.learnt_padding = nn.Parameter(torch.zeros(1, 1, out_dim, device=device))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim] (LUT: long ids [B, T]), mask [B, T] bool -> [B, T, out_dim]."""
        if self.spec.kind == "lut":
            x = self.embed(x)
        maskf = mask.float()[..., None]
        return self.output_proj(x) * maskf + self.learnt_padding * (1 - maskf)

    def lut(self, value: str | None) -> torch.Tensor:
        """The LUT condition of one value (None: absent) -> [1, 1, out_dim]."""
        device = self.output_proj.weight.device
        if value is None:
            ids, mask = [self.spec.n_bins], [False]
        else:
            if value not in self.spec.possible_values:
                raise ValueError(f"{self.spec.name} value {value!r} is not one of {list(self.spec.possible_values)}")
            ids, mask = [self.spec.possible_values.index(value)], [True]
        return self(torch.tensor([ids], device=device), torch.tensor([mask], device=device))


class ConditionProvider(nn.Module):
    def __init__(self, specs: tuple[ConditionerConfig, ...], out_dim: int, device=None):
        super().__init__()
        self.conditioners = nn.ModuleDict({c.name: Conditioner(c, out_dim, device) for c in specs})

    def sum_of(self, names: tuple[str, ...], values: dict[str, str | None]) -> torch.Tensor | None:
        """The `sum`-fused LUT conditions of `values` (a name missing: its "no value" row),
        [1, 1, out_dim] fp32; None when `names` is empty."""
        total = None
        for name in names:
            cond = self.conditioners[name].lut(values.get(name))
            total = cond if total is None else total + cond
        return total
