"""Engine core behaviour with a fabricated backend (tests/delay_backend.py DelayBackend).

DelayBackend returns each row's previous input frame and counts the frames a row has
seen since its reset, so "my outputs are exactly my inputs one frame later, numbered
from 1" proves routing, isolation and clean slot reuse at once.

Most tests use the manual clock (`run_ticks`) so they are exact and fast; a few run the
real engine thread briefly.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np
import pytest
import torch

from parley.engine import (
    Engine, EngineClosed, EngineConfig, EngineFull, FrameOut, InputError, OptionsError,
    OutputStream, SamplingOptions, SessionOptions, SessionRejected, Status, Terminal, TickClock,
)
from parley.engine.prefill_source import PrefillSource, prefill_key
from parley.engine.input_buffer import InputBuffer
from parley.engine.slack import CostModel
from delay_backend import DelayBackend, FakeTime, serve_one_session
from parley.models.config import FRAME_SAMPLES

N = FRAME_SAMPLES


def signal(seed: int, frames: int) -> np.ndarray:
    """A distinct, reproducible signal per session."""
    return np.random.default_rng(seed).uniform(-0.9, 0.9, frames * N).astype(np.float32)


def push_in_odd_chunks(session, pcm: np.ndarray) -> None:
    """Clients send whatever their codec gives; the engine must re-frame."""
    sizes = [7, 1913, 3000, 1, 500]
    pos, i = 0, 0
    while pos < len(pcm):
        session.push_audio(pcm[pos:pos + sizes[i % len(sizes)]])
        pos += sizes[i % len(sizes)]
        i += 1


def frames_of(events) -> list[FrameOut]:
    return [e for e in events if isinstance(e, FrameOut)]


def terminal_of(events) -> Terminal | None:
    return events[-1] if events and isinstance(events[-1], Terminal) else None


def make_engine(max_sessions=8, **config) -> tuple[Engine, DelayBackend]:
    backend = DelayBackend(max_sessions)
    config.setdefault("input_frames", 64)
    config.setdefault("output_events", 256)
    return Engine(backend, EngineConfig(**config)), backend


async def open_ready(engine: Engine, n: int, options=SessionOptions()):
    """Open n sessions in manual mode: admit, run one tick (prefills happen after it)."""
    sessions = [engine.open_nowait(options) for _ in range(n)]
    engine.run_ticks(1)
    for s in sessions:
        assert await asyncio.wait_for(s.ready, 1) is s
    return sessions


def assert_echo(frames: list[FrameOut], pcm: np.ndarray, first_count: int = 1) -> None:
    """Output k is input frame k, text token k + 1 (frames seen before it)."""
    for k, f in enumerate(frames):
        np.testing.assert_array_equal(f.pcm, pcm[k * N:(k + 1) * N])
        assert f.text_token == first_count + k


# ---------------------------------------------------------------- routing and isolation

def test_eight_sessions_each_get_exactly_their_own_outputs():
    async def main():
        engine, _ = make_engine(8)
        sessions = await open_ready(engine, 8)
        inputs = [signal(i, 10) for i in range(8)]
        for s, pcm in zip(sessions, inputs):
            push_in_odd_chunks(s, pcm)
        engine.run_ticks(10)
        for s, pcm in zip(sessions, inputs):
            frames = frames_of(s.events.drain())
            assert len(frames) == 9  # the first step after a reset is inside the delay
            assert_echo(frames, pcm)
            assert [f.tick for f in frames] == list(range(2, 11))
        engine.shutdown()

    asyncio.run(main())


def run_three_plus_visitor(with_visitor: bool):
    """Sessions a, b, c for 12 ticks; optionally a visitor opens at tick 4, closes at 7,
    and is replaced at 8 by another session on the same row."""

    async def main():
        engine, backend = make_engine(4)
        a, b, c = await open_ready(engine, 3)
        for i, s in enumerate((a, b, c)):
            s.push_audio(signal(i, 12))
        visitor = replacement = None
        for tick in range(12):
            if with_visitor and tick == 4:
                visitor = engine.open_nowait(SessionOptions())
                visitor.push_audio(signal(10, 12))
            if with_visitor and tick == 7:
                visitor.close()
            if with_visitor and tick == 8:
                replacement = engine.open_nowait(SessionOptions())
                replacement.push_audio(signal(11, 4))
            engine.run_ticks(1)
        outputs = [frames_of(s.events.drain()) for s in (a, b, c)]
        extra = None
        if with_visitor:
            extra = (visitor.row, replacement.row, visitor.events.drain(),
                     replacement.events.drain(), list(backend.resets))
        engine.shutdown()
        return outputs, extra

    return asyncio.run(main())


def test_a_session_opened_closed_and_replaced_leaves_others_bit_identical():
    baseline, _ = run_three_plus_visitor(False)
    with_visitor, (row_v, row_r, ev_v, ev_r, resets) = run_three_plus_visitor(True)
    for base, other in zip(baseline, with_visitor):
        assert len(base) == len(other) == 11
        for x, y in zip(base, other):
            assert x.pcm.tobytes() == y.pcm.tobytes() and x.text_token == y.text_token and x.tick == y.tick
    assert row_v == row_r == 3  # the replacement reused the visitor's slot ...
    assert resets.count(3) == 3  # ... reset when the visitor left and again when the replacement came
    assert terminal_of(ev_v) == Terminal(Status.CANCELLED, "closed by the client")
    frames_r = frames_of(ev_r)
    assert_echo(frames_r, signal(11, 4))  # starts clean: counts from 1, echoes its own audio


# ---------------------------------------------------------------- admission

def test_full_engine_refuses_at_once_and_close_frees_the_slot():
    async def main():
        engine, backend = make_engine(2)
        s0, s1 = await open_ready(engine, 2)
        opening = engine.open()
        with pytest.raises(EngineFull, match="all 2 session slots are in use"):
            opening.send(None)  # at once: on the coroutine's first step, before it could wait on anything
        assert engine.counters()["free_slots"] == 0
        s0.push_audio(signal(0, 3))
        engine.run_ticks(3)
        s0.close()
        assert engine.counters()["free_slots"] == 1
        s2 = engine.open_nowait(SessionOptions())  # the freed slot, usable right away
        assert s2.row == s0.row
        engine.run_ticks(1)  # plan drops s0's row, then s2 is reset and prefilled
        await s2.ready
        s2.push_audio(signal(5, 3))
        engine.run_ticks(3)
        assert_echo(frames_of(s2.events.drain()), signal(5, 3))  # clean: no trace of s0
        assert backend.resets == [0, 1, 0, 0]  # admissions of rows 0 and 1, s0 leaving, s2 admitted
        engine.shutdown()

    asyncio.run(main())


def test_a_late_second_end_of_a_session_cannot_free_its_successors_slot():
    # A client close racing an engine-side failure ends a session twice; by the second end its
    # row may already belong to the next session. Only SlotTable.release's owner check keeps
    # that row taken (without it, a third session would be admitted onto the same row).
    async def main():
        engine, _ = make_engine(1)
        (old,) = await open_ready(engine, 1)
        old.close()
        (new,) = await open_ready(engine, 1)
        assert new.row == old.row
        old.close()  # the duplicate client close ...
        engine.fail_session(old, "input rejected: late")  # ... and the engine-side failure
        assert engine.counters()["free_slots"] == 0
        with pytest.raises(EngineFull):
            engine.open_nowait(SessionOptions())
        new.push_audio(signal(3, 3))
        engine.run_ticks(3)
        assert_echo(frames_of(new.events.drain()), signal(3, 3))
        assert not new.closed
        engine.shutdown()

    asyncio.run(main())


def test_rejected_options_fail_open_and_free_the_slot():
    async def main():
        engine, _ = make_engine(1)
        engine.start()
        with pytest.raises(SessionRejected, match="not one of this model's voices"):
            await asyncio.wait_for(engine.open(SessionOptions(voice="unknown")), 2)
        session = await asyncio.wait_for(engine.open(), 2)  # the one slot is free again
        assert session.row == 0
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(main())


def test_cancelled_open_gives_the_slot_back():
    async def main():
        engine, _ = make_engine(1)  # manual mode: nobody prefills, so open() waits
        task = asyncio.create_task(engine.open())
        await asyncio.sleep(0.01)
        assert engine.counters()["free_slots"] == 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.counters()["free_slots"] == 1
        engine.run_ticks(1)  # the stale admission is skipped
        assert engine._scheduler.live_sessions() == []
        engine.shutdown()

    asyncio.run(main())


def test_options_are_validated_with_plain_sentences():
    with pytest.raises(OptionsError, match="text_temperature must be 0 \\(greedy\\) or more"):
        SamplingOptions(text_temperature=-1)
    with pytest.raises(OptionsError, match="audio_top_k must be a whole number"):
        SamplingOptions(audio_top_k=0)
    with pytest.raises(OptionsError, match="voice must be a non-empty name"):
        SessionOptions(voice="")
    with pytest.raises(OptionsError, match="max_sessions must be a whole number of at least 1, got 0"):
        Engine(DelayBackend(0))  # the backend owns the row count; the engine refuses an empty one
    assert Engine(DelayBackend(3)).max_sessions == 3


# ---------------------------------------------------------------- input buffering

def test_input_is_reframed_from_any_chunk_size():
    buf = InputBuffer(max_frames=8)
    pcm = signal(3, 3)
    for chunk in np.split(pcm, [5, 1925, 1926, 4000]):
        buf.push(chunk)
    assert len(buf) == 3
    for k in range(3):
        frame, at = buf.pop()
        assert at is not None
        np.testing.assert_array_equal(frame, pcm[k * N:(k + 1) * N])
    assert buf.pop() == (None, None) and buf.underruns == 1


def test_each_frame_keeps_the_arrival_of_its_last_samples():
    buf = InputBuffer(max_frames=8)
    pcm = signal(3, 2)
    buf.push(pcm[:N - 10], received_at=1.0)
    buf.push(pcm[N - 10:N + 5], received_at=2.0)  # completes frame 0, starts frame 1
    buf.push(pcm[N + 5:], received_at=3.0)
    buf.push(pcm[:10])  # an unfinished frame, stamped now
    assert [buf.pop()[1], buf.pop()[1], buf.pop()[1]] == [2.0, 3.0, None]  # then an underrun


def test_underrun_feeds_silence_and_counts():
    async def main():
        engine, _ = make_engine(2)
        (s,) = await open_ready(engine, 1)
        s.push_audio(signal(0, 2))
        engine.run_ticks(5)
        frames = frames_of(s.events.drain())
        assert_echo(frames[:2], signal(0, 2))
        assert all(not f.pcm.any() for f in frames[2:])  # silence after the input ran out
        assert s.input.underruns == 3
        assert engine.counters()["underruns"] == 3
        engine.shutdown()

    asyncio.run(main())


def test_each_session_gets_its_own_writable_frames():
    """The tick's rows are joined and its outputs copied out without numpy copies (which give the GIL
    up); a session's frame must still be its own: writable, sharing no memory with another's."""
    async def main():
        engine, _ = make_engine(3)
        sessions = await open_ready(engine, 3)
        for i, s in enumerate(sessions[:2]):  # the third has no input: silence
            s.push_audio(signal(i, 2))
        engine.run_ticks(2)
        frames = [frames_of(s.events.drain()) for s in sessions]
        for i in range(2):
            assert_echo(frames[i], signal(i, 2))
        assert all(not f.pcm.any() for f in frames[2])
        flat = [f.pcm for fs in frames for f in fs]
        assert all(p.flags.writeable and p.dtype == np.float32 and p.shape == (N,) for p in flat)
        flat[0][:] = 7.0  # a consumer writing its frame touches nobody else's
        assert not any(np.shares_memory(a, b) for i, a in enumerate(flat) for b in flat[i + 1:])
        assert_echo(frames[1], signal(1, 2))
        engine.shutdown()

    asyncio.run(main())


def test_overrun_drops_the_oldest_input_and_counts():
    async def main():
        engine, _ = make_engine(2, input_frames=3)
        (s,) = await open_ready(engine, 1)
        pcm = signal(0, 5)
        s.push_audio(pcm)
        assert s.input.overruns == 2 and engine.counters()["overruns"] == 2
        engine.run_ticks(4)
        frames = frames_of(s.events.drain())
        assert_echo(frames[:3], pcm[2 * N:])  # frames 0 and 1 were dropped, 2..4 kept
        engine.shutdown()

    asyncio.run(main())


# ---------------------------------------------------------------- the clock

def test_clock_catches_up_after_an_overrun_without_bursting():
    fake = FakeTime()
    clock = TickClock(0.08, now=fake.now, sleep=fake.sleep)
    stop = threading.Event()
    starts = []
    for work in (0.01, 0.085, 0.01, 0.2, 0.01, 0.01):
        assert clock.wait(stop)
        starts.append(round(fake.t, 6))
        fake.t += work
    # 0.085 overran by 5 ms: the next tick starts at once (late), then back on the grid.
    # 0.2 overran past a whole boundary (0.32): that one is skipped, one late tick runs at
    # 0.44 (for 0.40), and the next waits for 0.48: never two ticks back to back to catch up.
    assert starts == [0.0, 0.08, 0.165, 0.24, 0.44, 0.48]
    assert (clock.late_ticks, clock.skipped_ticks) == (2, 1)


def test_engine_counts_late_and_skipped_ticks_on_its_clock(caplog):
    fake = FakeTime()
    durations = {2: 0.1, 5: 0.25}  # step index -> how long the step "takes"
    starts = []

    def on_step(i, frames, mask):
        starts.append(round(fake.t, 6))
        fake.t += durations.get(i, 0.01)

    backend = DelayBackend(2, on_step=on_step)
    clock = TickClock(0.08, now=fake.now, sleep=fake.sleep)
    engine = Engine(backend, clock=clock)

    with caplog.at_level(logging.WARNING, logger="parley.engine"):
        serve_one_session(engine, 8)
    # step 2 (0.1 s) overruns 0.32: step 3 starts at once, late. Step 5 (0.25 s) misses
    # 0.56 and 0.64 (skipped); one late tick at 0.73, then the grid again at 0.80.
    assert starts == [0.08, 0.16, 0.24, 0.34, 0.4, 0.48, 0.73, 0.8]
    gaps = np.diff(starts)
    assert gaps.min() > 0.059  # no burst: every tick is at least most of a period apart
    counters = engine.counters()
    assert (counters["late_ticks"], counters["skipped_ticks"]) == (2, 2)
    assert counters["ticks"] == 9
    # How late each tick started, against the boundary it serves: 20 ms and 10 ms, the rest on time
    # (the fake clock wakes exactly); one log line says why (the second, within 10 s, is counted).
    lag = counters["tick_start_lag_seconds"]
    assert lag["count"] == 9 and lag["buckets"]["0.0002"] == 7 and lag["buckets"]["0.01"] == 8
    assert abs(lag["sum"] - 0.03) < 1e-9
    late = [r.getMessage() for r in caplog.records if "late" in r.getMessage()]
    assert len(late) == 1 and "started 20.0 ms late: the tick before ran 100.0 ms" in late[0], late
    engine.shutdown()


def test_a_long_prompt_is_prefilled_in_chunks_without_making_any_tick_late():
    """A 200-frame prompt costing 1 ms a frame does not fit in one tick's slack (80 ms minus a
    20 ms step): it is spread over several ticks, and the talking session never sees a late
    tick or a missing frame."""
    fake = FakeTime()

    def on_step(i, frames, mask):
        fake.t += 0.02

    def on_prefill(row, frames):
        fake.t += 0.001 * frames

    backend = DelayBackend(2, prompt_frames=200, on_step=on_step, on_prefill=on_prefill)
    clock = TickClock(0.08, now=fake.now, sleep=fake.sleep)
    engine = Engine(backend, clock=clock)

    async def main():
        talker = engine.open_nowait(SessionOptions())
        engine.serve_ticks(8)  # its own 200-frame prompt first, in chunks
        await talker.ready
        talker.push_audio(signal(0, 12))
        talker.events.drain()  # what it said before the newcomer came
        newcomer = engine.open_nowait(SessionOptions())
        engine.serve_ticks(8)
        await newcomer.ready
        return talker, newcomer

    talker, newcomer = asyncio.run(main())
    chunks = [n for row, n in backend.prefill_chunks if row == newcomer.row]
    assert sum(chunks) == 200 and len(chunks) >= 3  # 200 ms of prompt over several ticks' slack
    assert engine.counters()["late_ticks"] == 0
    assert len(frames_of(talker.events.drain())) == 8  # a frame every tick while the newcomer prefilled
    engine.shutdown()


def test_a_prompt_whose_chunk_cost_is_flat_runs_in_the_largest_chunks_that_fit():
    """Eager prefill of one row is launch-bound: on an H200 a 7B prompt chunk costs about the
    same at 8 or 170 frames. Each chunk size class is costed on its own (seeded before the first
    tick), so a 170-frame prompt at 40 ms a chunk runs as 128 + 42 frames over two ticks, not
    ~10 frames a tick as a per-frame estimate from small chunks would plan; no tick is late."""
    fake = FakeTime()

    def on_step(i, frames, mask):
        fake.t += 0.02

    def on_prefill(row, frames):
        fake.t += 0.04

    backend = DelayBackend(2, prompt_frames=170, on_step=on_step, on_prefill=on_prefill)
    engine = Engine(backend, clock=TickClock(0.08, now=fake.now, sleep=fake.sleep))

    async def main():
        talker = engine.open_nowait(SessionOptions())
        engine.serve_ticks(4)
        await asyncio.sleep(0)  # the ready callback, set from the ticks, runs
        assert talker.ready.done()  # (a wait here would hang the test if it were not)
        talker.push_audio(signal(0, 8))
        newcomer = engine.open_nowait(SessionOptions())
        engine.serve_ticks(4)
        await asyncio.sleep(0)
        assert newcomer.ready.done()  # live within the four ticks
        return newcomer

    newcomer = asyncio.run(main())
    assert [n for row, n in backend.prefill_chunks if row == newcomer.row] == [128, 42]
    assert engine.counters()["late_ticks"] == 0
    engine.shutdown()


def test_a_chunk_class_never_measured_runs_on_a_linear_prediction_from_smaller_ones():
    costs = CostModel()
    costs.seed(prefill_key(8), 0.010)
    costs.seed(prefill_key(16), 0.012)
    assert PrefillSource._plan(30, 0.030, costs) == (30, pytest.approx(0.024))  # class 32: min(4 x 10, 2 x 12 ms)
    assert PrefillSource._plan(30, 0.020, costs) == (16, None)  # the prediction does not fit; 16 is measured
    assert PrefillSource._plan(30, 0.005, costs) == (0, None)  # nothing fits: the caller forces a minimum chunk
    assert PrefillSource._plan(5, 0.030, costs) == (5, None)  # a short rest runs under the smallest class


# ---------------------------------------------------------------- failure

def baseline_outputs(n_ticks: int) -> list[list[FrameOut]]:
    async def main():
        engine, _ = make_engine(3)
        sessions = await open_ready(engine, 3)
        for i, s in enumerate(sessions):
            s.push_audio(signal(i, n_ticks))
        engine.run_ticks(n_ticks)
        out = [frames_of(s.events.drain()) for s in sessions]
        engine.shutdown()
        return out

    return asyncio.run(main())


@pytest.mark.parametrize("bad_audio, reason", [
    (np.full(N, np.nan, np.float32), "input audio contains NaN or infinite samples."),
    (np.zeros(N, np.int16), "input audio must be float PCM in [-1, 1], got dtype int16."),
    (np.zeros((2, N), np.float32), "input audio must be mono (one channel), got shape (2, 1920)."),
    (np.full(N, 3.0, np.float32), "input rejected: samples outside [-1, 1]"),  # refused by the backend
], ids=["nan", "int16", "stereo", "backend-refuses-row"])
def test_a_failing_session_does_not_disturb_the_others(bad_audio, reason):
    baseline = baseline_outputs(8)

    async def main():
        engine, _ = make_engine(3)
        sessions = await open_ready(engine, 3)
        for i, s in enumerate(sessions):
            s.push_audio(signal(i, 8 if i != 1 else 3))
        engine.run_ticks(3)
        sessions[1].push_audio(bad_audio)  # the next frame session 1 will feed
        engine.run_ticks(5)
        out = [s.events.drain() for s in sessions]
        counters = engine.counters()
        engine.shutdown()
        return out, counters

    out, counters = asyncio.run(main())
    assert terminal_of(out[1]) == Terminal(Status.FAILED, reason)
    assert counters["sessions_failed"] == 1
    for i in (0, 2):
        got = frames_of(out[i])
        assert [f.pcm.tobytes() for f in got] == [f.pcm.tobytes() for f in baseline[i]]
        assert [f.text_token for f in got] == [f.text_token for f in baseline[i]]


def test_fatal_backend_error_fails_every_stream_and_marks_unhealthy():
    async def main():
        backend = DelayBackend(3, fail_at_step=3)
        engine = Engine(backend, EngineConfig(tick_seconds=0.01))
        engine.start()
        sessions = [await asyncio.wait_for(engine.open(), 2) for _ in range(3)]
        ends = [await asyncio.wait_for(_last_event(s), 2) for s in sessions]
        for end in ends:
            assert end.status is Status.FAILED
            assert end.reason == "engine failure (see the server log)"  # no exception text to clients
        assert engine.fatal_error == "RuntimeError: simulated device failure"
        assert not engine.healthy and engine.counters()["healthy"] is False
        with pytest.raises(EngineClosed):
            await engine.open()
        await asyncio.to_thread(engine.shutdown)
        assert not engine._thread.is_alive()

    asyncio.run(main())


async def _last_event(session):
    last = None
    async for event in session.events:
        last = event
    return last


# ---------------------------------------------------------------- threads, loop, shutdown

def test_threaded_engine_streams_each_session_its_own_frames():
    async def main():
        engine, _ = make_engine(4, tick_seconds=0.01)
        engine.start()
        sessions = [await asyncio.wait_for(engine.open(), 2) for _ in range(4)]
        inputs = [signal(20 + i, 6) for i in range(4)]
        for s, pcm in zip(sessions, inputs):
            s.push_audio(pcm)

        async def first_audible_frames(s, n):
            # Ticks ran (feeding silence) while the later sessions were still opening.
            got = []
            async for event in s.events:
                assert isinstance(event, FrameOut), event
                if event.pcm.any():
                    got.append(event)
                if len(got) == n:
                    return got

        results = await asyncio.wait_for(asyncio.gather(*(first_audible_frames(s, 6) for s in sessions)), 5)
        for frames, pcm in zip(results, inputs):
            assert [f.pcm.tobytes() for f in frames] == [pcm[k * N:(k + 1) * N].tobytes() for k in range(6)]
            assert np.all(np.diff([f.text_token for f in frames]) == 1)  # consecutive frames
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(main())


def test_event_loop_is_never_blocked_by_model_work():
    """Every model call (prompt chunks, duplex steps) runs on the engine thread, never on the
    loop's: shown by the threads they ran on, not by timing the loop (wall time on a loaded
    machine says nothing)."""
    async def main():
        ran_on: set[threading.Thread] = set()
        backend = DelayBackend(2, step_seconds=0.03, prefill_seconds=0.3,
                               on_prefill=lambda row, frames: ran_on.add(threading.current_thread()))
        step = backend.step

        def recorded_step(*args):
            ran_on.add(threading.current_thread())
            return step(*args)

        backend.step = recorded_step
        engine = Engine(backend, EngineConfig(tick_seconds=0.04))
        engine.start()
        started = time.monotonic()
        session = await asyncio.wait_for(engine.open(), 30)
        assert time.monotonic() - started >= 0.3  # open() really waited for the prefill (a lower bound)
        session.push_audio(signal(0, 5))
        while engine.counters()["ticks"] < 3:
            await asyncio.sleep(0.01)  # the loop runs while the engine ticks
        await asyncio.to_thread(engine.shutdown)
        return ran_on, engine.counters()

    ran_on, counters = asyncio.run(main())
    assert counters["prefill_seconds"]["count"] == 1
    assert ran_on and threading.current_thread() not in ran_on  # asyncio.run's loop runs on this thread


def test_shutdown_is_clean_bounded_and_repeatable():
    async def main():
        engine, backend = make_engine(3, tick_seconds=0.01)
        engine.start()
        sessions = [await asyncio.wait_for(engine.open(), 2) for _ in range(3)]
        engine.shutdown()
        engine.shutdown()  # twice in a row is fine (bounded: the thread is joined, below)
        for s in sessions:
            events = s.events.drain()
            assert terminal_of(events) == Terminal(Status.CANCELLED, "the engine is shutting down")
            s.push_audio(signal(0, 1))  # pushing to an ended session is harmless
            s.close()  # so is closing it again
        assert backend.close_calls == 1
        assert not engine._thread.is_alive()
        with pytest.raises(EngineClosed):
            await engine.open()

    asyncio.run(main())


def test_shutdown_fails_opens_that_are_still_prefilling():
    async def main():
        engine, _ = make_engine(2)  # manual mode: the admission stays pending
        task = asyncio.create_task(engine.open())
        await asyncio.sleep(0.01)
        engine.shutdown()
        with pytest.raises(EngineClosed, match="shutting down"):
            await task

    asyncio.run(main())


def test_idle_engine_runs_no_step():
    engine, backend = make_engine(2)
    engine.run_ticks(5)
    assert backend.steps == 0 and engine.counters()["ticks"] == 5
    engine.shutdown()


# ---------------------------------------------------------------- the output stream

def test_stream_is_bounded_drops_oldest_and_ends_with_one_terminal():
    async def main():
        stream: OutputStream[int] = OutputStream("r1", asyncio.get_running_loop(), max_partials=3)
        kept = [stream.push(i) for i in range(5)]
        assert kept == [True, True, True, False, False] and stream.dropped == 2
        assert stream.finish(Terminal(Status.COMPLETED))
        assert not stream.finish(Terminal(Status.FAILED, "late"))  # the first terminal wins
        stream.push(99)  # after the end: discarded
        return [e async for e in stream]

    assert asyncio.run(main()) == [2, 3, 4, Terminal(Status.COMPLETED)]


def test_stream_consumer_wakes_for_items_pushed_from_another_thread():
    async def main():
        stream: OutputStream[int] = OutputStream("r2", asyncio.get_running_loop(), max_partials=1000)

        def produce():
            for i in range(200):
                stream.push(i)
                if i % 50 == 0:
                    time.sleep(0.005)
            stream.finish(Terminal(Status.COMPLETED))

        thread = threading.Thread(target=produce)
        thread.start()
        got = [e async for e in stream]
        thread.join()
        return got

    got = asyncio.run(asyncio.wait_for(main(), 5))
    assert got == [*range(200), Terminal(Status.COMPLETED)]


def test_slow_consumer_loses_oldest_frames_and_the_engine_counts_them():
    async def main():
        engine, _ = make_engine(1, output_events=2)
        (s,) = await open_ready(engine, 1)
        s.push_audio(signal(0, 6))
        engine.run_ticks(6)  # 5 valid frames into a stream that holds 2
        frames = frames_of(s.events.drain())
        assert [f.text_token for f in frames] == [4, 5]
        assert engine.counters()["dropped_events"] == 3
        engine.shutdown()

    asyncio.run(main())


def test_input_buffer_refuses_non_arrays_in_a_sentence():
    with pytest.raises(InputError, match="must be a numpy array"):
        InputBuffer(2).push([0.0] * 10)
    buf = InputBuffer(2)
    buf.push(torch.zeros(N))  # torch tensors are accepted
    assert len(buf) == 1


def test_a_started_engine_bounds_the_gil_switch_interval():
    """The engine thread takes the GIL back after each torch call; with the loop busy each take-back waits
    up to the switch interval (engine.GIL_SWITCH_S says why), so start() lowers it and never raises it."""
    import sys

    from parley.engine.engine import GIL_SWITCH_S

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        engine = Engine(DelayBackend(1))
        engine.start()
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S, rel=0.02)
        engine.shutdown()
        sys.setswitchinterval(0.0001)
        engine = Engine(DelayBackend(1))
        engine.start()
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.02)  # kept in whole microseconds
        engine.shutdown()
        sys.setswitchinterval(0.005)
        engine = Engine(DelayBackend(1))
        engine.start(beside_sockets=False)  # the engine process of --edge-workers: no sockets beside it
        assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.02)
        engine.shutdown()
    finally:
        sys.setswitchinterval(before)



def test_a_ticks_outputs_wake_the_event_loop_once():
    """Routing a tick's frames schedules one callback on the loop for every stream it fed (a thread's
    call_soon_threadsafe writes to the loop's wake-up socket and gives the GIL up), and each consumer
    still sees its own frame."""
    async def main():
        engine, _ = make_engine(6)
        sessions = await open_ready(engine, 6)
        for i, s in enumerate(sessions):
            s.push_audio(signal(i, 3))
        engine.run_ticks(1)  # the first frame of each session (the backend's one-frame delay)
        for s in sessions:
            s.events.drain()
        loop = asyncio.get_running_loop()
        scheduled = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            scheduled.append(callback)
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        waiters = [asyncio.ensure_future(s.events.__anext__()) for s in sessions]
        await asyncio.sleep(0)  # every consumer is waiting
        engine.run_ticks(1)
        got = await asyncio.wait_for(asyncio.gather(*waiters), 1)
        del loop.call_soon_threadsafe
        assert len(scheduled) == 1, scheduled
        for i, frame in enumerate(got):  # one of its own input frames, no neighbour's
            own = [k for k in range(3) if np.array_equal(frame.pcm, signal(i, 3)[k * N:(k + 1) * N])]
            assert len(own) == 1, (i, own)
        engine.shutdown()

    asyncio.run(main())


def test_the_ticks_time_is_split_into_its_phases():
    """`/metrics` splits the ticks' time: before the step, launching it, waiting for the device,
    routing; on a step that sleeps (the device's time) the wait holds it, and the phases add up to
    no more than the ticks' own time."""
    async def main():
        engine = Engine(DelayBackend(2, step_seconds=0.02), EngineConfig(input_frames=64, output_events=256))
        sessions = await open_ready(engine, 2)
        for i, s in enumerate(sessions):
            s.push_audio(signal(i, 6))
        before = engine.counters()
        engine.run_ticks(5)
        after = engine.counters()
        phases = {p: after[f"tick_{p}_seconds"] - before[f"tick_{p}_seconds"] for p in ("plan", "rows", "launch", "device", "route")}
        ticks = after["tick_seconds"]["sum"] - before["tick_seconds"]["sum"]
        assert phases["launch"] >= 5 * 0.02  # DelayBackend sleeps in its step: the launch, not the device copy
        assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= ticks + 1e-6
        engine.shutdown()

    asyncio.run(main())
