"""The engine client (realtime/engine_client.py) in its in-process form, over the echo backend on the
manual clock: the doors' calls give the engine's behaviour back as plain messages and the client's
own admission errors, and a re-prefill hands the slot over with nothing able to take it between.
The pools' calls (a live transcription row, speech whose text streams in, their slots) run on the
tiny STT and TTS checkpoints, their pools stepped by hand; the model stepped directly is the oracle."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from delay_backend import DelayBackend
from parley.engine import Engine, EngineConfig
from parley.engine.slack import CostModel
from parley.engine.stt_pool import SttPool
from parley.engine.tts_offline import synthesize
from parley.models.checkpoint import load_stt_checkpoint
from parley.models.config import FRAME_RATE, FRAME_SAMPLES
from parley.models.stt import SttGen
from parley.models.synthetic import TINY_TTS_VOICES, write_tiny_stt_checkpoint
from parley.realtime.engine_client import (
    DuplexSession, FrameOut, InProcessClient, OptionsError, OptionsRejected, PoolSlots, SessionClosed, SessionFull,
    SessionOptions, SpeechJob, Status, SttBusy, SttFacts, SttPartial, Terminal, TtsAudio, TtsWord,
)
from parley.realtime.server.speech_setup import load_speech_service
from test_kyutai_doors import CLIP, close_words, direct_transcript

N = FRAME_SAMPLES


def make_client(slots: int = 1) -> tuple[InProcessClient, Engine]:
    engine = Engine(DelayBackend(slots), EngineConfig(input_frames=64, output_events=256))
    return InProcessClient(engine), engine


async def admitted(client: InProcessClient, engine: Engine, options=SessionOptions()) -> DuplexSession:
    session = client.admit(options)
    engine.run_ticks(1)  # the prefill runs after this tick
    await asyncio.wait_for(client.ready(session), 1)
    return session


async def take(events, n: int) -> list:
    return [await asyncio.wait_for(events.__anext__(), 1) for _ in range(n)]


def test_audio_in_frames_out_as_plain_messages():
    async def main():
        client, engine = make_client()
        session = await admitted(client, engine)
        assert isinstance(session, DuplexSession) and session.options == SessionOptions()
        pcm = np.random.default_rng(0).uniform(-0.5, 0.5, 6 * N).astype(np.float32)
        session.push_audio(pcm)
        engine.run_ticks(6)
        frames = await take(session.events, 5)  # the echo answers frame k with input frame k - 1
        assert all(isinstance(f, FrameOut) for f in frames)
        for k, frame in enumerate(frames):
            np.testing.assert_array_equal(frame.pcm, pcm[k * N:(k + 1) * N])
        assert client.counters()["sessions_opened"] == 1
        engine.shutdown()

    asyncio.run(main())


def test_admission_answers_with_the_clients_own_errors():
    async def main():
        client, engine = make_client(1)
        session = await admitted(client, engine)
        with pytest.raises(SessionFull):
            client.admit(SessionOptions())
        session.close()
        assert session.closed
        [terminal] = await take(session.events, 1)  # a closed session's stream ends, cancelled
        assert isinstance(terminal, Terminal) and terminal.status is Status.CANCELLED
        session.push_audio(np.zeros(N, np.float32))  # to an ended session: nothing happens
        rejected = client.admit(SessionOptions(voice="unknown"))  # the freed slot, at once
        engine.run_ticks(1)
        with pytest.raises(OptionsRejected, match="not one of this model's voices"):
            await asyncio.wait_for(client.ready(rejected), 1)
        engine.shutdown()
        with pytest.raises(SessionClosed):
            client.admit(SessionOptions())

    asyncio.run(main())


def test_reopen_hands_the_slot_to_the_new_session():
    async def main():
        client, engine = make_client(1)
        old = await admitted(client, engine)
        new = client.reopen(old, SessionOptions(persona="a longer persona"))
        assert old.closed and new.id != old.id and new.options.persona == "a longer persona"
        with pytest.raises(SessionFull):  # the one slot is the new session's, before its prefill
            client.admit(SessionOptions())
        engine.run_ticks(1)
        await asyncio.wait_for(client.ready(new), 1)
        [terminal] = await take(old.events, 1)
        assert terminal.status is Status.CANCELLED
        new.push_audio(np.full(3 * N, 0.25, np.float32))
        engine.run_ticks(3)
        frames = await take(new.events, 2)
        assert [float(f.pcm[0]) for f in frames] == [0.25, 0.25]
        engine.shutdown()

    asyncio.run(main())


def test_the_input_backlog_is_told_and_a_model_that_does_not_translate_refuses_an_input_end():
    async def main():
        client, engine = make_client()
        session = await admitted(client, engine)
        assert session.input_backlog() == (0, 64)
        session.push_audio(np.zeros(3 * N, np.float32))
        assert session.input_backlog() == (3, 64)
        engine.run_ticks(1)
        assert session.input_backlog() == (2, 64)
        with pytest.raises(OptionsError, match="does not translate"):
            session.end_input()
        session.close()
        assert session.input_backlog() == (0, 0)
        session.end_input()  # an ended session's source has nothing left to end
        engine.shutdown()

    asyncio.run(main())


@pytest.fixture(scope="module")
def stt(tmp_path_factory):
    torch.set_num_threads(1)
    checkpoint = load_stt_checkpoint(write_tiny_stt_checkpoint(tmp_path_factory.mktemp("stt")), dtype=torch.float32)
    close_words(checkpoint)  # the tiny random STT taught to close words, so its rows report some
    return checkpoint


async def until_terminal(events) -> list:
    got = []
    while not (got and isinstance(got[-1], Terminal)):
        got.append(await asyncio.wait_for(events.__anext__(), 5))
    return got


def test_a_live_transcription_row_gives_the_models_words_and_heads_and_counts_its_slots(stt):
    """`submit_transcription(live=True)`: each step's partial carries the words as moshi-server's
    ASR reports them and every extra head, equal to the model stepped directly; `stt_facts` is the
    model's name and text delay; `stt_slots` counts the row from submit until the pool frees it."""
    async def main():
        engine = Engine(DelayBackend(1), EngineConfig())
        pool = SttPool(stt, slots=2)
        client = InProcessClient(engine, stt=pool)
        assert client.stt_facts() == SttFacts(stt.path.name, SttGen(stt.lm).text_delay)
        assert client.stt_slots() == PoolSlots(total=2, free=2)
        job = await client.submit_transcription(live=True)
        other = await client.submit_transcription(live=True)
        assert client.stt_slots() == PoolSlots(total=2, free=0) and client.stt_slots().used == 2
        with pytest.raises(SttBusy):
            await client.submit_transcription(live=True)
        other.cancel()
        frames = CLIP.size // FRAME_SAMPLES
        clip = CLIP[:frames * FRAME_SAMPLES]  # whole frames: the row steps them all, with no flush after
        for start in range(0, clip.size, 8 * FRAME_SAMPLES):  # at most 1.6 s ahead of the row, as live rows take
            job.feed(clip[start:start + 8 * FRAME_SAMPLES])
            pool.run_until_idle()
        job.cancel()  # the client leaves: the stream ends, cancelled
        pool.run_until_idle()
        *partials, terminal = await until_terminal(job.events)
        assert terminal.status is Status.CANCELLED and all(isinstance(p, SttPartial) for p in partials)
        words, heads, _ = direct_transcript(stt, clip, stt.settings.prefix_frames + frames)
        assert words and [e for p in partials for e in p.heard] == words
        stepped, got_heads = 0, []
        for p in partials:  # the steps that read the client's audio, as the ASR door counts them
            if round(p.audio_s * FRAME_RATE) > stepped:
                stepped = round(p.audio_s * FRAME_RATE)
                got_heads.append(list(p.heads))
        assert heads[0] and np.allclose(got_heads, heads, atol=1e-6)
        assert client.stt_slots() == PoolSlots(total=2, free=2)
        engine.shutdown()

    asyncio.run(main())


def test_speech_whose_text_streams_in_speaks_the_whole_script_and_counts_its_slot(tiny_tts_dir):
    """`submit_speech` with the text left open: words appended as they come and `end_text` give
    the frames and word times of the whole script synthesised at once; `speech_slots` counts the
    row from submit until the pool frees it."""
    service = load_speech_service(tiny_tts_dir, slots=1, voices=tiny_tts_dir / "voices", voice_map=None,
                                  device="cpu", dtype=torch.float32)
    front_end = service.front_end
    front_end.sampling = {"text_temperature": 0.0, "audio_temperature": 0.0}  # greedy: no draw to line up
    want = synthesize(service.pool, front_end.request("Hello there, how are you?", TINY_TTS_VOICES[0])[0])
    assert want.terminal.status is Status.COMPLETED and want.words

    async def main():
        engine = Engine(DelayBackend(1), EngineConfig())
        client = InProcessClient(engine, tts=service.pool)
        assert client.speech_slots() == PoolSlots(total=1, free=1)
        first, _ = front_end.request("Hello", TINY_TTS_VOICES[0])
        job = await client.submit_speech(dataclasses.replace(first, text_open=True))
        assert isinstance(job, SpeechJob) and client.speech_slots() == PoolSlots(total=1, free=0)
        events = asyncio.create_task(until_terminal(job.events))
        steps = 0
        while not events.done():
            item = service.pool.offer(None, CostModel())
            if item is not None:
                item.run()
                steps += 1
            elif steps and job is not None:  # the row waits for words: the rest of the text, then its end
                job.append(front_end.more_words("there, how are you?"))
                job.end_text()
                job = None
            await asyncio.sleep(0)
        got = events.result()
        assert got[-1].status is Status.COMPLETED
        assert [(w.text, w.start_s, w.stop_s) for w in got if isinstance(w, TtsWord)] == \
            [(w.text, w.start_s, w.stop_s) for w in want.words]
        np.testing.assert_array_equal(np.concatenate([e.pcm for e in got if isinstance(e, TtsAudio)]), want.pcm)
        service.pool.offer(None, CostModel())  # the ended row is freed at the pool's next offer
        assert client.speech_slots() == PoolSlots(total=1, free=1)
        engine.shutdown()

    asyncio.run(main())
