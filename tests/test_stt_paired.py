"""Paired transcription: STT rows read the duplex frame's own Mimi codes (engine/stt_paired.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from parley.engine import Engine, EngineConfig, FrameOut, OptionsError, SessionOptions
from parley.engine.backend import ModelBackend
from parley.engine.stream import Status, Terminal
from parley.engine.stt_paired import PairedTranscription
from parley.engine.stt_pool import SttPartial
from parley.models.checkpoint import load_checkpoint, load_stt_checkpoint
from parley.models.stt import SttGen
from parley.models.stt_text import TranscriptDecoder
from parley.models.synthetic import write_tiny_checkpoint, write_tiny_stt_checkpoint

TICKS = 10
ARRIVED = 5.0  # the input's arrival time (time.monotonic() scale) as the edge would stamp it


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    torch.set_num_threads(1)
    # A duplex Mimi with 16 codebooks (the LM reads 8) and an STT reading 12 of them.
    duplex = write_tiny_checkpoint(tmp_path_factory.mktemp("duplex16"), mimi_levels=16)
    return duplex, write_tiny_stt_checkpoint(tmp_path_factory.mktemp("stt12"), n_q=12, mimi_from=duplex)


def speech_like(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(TICKS * 1920) / 24_000
    return (0.3 * np.sin(2 * np.pi * rng.uniform(100, 400) * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def run(dirs, paired: bool, slots: int = 2, row_buckets: bool | None = None, in_frame: bool = True):
    """in_frame: the STT steps inside the frame on its latent (backend side work), else after the
    frame on the codes the frame encoded."""
    duplex, stt_dir = dirs
    transcription = None
    if paired:
        transcription = PairedTranscription(load_stt_checkpoint(stt_dir, dtype=torch.float32), slots,
                                            in_frame=in_frame)
    backend = ModelBackend(load_checkpoint(duplex, dtype=torch.float32), slots, seed=7,
                           encode_codebooks=12 if paired and not in_frame else None, row_buckets=row_buckets,
                           side_work=transcription.frame_work if transcription is not None else None)
    engine = Engine(backend, EngineConfig())
    if paired:
        engine.set_paired_transcription(transcription)

    async def main():
        sessions = [engine.open_nowait(SessionOptions()) for _ in range(2)]  # sampled, fixed seed
        engine.run_ticks(1)
        transcript = None
        for i, s in enumerate(sessions):
            await s.ready
            s.push_audio(speech_like(i), received_at=ARRIVED + i)
        if paired:
            transcript = engine.enable_transcription(sessions[0])
        engine.run_ticks(TICKS)
        frames = [[e for e in s.events.drain() if isinstance(e, FrameOut)] for s in sessions]
        counters = engine.counters()
        sessions[0].close()
        engine.run_ticks(1)
        await asyncio.sleep(0)
        if paired:  # /metrics: one row transcribed every tick
            assert counters["stt_paired_live"] == 1 and counters["stt_paired_slots"] == slots
            assert counters["stt_paired_steps"] == counters["stt_paired_rows_stepped"] == TICKS
            assert counters["stt_paired_dropped"] == 0
            assert counters["stt_paired_model_delay_seconds"] == SttGen(transcription.checkpoint.lm).text_delay / 12.5
        else:
            assert "stt_paired_live" not in counters
        transcript = transcript.drain() if paired else None
        if paired:  # every step read one of the frames pushed (no underrun): stamped with their arrival
            assert [e.input_at for e in transcript if isinstance(e, SttPartial) and e.input_at is not None] \
                == [ARRIVED] * TICKS
        return frames, transcript

    result = asyncio.run(main())
    engine.shutdown()
    return result


@pytest.mark.parametrize("in_frame", [True, False])
def test_duplex_output_is_bit_identical_with_paired_transcription(dirs, in_frame):
    plain, _ = run(dirs, paired=False)
    frames, transcript = run(dirs, paired=True, in_frame=in_frame)
    for a, b in zip(plain, frames):
        assert len(a) == len(b) == TICKS - 1
        for x, y in zip(a, b):
            assert np.array_equal(x.pcm, y.pcm) and x.text_token == y.text_token

    # The transcript is what the STT makes of the same audio, codes from a fresh 12-codebook encode.
    stt = load_stt_checkpoint(dirs[1], dtype=torch.float32)
    codes = stt.mimi.encode(torch.from_numpy(speech_like(0))[None])[0].T
    gen = SttGen(stt.lm)
    state = gen.init_state(1)
    dec = TranscriptDecoder(stt.tokenizer, gen.text_delay)
    eot = []
    for step, frame in enumerate(codes):
        out = gen.step(state, frame[None], torch.ones(1, dtype=torch.bool))
        eot.append(float(out.end_of_turn[0]))
        if out.valid[0]:
            dec.feed(int(out.text[0]), step)
    assert transcript[-1] == Terminal(Status.COMPLETED)  # the session closed: its transcript ended
    parts = [p for p in transcript[:-1] if isinstance(p, SttPartial)]
    assert len(parts) >= TICKS  # one per frame (+ the flushed last word)
    assert "".join(p.text for p in parts).strip() == dec.text and dec.text
    np.testing.assert_allclose([p.end_of_turn for p in parts[:TICKS]], eot, rtol=1e-5)


def test_enable_without_stt_model_names_it(dirs):
    engine = Engine(ModelBackend(load_checkpoint(dirs[0], dtype=torch.float32), 1), EngineConfig())

    async def main():
        session = engine.open_nowait(SessionOptions())
        with pytest.raises(OptionsError, match="speech-to-text"):
            engine.enable_transcription(session)
    asyncio.run(main())
    engine.shutdown()


def test_in_frame_transcription_needs_the_backend_side_work(dirs):
    engine = Engine(ModelBackend(load_checkpoint(dirs[0], dtype=torch.float32), 1), EngineConfig())
    stt = load_stt_checkpoint(dirs[1], dtype=torch.float32)
    engine.set_paired_transcription(PairedTranscription(stt, 1, in_frame=True))

    async def main():
        session = engine.open_nowait(SessionOptions())
        engine.run_ticks(1)
        await session.ready
        engine.enable_transcription(session)
        engine.run_ticks(1)
    asyncio.run(main())
    assert not engine.healthy and "side_work=paired.frame_work" in engine.fatal_error
    engine.shutdown()


def test_backend_refuses_more_codebooks_than_mimi_has(dirs):
    with pytest.raises(ValueError, match="encode_codebooks"):
        ModelBackend(load_checkpoint(dirs[0], dtype=torch.float32), 1, encode_codebooks=17)


def test_paired_transcription_in_a_row_bucket(dirs):
    """Two sessions in a 4-slot backend with row buckets: the frame runs rows 0-1 only, the STT
    steps the same rows of its state, and both give what a 2-slot backend gives."""
    frames2, transcript2 = run(dirs, paired=True)
    frames4, transcript4 = run(dirs, paired=True, slots=4, row_buckets=True)
    for a, b in zip(frames2, frames4):
        assert len(a) == len(b) == TICKS - 1
        assert all(np.array_equal(x.pcm, y.pcm) and x.text_token == y.text_token for x, y in zip(a, b))
    assert len(transcript4) > TICKS and list(map(repr, transcript4)) == list(map(repr, transcript2))  # NaN eot


def test_a_shutdown_ends_the_transcript_streams(dirs):
    """engine.shutdown ends each session; a transcript stream ended only at the engine thread's
    next tick, which never came, so a client following it waited forever."""
    duplex, stt_dir = dirs
    transcription = PairedTranscription(load_stt_checkpoint(stt_dir, dtype=torch.float32), 2, in_frame=True)
    backend = ModelBackend(load_checkpoint(duplex, dtype=torch.float32), 2, seed=7,
                           side_work=transcription.frame_work)
    engine = Engine(backend, EngineConfig())
    engine.set_paired_transcription(transcription)

    async def main():
        live, late = engine.open_nowait(SessionOptions()), engine.open_nowait(SessionOptions())
        engine.run_ticks(1)
        await live.ready
        await late.ready
        stepped = engine.enable_transcription(live)
        engine.run_ticks(2)
        queued = engine.enable_transcription(late)  # not yet applied by a tick
        engine.shutdown()
        await asyncio.sleep(0)
        for stream in (stepped, queued):
            events = stream.drain()
            assert isinstance(events[-1], Terminal) and events[-1].status is Status.CANCELLED, events[-3:]

    asyncio.run(main())
