"""The depformer as one persistent kernel a step (models/depformer_kernel.py), on an LMModel.

    problem = persistent_problem(model)        # None, or why this model cannot take it
    model.persistent_depformer = PersistentDepformer(model)   # packs the weights (no copy kept)
    check(model, batch)                         # start-up: near the layer path, no barrier gave up

`LMModel.depformer_logits` then runs each step through it on CUDA (with the fused kernels on)
and keeps the layer-by-layer path everywhere else. Opt-in (`--depformer persistent`) until the
kernel has been measured on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from . import depformer_kernel, kernels
from .config import ZERO_TOKEN
from .transformer import GatedFFN, RMSNorm, StreamingTransformer


def persistent_problem(model: nn.Module) -> str | None:
    """Why `model`'s depformer cannot run as the persistent kernel, or None when it can."""
    depformer: StreamingTransformer | None = getattr(model, "depformer", None)
    if depformer is None:
        return "the model has no depformer"
    if not depformer_kernel._HAVE_TRITON:
        return "Triton is not installed"
    if not depformer.weights_per_step or depformer.rope_max_period is not None or depformer.cross_attention:
        return "the kernel takes a depformer with weights per step and no RoPE"
    C, H = depformer.d_model, depformer.num_heads
    D = C // H
    if H != kernels._pow2(H) or D != kernels._pow2(D) or C % 32:
        return f"the kernel takes power-of-two heads and head dims, and a width that is a multiple of 32 (here {H} x {D})"
    for layer in depformer.layers:
        norms = (layer.norm1, layer.norm2)
        if not all(isinstance(n, RMSNorm) and n.fused_params() is not None for n in norms):
            return "the kernel takes float32-computed RMSNorms (norm rms_norm_f32)"
        if norms[0].eps != norms[1].eps or norms[0].eps != depformer.layers[0].norm1.eps:
            return "the kernel takes one RMSNorm eps for every norm"
        if not isinstance(layer.layer_scale_1, nn.Identity) or not isinstance(layer.layer_scale_2, nn.Identity):
            return "the kernel takes a depformer without layer scale"
        gating = layer.gating
        if not isinstance(gating, nn.ModuleList) or not all(
                isinstance(g, GatedFFN) and g.activation is torch.nn.functional.silu for g in gating):
            return "the kernel takes a gated SiLU feed-forward per step"
    return None


def _stacked(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """[L, ...] over per-layer tensors that are equally spaced slices of one storage (the
    depformer's rings, see StreamingTransformer.init_state)."""
    first = per_layer[0]
    step = (per_layer[1].data_ptr() - first.data_ptr()) // first.element_size() if len(per_layer) > 1 else first.numel()
    for i, t in enumerate(per_layer):
        if (t.shape != first.shape or t.stride() != first.stride() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.data_ptr() != first.data_ptr() + i * step * first.element_size()):
            raise ValueError("the depformer's rings are not one tensor over layers (init_state allocates them so)")
    return first.as_strided((len(per_layer), *first.shape), (step, *first.stride()))


class PersistentDepformer:
    """A model's depformer weights packed over layers, and its steps as one kernel each. Build
    it once the model is on its device with its weights: moving or reloading them afterwards
    unpacks the parameters, and `step` then refuses to run on the stale pack."""

    def __init__(self, model: nn.Module):
        problem = persistent_problem(model)
        if problem is not None:
            raise ValueError(f"the persistent depformer cannot run this model: {problem}")
        self.model = model
        layers = model.depformer.layers
        with torch.no_grad():
            self.layers = depformer_kernel.pack_layers(
                [layer.self_attn.in_proj_weight for layer in layers],
                [layer.self_attn.out_proj.weight for layer in layers],
                [[g.linear_in.weight for g in layer.gating] for layer in layers],
                [[g.linear_out.weight for g in layer.gating] for layer in layers],
                [layer.norm1.alpha for layer in layers], [layer.norm2.alpha for layer in layers])
            # The parameters become views of the packed tensors: one copy of the weights.
            for i, layer in enumerate(layers):
                layer.self_attn.in_proj_weight.data = self.layers.qkv[i]
                layer.self_attn.out_proj.weight.data = self.layers.out[i]
                for w, g in enumerate(layer.gating):
                    g.linear_in.weight.data = self.layers.ffn_in[i, w]
                    g.linear_out.weight.data = self.layers.ffn_out[i, w]
                layer.norm1.alpha.data = self.layers.norm1[i].view_as(layer.norm1.alpha)
                layer.norm2.alpha.data = self.layers.norm2[i].view_as(layer.norm2.alpha)
        self.eps = layers[0].norm1.eps
        # Benchmarks set these (benchmarks/depformer_kernel.py): a launch other than the default,
        # or one launch a phase instead of the grid barriers.
        self.launch: depformer_kernel.DepformerLaunch | None = None
        self.phase_by_phase = False
        # Every step's barrier: [0] arrivals (zeroed each step), [1] how often one gave up, ever.
        self.barrier = torch.zeros(2, dtype=torch.int32, device=next(model.parameters()).device)

    def gave_up(self) -> int:
        """How many grid barriers have given up waiting since start (a host sync): each one is
        a step whose outputs were wrong."""
        return int(self.barrier[1])

    def runs(self, hidden: torch.Tensor) -> bool:
        """Whether a step on `hidden` takes the kernel (CUDA, fused kernels switched on)."""
        return kernels.available(hidden)

    def step(self, step: int, in_index: int, hidden: torch.Tensor, prev_token: torch.Tensor,
             state) -> torch.Tensor:
        """`depformer(depformer_in[in_index](hidden) + emb(prev_token), state, step)` -> [B, C]."""
        model = self.model
        if (model.depformer.layers[0].self_attn.in_proj_weight.untyped_storage().data_ptr()
                != self.layers.qkv.untyped_storage().data_ptr()):  # (host-side: no sync)
            raise RuntimeError("the depformer's weights were moved or replaced after they were packed "
                               "(model.to(), load_state_dict): build a new PersistentDepformer")
        emb = model.depformer_text_emb if step == 0 else model.depformer_emb[step - 1]
        return depformer_kernel.depformer_step(
            hidden, prev_token, model.depformer_in[in_index].weight, emb.weight, self.layers,
            model.depformer._weight_index(step), _stacked(state.keys), _stacked(state.values),
            state.slot_pos, state.pos, self.eps, ZERO_TOKEN, launch=self.launch,
            phase_by_phase=self.phase_by_phase, barrier=self.barrier)


def check(model: nn.Module, batch: int, generator: torch.Generator | None = None) -> dict[str, float]:
    """Start-up check of the kernel on this device: one frame's steps on random input, against
    the layer-by-layer path on a state of its own. Raises RuntimeError when a grid barrier gave
    up (programs not all resident) or when the logits differ by more than 5 % of their largest
    (summation order alone moves them ~1e-3; a broken phase moves them by their own size).
    Returns {"max_diff": ..., "agreement": ...} (greedy tokens equal, fraction)."""
    persistent: PersistentDepformer = model.persistent_depformer
    cfg = model.cfg
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    hidden = torch.randn(batch, cfg.dim, generator=generator, device="cpu").to(dev, dtype)
    prev = torch.randint(0, cfg.text_card, (batch,), generator=generator, device="cpu").to(dev)
    if not persistent.runs(hidden):  # it would fall back to the layer path: the setting ignored
        raise RuntimeError("the persistent depformer needs the fused CUDA kernels, which are switched off "
                           "(PARLEY_FUSED=0) or not available here; run with --depformer layers")
    ours, theirs = model.depformer.init_state(batch), model.depformer.init_state(batch)
    before = persistent.gave_up()
    worst, agree = 0.0, []
    with torch.no_grad():
        for k in range(cfg.n_agent):
            y = model.depformer_logits(k, hidden, prev, ours).float()  # through the kernel
            model.persistent_depformer = None  # the layer path, once
            try:
                ref = model.depformer_logits(k, hidden, prev, theirs).float()
            finally:
                model.persistent_depformer = persistent
            worst = max(worst, ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item())
            agree.append((y.argmax(-1) == ref.argmax(-1)).float().mean().item())
            prev = ref.argmax(-1)
    gave_up = persistent.gave_up() - before
    if gave_up:
        raise RuntimeError(f"the persistent depformer's grid barrier gave up {gave_up} times: its programs "
                           "were not all resident on this GPU; run with --depformer layers")
    if worst > 0.05:
        raise RuntimeError(f"the persistent depformer's logits differ from the layer path's by {worst:.1%} of "
                           "their largest; run with --depformer layers")
    return {"max_diff": worst, "agreement": sum(agree) / len(agree)}
