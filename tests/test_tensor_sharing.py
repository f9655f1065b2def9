"""Equal weights held once: share_equal_tensors, and the TTS service sharing the duplex Mimi."""

from __future__ import annotations

import numpy as np
import torch

from parley.engine.tts_offline import synthesize
from parley.models.config import tiny_mimi_config
from parley.models.mimi.codec import Mimi
from parley.models.tensor_sharing import share_equal_tensors
from parley.models.tts_checkpoint import load_tts_checkpoint
from parley.realtime.server.speech_setup import load_speech_service


def _copy(mimi: Mimi) -> Mimi:
    twin = Mimi(tiny_mimi_config())
    twin.load_state_dict(mimi.state_dict())
    for module in twin.modules():  # derived (non-persistent) buffers follow the loaded codebooks
        if hasattr(module, "refresh_embedding"):
            module.refresh_embedding()
    return twin


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def test_equal_modules_end_up_holding_one_copy_and_compute_the_same():
    torch.manual_seed(0)
    source = Mimi(tiny_mimi_config())
    target = _copy(source)
    pcm = torch.randn(1, 4 * 1920, generator=torch.Generator().manual_seed(1))
    codes = target.encode(pcm)
    shared = share_equal_tensors(target, source)
    theirs = _tensors(source)
    assert shared >= sum(p.numel() * 4 for p in source.parameters())
    assert all(t is theirs[name] for name, t in _tensors(target).items())
    assert torch.equal(target.encode(pcm), codes)


def test_only_equal_tensors_are_shared():
    torch.manual_seed(0)
    source = Mimi(tiny_mimi_config())
    target = _copy(source)
    name, changed = next(iter(target.named_parameters()))
    with torch.no_grad():
        changed.add_(1.0)
    share_equal_tensors(target, source)
    mine, theirs = _tensors(target), _tensors(source)
    assert mine[name] is not theirs[name] and not torch.equal(mine[name], theirs[name])
    assert sum(t is theirs[n] for n, t in mine.items()) == len(mine) - 1


def test_speech_service_shares_the_duplex_mimi_and_speaks_the_same(tiny_tts_dir):
    duplex_mimi = load_tts_checkpoint(tiny_tts_dir, "cpu", torch.float32).mimi  # the same Mimi file
    plain = load_speech_service(tiny_tts_dir, slots=1, voices=tiny_tts_dir / "voices", voice_map=None,
                                device="cpu", dtype=torch.float32)
    shared = load_speech_service(tiny_tts_dir, slots=1, voices=tiny_tts_dir / "voices", voice_map=None,
                                 device="cpu", dtype=torch.float32, share_mimi=duplex_mimi)
    theirs = _tensors(duplex_mimi)
    assert all(t is theirs[n] for n, t in _tensors(shared.pool.mimi).items())
    assert not any(t is theirs[n] for n, t in _tensors(plain.pool.mimi).items())
    outputs = []
    for service in (plain, shared):
        service.front_end.sampling = {"text_temperature": 0.0, "audio_temperature": 0.0}
        request, _ = service.front_end.request("hello there", service.voices.names()[0])
        outputs.append(synthesize(service.pool, request).pcm)
    assert outputs[0].size > 0 and np.array_equal(outputs[0], outputs[1])
