"""The slack runner (engine/slack.py): what runs after a tick, in what order, and what a
failure takes down. A fake clock makes every decision exact."""

from __future__ import annotations

import asyncio

import pytest

from parley.engine import Engine, EngineConfig, EngineClosed, SessionOptions, Status
from parley.engine.slack import STALE_TICKS, CostModel, Priority, SlackRunner, SlackSource, WorkItem, second_call_cost
from delay_backend import DelayBackend

from test_engine_core import baseline_outputs, frames_of, make_engine, open_ready, signal


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


class ScriptedSource(SlackSource):
    """Offers items of known cost (advancing the fake clock when run), in order."""

    def __init__(self, clock: FakeClock, priority: Priority, costs: list[float], name: str,
                 ran: list[str], fail_at: int | None = None, error: Exception | None = None,
                 predicted: float | None = None, realtime: bool = False, forced: bool = False) -> None:
        self.clock, self.priority, self.costs, self.name, self.ran = clock, priority, list(costs), name, ran
        self.fail_at, self.error, self.failures, self.offers = fail_at, error, [], 0
        self.predicted = predicted  # every item's WorkItem.predicted_s
        self.realtime, self.forced = realtime, forced  # every item's class (rule 1) and WorkItem.forced

    def offer(self, left_s, costs: CostModel):
        self.offers += 1
        if not self.costs:
            return None
        cost = self.costs[0]

        def run():
            self.costs.pop(0)
            self.clock.t += cost
            self.ran.append(f"{self.name}:{cost}")
            if self.fail_at is not None and len(self.ran) == self.fail_at:
                raise self.error

        return WorkItem(key=(self.name, cost), run=run, fail=self.failures.append, predicted_s=self.predicted,
                        realtime=self.realtime, forced=self.forced)


class EndlessSource(SlackSource):
    """Always has an item of one cost (a TTS stream read as fast as it comes, an image queue that
    never empties); counts the items and seconds it ran."""

    def __init__(self, clock: FakeClock, priority: Priority, cost: float, name: str, ran: list[str],
                 realtime: bool = False) -> None:
        self.clock, self.priority, self.cost, self.name, self.ran = clock, priority, cost, name, ran
        self.realtime, self.items, self.seconds, self.available = realtime, 0, 0.0, True
        self.due_s = 0.0  # every item's WorkItem.due_s

    def offer(self, left_s, costs: CostModel):
        return WorkItem(key=(self.name,), run=self._run, fail=lambda exc: None, realtime=self.realtime,
                        due_s=self.due_s) if self.available else None

    def _run(self) -> None:
        self.clock.t += self.cost
        self.items += 1
        self.seconds += self.cost
        self.ran.append(self.name)


def runner(clock: FakeClock, guard: float = 0.003) -> SlackRunner:
    return SlackRunner(clock.now, lambda: None, guard)


def live_stt_and_tts_before_first_audio():
    """A live transcription (realtime, its frames scripted per tick) and a TTS row of 20 ms steps
    before its first audio (realtime, always ready), behind a runner with no guard."""
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    stt = ScriptedSource(clock, Priority.TRANSCRIPTION, [], "stt", ran, realtime=True)
    tts = EndlessSource(clock, Priority.TTS, 0.020, "tts", ran, realtime=True)
    slack.add_source(stt)
    slack.add_source(tts)
    slack.costs.record(("tts",), 0.020)
    return clock, ran, slack, stt, tts


def endless(slack: SlackRunner, clock: FakeClock, ran: list[str], priority: Priority, cost: float,
            name: str) -> EndlessSource:
    """A throughput EndlessSource added to `slack`, its cost already measured."""
    source = EndlessSource(clock, priority, cost, name, ran)
    slack.add_source(source)
    slack.costs.record((name,), cost)
    return source


def test_an_item_whose_estimate_exceeds_the_slack_left_never_starts():
    clock, ran = FakeClock(), []
    slack = runner(clock)
    slack.costs.record(("tts", 0.030), 0.030)
    source = ScriptedSource(clock, Priority.TTS, [0.030, 0.030, 0.030], "tts", ran)
    slack.add_source(source)
    slack.run_until(deadline=0.070)  # 67 ms usable: two 30 ms items fit, the third would end at 90 ms
    assert ran == ["tts:0.03", "tts:0.03"]
    assert clock.t == pytest.approx(0.060)
    assert slack.stats.past_boundary == 0 and slack.stats.overruns == 0


def test_an_unseen_key_runs_on_its_sources_prediction_until_its_first_measurement():
    """Rule 2: a predicted item (40 ms, really 30) does not start, even as a tick's first item,
    while the prediction exceeds the slack left; it runs once it fits, and from then on its
    measured 30 ms is the estimate (the prediction is never recorded)."""
    clock, ran = FakeClock(), []
    slack = runner(clock)
    slack.add_source(ScriptedSource(clock, Priority.IMAGES, [0.030, 0.030], "cold", ran, predicted=0.040))
    slack.run_until(deadline=0.035)  # 32 ms usable
    assert ran == [] and clock.t == 0.0
    clock.t = 0.080
    slack.run_until(deadline=0.125)  # 42 ms usable: the prediction fits
    assert ran == ["cold:0.03"] and slack.costs.estimate(("cold", 0.030)) == pytest.approx(0.030)
    clock.t = 0.160
    slack.run_until(deadline=0.195)  # 32 ms usable again: the measured 30 ms fits
    assert ran == ["cold:0.03", "cold:0.03"]
    assert slack.stats.past_boundary == 0 and slack.stats.overruns == 0


def test_realtime_items_go_first_least_served_first_and_a_throughput_item_waits_for_room():
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    for key, cost in ((("images", 0.050), 0.050), (("prefill", 0.020), 0.020), (("tts", 0.010), 0.010)):
        slack.costs.record(key, cost)
    slack.add_source(ScriptedSource(clock, Priority.IMAGES, [0.050], "images", ran))
    slack.add_source(ScriptedSource(clock, Priority.TTS, [0.010, 0.010], "tts", ran, realtime=True))
    slack.add_source(ScriptedSource(clock, Priority.PREFILL, [0.020, 0.020], "prefill", ran, realtime=True))
    slack.run_until(deadline=0.065)
    # Realtime first: prefill (a tie at 0 s served: the first asked), then TTS until it has had
    # as long (two 10 ms items), then prefill; the 50 ms image no longer fits in what is left.
    assert ran == ["prefill:0.02", "tts:0.01", "tts:0.01", "prefill:0.02"]
    clock.t = 0.080
    slack.run_until(deadline=0.160)  # next tick: the image fits now
    assert ran[-1] == "images:0.05"


def test_realtime_sources_that_do_not_fit_one_tick_together_take_turns():
    """A loaded CPU: 25 ms of slack, a live transcription step of 10 ms every tick and TTS steps
    of 20 ms before its first audio, both realtime. In strict order one of them would starve
    the other; least served first, both progress: TTS runs about every other tick, and the
    transcription steps in the others, its missed frames caught up in one item."""
    clock, ran, slack, stt, tts = live_stt_and_tts_before_first_audio()
    for units in (1, 2, 3):
        slack.costs.record(("stt", 0.010 * units), 0.010 * units)
    for tick in range(40):
        clock.t = tick * 0.080
        backlog = round(100 * sum(stt.costs))  # frames not stepped yet
        stt.costs[:] = [0.010 * (backlog + 1)]  # one item steps every frame that arrived
        slack.run_until(deadline=clock.t + 0.025)
    assert 15 <= tts.items <= 25
    assert sum(1 for r in ran if r.startswith("stt")) >= 15 and all(cost <= 0.031 for cost in stt.costs)


def test_a_realtime_item_due_now_goes_before_one_due_later_however_much_each_was_served():
    """Earliest due first among realtime items: a TTS row with half a second of lead over its
    listener (its steps due in 0.5 s) leaves every tick's first place to the live transcription's
    frame (due now); once the lead is gone, both are due now and take turns, least served first."""
    clock, ran, slack, stt, tts = live_stt_and_tts_before_first_audio()
    slack.costs.record(("stt", 0.010), 0.010)

    def tick(n: int) -> list[str]:
        clock.t = n * 0.080
        stt.costs[:] = [0.010]
        before = len(ran)
        slack.run_until(deadline=clock.t + 0.025)
        return ran[before:]

    tts.due_s = 0.5
    assert [tick(n) for n in range(6)] == [["stt:0.01"]] * 6  # the 20 ms step never fits after it
    tts.due_s = 0.0
    # Its lead time not being owed to it, TTS starts level with the transcription; then they take
    # turns in equal time: two 10 ms transcription items to one 20 ms TTS item.
    turns = [tick(n) for n in range(6, 18)]
    assert turns[:2] == [["stt:0.01"], ["tts"]] and all(len(t) == 1 for t in turns)
    assert turns.count(["tts"]) == 4 and turns.count(["stt:0.01"]) == 8


def test_a_realtime_item_goes_before_a_throughput_item_of_a_higher_priority_source():
    """Rule 1: the class decides first, the priority only among realtime items (and ties)."""
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    for name in ("tts", "stt", "images"):
        slack.costs.record((name, 0.010), 0.010)
    slack.add_source(ScriptedSource(clock, Priority.TTS, [0.010] * 2, "tts", ran))
    slack.add_source(ScriptedSource(clock, Priority.IMAGES, [0.010] * 2, "images", ran))
    slack.add_source(ScriptedSource(clock, Priority.TRANSCRIPTION, [0.010] * 2, "stt", ran, realtime=True))
    slack.run_until(deadline=0.0605)
    assert ran[:2] == ["stt:0.01", "stt:0.01"]  # the live transcription's steps, then throughput
    assert sorted(ran[2:]) == ["images:0.01", "images:0.01", "tts:0.01", "tts:0.01"]


def test_a_tts_stream_ahead_of_real_time_no_longer_starves_live_transcription_or_images():
    """Issue 32 item 4: a TTS source that always has work (a client downloading as fast as the
    audio comes, far ahead of real time: throughput) beside a live transcription session (a
    frame of audio every tick: realtime) and an image queue that never empties. Over 100 ticks of
    60 ms slack the transcription steps every tick, and TTS and images share what is left in
    equal time, each within one image item of half (strict priority gave TTS every tick)."""
    clock, ran = FakeClock(), []
    slack = runner(clock)
    tts = EndlessSource(clock, Priority.TTS, 0.004, "tts", ran)
    stt = ScriptedSource(clock, Priority.TRANSCRIPTION, [], "stt", ran, realtime=True)
    images = EndlessSource(clock, Priority.IMAGES, 0.015, "images", ran)
    for source in (tts, stt, images):
        slack.add_source(source)
    for key, cost in ((("tts",), 0.004), (("stt", 0.006), 0.006), (("images",), 0.015)):
        slack.costs.record(key, cost)
    for tick in range(100):
        clock.t = tick * 0.080 + 0.017  # the duplex frame took the tick's first 17 ms
        stt.costs[:] = [0.006]  # the frame that arrived this tick
        slack.run_until(deadline=tick * 0.080 + 0.080)
        assert stt.costs == [] and clock.t <= tick * 0.080 + 0.077  # stepped; nothing past the guard
    throughput = tts.seconds + images.seconds
    assert throughput > 100 * 0.040
    assert abs(tts.seconds - images.seconds) <= 0.015 + 1e-9
    assert images.items >= 150 and slack.stats.past_boundary == 0


def test_throughput_sources_share_the_slack_in_equal_time_not_equal_items():
    """Least served first, by measured seconds: a source of 5 ms items and one of 20 ms items get
    the same time (four small items to one large), whichever is asked first."""
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    large = endless(slack, clock, ran, Priority.IMAGES, 0.020, "large")
    small = endless(slack, clock, ran, Priority.TTS, 0.005, "small")
    for tick in range(50):
        clock.t = tick * 0.080
        slack.run_until(deadline=clock.t + 0.0605)
    assert small.seconds + large.seconds == pytest.approx(50 * 0.060)
    assert abs(small.seconds - large.seconds) <= 0.020 + 1e-9
    assert small.items == pytest.approx(4 * large.items, abs=4)


def test_a_throughput_source_back_from_idle_gets_its_share_not_the_time_it_missed():
    """A source with nothing to offer is lifted to the least served of those with work: an image
    queue that shared the slack, then sat idle for 40 ticks, takes half of each tick's slack once
    busy again, not every tick until its count catches up with the TTS stream's 40 ticks."""
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    tts = endless(slack, clock, ran, Priority.TTS, 0.010, "tts")
    images = endless(slack, clock, ran, Priority.IMAGES, 0.010, "images")

    def tick(n: int) -> tuple[int, int]:
        clock.t = n * 0.080
        before = (tts.items, images.items)
        slack.run_until(deadline=clock.t + 0.0605)
        return tts.items - before[0], images.items - before[1]

    assert [tick(n) for n in range(10)] == [(3, 3)] * 10
    images.available = False
    assert [tick(n) for n in range(10, 50)] == [(6, 0)] * 40
    images.available = True
    assert [tick(n) for n in range(50, 60)] == [(3, 3)] * 10


def test_forced_items_still_run_first_whatever_their_class():
    """Rule 3 is unchanged: a forced item runs as a tick's first item though it does not fit,
    a realtime one (prefill's minimum chunk) and a throughput one (the TTS pool's liveness step)
    alike; not first, a forced item waits for the next tick."""
    clock, ran = FakeClock(), []
    slack = runner(clock)
    prefill = ScriptedSource(clock, Priority.PREFILL, [0.030], "prefill", ran, realtime=True, forced=True)
    tts = ScriptedSource(clock, Priority.TTS, [0.030], "tts", ran, forced=True)
    images = EndlessSource(clock, Priority.IMAGES, 0.002, "images", ran)
    for source in (prefill, tts, images):
        slack.add_source(source)
    for key in (("prefill", 0.030), ("tts", 0.030)):
        slack.costs.record(key, 0.100)  # never fits a tick's slack
    slack.costs.record(("images",), 0.002)
    clock.t = 0.070
    slack.run_until(deadline=0.080)  # 7 ms usable: the forced prefill item, and nothing after it
    assert ran == ["prefill:0.03"]
    clock.t = 0.150
    slack.run_until(deadline=0.160)  # the forced TTS item goes first, ahead of the fitting images
    assert ran == ["prefill:0.03", "tts:0.03"]
    clock.t = 0.230
    slack.run_until(deadline=0.240)  # nothing forced left: the images fill the slack
    assert ran[2:] == ["images"] * 3


def test_an_item_with_no_estimate_runs_only_as_the_first_of_a_tick():
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    slack.add_source(ScriptedSource(clock, Priority.TTS, [0.001, 0.002], "new", ran))
    slack.run_until(deadline=1.0)
    assert ran == ["new:0.001"]  # the second key is unknown too, and something already ran
    slack.run_until(deadline=2.0)
    assert ran == ["new:0.001", "new:0.002"]


def test_a_failing_item_fails_its_request_only_and_the_runner_goes_on():
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    bad = ScriptedSource(clock, Priority.PREFILL, [0.001], "bad", ran, fail_at=1, error=ValueError("boom"))
    good = ScriptedSource(clock, Priority.TTS, [0.001], "good", ran)
    slack.add_source(bad)
    slack.add_source(good)
    slack.run_until(deadline=None)
    assert ran == ["bad:0.001", "good:0.001"]
    assert [str(e) for e in bad.failures] == ["boom"] and good.failures == []
    assert slack.stats.failed == 1


def test_a_cuda_error_in_an_item_is_fatal():
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    source = ScriptedSource(clock, Priority.TTS, [0.001], "gpu", ran, fail_at=1,
                            error=RuntimeError("CUDA error: an illegal memory access was encountered"))
    slack.add_source(source)
    with pytest.raises(RuntimeError, match="CUDA error"):
        slack.run_until(deadline=None)
    assert source.failures == []


def test_overruns_and_items_past_the_boundary_are_counted():
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    slack.costs.record(("slow", 0.050), 0.010)  # the estimate says 10 ms; it takes 50
    slack.add_source(ScriptedSource(clock, Priority.TTS, [0.050], "slow", ran))
    slack.run_until(deadline=0.020)
    assert slack.stats.overruns == 1 and slack.stats.past_boundary == 1


def test_cost_estimate_is_the_second_largest_of_the_recent_window_per_unit():
    costs = CostModel(window=3)
    costs.record("k", 0.008, units=2)
    assert costs.estimate("k") == pytest.approx(0.004)  # one observation: that one
    for seconds in (0.009, 0.002, 0.003, 0.001):
        costs.record("k", seconds * 2, units=2)
    assert costs.estimate("k") == pytest.approx(0.002)  # window 0.002, 0.003, 0.001 (0.009 fell out)
    assert costs.estimate("k", units=10) == pytest.approx(0.020)
    assert costs.estimate("other") is None


def test_warm_up_seeds_stand_in_for_a_key_until_it_has_two_live_costs():
    """Seeds (warm-up costs, often cold and high) set the estimate before the key runs, still
    count beside one live cost, and are gone once two live costs can set it on their own."""
    costs = CostModel()
    costs.seed("preview", 0.0107)
    costs.seed("preview", 0.0104)
    assert costs.estimate("preview") == pytest.approx(0.0104)
    costs.record("preview", 0.0054)
    assert costs.estimate("preview") == pytest.approx(0.0104)  # one live cost is not enough
    costs.record("preview", 0.0056)
    assert costs.estimate("preview") == pytest.approx(0.0054)  # the seeds went
    costs.seed("preview", 0.020)  # a key with live costs takes no seed
    assert costs.estimate("preview") == pytest.approx(0.0054)
    assert dict(costs.estimates()) == {"preview": pytest.approx(0.0054)}
    costs.seed("unseen", 0.003)
    assert dict(costs.estimates())["unseen"] == pytest.approx(0.003)


def test_one_slow_observation_does_not_hold_a_key_out_but_a_second_sets_the_estimate():
    """Issue 14: a step whose costs ran 13 ms typical, 20 ms second worst and 32 ms once (a
    preempted call; not twice the next, so rule 5 never heals it) must run in 25 ms of slack
    every tick, not wait for a slack that holds its worst call. A slow cost that repeats is
    real: its second observation sets the estimate, and no later item starts over it."""
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    key = ("stt", 0.013)
    for seconds in [0.013] * 29 + [0.0188, 0.0206, 0.0316]:
        slack.costs.record(key, seconds)
    source = ScriptedSource(clock, Priority.TRANSCRIPTION, [0.013] * 10, "stt", ran)
    slack.add_source(source)
    for tick in range(10):
        clock.t = tick * 0.080
        slack.run_until(deadline=clock.t + 0.025)
        assert len(ran) == tick + 1  # a step every tick: 20.6 ms fits, 31.6 would not
    assert slack.stats.overruns == 0 and slack.stats.stale_trials == 0
    slow = ScriptedSource(clock, Priority.TRANSCRIPTION, [0.030] * 4, "slow", ran)
    slack.add_source(slow)
    slack.costs.record(("slow", 0.030), 0.010)  # seeded cheap, but it really costs 30 ms
    for tick in range(2):  # the first 30 ms is set aside as a possible one-off; the second is not
        clock.t = 1.0 + tick * 0.080
        slack.run_until(deadline=clock.t + 0.025)
    assert ran[-2:] == ["slow:0.03"] * 2 and slack.stats.overruns == 2
    assert slack.costs.estimate(("slow", 0.030)) == pytest.approx(0.030)
    for tick in range(5):
        clock.t = 2.0 + tick * 0.080
        slack.run_until(deadline=clock.t + 0.025)
    assert ran.count("slow:0.03") == 2 and slack.stats.overruns == 2  # never started over it again


def test_a_prompt_that_raises_fails_its_session_only_and_others_stay_bit_identical():
    baseline = baseline_outputs(8)

    async def main():
        engine, _ = make_engine(4)
        sessions = await open_ready(engine, 3)
        for i, s in enumerate(sessions):
            s.push_audio(signal(i, 8))
        engine.run_ticks(3)
        crashing = engine.open_nowait(SessionOptions(voice="crash"))
        engine.run_ticks(5)
        with pytest.raises(EngineClosed, match="could not be started"):
            await crashing.ready
        out = [frames_of(s.events.drain()) for s in sessions]
        end = crashing.events.drain()[-1]
        counters = engine.counters()
        healthy = engine.healthy
        engine.shutdown()
        return out, end, counters, healthy

    out, end, counters, healthy = asyncio.run(main())
    assert healthy and counters["free_slots"] == 1
    assert end.status is Status.FAILED and "simulated" not in end.reason  # no exception text to clients
    for i in range(3):
        assert [f.pcm.tobytes() for f in out[i]] == [f.pcm.tobytes() for f in baseline[i]]
        assert [f.text_token for f in out[i]] == [f.text_token for f in baseline[i]]


def test_slack_sources_are_registered_before_start_only():
    engine = Engine(DelayBackend(1), EngineConfig(tick_seconds=0.01))
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="before the engine starts"):
            engine.add_slack_source(ScriptedSource(FakeClock(), Priority.TTS, [], "late", []))
    finally:
        engine.shutdown()


def test_a_key_poisoned_by_a_repeated_outlier_heals_after_stale_ticks():
    """Two cold 108 ms observations must not starve a source whose items really take 5 ms."""
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    slack.costs.record(("enc", 0.005), 0.005)
    slack.costs.record(("enc", 0.005), 0.108)
    slack.costs.record(("enc", 0.005), 0.108)  # seen twice: the estimate is now 108 ms
    slack.add_source(ScriptedSource(clock, Priority.IMAGES, [0.005] * 3, "enc", ran))
    for tick in range(STALE_TICKS):
        clock.t = tick * 0.080
        slack.run_until(deadline=clock.t + 0.060)
    # Never started over its estimate; the 25th declined tick put the key on trial.
    assert ran == [] and slack.stats.stale_drops == 0
    assert slack.costs.on_trial(("enc", 0.005)) and slack.costs.estimate(("enc", 0.005)) == pytest.approx(0.005)
    clock.t = STALE_TICKS * 0.080
    slack.run_until(deadline=clock.t + 0.060)  # the trial (first item) costs 5 ms: the outlier goes
    assert ran == ["enc:0.005"] * 3 and slack.stats.past_boundary == 0
    assert slack.stats.stale_trials == 1 and slack.stats.stale_drops == 1
    assert slack.costs.estimate(("enc", 0.005)) == pytest.approx(0.005)  # one 108 ms is left: a one-off


def test_a_trial_runs_only_with_the_whole_slack_free_and_a_slow_trial_keeps_the_outlier():
    """A key on trial never runs after other work in the same tick (a repeat of the slow call
    would have less room), and a trial that is slow again proves the cost was no outlier."""
    clock, ran = FakeClock(), []
    slack = runner(clock, guard=0.0)
    key = ("enc", 0.040)
    slack.costs.record(("tts", 0.010), 0.010)
    slack.costs.record(key, 0.005)
    slack.costs.record(key, 0.070)
    slack.costs.record(key, 0.070)  # seen twice, more than the 60 ms slack: declined every tick
    tts = ScriptedSource(clock, Priority.TTS, [], "tts", ran, realtime=True)
    slack.add_source(tts)
    slack.add_source(ScriptedSource(clock, Priority.IMAGES, [0.040], "enc", ran))
    for tick in range(STALE_TICKS + 3):  # realtime work every tick: the slack never starts free for enc
        clock.t = tick * 0.080
        tts.costs[:] = [0.010]
        slack.run_until(deadline=clock.t + 0.060)
    assert slack.costs.on_trial(key) and slack.costs.estimate(key) == pytest.approx(0.005)
    assert ran == ["tts:0.01"] * (STALE_TICKS + 3)  # on trial, yet never after the TTS item
    clock.t = (STALE_TICKS + 3) * 0.080
    slack.run_until(deadline=clock.t + 0.060)  # the whole slack is free: the trial runs, costs 40 ms
    assert ran[-1] == "enc:0.04" and slack.stats.past_boundary == 0
    assert slack.stats.stale_trials == 1 and slack.stats.stale_drops == 0  # 40 ms > 70 / 2: no outlier
    assert not slack.costs.on_trial(key) and slack.costs.estimate(key) == pytest.approx(0.070)


def test_the_cost_model_keeps_a_bounded_number_of_keys_evicting_the_least_recently_recorded():
    costs = CostModel(max_keys=3)
    for key in ("a", "b", "c"):
        costs.record(key, 0.01)
    costs.record("a", 0.02)  # "a" is the most recent now; "b" the stalest
    costs.record("d", 0.03)
    assert costs.estimate("b") is None
    assert [k for k, _ in costs.estimates()] == ["c", "a", "d"]
    assert costs.estimate("a") == pytest.approx(0.01)  # its window survived: second largest of two


def test_a_seed_is_the_second_call_s_cost_with_the_sync_inside_it():
    clock = iter([0.0, 5.0, 10.0, 11.5])  # the first call is cold (5 s), the second 1.5 s
    calls, syncs = [], []
    spent, result = second_call_cost(lambda: calls.append(1) or len(calls), lambda: syncs.append(len(calls)),
                                     lambda: next(clock))
    assert spent == 1.5 and result == 2 and syncs == [1, 2]
