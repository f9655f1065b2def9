"""The one switch of the fused kernels (models/kernels.py): PARLEY_FUSED and set_enabled / enabled."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from parley.models import kernels


def _import_with(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PARLEY_FUSED=value)
    code = "from parley.models import kernels; print(kernels.set_enabled(True))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_env_switch_is_honoured_or_refused():
    assert _import_with("0").stdout.strip() == "False"
    bad = _import_with("off")
    assert bad.returncode != 0 and "PARLEY_FUSED='off'" in bad.stderr


def test_enabled_restores_the_previous_setting():
    before = kernels.set_enabled(True)
    try:
        with kernels.enabled(False):
            assert not kernels.available(torch.zeros(1))
            with kernels.enabled(True):
                assert kernels.set_enabled(True) is True
            assert kernels.set_enabled(False) is False
        assert kernels.set_enabled(True) is True
        assert not kernels.available(torch.zeros(1))  # CPU tensors never take the fused path
    finally:
        kernels.set_enabled(before)
