"""The overlap lane (engine/slack_lane.py, slack.py rule 9): image work on a second device stream beside
the ticks' slack, on fake streams that share one host clock. No wall time; the CUDA test compares pixels."""

from __future__ import annotations

import pytest

from parley.engine import EngineConfig, OptionsError
from parley.engine.slack import Priority, SlackRunner
from parley.engine.slack_lane import OverlapLane
from test_slack_queue import DEVICES, DeviceSource, FakeDevice, seeded

PERIOD = 0.080
FRAME = 0.015  # the frame's share of each tick, before the slack starts


class LaneStream(FakeDevice):
    """A second stream of the same device: its own queue, the main stream's host clock."""

    def __init__(self, main: FakeDevice) -> None:
        self._main = main
        super().__init__()
        main.t = 0.0

    t = property(lambda self: self._main.t, lambda self, value: setattr(self._main, "t", value))


def lane_runner(device: FakeDevice, horizon_s: float = 1.5 * PERIOD, depth: int = 8):
    lane_stream = LaneStream(device)
    lane = OverlapLane(lane_stream, device.now, horizon_s, depth=depth)
    return SlackRunner(device.now, device.synchronize, 0.003, queue_depth=2, timeline=device, lane=lane), lane_stream


def images_on(stream: FakeDevice, items: int, device_s: float = 0.030, host_half: bool = False) -> DeviceSource:
    images = DeviceSource(stream, "images", device_s=device_s, items=items, host_half=host_half,
                          priority=Priority.IMAGES)
    images.overlaps = True
    return images


def run_ticks(runner: SlackRunner, device: FakeDevice, ticks: int) -> None:
    for tick in range(ticks):
        device.t = max(device.t, tick * PERIOD + FRAME)  # the frame ran on the main stream
        runner.run_until((tick + 1) * PERIOD)


def test_image_work_runs_back_to_back_on_the_lane_while_the_ticks_slack_runs_beside_it():
    """Each tick's slack holds its realtime work on the main stream, fitted to the boundary as before;
    the images never wait for a tick's tail: the lane's device runs them back to back from the first
    top-up to the last, across tick boundaries, and the main stream never holds one."""
    device = FakeDevice()
    runner, lane_stream = lane_runner(device)
    tts = DeviceSource(device, "tts", device_s=0.010, items=12, realtime=True)
    images = images_on(lane_stream, items=20)
    seeded(runner, tts, images)
    run_ticks(runner, device, 10)
    assert images.sent == 20 and tts.outputs[0] == list(range(12))
    ends = [end for _, end in images.launched]
    assert ends == pytest.approx([ends[0] + 0.030 * i for i in range(20)])  # no gap on the lane
    assert ends[0] == pytest.approx(FRAME + 0.030, abs=1e-3)  # queued at the first slack's start
    assert device.free_at == pytest.approx(max(end for _, end in tts.launched))  # the main stream: TTS only
    assert all(end <= (end // PERIOD + 1) * PERIOD - 0.003 + 1e-9 for _, end in tts.launched)
    assert runner.stats.past_boundary == 0


def test_the_lane_is_filled_to_its_horizon_and_depth_only():
    device = FakeDevice()
    runner, lane_stream = lane_runner(device, horizon_s=0.100, depth=8)
    images = images_on(lane_stream, items=50)
    seeded(runner, images)
    device.t = FRAME
    runner.run_until(PERIOD)
    # Queued while the work ahead ended under 100 ms from now: 0, 30, 60, 90 ms ahead, so four.
    assert images.sent == 4 and max(images.in_flight_at_launch) == 4
    runner, lane_stream = lane_runner(FakeDevice(), horizon_s=10.0, depth=3)
    images = images_on(lane_stream, items=50)
    seeded(runner, images)
    runner.run_until(PERIOD)
    assert images.sent == 3  # the depth bounds it when the horizon does not


def test_lane_outputs_are_read_after_the_device_ran_them_in_order():
    """Items with host halves (previews, final images) on the lane: each read only once its end event
    is done (the host half asserts it), in launch order, and the source is not asked while one is
    pending; the engine thread never waits for the lane."""
    device = FakeDevice()
    runner, lane_stream = lane_runner(device)
    images = images_on(lane_stream, items=9, device_s=0.020, host_half=True)
    images.sessions, images.outputs = 3, {s: [] for s in range(3)}
    seeded(runner, images)
    run_ticks(runner, device, 12)
    assert images.outputs == {s: list(range(s, 9, 3)) for s in range(3)}
    assert images.offers_while_pending == 0
    assert lane_stream.waits == 0 and device.waits == 0
    assert runner.stats.items == 9 and runner.costs.estimate(("images",)) == pytest.approx(0.020, abs=2e-4)


def test_a_lane_needs_a_queue_and_the_engine_config_a_depth_over_one():
    device = FakeDevice()
    lane = OverlapLane(LaneStream(device), device.now, 0.12)
    with pytest.raises(ValueError, match="overlap lane needs items queued"):
        SlackRunner(device.now, device.synchronize, 0.003, queue_depth=1, timeline=device, lane=lane)
    with pytest.raises(OptionsError, match="overlap_images needs slack items queued"):
        EngineConfig(overlap_images=True, slack_queue_depth=1)
    with pytest.raises(OptionsError, match="overlap_images must be True or False"):
        EngineConfig(overlap_images=1)


def test_the_engine_refuses_the_lane_off_cuda():
    from types import SimpleNamespace

    backend = SimpleNamespace(device="cpu", synchronize=lambda: None)
    with pytest.raises(OptionsError, match="not on CUDA"):
        SlackRunner.for_backend(backend, lambda: 0.0, EngineConfig(overlap_images=True))


def test_parley_serve_refuses_overlap_images_on_the_cpu():
    from parley.realtime.server.serve import ServeConfig, ServeError
    from parley.realtime.server.services import _engine_config

    assert _engine_config(ServeConfig(model=None, overlap_images=True), cuda=True).overlap_images
    with pytest.raises(ServeError, match="--overlap-images: the image stream is a CUDA stream"):
        _engine_config(ServeConfig(model=None, overlap_images=True), cuda=False)


@pytest.mark.parametrize("device", [p for p in DEVICES if getattr(p, "values", None) == ("cuda",)])
def test_images_on_the_lane_are_the_images_of_the_ticks_slack(device):
    """On CUDA, every item of three requests (one tiled) run on the lane's stream, graphs included, with
    the engine's stream at the higher priority: the same pixels, in the same order, as in the slack."""
    import asyncio

    import numpy as np
    import torch

    from parley.engine.image_queue import ImageQueue, ImageSpec
    from parley.engine.slack_queue import CudaTimeline
    from parley.models.image_pipeline import stepper_for
    from parley.models.tiny_diffusion import tiny_pipeline

    stepper = stepper_for(tiny_pipeline("sd").to(device))
    size = stepper.default_size
    tiled = next(s for s in range(size, 8 * size, stepper.latent_stride) if stepper.tiled(s, s))

    async def run(overlap: bool):
        queue = ImageQueue(stepper, max_slack_s=1.0, stream_events=4)
        lane = OverlapLane.for_device(torch.device(device), lambda: 0.0, 0.12) if overlap else None
        runner = SlackRunner(lambda: 0.0, torch.cuda.synchronize, 0.0, queue_depth=2, timeline=CudaTimeline(),
                             lane=lane)
        runner.add_source(queue)
        runner.bind_thread()
        requests = [queue.submit(ImageSpec(f"p{i}", s, s, steps=3, guidance=5.0, seed=i, partial_images=1))
                    for i, s in enumerate((size, size, tiled))]
        events: list[list] = [[] for _ in requests]
        try:
            for _ in range(200):
                runner.run_until(None)
                torch.cuda.synchronize()  # the lane's items done: the next run hands them out
                for request, got in zip(requests, events):
                    got += request.events.drain()
                if all(got and type(got[-1]).__name__ == "Terminal" for got in events):
                    break
        finally:
            torch.cuda.set_stream(torch.cuda.default_stream())
        return [[(type(e).__name__, getattr(e, "pixels", None)) for e in got] for got in events]

    slack = asyncio.run(run(False))
    lane = asyncio.run(run(True))
    assert [[name for name, _ in got] for got in slack] == [["ImagePartial", "ImageResult", "Terminal"]] * 3
    for ours, reference in zip(lane, slack):
        assert [name for name, _ in ours] == [name for name, _ in reference]
        for (_, pixels), (_, expected) in zip(ours, reference):
            assert (pixels is None) == (expected is None)
            if pixels is not None:
                np.testing.assert_array_equal(pixels, expected)
