"""Session-wide test checkpoints, written once by Parley's own code in the published layout.

    tiny_moshi_dir        tiny random Moshi (dep_q 8), fp32 LM
    tiny_personaplex_dir  tiny random PersonaPlex (dep_q 16), fp32 LM, voices.tgz
    echo_dir              constructed echo LM (models/synthetic.py): agent frame f == user frame f - 1
    tiny_tts_dir          tiny random DSM TTS (tts-1.6b-en_fr layout), fp32, voices in voices/

Treat them as read-only: tests that damage a checkpoint copy it first (`copy_checkpoint`).

New tests follow tests/README.md: bit-exact only for the same computation (same shapes, device
and weights in memory), a stated tolerance across batch shapes, reloads and devices; a fake
clock, never a measured duration, for anything that schedules.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import torch

from parley.models.synthetic import write_echo_checkpoint, write_tiny_checkpoint, write_tiny_tts_checkpoint


@pytest.fixture(scope="session")
def tiny_moshi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_moshi"), kind="moshi")


@pytest.fixture(scope="session")
def tiny_personaplex_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_personaplex"), kind="personaplex")


@pytest.fixture(scope="session")
def echo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_echo_checkpoint(tmp_path_factory.mktemp("echo"))


@pytest.fixture(scope="session")
def tiny_tts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tts_checkpoint(tmp_path_factory.mktemp("tiny_tts"), seed=3)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared box: intra-op threads only spin against each other (use with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def copy_checkpoint(tmp_path: Path):
    """copy_checkpoint(src) -> a private copy of a checkpoint directory, safe to modify."""

    def copy(src: Path) -> Path:
        dst = tmp_path / src.name
        # As published: without the voices/ folder an earlier load may have unpacked from voices.tgz.
        unpacked = (lambda d, names: ["voices"] if Path(d) == src and "voices.tgz" in names else [])
        shutil.copytree(src, dst, ignore=unpacked)
        return dst

    return copy
