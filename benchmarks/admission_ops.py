"""How many eager ops a TTS admission launches (CPU, seconds): the count, not a timing.

    python benchmarks/admission_ops.py

On the GPU every eager op of an admission costs a launch (several us) and each pageable host ->
device copy a stream round trip, so the count is what the admission's host side costs there. A
tiny random TTS checkpoint, graphs off (CPU): `TtsPool._load_row` of a short request into a
warmed row, then its `TtsGen.begin` alone (the part a CUDA pool runs eagerly, beside the graphed
reset and voice). Counted: top-level aten ops (those not called by another aten op).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from parley.engine.slack import CostModel
from parley.engine.tts_pool import TtsPool, TtsRequest
from parley.models.dsm import split_words
from parley.models.synthetic import TINY_TTS_VOICES, write_tiny_tts_checkpoint
from parley.models.tts_checkpoint import VoiceStore, load_tts_checkpoint


def top_level_ops(fn) -> Counter:
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops: Counter = Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            ops[event.name] += 1
    return ops


def main() -> None:
    torch.set_num_threads(1)
    directory = write_tiny_tts_checkpoint(Path(tempfile.mkdtemp(prefix="admission-ops-")), seed=3)
    ck = load_tts_checkpoint(directory, dtype=torch.float32)
    store = VoiceStore.open(directory / "voices", ck.config.voice_suffix, 16)
    pool = TtsPool(ck.lm, ck.mimi, 8, voice_frames=10)
    pool.warm_up(CostModel())
    req = TtsRequest(tuple(split_words("How are you doing today?", ck.tokenizer.encode, 12.5)),
                     (store.load(TINY_TTS_VOICES[0]),), {"control": "ok", "cfg": "2.0"})
    pool._load_row(1, req)  # the same request once first: warm kernels and caches
    load_row = top_level_ops(lambda: pool._load_row(2, req))
    begin = top_level_ops(lambda: pool._gen.begin(2, req.entries, req.conditions, req.padding_bonus,
                                                  req.text_temperature, req.text_top_k,
                                                  req.audio_temperature, req.audio_top_k))
    print(f"TtsPool._load_row: {sum(load_row.values())} top-level aten ops")
    print(f"TtsGen.begin: {sum(begin.values())} top-level aten ops: "
          + ", ".join(f"{name} {n}" for name, n in begin.most_common(8)))


if __name__ == "__main__":
    main()
