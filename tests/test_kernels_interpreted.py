"""The fused CUDA path on the CPU, in the Triton interpreter (tests/interpreted_kernels.py): the
kernels, the transformer's one-step decode, whole LM frames
and Mimi steps, float32 against the plain path; then paged KV rings (block tables) against dense
ones through the same kernels; then grouped KV heads and rope_concat (Hibiki-Zero's attention).

CI has no GPU, so without this a change to the CUDA path is first run in a GPU session. The
interpreter is picked when the kernels are defined: the checks run in a process of their own.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the test extra)")
def test_fused_kernels_in_the_interpreter_match_pytorch():
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "interpreted_kernels.py")], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.split() == ["ok", "decode_attention", "ok", "rope_write", "ok", "norms", "ok", "sample",
                                   "ok", "fp8", "ok", "transformer_decode", "ok", "frame",
                                   "ok", "paged_attention", "ok", "paged_rope_write", "ok", "paged_transformer_decode",
                                   "ok", "page_list_decode", "ok", "grouped_attention", "ok", "grouped_rope_write",
                                   "ok", "grouped_transformer_decode"]
