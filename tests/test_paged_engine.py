"""The engine over a paged KV state (ModelBackend(kv_blocks=) driven by the engine's KvBlockPool,
what `parley serve` runs) against the engine over dense rows, on the tiny checkpoints on CPU.

Same weights, shapes and device, and the paged eager path is the dense math on a gathered copy
of each ring (models/paged_kv.py): the outputs must be bit-identical, sessions that start late,
end and give their row (and blocks) to the next, run past their window (the ring wraps onto the
row's own blocks) and start with a PersonaPlex prompt (adopted through the block table) included.
The shrink policy changes what a shrunk row attends, so it is checked to keep serving only.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from parley.engine import Engine, EngineConfig, FrameOut, OptionsError, SamplingOptions, SessionOptions
from parley.engine.backend import ModelBackend, kv_layout
from parley.engine.kv_blocks import KvBlockPool, KvChanges, KvLayout
from delay_backend import DelayBackend
from parley.models import paged_kv
from parley.models.checkpoint import load_checkpoint
from parley.models.config import FRAME_SAMPLES
from parley.models.row_views import leading_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingOptions.greedy()
BLOCK = 8  # the tiny models' 40-frame window in 5 blocks (their default block is the whole window)


def speech_like(seed: int, frames: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(frames * FRAME_SAMPLES) / 24_000
    tone = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 400) * t)
    return (tone + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def engine_for(ckpt_dir, rows: int, paged: bool, blocks: int | None = None, policy: str = "reserve",
               device: str = "cpu", block: int = BLOCK):
    """An engine over the checkpoint: dense rows and no pool, or a paged state of `blocks` blocks
    (default: every row a full window) and its pool, as `parley serve` builds them (on CUDA: one
    graph per row bucket, the table rewritten between replays)."""
    checkpoint = load_checkpoint(ckpt_dir, device, torch.float32)
    config = EngineConfig(input_frames=256, output_events=1024)
    if not paged:
        backend = ModelBackend(checkpoint, rows, seed=0)
        return Engine(backend, config), backend
    layout = kv_layout(checkpoint, None, block)
    total = blocks if blocks is not None else rows * layout.window_blocks
    backend = ModelBackend(checkpoint, rows, seed=0, kv_blocks=total, kv_block_frames=layout.block_frames)
    return Engine(backend, config, kv=KvBlockPool(layout, rows, total, policy)), backend


def outputs(session) -> list[tuple[bytes, int]]:
    return [(e.pcm.tobytes(), e.text_token) for e in session.events.drain() if isinstance(e, FrameOut)]


def conversation(engine: Engine, options: SessionOptions) -> dict[str, list]:
    """Three rows' worth of sessions over 70 ticks: a from tick 0 to the end (wraps its 40-frame
    window), b from 0 to 20 then closed, c opened at 25 on b's row (its blocks reused), d from 10
    for 30 ticks. Each session's frames and text tokens."""
    async def main():
        sessions = {}
        out: dict[str, list] = {}

        def open_(name: str, seed: int, frames: int) -> None:
            s = engine.open_nowait(SessionOptions(sampling=GREEDY, persona=options.persona, voice=options.voice))
            s.push_audio(speech_like(seed, frames))
            sessions[name], out[name] = s, []

        open_("a", 1, 70)
        open_("b", 2, 20)
        for tick in range(70):
            if tick == 10:
                open_("d", 4, 30)
            if tick == 21:
                sessions["b"].close()
            if tick == 25:
                open_("c", 3, 40)
            engine.run_ticks(1)
            for name, s in sessions.items():
                out[name] += outputs(s)
        return out, {name: s.row for name, s in sessions.items()}

    result, rows = asyncio.run(main())
    engine.shutdown()
    assert rows["c"] == rows["b"]  # c took b's row (and, paged, its blocks)
    return result


@pytest.mark.parametrize("block", [BLOCK, 12], ids=["divides", "partial-last"])  # 40 = 3 x 12 + 4
def test_paged_engine_equals_dense_bit_for_bit(tiny_moshi_dir, block):
    dense_engine, _ = engine_for(tiny_moshi_dir, 3, paged=False)
    paged_engine, backend = engine_for(tiny_moshi_dir, 3, paged=True, block=block)
    dense = conversation(dense_engine, SessionOptions())
    paged = conversation(paged_engine, SessionOptions())
    assert backend.kv_paged
    assert len(paged["a"]) > 45  # past its 40-frame window: the ring wrapped onto its own blocks
    for name in ("a", "b", "c", "d"):
        assert len(paged[name]) == len(dense[name]) > 0, name
        assert paged[name] == dense[name], name
    counters = paged_engine.counters()
    assert counters["kv_shortfalls"] == 0 and counters["kv_blocks_high_water"] <= 3 * -(-40 // block)


def test_paged_personaplex_prompts_equal_dense_bit_for_bit(tiny_personaplex_dir):
    """Each session starts with a persona and voice prompt (prefilled apart, then adopted through
    the row's block table, whose blocks the pool maps before the prompt is written)."""
    prompt = SessionOptions(persona="Hi there", voice="NATF0")
    dense_engine, _ = engine_for(tiny_personaplex_dir, 3, paged=False)
    paged_engine, _ = engine_for(tiny_personaplex_dir, 3, paged=True)
    dense = conversation(dense_engine, prompt)
    paged = conversation(paged_engine, prompt)
    for name in ("a", "b", "c", "d"):
        assert len(paged[name]) == len(dense[name]) > 0, name
        assert paged[name] == dense[name], name


def test_shrink_policy_short_of_memory_keeps_serving(tiny_moshi_dir):
    """Three sessions on 9 blocks (a full window is 5): the pool runs out, takes the longest rows'
    oldest blocks, and every session gets a finite frame every tick."""
    engine, backend = engine_for(tiny_moshi_dir, 3, paged=True, blocks=9, policy="shrink")

    async def main():
        sessions = [engine.open_nowait(SessionOptions(sampling=GREEDY)) for _ in range(3)]
        for i, s in enumerate(sessions):
            s.push_audio(speech_like(i, 60))
        engine.run_ticks(60)
        return [[e for e in s.events.drain() if isinstance(e, FrameOut)] for s in sessions]

    frames = asyncio.run(main())
    counters = engine.counters()
    engine.shutdown()
    assert engine.healthy and engine.fatal_error is None
    assert counters["kv_shrinks"] > 0 and counters["kv_blocks_used"] <= 9
    for session_frames in frames:
        assert len(session_frames) >= 55  # every tick past the model's delay
        assert all(np.isfinite(f.pcm).all() for f in session_frames)


def test_map_kv_blocks_writes_the_captured_tensors_in_place(tiny_moshi_dir):
    """The graphs of each row bucket read the block table, slot positions and positions where they
    were captured: every change lands in those tensors (and their bucket views), none replaced."""
    backend = ModelBackend.load(tiny_moshi_dir, 4, seed=0, kv_blocks=12, kv_block_frames=BLOCK)
    state = backend._lm_state.transformer
    view = leading_rows(backend._lm_state, 2).transformer  # a bucket's view, as captured
    before = [t.data_ptr() for t in (state.block_table, state.slot_pos, state.pos, *state.keys)]
    backend.map_kv_blocks(KvChanges(assigned=[(1, 0, 3), (1, 1, 4), (2, 4, 5)]))
    assert state.block_table[1].tolist() == [3, 4, 0, 0, 0] and state.block_table[2, 4] == 5
    assert view.block_table[1].tolist() == [3, 4, 0, 0, 0]
    state.slot_pos[1, :16] = torch.arange(16)
    state.pos[1] = 16
    backend.map_kv_blocks(KvChanges(forgotten=[(1, 0)], assigned=[(1, 2, 3)]))
    assert state.block_table[1].tolist() == [0, 4, 3, 0, 0]
    assert state.slot_pos[1, :8].eq(-1).all() and state.slot_pos[1, 8:16].tolist() == list(range(8, 16))
    backend.map_kv_blocks(KvChanges(released=[1]))
    assert state.block_table[1].eq(paged_kv.NULL_BLOCK).all() and state.slot_pos[1].eq(-1).all()
    assert int(state.pos[1]) == 0 and view.block_table[1].eq(0).all()
    assert [t.data_ptr() for t in (state.block_table, state.slot_pos, state.pos, *state.keys)] == before
    backend.close()


def test_the_engine_pairs_a_pool_with_a_paged_state_only(tiny_moshi_dir):
    layout = KvLayout(window_frames=40, block_frames=BLOCK, block_bytes=1024)
    dense = ModelBackend.load(tiny_moshi_dir, 2, seed=0)
    with pytest.raises(OptionsError, match="paged KV state"):
        Engine(dense, kv=KvBlockPool(layout, 2, 10))
    paged = ModelBackend(dense.checkpoint, 2, seed=0, kv_blocks=10, kv_block_frames=BLOCK)
    with pytest.raises(OptionsError, match="block pool"):
        Engine(paged)
    with pytest.raises(OptionsError, match="paged KV state"):
        Engine(DelayBackend(2), kv=KvBlockPool(layout, 2, 10))  # no block table to map


def test_the_kv_layout_takes_the_models_block_rule(tiny_moshi_dir):
    checkpoint = ModelBackend.load(tiny_moshi_dir, 1, seed=0).checkpoint
    window = checkpoint.lm.transformer.capacity
    assert kv_layout(checkpoint, None).block_frames == paged_kv.block_size_for(window, None) == 40
    assert kv_layout(checkpoint, None, BLOCK).block_frames == BLOCK
    assert kv_layout(checkpoint, None, 12).block_frames == 12  # 4 blocks, the last holding 4 frames
    with pytest.raises(OptionsError, match="1 .. the 40-frame window"):
        kv_layout(checkpoint, None, 41)


def test_parley_serve_pages_the_duplex_model_in_the_models_blocks(tiny_moshi_dir):
    from parley.engine import KvSettings
    from parley.realtime.server.serve import ServeConfig, ServeError
    from parley.realtime.server.services import build_services

    def config(**kv) -> ServeConfig:
        return ServeConfig(model=str(tiny_moshi_dir), codec_workers=0, torch_threads=1, max_sessions=2,
                           kv=KvSettings(**kv))

    # The model's default block (the whole 40-frame window), a block that divides it, one that does not.
    for kv, block in (({}, 40), ({"block_frames": BLOCK}, BLOCK), ({"block_frames": 12}, 12)):
        engine = build_services(config(**kv)).engine
        try:
            assert engine._backend.kv_paged and engine.kv.layout.block_frames == block
            assert engine.kv.total == 2 * -(-40 // block)  # --max-sessions full windows
        finally:
            engine.shutdown()
    with pytest.raises(ServeError, match="--kv-.*40-frame window"):
        build_services(config(block_frames=41))
    # FlashInfer's decode (tests/test_flashinfer_decode.py) reads bf16 KV on CUDA: refused by name here.
    with pytest.raises(ServeError, match="--kv-attention: paged_attention flashinfer: it runs on CUDA"):
        build_services(config(attention="flashinfer"))


def test_page_list_attention_is_refused_where_it_cannot_run(tiny_moshi_dir):
    checkpoint = load_checkpoint(tiny_moshi_dir, "cpu", torch.float32)
    with pytest.raises(OptionsError, match="one of parley, flashinfer"):
        ModelBackend(checkpoint, 1, kv_blocks=5, paged_attention="sdpa")
    with pytest.raises(OptionsError, match="flashinfer: it reads a paged KV cache"):
        ModelBackend(checkpoint, 1, paged_attention="flashinfer")
    with pytest.raises(OptionsError, match="flashinfer: it runs on CUDA"):
        ModelBackend(checkpoint, 1, kv_blocks=5, paged_attention="flashinfer")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paged_engine_under_cuda_graphs_equals_dense(tiny_moshi_dir):
    """The same conversation on CUDA, each tick a row bucket's graph replay: the paged engine's
    text equals the dense engine's and its audio is within test_engine_models' graph tolerance
    (the paged kernels run the dense arithmetic in the same order; bits may still differ)."""
    dense = conversation(engine_for(tiny_moshi_dir, 3, paged=False, device="cuda")[0], SessionOptions())
    paged_engine, _ = engine_for(tiny_moshi_dir, 3, paged=True, device="cuda")
    paged = conversation(paged_engine, SessionOptions())
    for name in ("a", "b", "c", "d"):
        assert len(paged[name]) == len(dense[name]) > 0, name
        assert [t for _, t in paged[name]] == [t for _, t in dense[name]], name
        for (p, _), (d, _) in zip(paged[name], dense[name]):
            np.testing.assert_allclose(np.frombuffer(p, np.float32), np.frombuffer(d, np.float32), atol=1e-5)
    shrink, _ = engine_for(tiny_moshi_dir, 3, paged=True, blocks=9, policy="shrink", device="cuda")
    conversation(shrink, SessionOptions())
    assert shrink.healthy and shrink.counters()["kv_shrinks"] > 0
