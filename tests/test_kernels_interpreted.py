"""The fused CUDA path on the CPU, in the Triton interpreter (tests/interpreted_kernels.py): the
kernels, the transformer's one-step decode, whole LM frames
and Mimi steps, float32 against the plain path; then paged KV rings (block tables) against dense
ones through the same kernels (group `moshi`); then grouped KV heads and rope_concat (Hibiki-Zero's
attention, group `grouped`), in a process of its own.

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


EXPECTED = {
    "moshi": ["decode_attention", "rope_write", "norms", "sample", "fp8", "transformer_decode", "frame",
              "paged_attention", "paged_rope_write", "paged_transformer_decode", "page_list_decode"],
    "grouped": ["grouped_attention", "grouped_rope_write", "grouped_transformer_decode", "grouped_page_list_decode"],
}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the test extra)")
@pytest.mark.parametrize("group", list(EXPECTED))
def test_fused_kernels_in_the_interpreter_match_pytorch(group):
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "interpreted_kernels.py"), group], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.split() == [word for name in EXPECTED[group] for word in ("ok", name)]
