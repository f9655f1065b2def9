"""Translation sessions (Hibiki) in the engine: many in one tick over the paged KV state, the
window sliding past the context, and the end of a source (engine/translation.py), on the CPU
with tiny random Hibiki-Zero- and Hibiki-shaped checkpoints (models/synthetic.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from parley.engine import Engine, EngineConfig, FrameOut, KvBlockPool, OptionsError, SamplingOptions, SessionOptions
from parley.engine import Status, Terminal, kv_layout
from parley.engine.backend import BackendOutput, ModelBackend
from parley.models.checkpoint import load_checkpoint
from parley.models.config import FRAME_SAMPLES, TEXT_EOS
from parley.models.lm import LMModel
from parley.models.synthetic import HIBIKI_KINDS, write_tiny_hibiki_checkpoint

GREEDY = SessionOptions(sampling=SamplingOptions.greedy())
BLOCK = 8  # the tiny 40-frame window in 5 blocks
FRAMES = 50  # > the 40-frame context: every row's window slides
MAX_DELAY = 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=HIBIKI_KINDS)
def hibiki_dir(request, tmp_path_factory):
    return write_tiny_hibiki_checkpoint(tmp_path_factory.mktemp(request.param), kind=request.param)


class Recording:
    """Wraps a backend: keeps each tick's user codes; `eos_text_at` (tick -> row) fabricates the
    model saying end of text there (the engine's reaction is under test, not the weights)."""

    def __init__(self, inner: ModelBackend, eos_text_at: dict[int, int] | None = None) -> None:
        self.inner = inner
        self.max_sessions = inner.max_sessions
        self.user: list[torch.Tensor] = []
        self._eos_text_at = eos_text_at or {}

    def step(self, frames: torch.Tensor, live_mask: torch.Tensor) -> BackendOutput:
        out = self.inner.step(frames, live_mask)
        self.user.append(out.user_codes.cpu().clone())
        row = self._eos_text_at.get(len(self.user) - 1)
        if row is not None:
            text = out.text_tokens.clone()
            text[row] = TEXT_EOS
            out.text_tokens, out.packed = text, None  # to_host packs the fabricated text
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def paged_engine(ckpt_dir, rows: int, eos_text_at: dict[int, int] | None = None):
    checkpoint = load_checkpoint(ckpt_dir, "cpu", torch.float32)
    layout = kv_layout(checkpoint, None, BLOCK)
    total = rows * layout.window_blocks
    backend = Recording(ModelBackend(checkpoint, rows, seed=0, kv_blocks=total, kv_block_frames=layout.block_frames),
                        eos_text_at)
    return Engine(backend, EngineConfig(input_frames=256, output_events=1024),
                  kv=KvBlockPool(layout, rows, total, "reserve")), backend


def source(seed: int, frames: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(frames * FRAME_SAMPLES) / 24_000
    return (0.3 * np.sin(2 * np.pi * rng.uniform(100, 400) * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def events(session) -> list:
    return list(session.events.drain())


def frames_of(evts) -> list[tuple[bytes, int]]:
    return [(e.pcm.tobytes(), e.text_token) for e in evts if isinstance(e, FrameOut)]


def run(engine: Engine, talking: list[int], rows: int = 3, ticks: int = FRAMES, end_after: dict[int, int] = {}):
    """Open `rows` greedy sessions; those not in `talking` close at once (their rows stay idle).
    Talkers get their source; `end_after` {session: tail_frames} ends their input. -> events."""
    async def main():
        sessions = [engine.open_nowait(GREEDY) for _ in range(rows)]
        engine.run_ticks(1)
        for i, s in enumerate(sessions):
            await s.ready
            if i not in talking:
                s.close()
        for i in talking:
            sessions[i].push_audio(source(i, FRAMES))
            if i in end_after:
                sessions[i].end_input(tail_frames=end_after[i])
        engine.run_ticks(ticks)
        return sessions, [events(s) for s in sessions]
    return asyncio.run(main())


def test_translations_in_one_tick_give_each_its_tokens_alone(hibiki_dir):
    """Three sessions stepped together over the paged KV give each the frames it gets with the
    other rows idle (same shapes: bit for bit), past the context window."""
    engine, _ = paged_engine(hibiki_dir, 3)
    _, together = run(engine, talking=[0, 1, 2])
    for i in range(3):
        frames = frames_of(together[i])
        assert len(frames) == FRAMES - MAX_DELAY, "a frame a tick once the delays have passed"
        assert len({t for _, t in frames}) > 1, "degenerate test: the text never changes"
        alone_engine, _ = paged_engine(hibiki_dir, 3)
        _, alone = run(alone_engine, talking=[i])
        assert frames == frames_of(alone[i]), f"session {i} changed with others beside it"
    assert frames_of(together[0]) != frames_of(together[1])


def test_kv_blocks_hold_the_grouped_heads_only(hibiki_dir):
    """The KV pool sizes a block by the heads the ring stores: num_heads / kv_repeat."""
    checkpoint = load_checkpoint(hibiki_dir, "cpu", torch.float32)
    cfg, tr = checkpoint.lm_config, checkpoint.lm.transformer
    assert tr.kv_heads == cfg.num_heads // cfg.kv_repeat
    per_slot = 2 * tr.kv_heads * (cfg.dim // cfg.num_heads) * 4  # a key and a value, fp32
    assert kv_layout(checkpoint, None, BLOCK).block_bytes == per_slot * cfg.num_layers * BLOCK


def test_end_of_input_writes_the_end_code_once_after_the_last_audio(hibiki_dir):
    engine, backend = paged_engine(hibiki_dir, 2)
    sessions, evts = run(engine, talking=[0, 1], rows=2, ticks=FRAMES + 8, end_after={0: 5})
    # Steps 0 .. FRAMES - 1 read the source (tick 0 ran no step: the rows were being prefilled);
    # step FRAMES carries the end code.
    eos_tick = FRAMES
    card = 2048
    codes = torch.stack(backend.user)  # [ticks, rows, 16]
    assert (codes[eos_tick, 0] == card).all()
    assert not (codes[:eos_tick, 0] == card).any() and not (codes[eos_tick + 1:, 0] == card).any()
    assert not (codes[:, 1] == card).any(), "the other session's source did not end"
    # No end of text from these random weights: the tail (5 frames) ends the session, completed.
    assert evts[0][-1] == Terminal(Status.COMPLETED, "the model said no end of text within the tail after "
                                                     "the source ended")
    assert len(frames_of(evts[0])) == FRAMES - MAX_DELAY + 5
    assert not sessions[1].closed


def test_the_models_end_of_text_ends_the_translation_before_that_frame(hibiki_dir):
    eos_tick = FRAMES  # the step that carries the end code (as above)
    # An end of text while the source plays is padding; the one 3 frames after the end code ends it.
    engine, _ = paged_engine(hibiki_dir, 1, eos_text_at={10: 0, eos_tick + 3: 0})
    sessions, evts = run(engine, talking=[0], rows=1, ticks=FRAMES + 8, end_after={0: 100})
    assert evts[0][-1] == Terminal(Status.COMPLETED, "the translation is complete")
    frames = frames_of(evts[0])
    assert len(frames) == FRAMES - MAX_DELAY + 3, "the end-of-text frame is not sent"
    assert frames[10 - MAX_DELAY][1] == TEXT_EOS, "the early end of text went out as a frame"


def test_a_source_ended_before_the_session_is_live_is_still_translated_then_ends(hibiki_dir):
    engine, backend = paged_engine(hibiki_dir, 1)

    async def main():
        s = engine.open_nowait(GREEDY)
        s.push_audio(source(0, 3))
        s.end_input(tail_frames=4)  # before its first tick: it is not prefilled yet
        engine.run_ticks(12)
        return s, events(s)
    s, evts = asyncio.run(main())
    assert s.closed and evts[-1].status is Status.COMPLETED
    codes = torch.stack(backend.user)[:, 0]
    assert (codes[3] == 2048).all() and not (codes[:3] == 2048).any(), "three frames of audio, then the end code"


def test_audio_after_the_end_of_input_fails_that_session_only(hibiki_dir):
    engine, _ = paged_engine(hibiki_dir, 2)

    async def main():
        a, b = engine.open_nowait(GREEDY), engine.open_nowait(GREEDY)
        engine.run_ticks(1)
        await a.ready
        await b.ready
        a.push_audio(source(0, 2)[:1000])
        a.end_input()
        a.push_audio(source(0, 1))
        return a, b, events(a)
    a, b, evts = asyncio.run(main())
    assert evts[-1] == Terminal(Status.FAILED, "the input has ended; no more audio is taken after it.")
    assert not b.closed


def test_ending_the_input_of_a_model_that_does_not_translate_is_refused(tiny_moshi_dir):
    engine = Engine(ModelBackend.load(tiny_moshi_dir, 1, seed=0))

    async def main():
        s = engine.open_nowait(GREEDY)
        engine.run_ticks(1)
        await s.ready
        with pytest.raises(OptionsError, match="this model does not translate"):
            s.end_input()
    assert not engine.translates
    asyncio.run(main())


def test_flashinfer_page_lists_take_grouped_heads_and_rope_concat_and_refuse_other_group_sizes(hibiki_dir):
    """Grouped KV heads and rope_concat take the fused decode, whose page lists FlashInfer reads
    (keys rotated by our kernel first; grouped heads as FlashInfer's GQA): on the CPU the refusal
    is FlashInfer's own device, not the model's attention. A kv_repeat FlashInfer's decode does
    not dispatch (3) is refused by name before anything is built."""
    checkpoint = load_checkpoint(hibiki_dir, "cpu", torch.float32)
    layout = kv_layout(checkpoint, None, BLOCK)
    with pytest.raises(OptionsError, match="paged_attention flashinfer: it runs on CUDA"):
        ModelBackend(checkpoint, 2, seed=0, kv_blocks=2 * layout.window_blocks, kv_block_frames=layout.block_frames,
                     paged_attention="flashinfer")
    cfg = dataclasses.replace(checkpoint.lm_config, dim=96, num_heads=3, kv_repeat=3, depformer_kv_repeat=1)
    torch.manual_seed(0)
    checkpoint = dataclasses.replace(checkpoint, lm=LMModel(cfg).eval(), lm_config=cfg)
    with pytest.raises(OptionsError, match="paged_attention flashinfer: this model's kv_repeat 3"):
        ModelBackend(checkpoint, 2, seed=0, kv_blocks=2 * layout.window_blocks, kv_block_frames=layout.block_frames,
                     paged_attention="flashinfer")
