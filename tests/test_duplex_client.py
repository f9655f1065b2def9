"""examples/duplex_client.py: its --help names every default a user would otherwise have to read
the source for (where the reply goes, which server it talks to)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "duplex_client.py"


def load_example():
    spec = importlib.util.spec_from_file_location("duplex_client", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_names_every_default():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    options = " ".join(out.split("\noptions:\n", 1)[1].split())  # the flags' section, unwrapped
    # each flag's help runs from its option string to the next flag's
    helps = dict(re.findall(r"(--[\w-]+)(.*?)(?= --[\w-]+ |$)", options))
    for flag, default in (("--url", "ws://127.0.0.1:8998"), ("--out", "reply.wav"), ("--text-out", "reply.txt"),
                          ("--tail", "3.0")):
        assert f"default {default}" in helps[flag], (flag, helps[flag])
    assert "default: its speech-to-speech model" in helps["--model"], helps["--model"]
    # and any default added later: every flag whose default is worth printing shows it
    for action in load_example().build_parser()._actions:
        if action.option_strings and action.default not in (None, "", False, argparse.SUPPRESS):
            assert f"default {action.default}" in helps[action.option_strings[-1]], action.option_strings
