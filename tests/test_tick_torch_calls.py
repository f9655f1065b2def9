"""The engine thread's torch calls per tick stay few, however many rows change at once.

Every torch call gives the GIL up, and taking it back waits while the event loop runs Python:
about half a millisecond a call beside a busy loop (the switch interval), which at ~270 sessions
made most ticks late on the H200 (docs/benchmarks.md). So the tick's host side must not make a
call per row: a tick's block changes are one batch (TransformerState.map_blocks), a reset is one
program (engine/row_reset.py, one graph replay on CUDA), the frame's output one packed copy.

Counted here: Python-level torch calls on the thread running the ticks, outside the device
programs (the frame's BucketedStep and the reset program, each a single replay on CUDA), on the
tiny paged checkpoint on CPU, through opens one a tick, block boundaries that many rows cross in
the same tick, and every session closing in one tick.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from parley.engine import Engine, EngineConfig, SamplingOptions, SessionOptions
from parley.engine.backend import ModelBackend, kv_layout
from parley.engine.bucketed_step import BucketedStep
from parley.engine.kv_blocks import KvBlockPool
from parley.engine.row_reset import RowReset
from parley.models.checkpoint import load_checkpoint
from parley.models.config import FRAME_SAMPLES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 8  # frames per KV block: rows opened 8 ticks apart cross a block boundary in the same tick


class CallCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.inside_program = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.inside_program:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def programs_uncounted(counter: CallCounter, monkeypatch):
    """The device programs' own calls are one replay each on CUDA: not counted."""
    for cls, name in ((BucketedStep, "__call__"), (RowReset, "_program")):
        original = getattr(cls, name)

        def wrapped(self, *args, _original=original):
            counter.inside_program += 1
            try:
                return _original(self, *args)
            finally:
                counter.inside_program -= 1
        monkeypatch.setattr(cls, name, wrapped)
    yield


def calls_per_tick(ckpt_dir, rows: int, monkeypatch) -> list[int]:
    checkpoint = load_checkpoint(ckpt_dir, "cpu", torch.float32)
    layout = kv_layout(checkpoint, None, BLOCK)
    total = rows * layout.window_blocks
    backend = ModelBackend(checkpoint, rows, seed=0, kv_blocks=total, kv_block_frames=layout.block_frames)
    engine = Engine(backend, EngineConfig(input_frames=256, output_events=4096),
                    kv=KvBlockPool(layout, rows, total, "reserve"))
    counter = CallCounter()
    pcm = np.zeros(FRAME_SAMPLES * 64, np.float32)

    async def main() -> list[int]:
        sessions, counts = [], []
        for tick in range(rows + 2 * BLOCK + 4):
            if tick < rows:  # one open a tick (each open sets its row's sampling: a few calls)
                session = engine.open_nowait(SessionOptions(sampling=SamplingOptions.greedy()))
                session.push_audio(pcm)
                sessions.append(session)
            if tick == rows + 2 * BLOCK:  # every session ends in this tick: one reset, one release batch
                for session in sessions:
                    session.close()
            with programs_uncounted(counter, monkeypatch), counter:
                counter.calls = 0
                engine.run_ticks(1)
            counts.append(counter.calls)
            monkeypatch.undo()
            for session in sessions:
                session.events.drain()
        return counts

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_ticks_torch_calls_do_not_grow_with_the_rows_it_changes(tiny_moshi_dir, monkeypatch):
    few = calls_per_tick(tiny_moshi_dir, 4, monkeypatch)
    many = calls_per_tick(tiny_moshi_dir, 16, monkeypatch)
    # With 16 rows, two rows cross a block boundary in the same tick, and 16 end in one tick; per
    # row that was ~25 calls a block and ~250 a reset, each half a millisecond beside a busy loop.
    assert max(many) == max(few), (few, many)
    assert max(many) <= 30, many
    assert min(many[:-4]) >= 5, many  # the count sees the tick (a frame is a few calls; idle ticks none)
