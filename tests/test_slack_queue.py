"""Slack items queued on the device back to back (engine/slack_queue.py, slack.py rule 8), on a fake
device: a host clock tests move by hand and a device timeline that runs each item's work after the
work queued before it. No wall time, no CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from parley.engine import EngineConfig, OptionsError
from parley.engine.slack import CostModel, Priority, SlackRunner, SlackSource, WorkItem
from parley.engine.slack_queue import SlackQueue


@dataclass
class Event:
    at: float  # when the device reaches it


class FakeDevice:
    """One stream: work queued at host time t starts when the device is free and t has come; an event
    is reached when the work queued before it has run. `wait` moves the host clock to the event."""

    def __init__(self) -> None:
        self.t = 0.0  # the host clock
        self.free_at = 0.0  # when the device has run everything queued
        self.waits = 0  # host waits on an event (the depth bound, the slack's end)
        self.syncs = 0  # whole-device synchronisations (the depth-1 path)
        self.recorded = 0

    def now(self) -> float:
        return self.t

    def queue(self, seconds: float) -> float:
        """Device work of `seconds`; returns when it ends."""
        self.free_at = max(self.free_at, self.t) + seconds
        return self.free_at

    def synchronize(self) -> None:
        self.syncs += 1
        self.t = max(self.t, self.free_at)

    # the DeviceTimeline protocol
    def record(self) -> Event:
        self.recorded += 1
        return Event(max(self.free_at, self.t))

    def done(self, event: Event) -> bool:
        return event.at <= self.t

    def wait(self, event: Event) -> None:
        self.waits += 1
        self.t = max(self.t, event.at)

    def elapsed_s(self, start: Event, end: Event) -> float:
        return end.at - start.at

    def release(self, events: list) -> None:
        pass


class DeviceSource(SlackSource):
    """Items of `device_s` device work each, launched in `launch_s` of host time. With `host_half`,
    each item's output (its index) is read by a host half, which checks the device has run it, and
    goes to session `index % sessions`; without, `run` does it all (nothing to read back)."""

    def __init__(self, device: FakeDevice, name: str, device_s: float, items: int, *, launch_s: float = 0.0001,
                 host_half: bool = True, sessions: int = 1, realtime: bool = False,
                 priority: Priority = Priority.TTS) -> None:
        self.device, self.name, self.device_s, self.left = device, name, device_s, items
        self.launch_s, self.host_half, self.sessions, self.realtime = launch_s, host_half, sessions, realtime
        self.priority = priority
        self.sent = 0
        self.outputs: dict[int, list[int]] = {s: [] for s in range(sessions)}
        self.launched: list[tuple[float, float]] = []  # (host time at launch, device end) per item
        self.in_flight_at_launch: list[int] = []  # items of any source not yet run by the device
        self.offers_while_pending = 0
        self._pending = 0  # host halves not yet run

    def offer(self, left_s, costs: CostModel):
        if self._pending:
            self.offers_while_pending += 1
        if self.left == 0:
            return None
        index = self.sent

        def launch():
            self.left -= 1
            self.sent += 1
            self.device.t += self.launch_s
            end = self.device.queue(self.device_s)
            self.launched.append((self.device.t, end))
            self.in_flight_at_launch.append(sum(e > self.device.t for _, e in self.launched))
            if not self.host_half:
                return None
            self._pending += 1

            def finish():
                assert self.device.t >= end, "a host half read its output before the device wrote it"
                self._pending -= 1
                self.outputs[index % self.sessions].append(index)
            return finish

        def run():
            finish = launch()
            if finish is not None:
                self.device.synchronize()  # a read of a device value waits for the device
                finish()

        return WorkItem(key=(self.name,), run=run, fail=lambda exc: None, realtime=self.realtime,
                        launch=launch if self.host_half else None)


def queued_runner(device: FakeDevice, depth: int, guard: float = 0.003) -> SlackRunner:
    return SlackRunner(device.now, device.synchronize, guard, queue_depth=depth, timeline=device)


def seeded(runner: SlackRunner, *sources: DeviceSource) -> SlackRunner:
    """Each source's key measured (seeded at its device cost), as a warm-up leaves it."""
    for source in sources:
        runner.costs.seed((source.name,), source.device_s)
        runner.add_source(source)
    return runner


def test_items_queue_back_to_back_up_to_the_depth():
    """A source of pure device work (an image step: nothing read back) is asked again at once."""
    device = FakeDevice()
    source = DeviceSource(device, "images", device_s=0.010, items=6, host_half=False, priority=Priority.IMAGES)
    runner = seeded(queued_runner(device, depth=2), source)
    runner.run_until(0.080)
    assert source.sent == 6
    first_end = source.launched[0][1]
    assert source.launched[1][0] < first_end, "the second item was launched before the first ended"
    assert max(source.in_flight_at_launch) == 2  # never more than the depth in flight
    # Back to back: the device ran the six items without a gap (each starts when the one before ends).
    ends = [end for _, end in source.launched]
    assert ends == pytest.approx([first_end + 0.010 * i for i in range(6)])
    assert device.syncs == 0  # no whole-device synchronisation, only waits on the oldest item
    assert device.waits == 6  # the oldest whenever two are in flight (five times), the last at the end
    assert device.t >= ends[-1]  # every item done before the slack ended


def test_sources_with_host_halves_queue_beside_each_other():
    """Each source has at most one host half pending; two sources keep two items in flight."""
    device = FakeDevice()
    tts = DeviceSource(device, "tts", device_s=0.010, items=3, realtime=True)
    stt = DeviceSource(device, "stt", device_s=0.010, items=3, realtime=True, priority=Priority.TRANSCRIPTION)
    runner = seeded(queued_runner(device, depth=2), tts, stt)
    runner.run_until(0.080)
    assert stt.launched[0][0] < tts.launched[0][0] < stt.launched[0][1]  # the second queued behind the first
    assert tts.outputs[0] == stt.outputs[0] == [0, 1, 2]
    assert tts.offers_while_pending == stt.offers_while_pending == 0


def test_no_throughput_item_is_queued_behind_a_realtime_one_whose_host_half_is_pending():
    """A TTS row before its first audio steps on host halves; an image denoise item queued behind its
    step would hold its next step for the image's whole length. So the image waits until the realtime
    source offers nothing, and the steps run without an image between them."""
    device = FakeDevice()
    tts = DeviceSource(device, "tts", device_s=0.010, items=3, realtime=True)
    images = DeviceSource(device, "images", device_s=0.030, items=1, host_half=False, priority=Priority.IMAGES)
    runner = seeded(queued_runner(device, depth=2), tts, images)
    runner.run_until(0.200)
    assert tts.outputs[0] == [0, 1, 2] and images.sent == 1
    tts_ends = [end for _, end in tts.launched]
    image_start = images.launched[0][1] - 0.030
    assert image_start >= tts_ends[-1]  # the image only after the last realtime step
    assert all(launch_at >= previous_end for (launch_at, _), previous_end in zip(tts.launched[1:], tts_ends))


def test_depth_one_waits_for_each_item():
    device = FakeDevice()
    source = DeviceSource(device, "tts", device_s=0.010, items=3)
    runner = seeded(queued_runner(device, depth=1), source)
    runner.run_until(0.080)
    assert max(source.in_flight_at_launch) == 1
    assert device.recorded == 0  # no queue, no events: each item run and synchronised (rule 4)
    assert all(launch_at >= previous_end for (launch_at, _), (_, previous_end)
               in zip(source.launched[1:], source.launched))


def test_costs_are_the_device_time_not_the_host_time():
    """An item whose launch takes little host time but runs 10 ms on the device costs 10 ms; the host
    saw it done later (it waited on the oldest), and that later time is not its cost."""
    device = FakeDevice()
    source = DeviceSource(device, "tts", device_s=0.010, items=4, launch_s=0.0)
    runner = SlackRunner(device.now, device.synchronize, 0.003, queue_depth=2, timeline=device)
    runner.add_source(source)
    runner.costs.seed(("tts",), 0.004)  # a warm-up below the live cost
    runner.run_until(0.080)
    assert runner.costs.estimate(("tts",)) == pytest.approx(0.010)
    assert runner.stats.seconds == pytest.approx(0.040)
    assert runner.stats.by_key[("tts",)] == [4, pytest.approx(0.040)]
    # The first three were launched on the 4 ms seed (the third after one live cost, which alone does
    # not set an estimate: slack.py rule 2), the fourth after two live costs replaced it.
    assert runner.stats.overruns == 3


def test_an_item_past_the_deadline_on_the_queued_timeline_is_not_launched():
    """Host time says a third 30 ms item fits (the host is < 1 ms in); the queued timeline says it
    would end at ~90 ms, past 80 - 3: it is not launched, and the queued work ends before the guard."""
    device = FakeDevice()
    source = DeviceSource(device, "images", device_s=0.030, items=5, host_half=False, priority=Priority.IMAGES)
    runner = seeded(queued_runner(device, depth=4), source)
    offered_left: list[float] = []
    offered_at: list[float] = []
    offer = source.offer
    source.offer = lambda left, costs: offered_left.append(left) or offered_at.append(device.t) or offer(left, costs)
    runner.run_until(0.080)
    assert source.sent == 2
    assert source.launched[-1][1] <= 0.080 - 0.003
    # The third offer was sized to what the queued timeline leaves (~17 ms), not to host time (~77 ms).
    assert offered_left[2] == pytest.approx(0.080 - 0.003 - source.launched[1][1], abs=1e-3)
    assert offered_left[2] < 0.030 < 0.080 - 0.003 - offered_at[2]  # (host time would have launched it)
    assert runner.stats.past_boundary == 0


def test_nothing_is_queued_behind_an_item_with_no_estimate():
    device = FakeDevice()
    unknown = DeviceSource(device, "new", device_s=0.020, items=1, priority=Priority.PREFILL)
    known = DeviceSource(device, "tts", device_s=0.010, items=1)
    runner = queued_runner(device, depth=3)
    runner.add_source(unknown)
    runner.add_source(known)
    runner.costs.seed(("tts",), 0.010)
    runner.run_until(0.080)
    assert known.launched[0][0] >= unknown.launched[0][1]  # waited for before the next was launched
    assert runner.costs.estimate(("new",)) == pytest.approx(0.020, abs=2e-4)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_outputs_reach_their_sessions_in_order(depth):
    """Two sources with host halves and one without, several sessions each: every output arrives, in
    order, each read after the device ran it (the host half asserts it), and a source with a host half
    pending is never asked for more."""
    device = FakeDevice()
    tts = DeviceSource(device, "tts", device_s=0.004, items=12, sessions=3, realtime=True)
    stt = DeviceSource(device, "stt", device_s=0.003, items=12, sessions=2, realtime=True,
                       priority=Priority.TRANSCRIPTION)
    images = DeviceSource(device, "images", device_s=0.005, items=6, host_half=False, priority=Priority.IMAGES)
    runner = seeded(queued_runner(device, depth), tts, stt, images)
    for tick in range(4):
        device.t = max(device.t, 0.080 * tick)
        runner.run_until(0.080 * (tick + 1))
    assert tts.outputs == {s: list(range(s, 12, 3)) for s in range(3)}
    assert stt.outputs == {s: list(range(s, 12, 2)) for s in range(2)}
    assert images.sent == 6
    assert tts.offers_while_pending == stt.offers_while_pending == 0


def test_depth_one_reproduces_todays_order():
    """Depth 1 with a device timeline runs what a runner without one (today's, and the CPU's) runs: the
    same items in the same order, each synchronised before the next is chosen, no event recorded."""
    def order(queued: bool) -> tuple[list[str], int, int]:
        device = FakeDevice()
        queue = {"queue_depth": 1, "timeline": device} if queued else {}
        sources = [DeviceSource(device, "stt", 0.002, 4, realtime=True, priority=Priority.TRANSCRIPTION),
                   DeviceSource(device, "tts", 0.003, 30, realtime=True),
                   DeviceSource(device, "images", 0.005, 20, host_half=False, priority=Priority.IMAGES)]
        runner = seeded(SlackRunner(device.now, device.synchronize, 0.003, **queue), *sources)
        ran: list[str] = []
        for source in sources:
            launch = source.offer

            def traced(left, costs, source=source, offer=launch):
                item = offer(left, costs)
                if item is not None:
                    run = item.run
                    item.run = lambda: ran.append(source.name) or run()
                return item
            source.offer = traced
        for tick in range(2):
            device.t = max(device.t, 0.080 * tick)
            runner.run_until(0.080 * (tick + 1))
        return ran, device.syncs, device.recorded

    today = order(queued=False)
    assert order(queued=True) == today
    ran, syncs, recorded = today
    assert syncs == len(ran) + sum(name != "images" for name in ran)  # the runner's, and each read's own
    assert recorded == 0
    assert set(ran) == {"stt", "tts", "images"}


def test_a_host_half_that_raises_fails_its_item_only():
    device = FakeDevice()
    failures: list[Exception] = []

    class Raising(SlackSource):
        priority = Priority.TTS

        def __init__(self) -> None:
            self.left = 1

        def offer(self, left_s, costs):
            if not self.left:
                return None

            def launch():
                self.left -= 1
                device.queue(0.005)

                def finish():
                    raise ValueError("bad output")
                return finish
            return WorkItem(key=("raising",), run=lambda: None, fail=failures.append, launch=launch)

    other = DeviceSource(device, "images", 0.005, 2, host_half=False, priority=Priority.IMAGES)
    runner = seeded(queued_runner(device, 2), other)
    runner.add_source(Raising())
    runner.costs.seed(("raising",), 0.005)
    runner.run_until(0.080)
    assert [str(e) for e in failures] == ["bad output"]
    assert runner.stats.failed == 1 and other.sent == 2
    assert runner.costs.estimate(("raising",)) == pytest.approx(0.005)  # the seed: no live cost recorded


def test_queued_end_folds_the_items_in_flight():
    """Rule 2 on its own: an item starts when the one before it ends (or when launched, if later),
    ends its estimate later, and never before its launch returned."""
    device = FakeDevice()
    queue = SlackQueue(device, depth=3, now=device.now)
    queue.begin()

    def push(estimate: float, launch_s: float) -> None:
        from parley.engine.slack_queue import InFlight
        launched_at = device.t
        start = queue.start()
        device.t += launch_s
        device.queue(estimate)
        queue.push(InFlight(None, None, (start, queue.end()), launched_at, device.t, estimate, 0.0, False, None))

    push(0.010, 0.001)
    assert queue.queued_end() == pytest.approx(0.010)
    push(0.004, 0.020)  # a launch slower than the device: it cannot end before its launch returned
    assert queue.queued_end() == pytest.approx(0.021)
    device.t = 0.030
    done = queue.completed()
    # Each span runs from its start event (when the device reached it) to its end: the first's includes
    # the 1 ms its launch took, the second's the device idle while its slow launch went on (rule 1).
    assert [round(c.seconds, 6) for c in done] == [0.011, 0.014]
    assert queue.empty and queue.queued_end() == pytest.approx(0.030)


def test_engine_config_refuses_a_depth_below_one():
    assert EngineConfig().slack_queue_depth == 2
    with pytest.raises(OptionsError, match="slack_queue_depth must be a whole number of at least 1"):
        EngineConfig(slack_queue_depth=0)


# ---- the real pools through the queued path (their host halves) ----

class DoneTimeline:
    """A device that has always finished (the CPU's): every event done, each item costing nothing."""

    def record(self) -> float:
        return 0.0

    def done(self, event: float) -> bool:
        return True

    def wait(self, event: float) -> None:
        pass

    def elapsed_s(self, start: float, end: float) -> float:
        return end - start

    def release(self, events: list) -> None:
        pass


def timeline_for(device: str):
    from parley.engine.slack_queue import CudaTimeline
    return CudaTimeline() if device == "cuda" else DoneTimeline()


def sync_for(device: str):
    import torch
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_tts_pool_queued_gives_the_audio_and_words_of_each_item_waited_for(tiny_tts_dir, device):
    """Queued (depth 3), each step's results reach its rows by the host half: the same words and audio,
    in the same order, as steps run and waited for one by one; on CUDA, with graphs and device costs."""
    import asyncio

    import numpy as np
    import torch

    from parley.engine.tts_pool import TtsAudio, TtsPool, TtsRequest, TtsWord
    from test_tts_pool import speak_to_the_end
    from parley.models.dsm import split_words
    from parley.models.synthetic import TINY_TTS_VOICES
    from parley.models.tts_checkpoint import VoiceStore, load_tts_checkpoint

    ck = load_tts_checkpoint(tiny_tts_dir, device=device, dtype=torch.float32)
    store = VoiceStore.open(tiny_tts_dir / "voices", ck.config.voice_suffix, 16)
    texts = [("Hello there, how are you?", 0), ("The quick brown fox jumps.", 1), ("Good morning!", 2)]
    reqs = [TtsRequest(tuple(split_words(text, ck.tokenizer.encode, 12.5)), (store.load(TINY_TTS_VOICES[v]),),
                       {"control": "ok", "cfg": "2.0"}, text_temperature=0.0, audio_temperature=0.0)
            for text, v in texts]

    async def run(depth: int):
        pool = TtsPool(ck.lm, ck.mimi, 4, voice_frames=10)
        runner = SlackRunner(lambda: 0.0, sync_for(device), 0.0, queue_depth=depth, timeline=timeline_for(device))
        pool.warm_up(runner.costs)
        events = speak_to_the_end(runner, pool, reqs)
        return runner, [([(e.text, e.start_s) for e in got if isinstance(e, TtsWord)],
                         np.concatenate([e.pcm for e in got if isinstance(e, TtsAudio)])) for got in events]

    _, waited = asyncio.run(run(1))
    runner, queued = asyncio.run(run(3))
    for (words, pcm), (queued_words, queued_pcm) in zip(waited, queued):
        assert queued_words == words
        np.testing.assert_array_equal(queued_pcm, pcm)
    if device == "cuda":  # device costs recorded for the steps that ran
        assert runner.stats.items > 0 and runner.stats.seconds > 0


@pytest.mark.parametrize("device", DEVICES)
def test_stt_pool_queued_gives_the_transcripts_of_each_item_waited_for(tmp_path, device):
    """Queued (depth 2), several steps an item, outputs published and rows completed by the host half in
    step order: the same partials, in order, as the steps published at once."""
    import asyncio

    import numpy as np
    import torch

    from parley.engine.stream import Terminal
    from parley.engine.stt_pool import SttPool
    from parley.models.checkpoint import load_stt_checkpoint
    from parley.models.synthetic import write_tiny_stt_checkpoint

    stt = load_stt_checkpoint(write_tiny_stt_checkpoint(tmp_path / "stt"), device=device, dtype=torch.float32)
    clips = [(0.1 * np.random.default_rng(seed).standard_normal(int(s * 24_000))).astype(np.float32)
             for seed, s in ((1, 1.0), (2, 0.55), (3, 1.3))]

    async def run(depth: int):
        pool = SttPool(stt, slots=2)  # three requests, two rows: one waits and takes a completed row
        runner = SlackRunner(lambda: 0.0, sync_for(device), 0.0, queue_depth=depth, timeline=timeline_for(device))
        pool.warm_up(runner.costs)
        runner.add_source(pool)
        requests = [pool.submit() for _ in clips]
        for request, clip in zip(requests, clips):
            request.feed(clip)
            request.end_input()
        got = [[] for _ in requests]
        for _ in range(200):
            runner.run_until(None)
            for request, events in zip(requests, got):
                events += request.events.drain()
            if all(events and isinstance(events[-1], Terminal) for events in got):
                break
        return [[(p.text, p.words) if not isinstance(p, Terminal) else p for p in events] for events in got]

    waited, queued = asyncio.run(run(1)), asyncio.run(run(2))
    assert queued == waited
    assert all(events[-1].status.value == "completed" for events in queued)


@pytest.mark.parametrize(("device", "depth", "queued"), [("cuda", 2, True), ("cuda", 1, False), ("cpu", 2, False),
                                                         (None, 3, False)])
def test_the_engine_queues_only_on_cuda_and_above_depth_one(device, depth, queued):
    """The engine's runner (SlackRunner.for_backend): a queue of the configured depth beside a CUDA
    backend; depth 1, a CPU backend or one naming no device run each item and wait (rule 4)."""
    from types import SimpleNamespace

    backend = SimpleNamespace(device=device, synchronize=lambda: None)
    runner = SlackRunner.for_backend(backend, lambda: 0.0, EngineConfig(slack_queue_depth=depth))
    assert (runner._queue is not None) == queued
    if queued:
        assert runner._queue.depth == depth


@pytest.mark.parametrize("device", DEVICES)
def test_image_queue_queued_hands_out_the_images_of_each_item_waited_for(device):
    """Queued (depth 2), previews and final images reach their requests by the items' host halves (a
    tiled size too: its blend): the same pixels, in the same order, as items run and waited for one
    by one."""
    import asyncio

    import numpy as np

    from parley.engine.image_queue import ImageQueue, ImageSpec
    from parley.models.image_pipeline import stepper_for
    from parley.models.tiny_diffusion import tiny_pipeline

    stepper = stepper_for(tiny_pipeline("sd").to(device))
    size = stepper.default_size
    tiled = next(s for s in range(size, 8 * size, stepper.latent_stride) if stepper.tiled(s, s))

    async def run(depth: int):
        queue = ImageQueue(stepper, max_slack_s=1.0, stream_events=4)
        runner = SlackRunner(lambda: 0.0, sync_for(device), 0.0, queue_depth=depth, timeline=timeline_for(device))
        runner.add_source(queue)
        requests = [queue.submit(ImageSpec(f"p{i}", s, s, steps=3, guidance=5.0, seed=i, partial_images=1))
                    for i, s in enumerate((size, size, tiled))]
        runner.run_until(None)
        return [[(type(e).__name__, getattr(e, "pixels", None)) for e in r.events.drain()] for r in requests]

    waited = asyncio.run(run(1))
    queued = asyncio.run(run(2))
    assert [[name for name, _ in events] for events in waited] == [["ImagePartial", "ImageResult", "Terminal"]] * 3
    for ours, reference in zip(queued, waited):
        assert [name for name, _ in ours] == [name for name, _ in reference]
        for (_, pixels), (_, expected) in zip(ours, reference):
            assert (pixels is None) == (expected is None)
            if pixels is not None:
                np.testing.assert_array_equal(pixels, expected)
