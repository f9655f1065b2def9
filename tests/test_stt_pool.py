"""Standalone transcription rows (engine/stt_pool.py) on the tiny STT checkpoint, CPU."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from parley.engine import stt_pool
from parley.engine.engine import Engine
from parley.engine.slack import CostModel, SlackRunner
from parley.engine.config import EngineConfig
from parley.engine.stream import Status, Terminal
from parley.engine.stt_pool import SttBusy, SttInputError, SttPartial, SttPool
from delay_backend import DelayBackend
from parley.models.checkpoint import load_stt_checkpoint
from parley.models.config import FRAME_SAMPLES
from parley.models.stt import SttGen
from parley.models.stt_text import TranscriptDecoder
from parley.models.synthetic import write_tiny_stt_checkpoint

from test_slack import FakeClock


@pytest.fixture(scope="module")
def stt(tmp_path_factory):
    torch.set_num_threads(1)
    return load_stt_checkpoint(write_tiny_stt_checkpoint(tmp_path_factory.mktemp("stt")), dtype=torch.float32)


def audio(seconds: float, seed: int) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(seconds * 24_000))).astype(np.float32)


def expected_text(stt, pcm: np.ndarray) -> str:
    """The transcript of one request computed directly: prefix silence, audio, delay silence."""
    s = stt.settings
    frames = -(-pcm.size // FRAME_SAMPLES)
    signal = np.zeros((s.prefix_frames + frames + s.suffix_frames) * FRAME_SAMPLES, np.float32)
    signal[s.prefix_frames * FRAME_SAMPLES:][:pcm.size] = pcm
    codes = stt.mimi.encode(torch.from_numpy(signal)[None])[0].T  # [F, n_q]
    gen = SttGen(stt.lm)
    state = gen.init_state(1)
    dec = TranscriptDecoder(stt.tokenizer, gen.text_delay)
    for step, frame in enumerate(codes):
        out = gen.step(state, frame[None], torch.ones(1, dtype=torch.bool))
        if out.valid[0]:
            dec.feed(int(out.text[0]), step)
    return dec.text


def submitted(pool: SttPool, clip: np.ndarray):
    """A request with all of `clip` fed and its input ended."""
    request = pool.submit()
    request.feed(clip)
    request.end_input()
    return request


def collect(request) -> tuple[str, list, Terminal]:
    parts = request.events.drain()
    terminal = parts.pop() if parts and isinstance(parts[-1], Terminal) else None
    assert all(isinstance(p, SttPartial) for p in parts)
    return "".join(p.text for p in parts), [w for p in parts for w in p.words], terminal


def test_requests_in_one_batch_equal_each_alone(stt):
    async def main():
        pool = SttPool(stt, slots=3)
        clips = [audio(1.0, 1), audio(0.55, 2), audio(1.3, 3)]
        requests = [pool.submit() for _ in clips]
        for request, clip in zip(requests, clips):
            request.feed(clip[:5000])  # arbitrary pieces, as a network would deliver them
            request.feed(clip[5000:])
            request.end_input()
        pool.run_until_idle()
        await asyncio.sleep(0)
        for request, clip in zip(requests, clips):
            text, words, terminal = collect(request)
            assert terminal == Terminal(Status.COMPLETED)
            assert text.strip() == expected_text(stt, clip) and text.strip()
            assert " ".join(w.text for w in words) == " ".join(text.split())
            assert all(0 <= w.start <= w.end <= clip.size / 24_000 for w in words)  # none past the audio
        assert pool.counters["stt_audio_seconds"] == pytest.approx(sum(-(-c.size // 1920) * 0.08 for c in clips))
    asyncio.run(main())


def test_full_stream_pauses_the_row_and_drops_nothing(stt, monkeypatch):
    monkeypatch.setattr(stt_pool, "OUTPUT_EVENTS", 2)

    async def main():
        pool = SttPool(stt, slots=1)
        clip = audio(1.5, 4)
        request = pool.submit()
        request.feed(clip)
        request.end_input()
        parts = []
        for _ in range(200):
            pool.run_until_idle()  # returns when the row's stream is full
            await asyncio.sleep(0)
            got = request.events.drain()
            assert len(got) <= 3  # 2 partials + the terminal at most: bounded
            parts += got
            if parts and isinstance(parts[-1], Terminal):
                break
        assert parts[-1] == Terminal(Status.COMPLETED)
        assert "".join(p.text for p in parts[:-1]).strip() == expected_text(stt, clip)
    asyncio.run(main())


def test_queue_bound_bad_input_and_cancel(stt):
    async def main():
        pool = SttPool(stt, slots=1, max_queue=2, max_input_s=1.0)
        a, b = pool.submit(), pool.submit()
        with pytest.raises(SttBusy):
            pool.submit()
        with pytest.raises(SttInputError, match="NaN"):
            a.feed(np.array([0.0, np.nan], np.float32))
        with pytest.raises(SttInputError, match="longer"):
            a.feed(audio(1.2, 5))
        a.cancel()
        b.feed(audio(0.3, 6))
        b.end_input()
        pool.run_until_idle()
        await asyncio.sleep(0)
        assert collect(a)[2].status is Status.CANCELLED
        assert collect(b)[2].status is Status.COMPLETED
    asyncio.run(main())


def test_runs_as_engine_slack_work(stt):
    async def main():
        engine = Engine(DelayBackend(2), EngineConfig())
        pool = SttPool(stt, slots=2)
        engine.add_slack_source(pool)
        clip = audio(0.8, 7)
        request = pool.submit()
        request.feed(clip)
        request.end_input()
        engine.run_ticks(1)  # manual ticks: slack runs everything offered
        await asyncio.sleep(0)
        text, _, terminal = collect(request)
        assert terminal == Terminal(Status.COMPLETED)
        assert text.strip() == expected_text(stt, clip)
        assert engine.counters()["slack_items"] >= 1
        engine.shutdown()
    asyncio.run(main())


def test_one_request_runs_in_the_lowest_bucket(stt):
    """A request in row 0 of a 4-row pool steps a 1-row bucket; the others' state is untouched,
    and the transcript is the one a 1-row pool gives."""
    async def main():
        pool = SttPool(stt, slots=4)
        clip = audio(0.6, 12)
        request = submitted(pool, clip)
        seen = []
        real = pool.run_device
        pool.run_device = lambda frames, run: seen.append(pool.bucket(i for i, f in enumerate(run) if f)) or real(
            frames, run)
        pool.run_until_idle()
        await asyncio.sleep(0)
        assert set(seen) == {1}
        assert pool._state.offsets.tolist()[1:] == [0, 0, 0] and not pool._state.transformer.keys[0][1:].any()
        assert collect(request)[0].strip() == expected_text(stt, clip)
    asyncio.run(main())


def test_counters_and_stop_end_requests_cleanly(stt):
    """slack_counters report rows, queue and outcomes; slack_stop (a draining or stopping engine)
    ends the running and the queued request with its terminal, and later submits are refused."""
    async def main():
        engine = Engine(DelayBackend(2), EngineConfig())
        pool = SttPool(stt, slots=1)
        engine.add_slack_source(pool)
        submitted(pool, audio(0.3, 13))
        engine.run_ticks(1)
        running, queued = pool.submit(), pool.submit()
        running.feed(audio(0.5, 14))  # no end_input: it would wait for more audio forever
        engine.run_ticks(1)
        counters = engine.counters()
        assert counters["stt_live"] == 1 and counters["stt_slots"] == 1 and counters["stt_queued"] == 1
        assert counters["stt_requests"] == 3 and counters["stt_completed"] == 1 and counters["stt_steps"] > 0
        engine.shutdown()
        await asyncio.sleep(0)
        for request in (running, queued):
            assert request.events.drain()[-1] == Terminal(Status.CANCELLED, "the engine is shutting down")
        assert pool.slack_counters()["stt_cancelled"] == 2 and pool.live == 0
        with pytest.raises(SttBusy, match="shutting down"):
            pool.submit()
    asyncio.run(main())


def test_rows_the_slack_cannot_fit_count_as_starved(stt):
    pool = SttPool(stt, slots=1)

    async def main():
        request = pool.submit()
        request.feed(audio(0.5, 15))
        pool.slack_started(1.0)
        assert pool.offer(1.0, CostModel()) is not None  # admitted; its step does not run this tick
        pool.slack_started(2.0)
        pool.slack_started(3.0)
        assert pool.counters["stt_starved"] == 1
    asyncio.run(main())


def test_live_request_refuses_audio_far_ahead_of_the_row(stt, monkeypatch):
    """A live request (a realtime transcription session) holds at most LIVE_BACKLOG_S of audio not
    yet stepped; more is refused and the request goes on. A live request is never queued, and it
    gets a partial every step (the end-of-turn probability), text or not."""
    monkeypatch.setattr(stt_pool, "LIVE_BACKLOG_S", 2)

    async def main():
        pool = SttPool(stt, slots=1)
        live = pool.submit(live=True)
        with pytest.raises(SttBusy):
            pool.submit(live=True)  # its one row is spoken for
        live.feed(audio(1.6, 16))  # 20 frames
        with pytest.raises(SttInputError, match="real-time pace"):
            live.feed(audio(0.8, 17))
        pool.run_until_idle()  # the row steps what it has
        live.feed(audio(0.8, 17))  # room again
        await asyncio.sleep(0)
        parts = live.events.drain()
        assert len(parts) == stt.settings.prefix_frames + 20 and not any(isinstance(p, Terminal) for p in parts)
        assert all(0 <= p.end_of_turn <= 1 for p in parts) and any(not p.text for p in parts)
    asyncio.run(main())


def test_partials_carry_the_arrival_of_the_newest_frame_read(stt):
    """input_at is the feed time of the chunk holding each frame's last sample; made-up frames
    (silence prefix, flush) carry the time their step made them."""
    pool = SttPool(stt, slots=1)
    request = pool.submit(asyncio.new_event_loop(), live=True)  # live: a partial every step
    clip = audio(0.4, 3)  # five frames, fed in chunks across frame edges
    edges = [0, 1000, 2 * FRAME_SAMPLES, 2 * FRAME_SAMPLES + 1, 4 * FRAME_SAMPLES + 7, clip.size]
    for k, (a, b) in enumerate(zip(edges, edges[1:])):
        request.feed(clip[a:b], received_at=100.0 + k)
    request.end_input()
    before = time.monotonic()
    pool.run_until_idle()
    after = time.monotonic()
    events = request.events.drain()
    assert isinstance(events[-1], Terminal) and events[-1].status is Status.COMPLETED
    stamped = [e.input_at for e in events[:-1] if isinstance(e, SttPartial) and e.input_at is not None]
    prefix, suffix = stt.settings.prefix_frames, stt.settings.suffix_frames
    assert len(stamped) == prefix + 5 + suffix
    # frame k's last sample is sample 1920 (k + 1) - 1: in chunks 1, 1, 3, 3 and 4
    assert stamped[prefix:prefix + 5] == [101.0, 101.0, 103.0, 103.0, 104.0]
    made_up = stamped[:prefix] + stamped[prefix + 5:]
    assert made_up and all(before <= t <= after for t in made_up)  # made at their step, not fed


def clocked(pool: SttPool, clock: FakeClock, cost_by_bucket: dict[int, float]) -> list[int]:
    """Each device step advances the fake clock by its bucket's cost; returns the buckets run."""
    real, seen = pool.run_device, []

    def run_device(frames, run):
        n = pool.bucket(i for i, flag in enumerate(run) if flag)
        seen.append(n)
        clock.t += cost_by_bucket[n]
        return real(frames, run)

    pool.run_device = run_device
    return seen


def test_a_live_row_steps_every_tick_despite_one_slow_step_in_its_costs(stt):
    """Issue 14: the step key's costs hold one preempted 30 ms call among 10 ms ones; 20 ms of slack
    holds a step, so the live row steps every tick (the max-of-window estimate held it out)."""
    clock = FakeClock()
    slack = SlackRunner(clock.now, lambda: None, 0.0)
    pool = SttPool(stt, slots=1)
    slack.add_source(pool)
    for seconds in [0.010] * 30 + [0.016, 0.030]:
        slack.costs.record(stt_pool.step_key(1), seconds)
    clocked(pool, clock, {1: 0.010})
    request = pool.submit(asyncio.new_event_loop(), live=True)
    for tick in range(12):
        clock.t = tick * 0.080
        request.feed(audio(0.08, tick), received_at=clock.t)
        slack.run_until(deadline=clock.t + 0.020)
        assert pool.counters["stt_steps"] == tick + 1
    assert pool.counters["stt_starved"] == 0 and slack.stats.overruns == 0 and slack.stats.past_boundary == 0


def test_live_rows_step_alone_when_the_uploads_bucket_does_not_fit(stt):
    """A live row (row 0) beside an upload (row 1): a 2-row step costs 30 ms, a 1-row step 10 ms,
    and the slack holds 20 ms. The live row steps every tick by itself; the upload waits (it is
    never started over its estimate) and catches up, with the same transcript, once the slack
    holds both rows."""
    async def main():
        clock = FakeClock()
        slack = SlackRunner(clock.now, lambda: None, 0.0)
        pool = SttPool(stt, slots=2)
        slack.add_source(pool)
        for n, cost in ((1, 0.011), (2, 0.031)):  # a little over the clock's costs: no overrun from rounding
            slack.costs.record(stt_pool.step_key(n), cost)
            slack.costs.record(stt_pool.step_key(n), cost)
        buckets = clocked(pool, clock, {1: 0.010, 2: 0.030})
        live = pool.submit(live=True)
        clip = audio(0.5, 21)
        upload = submitted(pool, clip)
        for tick in range(8):
            clock.t = tick * 0.080
            live.feed(audio(0.08, 30 + tick), received_at=clock.t)
            slack.run_until(deadline=clock.t + 0.020)
            assert buckets and set(buckets) == {1}  # live-only steps
            assert pool._rows[0].step >= tick + 1 and pool._rows[1].step == 0
        assert pool.counters["stt_starved"] == 6 and slack.stats.overruns == 0  # the upload waited (ticks 1-6 counted)
        live.end_input()
        while not upload.events.finished:
            clock.t += 0.080
            slack.run_until(deadline=clock.t + 0.200)  # room for 2-row steps: the upload runs
        await asyncio.sleep(0)
        assert 2 in buckets and slack.stats.past_boundary == 0
        text, _, terminal = collect(upload)
        assert terminal == Terminal(Status.COMPLETED) and text.strip() == expected_text(stt, clip)
    asyncio.run(main())


def test_live_steps_are_realtime_and_carry_the_uploads_in_their_bucket_uploads_alone_are_throughput(stt):
    """slack.py rule 1, decided here: an item stepping a live session's rows is realtime work, as
    many steps as its audio holds, and an upload in the live rows' bucket steps with it (the
    bucket costs the same); an upload outside that bucket, or with no live row ready, steps in
    a throughput item of its own."""
    async def main():
        pool = SttPool(stt, slots=4)
        costs = CostModel()
        for n in pool._steps.buckets:
            costs.record(stt_pool.step_key(n), 0.001)
        inside = submitted(pool, audio(0.5, 1))  # row 0: in the live row's 2-row bucket
        live = pool.submit(live=True)  # row 1
        outside = submitted(pool, audio(0.5, 2))  # row 2: a 4-row bucket
        live.feed(audio(0.16, 3))  # two frames
        item = pool.offer(1.0, costs)
        assert item.realtime and item.key == stt_pool.step_key(2)
        assert item.units == stt.settings.prefix_frames + 2  # the live row's steps, no more
        item.run()
        assert pool._rows[0].step == pool._rows[1].step == item.units and pool._rows[2].step == 0
        item = pool.offer(0.0035, costs)  # the live row has read all it was sent; 3 steps fit
        assert not item.realtime and item.key == stt_pool.step_key(4) and item.units == 3
        item.run()
        assert [row.step for row in pool._rows[:3]] == [stt.settings.prefix_frames + 5,
                                                        stt.settings.prefix_frames + 2, 3]
        live.feed(audio(0.08, 4))  # the next frame arrives: realtime again
        assert pool.offer(1.0, costs).realtime
        for request in (live, inside, outside):
            request.cancel()
    asyncio.run(main())
