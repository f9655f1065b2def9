"""One copy of weights that two loaded models hold equal (e.g. the Mimi codec that Kyutai's TTS
and STT checkpoints ship as the very file the duplex model uses).

    shared_bytes = share_equal_tensors(tts_mimi, duplex_mimi)

Every parameter and buffer of `target` whose counterpart in `source` (same name) is equal in
shape, dtype, device and value is replaced by the source's tensor, so the target's copy is freed.
Call it before capturing CUDA graphs on `target` (graphs keep the addresses they saw). Inference
never writes weights, so sharing them between modules is safe; anything unequal stays as loaded.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import nn


def share_equal_tensors(target: nn.Module, source: nn.Module) -> int:
    """Point `target`'s equal tensors at `source`'s; returns the bytes no longer held twice."""
    theirs = dict(chain(source.named_parameters(remove_duplicate=False), source.named_buffers(remove_duplicate=False)))
    shared = 0
    for name, mine in list(chain(target.named_parameters(remove_duplicate=False),
                                 target.named_buffers(remove_duplicate=False))):
        other = theirs.get(name)
        if other is None or other is mine or not _equal(mine, other):
            continue
        owner_name, _, attr = name.rpartition(".")
        setattr(target.get_submodule(owner_name), attr, other)  # re-registers the parameter or buffer
        shared += mine.numel() * mine.element_size()
    return shared


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return isinstance(a, nn.Parameter) == isinstance(b, nn.Parameter) and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
