"""The TTS pool as slack work: beside duplex sessions (whose outputs stay bit-identical),
back-pressure instead of drops, cancellation at the next tick, starved rows counted."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from parley.engine import Engine, EngineConfig
from parley.engine.session import FrameOut
from parley.engine.slack import CostModel, SlackRunner
from parley.engine.stream import Status, Terminal
from delay_backend import DelayBackend
from parley.engine.tts_pool import ADMIT_KEY, TtsAudio, TtsPool, TtsRequest, TtsWord, step_key
from parley.models.config import FRAME_SAMPLES
from parley.models.dsm import split_words
from parley.models.synthetic import TINY_TTS_VOICES
from parley.models.tts_checkpoint import VoiceStore, load_tts_checkpoint

TEXTS = ["Hello there.", "How are you doing today?", "The quick brown fox jumps.", "Good morning!",
         "Tell me a story.", "Yes, of course.", "See you tomorrow.", "What would you like?"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tts(tiny_tts_dir):
    ck = load_tts_checkpoint(tiny_tts_dir, dtype=torch.float32)
    return ck, VoiceStore.open(tiny_tts_dir / "voices", ck.config.voice_suffix, 16)


def request(tts, text, voice=0, **kw):
    ck, store = tts
    return TtsRequest(tuple(split_words(text, ck.tokenizer.encode, 12.5)), (store.load(TINY_TTS_VOICES[voice]),),
                      {"control": "ok", "cfg": "2.0"}, **kw)


def signal(seed, frames):
    return np.random.default_rng(seed).uniform(-0.9, 0.9, frames * FRAME_SAMPLES).astype(np.float32)


async def duplex_run(tts, with_tts: bool, ticks: int = 40):
    backend = DelayBackend(4)
    engine = Engine(backend, EngineConfig(input_frames=64, output_events=256))
    pool = None
    if with_tts:
        ck, _ = tts
        pool = TtsPool(ck.lm, ck.mimi, 8, voice_frames=10)
        pool.warm_up(engine.slack_costs)
        engine.add_slack_source(pool)
        jobs = [pool.submit(request(tts, text, i % 3), asyncio.get_running_loop()) for i, text in enumerate(TEXTS)]
    sessions = [engine.open_nowait() for _ in range(4)]
    engine.run_ticks(1)
    for i, s in enumerate(sessions):
        await asyncio.wait_for(s.ready, 5)
        s.push_audio(signal(i, ticks))
    frames = {i: [] for i in range(4)}
    tts_events = {i: [] for i in range(len(TEXTS))} if with_tts else {}
    for _ in range(ticks):
        engine.run_ticks(1)
        for i, s in enumerate(sessions):
            frames[i] += [(f.pcm.tobytes(), f.text_token) for f in s.events.drain() if isinstance(f, FrameOut)]
        for i in tts_events:
            tts_events[i] += jobs[i].stream.drain()  # a client reading everything as it comes
    for _ in range(200):  # let the TTS requests finish without duplex traffic
        if not with_tts or all(ev and isinstance(ev[-1], Terminal) for ev in tts_events.values()):
            break
        engine.run_ticks(1)
        for i in tts_events:
            tts_events[i] += jobs[i].stream.drain()
    engine.shutdown()
    return frames, tts_events, pool


def test_duplex_outputs_are_bit_identical_beside_eight_tts_requests(tts):
    alone, _, _ = asyncio.run(duplex_run(tts, with_tts=False))
    beside, tts_events, pool = asyncio.run(duplex_run(tts, with_tts=True))
    assert all(len(v) == 39 for v in alone.values())
    assert beside == alone
    for i, events in tts_events.items():
        assert events[-1] == Terminal(Status.COMPLETED), (i, events[-1])
        assert sum(isinstance(e, Terminal) for e in events) == 1
        audio = [e for e in events if isinstance(e, TtsAudio)]
        words = [e.text for e in events if isinstance(e, TtsWord)]
        assert audio and all(a.pcm.shape == (FRAME_SAMPLES,) and np.abs(a.pcm).max() <= 0.99 for a in audio)
        assert words == TEXTS[i].split()
    assert pool.live == 0 and pool.completed == len(TEXTS)


def run_items(pool, n=None):
    from parley.engine.slack import CostModel
    costs = CostModel()
    done = 0
    while n is None or done < n:
        item = pool.offer(None, costs)
        if item is None:
            return done
        item.run()
        done += 1
    return done


def test_back_pressure_waits_instead_of_dropping(tts):
    async def main():
        ck, _ = tts
        pool = TtsPool(ck.lm, ck.mimi, 1, voice_frames=10, lead_frames=5)
        job = pool.submit(request(tts, "one two three four five six seven eight nine ten"), asyncio.get_running_loop())
        run_items(pool)  # nobody reads: the row stops at its lead cap
        assert job.stream.buffered >= 5 and job.stream.dropped == 0 and pool.live == 1
        got = []
        while not (got and isinstance(got[-1], Terminal)):
            got += job.stream.drain()
            run_items(pool)
        assert job.stream.dropped == 0 and got[-1].status is Status.COMPLETED
        assert sum(isinstance(e, TtsAudio) for e in got) == job.frames
    asyncio.run(main())


def test_word_times_are_the_steps_the_state_machine_consumed_them_at(tts):
    """Each word's start is the step its entry was consumed at (the DSM's word_step, read back
    from the device here), shifted by the dropped frames; its stop is the next word's start."""
    from parley.engine.tts_pool import FRAME_DROP
    from parley.models.tts import FRAME_RATE

    async def main():
        ck, _ = tts
        pool = TtsPool(ck.lm, ck.mimi, 1, voice_frames=10)
        req = request(tts, "one, two <break time=\"0.5s\"/> three four five")
        job = pool.submit(req, asyncio.get_running_loop())
        got = []
        while not (got and isinstance(got[-1], Terminal)):
            run_items(pool)
            got += job.stream.drain()
        words = [e for e in got if isinstance(e, TtsWord)]
        steps = pool._gen.dsm.word_step[0, :len(req.entries)].tolist()  # the finished row's state, kept
        expected = [max(step - FRAME_DROP, 0) / FRAME_RATE for entry, step in zip(req.entries, steps) if entry.tokens]
        assert [w.text for w in words] == ["one,", "two", "three", "four", "five"]
        assert [w.start_s for w in words] == expected
        assert [w.stop_s for w in words[:-1]] == expected[1:]
    asyncio.run(main())


def test_cancel_frees_the_row_at_the_next_offer(tts):
    async def main():
        ck, _ = tts
        pool = TtsPool(ck.lm, ck.mimi, 1, voice_frames=10)
        loop = asyncio.get_running_loop()
        job = pool.submit(request(tts, "a long sentence that goes on and on for a while"), loop)
        run_items(pool, 25)
        assert pool.live == 1
        job.cancel()
        assert run_items(pool) == 0 and pool.live == 0
        assert job.stream.drain()[-1] == Terminal(Status.CANCELLED, "the client went away")
        again = pool.submit(request(tts, "Hello there."), loop)  # the slot serves the next request
        run_items(pool)
        assert again.stream.drain()[-1].status is Status.COMPLETED
    asyncio.run(main())


def test_starved_rows_are_counted_then_one_step_is_forced(tts):
    async def main():
        ck, _ = tts
        pool = TtsPool(ck.lm, ck.mimi, 2, voice_frames=10, force_after_ticks=3)
        now = [0.0]
        runner = SlackRunner(lambda: now[0], lambda: None, guard_s=0.003)
        runner.add_source(pool)
        loop = asyncio.get_running_loop()
        jobs = [pool.submit(request(tts, "Hello there."), loop) for _ in range(2)]
        runner.costs.record(ADMIT_KEY, 0.001)
        for key in pool.step_keys:
            runner.costs.record(key, 1.0)  # a step "costs" a second: it never fits a tick's slack
        forced_ticks = []
        for tick in range(8):
            now[0] = tick
            before = sum(pool.steps.values())
            runner.run_until(tick + 0.08)
            if sum(pool.steps.values()) > before:
                forced_ticks.append(tick)
        assert pool.live == 2  # admitted in tick 0 (that item fits)
        # Ticks 1..3 give no step (2 starved rows each); tick 4 forces one step (both rows);
        # ticks 5 and 6 starve again (counted when the next tick starts).
        assert forced_ticks == [4] and pool.forced == 1
        assert pool.starved == 2 * 3 + 2 * 2
        for job in jobs:
            job.cancel()
    asyncio.run(main())


def test_engine_shutdown_ends_every_tts_request(tts):
    async def main():
        ck, _ = tts
        engine = Engine(DelayBackend(1))
        pool = TtsPool(ck.lm, ck.mimi, 1, voice_frames=10)
        engine.add_slack_source(pool)
        loop = asyncio.get_running_loop()
        live = pool.submit(request(tts, "a sentence long enough to still be running"), loop)
        run_items(pool, 3)
        assert pool.live == 1
        engine.shutdown()
        assert live.stream.drain()[-1] == Terminal(Status.CANCELLED, "the engine is shutting down")
        assert pool.live == 0
        # A request after the stop would wait forever (no engine offers work): it ends at once.
        late = pool.submit(request(tts, "Hi."), loop)
        assert late.stream.drain() == [Terminal(Status.CANCELLED, "the engine is shutting down")]
        assert pool.live == 0
    asyncio.run(main())


def test_engine_failure_ends_queued_and_later_tts_requests(tts):
    async def main():
        ck, _ = tts
        pool = TtsPool(ck.lm, ck.mimi, 1, voice_frames=10)
        loop = asyncio.get_running_loop()
        queued = pool.submit(request(tts, "Hi."), loop)
        pool.slack_stop(Terminal(Status.FAILED, "engine failure"))
        assert queued.stream.drain() == [Terminal(Status.FAILED, "engine failure")]
        later = pool.submit(request(tts, "Hello."), loop)
        assert later.stream.drain() == [Terminal(Status.FAILED, "engine failure")]
    asyncio.run(main())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_eager_tokens(tiny_tts_dir):
    """The step kinds and the admission captured as CUDA graphs produce what the eager pool
    produces (greedy), for two requests with different voices in rows 0 and 1 at once (the
    admission graph resets only its row and writes the voice into that row)."""
    ck = load_tts_checkpoint(tiny_tts_dir, device="cuda", dtype=torch.float32)
    store = VoiceStore.open(tiny_tts_dir / "voices", ck.config.voice_suffix, 16)
    reqs = [TtsRequest(tuple(split_words(text, ck.tokenizer.encode, 12.5)), (store.load(TINY_TTS_VOICES[v]),),
                       {"control": "ok", "cfg": "2.0"}, text_temperature=0.0, audio_temperature=0.0)
            for text, v in (("Hello there, how are you?", 0), ("The quick brown fox jumps.", 1))]

    async def run(graphs: bool) -> list[tuple[list[str], np.ndarray]]:
        pool = TtsPool(ck.lm, ck.mimi, 4, voice_frames=10, cuda_graphs=graphs)
        runner = SlackRunner(lambda: 0.0, torch.cuda.synchronize, guard_s=0.0)
        pool.warm_up(runner.costs)
        assert pool.graphed == graphs
        events = speak_to_the_end(runner, pool, reqs)
        return [([e.text for e in got if isinstance(e, TtsWord)],
                 np.concatenate([e.pcm for e in got if isinstance(e, TtsAudio)])) for got in events]

    eager, graphed = asyncio.run(run(False)), asyncio.run(run(True))
    for (eager_words, eager_pcm), (graphed_words, graphed_pcm) in zip(eager, graphed):
        assert graphed_words == eager_words
        np.testing.assert_allclose(graphed_pcm, eager_pcm, atol=1e-4)
    assert not np.allclose(eager[0][1][:len(eager[1][1])], eager[1][1][:len(eager[0][1])])  # two streams


def test_admission_is_measured_before_the_first_request_and_leaves_no_trace(tts):
    """warm_up and slack_prepare cost an admission too (the first request's admission is not a
    cold, unestimated item), and the warm-up admission into row 0 changes no later output."""
    from parley.engine.slack import CostModel
    from parley.engine.tts_offline import synthesize

    ck, _ = tts
    req = request(tts, "Hello there, how are you?", text_temperature=0.0, audio_temperature=0.0)
    plain = synthesize(TtsPool(ck.lm, ck.mimi, 2, voice_frames=10), req)
    pool = TtsPool(ck.lm, ck.mimi, 2, voice_frames=10)
    costs = CostModel()
    pool.warm_up(costs)
    pool.slack_prepare(costs)
    assert all(costs.estimate(key) > 0 for key in (ADMIT_KEY, *pool.step_keys))
    warmed = synthesize(pool, req)
    assert warmed.terminal.status is Status.COMPLETED
    assert [w.text for w in warmed.words] == [w.text for w in plain.words]
    np.testing.assert_array_equal(warmed.pcm, plain.pcm)


def test_a_new_row_warms_up_on_text_steps_beside_a_speaking_row(tts):
    """Warm-up rows first: on a fake clock with the H200's step costs (tts_load at 2246cca: text
    4.2 ms, full 13.2 ms, admission 4.3 ms) and 60 ms of slack per tick, a request arriving beside
    a speaking one has its first audio (its 19th step: 16 warm-up steps, two dropped frames) within
    three ticks, where full steps alone, four a tick, would take five; the speaking row keeps a
    step every tick."""
    cost = {"text": 0.0042, "full": 0.0132}
    admit_s = 0.0043

    async def main():
        ck, _ = tts
        pool = TtsPool(ck.lm, ck.mimi, 2, voice_frames=10)
        now = [0.0]
        step, admit = pool._step, pool._admit

        def timed_step(rows, kind):  # the fake clock moves by what the item costs on the GPU
            step(rows, kind)
            now[0] += cost[kind]

        def timed_admit(job):
            admit(job)
            now[0] += admit_s

        pool._step, pool._admit = timed_step, timed_admit
        runner = SlackRunner(lambda: now[0], lambda: None, guard_s=0.003)
        runner.add_source(pool)
        runner.costs.record(ADMIT_KEY, admit_s)
        for kind, seconds in cost.items():
            for n in pool.buckets:
                runner.costs.record(step_key(kind, n), seconds)
        loop = asyncio.get_running_loop()
        speaking = pool.submit(request(tts, "a long sentence that goes on and on for a while"), loop)

        def tick(t: int) -> None:
            now[0] = t * 0.08 + 0.017  # the duplex frame took the tick's first 17 ms
            runner.run_until(t * 0.08 + 0.08)

        t = 0
        while speaking.frames < 3:
            tick(t)
            t += 1
        new = pool.submit(request(tts, "Hello there, how are you?"), loop)
        arrived = t
        speaking_frames = []
        while not any(isinstance(e, TtsAudio) for e in new.stream.drain()):
            before = speaking.frames
            tick(t)
            speaking_frames.append(speaking.frames - before)
            t += 1
            assert t - arrived <= 3, "the new row's first audio took more than three ticks"
        assert all(n >= 1 for n in speaking_frames)  # real time kept for the speaking row
        speaking.cancel()
        new.cancel()
    asyncio.run(main())


def test_an_admission_that_does_not_fit_waits_for_the_next_tick(tts):
    """A declined offer loses nothing: when the slack left cannot hold an admission (a long
    duplex frame), the request stays queued and is admitted at the next tick that has room (on
    the H200 a request was popped by a declined offer and its client waited forever)."""
    async def main():
        ck, _ = tts
        pool = TtsPool(ck.lm, ck.mimi, 2, voice_frames=10)
        now = [0.0]
        step, admit = pool._step, pool._admit

        def timed_step(rows, kind):  # the fake clock moves by what an item costs
            step(rows, kind)
            now[0] += 0.004

        def timed_admit(job):
            admit(job)
            now[0] += 0.005

        pool._step, pool._admit = timed_step, timed_admit
        runner = SlackRunner(lambda: now[0], lambda: None, guard_s=0.003)
        runner.add_source(pool)
        runner.costs.record(ADMIT_KEY, 0.005)
        for key in pool.step_keys:
            runner.costs.record(key, 0.004)
        job = pool.submit(request(tts, "Hello there."), asyncio.get_running_loop())
        now[0] = 0.075  # the frame left 5 ms: minus the 3 ms guard, the 5 ms admission does not fit
        runner.run_until(0.08)
        assert pool.live == 0 and not job.stream.finished
        now[0] = 0.097  # the next tick's frame took 17 ms: room for the admission now
        runner.run_until(0.16)
        assert pool.live == 1
        for t in range(2, 200):
            if job.stream.finished:
                break
            now[0] = t * 0.08 + 0.017
            runner.run_until(t * 0.08 + 0.08)
            job.stream.drain()
        assert job.stream.terminal == Terminal(Status.COMPLETED)
        assert job.frames > 0
    asyncio.run(main())


def test_warm_up_admits_with_the_requests_conditions(tts, monkeypatch):
    """warm_up measures admissions that carry the service's conditions, so the first
    real request's admission is not the first to compute their sum (an unmeasured extra cost)."""
    ck, _ = tts
    computed = []
    real = ck.lm.condition_sum
    monkeypatch.setattr(ck.lm, "condition_sum", lambda values: computed.append(dict(values)) or real(values))
    service_conditions = {"control": "ok", "cfg": "2.0"}  # what `request` carries
    pool = TtsPool(ck.lm, ck.mimi, 2, voice_frames=10, warm_conditions=service_conditions)
    pool.warm_up(CostModel())
    assert computed == [service_conditions]  # once, at warm-up
    pool._load_row(1, request(tts, "Hello there."))
    assert computed == [service_conditions]  # the request's admission found it cached
    plain = TtsPool(ck.lm, ck.mimi, 2, voice_frames=10)
    plain.warm_up(CostModel())  # each condition's first value: not what requests carry
    computed.clear()
    plain._load_row(1, request(tts, "Hello there."))
    assert computed == [service_conditions]  # computed during the live admission


def test_a_rows_steps_are_realtime_until_it_is_a_second_ahead_of_a_real_time_listener(tts):
    """slack.py rule 1, decided here: an admission and every step before a row's first audio are
    realtime work; after it, a step is realtime while the row is less than `realtime_lead_frames`
    ahead of a listener playing it in real time since its first frame (wall time, the pool's
    clock), and throughput work past that (a client reading as fast as audio comes has read it
    all, and is still far ahead of real time)."""
    async def main():
        ck, _ = tts
        now = [100.0]
        pool = TtsPool(ck.lm, ck.mimi, 1, voice_frames=10, now=lambda: now[0])
        costs = CostModel()
        job = pool.submit(request(tts, " ".join(TEXTS)), asyncio.get_running_loop())

        def step() -> bool:
            item = pool.offer(None, costs)
            item.run()
            job.stream.drain()  # the client reads everything as it comes
            return item.realtime

        assert pool.offer(None, costs).key == ADMIT_KEY and step()  # the admission
        while job.frames == 0:
            assert pool.offer(None, costs).due_s == 0  # first audio is due now
            assert step()  # the clock stands still: no audio yet
        item = pool.offer(None, costs)  # due when its lead over the listener would run out
        assert item.realtime and item.due_s == pytest.approx(job.frames / 12.5)
        while job.frames < pool.realtime_lead_frames:
            assert step()
        assert not step() and not step()  # 13 frames ahead of a listener who has heard none
        now[0] += 0.5  # a listener playing from the first frame has heard 6.25 frames
        assert job.frames < 6.25 + pool.realtime_lead_frames
        while job.frames < 6.25 + pool.realtime_lead_frames:
            assert step()
        assert not step()
        job.cancel()
    asyncio.run(main())


def test_text_that_streams_in_waits_for_words_and_gives_the_whole_scripts_frames(tts):
    """A `text_open` request steps only while it holds the DSM's lookahead + 1 unconsumed words;
    words appended one at a time (each once the row waits for it), then `end_text`, give the
    frames and word times of the whole script."""
    import dataclasses

    ck, _ = tts
    text = "The quick brown fox jumps over the lazy dog."
    whole = request(tts, text, text_temperature=0.0, audio_temperature=0.0)  # greedy: no draw to line up

    def frames_of(job, pool, feed):
        got = []
        while not (got and isinstance(got[-1], Terminal)):
            ran = run_items(pool)
            events = job.stream.drain()
            if not ran and not events:
                feed()  # the row waits, and not on its reader: give it what it waits for
            got += events
        return got

    async def main():
        pool = TtsPool(ck.lm, ck.mimi, 1, voice_frames=10)
        want = frames_of(pool.submit(whole, asyncio.get_running_loop()), pool, lambda: None)
        entries = list(whole.entries)
        streamed = dataclasses.replace(whole, entries=tuple(entries[:1]), text_open=True)
        job = pool.submit(streamed, asyncio.get_running_loop())
        waits = []

        def feed():
            waits.append(pool._rows[0].steps)
            if len(entries) > len(pool._rows[0].entries):
                job.append([entries[len(pool._rows[0].entries)]])
            else:
                job.end_text()

        got = frames_of(job, pool, feed)
        assert len(waits) == len(entries) and waits[0] == 0  # one word: it cannot start
        assert waits[1:] == sorted(waits[1:]) and waits[-1] > 0  # then it spoke as words came
        assert [e.text for e in got if isinstance(e, TtsWord)] == [e.text for e in want if isinstance(e, TtsWord)]
        assert [(e.start_s, e.stop_s) for e in got if isinstance(e, TtsWord)] == \
            [(e.start_s, e.stop_s) for e in want if isinstance(e, TtsWord)]
        np.testing.assert_array_equal(np.concatenate([e.pcm for e in got if isinstance(e, TtsAudio)]),
                                      np.concatenate([e.pcm for e in want if isinstance(e, TtsAudio)]))
        assert got[-1].status is Status.COMPLETED
    asyncio.run(main())


def speak_to_the_end(runner, pool, reqs) -> list[list]:
    """Each request's events, the runner driving `pool` (added to it here) until every one completed."""
    runner.add_source(pool)
    jobs = [pool.submit(r, asyncio.get_running_loop()) for r in reqs]
    events: list[list] = [[] for _ in jobs]
    for _ in range(300):
        runner.run_until(None)
        for job, got in zip(jobs, events):
            got += job.stream.drain()
        if all(job.stream.finished for job in jobs):
            break
    assert all(got and got[-1] == Terminal(Status.COMPLETED) for got in events)
    return events
