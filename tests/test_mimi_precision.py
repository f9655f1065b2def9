"""`--mimi-dtype auto` (models/mimi/precision.py): a float16 copy of the loaded codec is run beside
float32 on a loud probe, and taken only when it stays finite and near. On the CPU here: the
tiny Mimi passes; the same Mimi with one convolution scaled past float16's range fails, naming
where; auto on the CPU is float32 without a probe, and an explicit dtype is taken as given."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from parley.models.checkpoint import load_checkpoint
from parley.models.mimi import precision
from parley.models.mimi.precision import half_precision_problem, mimi_dtype_for, probe_signal


@pytest.fixture(scope="module")
def tiny_mimi(tiny_moshi_dir):
    return load_checkpoint(tiny_moshi_dir, "cpu", torch.float32, mimi_dtype=torch.float32).mimi


def test_float16_passes_the_probe_on_a_codec_in_range(tiny_mimi):
    assert half_precision_problem(tiny_mimi, frames=3) is None


def test_an_encoder_past_float16s_range_fails_the_probe(tiny_mimi):
    broken = copy.deepcopy(tiny_mimi)
    with torch.no_grad():
        first = next(m for m in broken.encoder.modules() if isinstance(m, torch.nn.Conv1d))
        first.weight.mul_(1e6)  # float32 carries it; float16 (at most 65504) overflows to inf
    assert half_precision_problem(broken, frames=3) == "float16 overflowed in the encoder on a loud probe"


def test_a_decoder_past_float16s_range_fails_the_probe(tiny_mimi):
    broken = copy.deepcopy(tiny_mimi)
    with torch.no_grad():
        last = [m for m in broken.decoder.modules() if isinstance(m, torch.nn.Conv1d)][-2]
        last.weight.mul_(1e6)
    assert half_precision_problem(broken, frames=3) == "float16 overflowed in the decoder on a loud probe"


def test_auto_is_float32_on_the_cpu_and_an_explicit_dtype_is_kept(tiny_mimi, monkeypatch, caplog):
    def no_probe(*args, **kwargs):
        raise AssertionError("auto probed on the CPU")
    monkeypatch.setattr(precision, "half_precision_problem", no_probe)
    with caplog.at_level(logging.INFO, logger="parley.models.mimi"):
        assert mimi_dtype_for(tiny_mimi, None) == torch.float32
    assert "Mimi computes in float32 (--mimi-dtype auto on the CPU)" in caplog.text
    assert mimi_dtype_for(tiny_mimi, torch.bfloat16) == torch.bfloat16
    assert mimi_dtype_for(tiny_mimi, torch.float16) == torch.float16


def test_the_probe_is_loud():
    pcm = probe_signal(2)
    assert pcm.shape == (4, 2 * 1920)
    assert pcm[0].abs().max() > 1.9 and pcm[1].abs().max() == 2.0 and pcm[1].abs().mean() > 1.9
    assert pcm[3].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_takes_float16_on_cuda_and_says_which(tiny_moshi_dir, caplog):
    with caplog.at_level(logging.INFO, logger="parley.models.mimi"):
        mimi = load_checkpoint(tiny_moshi_dir, "cuda", torch.float32).mimi
    assert mimi.dtype == torch.float16
    assert "Mimi computes in float16" in caplog.text
