"""The engine client (realtime/engine_client.py) in its in-process form, over the echo backend on the
manual clock: the doors' calls give the engine's behaviour back as plain messages and the client's
own admission errors, and a re-prefill hands the slot over with nothing able to take it between."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from delay_backend import DelayBackend
from parley.engine import Engine, EngineConfig
from parley.models.config import FRAME_SAMPLES
from parley.realtime.engine_client import (
    DuplexSession, FrameOut, InProcessClient, OptionsError, OptionsRejected, SessionClosed, SessionFull, SessionOptions, Status,
    Terminal,
)

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
