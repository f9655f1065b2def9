"""The persistent depformer kernel (models/depformer_kernel.py) against the layer path.

On CPU: its arithmetic in the Triton interpreter (a subprocess with TRITON_INTERPRET=1, one
launch a phase, since the interpreter runs programs one after another), the weight packing,
the refusals. On a GPU (`gpu`): the real kernel with its grid barriers, eager and in a graph.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from parley.engine.backend import ModelBackend
from parley.models.config import tiny_lm_config
from parley.models.lm import LMModel
from parley.models.lm_gen import LMGen
from parley.models.persistent_depformer import PersistentDepformer, _stacked, check, persistent_problem

ROOT = Path(__file__).resolve().parent.parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny_lm(dtype=torch.float32, device="cpu", **changes) -> LMModel:
    torch.manual_seed(0)
    model = LMModel(dataclasses.replace(tiny_lm_config(**{k: changes.pop(k) for k in ("dep_q",) if k in changes}),
                                        **changes), device=device, dtype=dtype)
    with torch.no_grad():
        model.init_weights(torch.Generator().manual_seed(1))
        for norm in (n for layer in model.depformer.layers for n in (layer.norm1, layer.norm2)):
            if hasattr(norm, "alpha"):  # RMSNorms away from 1, so that a dropped alpha shows
                norm.alpha.uniform_(0.5, 1.5)
    return model.eval()


INTERPRETER_CHECK = textwrap.dedent("""
    import torch
    from parley.models import depformer_kernel as dk
    from parley.models.persistent_depformer import PersistentDepformer
    from tests.test_persistent_depformer import tiny_lm
    torch.set_grad_enabled(False)
    for batch, dep_q, launch in ((3, 8, None), (20, 16, dk.DepformerLaunch(16, 16, 32, 32, 64, 1, 4))):
        model = tiny_lm(dep_q=dep_q)
        ref, ours = model.depformer.init_state(batch), model.depformer.init_state(batch)
        persistent = PersistentDepformer(model)
        persistent.launch = launch
        hidden = torch.randn(batch, model.cfg.dim)
        prev = torch.randint(0, 100, (batch,))
        prev[0] = -1  # ZERO_TOKEN: embeds to zero
        for k in range(model.cfg.n_agent):
            expected = model.depformer_logits(k, hidden, prev, ref)
            got = model.linears[k](persistent.step(k, k, hidden, prev, ours))
            err = ((got - expected).abs().max() / expected.abs().max()).item()
            assert err < 1e-5, (batch, k, err)
            assert torch.equal(ours.pos, ref.pos) and torch.equal(ours.slot_pos, ref.slot_pos)
            for a, b in zip(ours.keys + ours.values, ref.keys + ref.values):
                assert (a - b).abs().max() < 1e-5
            prev = expected.argmax(-1)
        print("ok", batch, dep_q)
""")


@needs_triton
def test_kernel_equals_the_layer_path_in_the_interpreter():
    """float32 (the interpreter's bf16 casts truncate, so bf16 is checked on the GPU): logits,
    rings and positions after every step; 2 row tiles, 16 depformer steps, the zero token."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.split() == ["ok", "3", "8", "ok", "20", "16"], proc.stdout


@needs_triton
def test_packing_keeps_one_copy_and_the_layer_path_bit_identical():
    model = tiny_lm()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    gen = LMGen(model, text_temp=0, audio_temp=0)
    hidden = torch.randn(4, model.cfg.dim)
    text = torch.randint(0, 100, (4,))
    expected = gen.depformer(gen.init_state(4), hidden, text)
    persistent = PersistentDepformer(model)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    storage = persistent.layers.qkv.untyped_storage().data_ptr()
    assert all(layer.self_attn.in_proj_weight.untyped_storage().data_ptr() == storage
               for layer in model.depformer.layers)
    assert torch.equal(gen.depformer(gen.init_state(4), hidden, text), expected)  # CPU: the layer path
    model.load_state_dict({name: p.clone() for name, p in model.state_dict().items()}, assign=True)
    with pytest.raises(RuntimeError, match="moved or replaced after they were packed"):
        persistent.step(0, 0, hidden, text, model.depformer.init_state(4))


@needs_triton
def test_the_start_up_check_refuses_when_the_kernel_would_not_run():
    """Off CUDA, or with PARLEY_FUSED=0, every step would quietly take the layer path: the
    check refuses instead of passing with the setting ignored."""
    model = tiny_lm()
    model.persistent_depformer = PersistentDepformer(model)
    with pytest.raises(RuntimeError, match="needs the fused CUDA kernels"):
        check(model, 2)


def test_the_depformer_rings_are_one_tensor_over_layers():
    model = tiny_lm()
    state = model.depformer.init_state(3)
    stacked = _stacked(state.keys)
    assert stacked.shape == (len(state.keys), *state.keys[0].shape)
    state.keys[1][0, 0, 0, 0] = 7.0
    assert stacked[1, 0, 0, 0, 0] == 7.0
    with pytest.raises(ValueError, match="one tensor over layers"):
        _stacked([torch.zeros(2, 2), torch.zeros(2, 2)])
    assert len(model.transformer.init_state(2).keys) == model.cfg.num_layers  # the temporal: unchanged


@needs_triton
@pytest.mark.parametrize("change, message", [
    (dict(depformer_layer_scale=0.1), "layer scale"),
    (dict(depformer_pos_emb="rope"), "no RoPE"),
    (dict(norm="layer_norm"), "RMSNorm"),
    (dict(depformer_weights_per_step=False), "weights per step"),
])
def test_models_the_kernel_cannot_run_are_refused(change, message):
    model = tiny_lm(**change)
    assert message in persistent_problem(model)
    with pytest.raises(ValueError, match="cannot run this model"):
        PersistentDepformer(model)


def test_the_backend_refuses_an_unknown_or_cpu_persistent_depformer(tiny_moshi_dir):
    with pytest.raises(ValueError, match="CUDA kernel"):
        ModelBackend.load(tiny_moshi_dir, 1, depformer="persistent")
    with pytest.raises(ValueError, match="'layers' or 'persistent'"):
        ModelBackend.load(tiny_moshi_dir, 1, depformer="fast")


def test_serve_refuses_persistent_depformer_on_cpu(tiny_moshi_dir):
    from parley.realtime.server import ServeConfig, ServeError, build_app
    with pytest.raises(ServeError, match="--depformer persistent is a CUDA kernel"):
        build_app(ServeConfig(model=str(tiny_moshi_dir), device="cpu", depformer="persistent"))


# -- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, dep_q", [(1, 8), (5, 16), (64, 8), (130, 8)])
def test_kernel_equals_the_layer_path_on_the_gpu(dtype, batch, dep_q):
    """The grid-barrier kernel against the layer-by-layer fused path: float32 to 1e-4 of the
    largest logit, bf16 to 5e-2 (summation order) with the greedy codes mostly equal; no
    barrier gave up. 130 rows: two row tiles of 128."""
    model = tiny_lm(dtype, "cuda", dep_q=dep_q)
    model.persistent_depformer = PersistentDepformer(model)
    result = check(model, batch, torch.Generator().manual_seed(batch))
    assert result["max_diff"] < (1e-4 if dtype == torch.float32 else 5e-2), result
    assert result["agreement"] > (0.99 if dtype == torch.float32 else 0.6), result


@pytest.mark.gpu
@cuda
def test_a_graph_of_the_kernel_replays_what_eager_computes():
    from parley.engine.cuda_graph import CUDAGraphRunner
    model = tiny_lm(torch.bfloat16, "cuda")
    model.persistent_depformer = PersistentDepformer(model)
    gen = LMGen(model, text_temp=0, audio_temp=0)
    state = gen.init_state(6)
    hidden = torch.randn(6, model.cfg.dim, device="cuda", dtype=torch.bfloat16)
    text = torch.randint(0, 100, (6,), device="cuda")
    eager = gen.depformer(state, hidden, text).clone()
    runner = CUDAGraphRunner(lambda h, t: (gen.depformer(state, h, t),), (hidden, text))
    for _ in range(3):
        assert torch.equal(runner(hidden, text)[0], eager)
    runner.close()


@pytest.mark.gpu
@cuda
def test_the_backend_refuses_the_persistent_depformer_with_the_fused_kernels_off(tiny_moshi_dir):
    from parley.models import kernels
    with kernels.enabled(False), pytest.raises(RuntimeError, match="switched off"):
        ModelBackend.load(tiny_moshi_dir, 2, device="cuda", depformer="persistent")


@pytest.mark.gpu
@cuda
def test_the_backend_serves_frames_with_the_persistent_depformer(tiny_moshi_dir):
    backend = ModelBackend.load(tiny_moshi_dir, 4, device="cuda", seed=0, depformer="persistent")
    assert backend.checkpoint.lm.persistent_depformer is not None
    pcm = torch.randn(4, backend.checkpoint.mimi.frame_size) * 0.1
    live = torch.ones(4, dtype=torch.bool)
    for _ in range(3):
        out = backend.step(pcm, live).to_host()
    assert out.pcm.shape[0] == 4
    assert backend.checkpoint.lm.persistent_depformer.gave_up() == 0
    backend.close()
