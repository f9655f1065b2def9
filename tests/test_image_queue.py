"""Images as slack work (engine/image_queue.py) on the tiny SD pipeline: items only when they fit
(fake clock), batching, back-pressure without drops, cancel, limits, failure containment, and
duplex sessions bit-identical with and without image load."""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from clocked_stepper import DEFAULT_COSTS, ClockedStepper
from parley.engine.image_costs import predict
from parley.engine.image_queue import (ImagePartial, ImageQueue, ImageQueueFull, ImageRefused, ImageRequest, ImageResult,
                                       ImageSpec, preview_steps)
from parley.engine.slack import CostModel, SlackRunner
from parley.engine.stream import Status, Terminal
from parley.models.image_pipeline import speed_up, stepper_for
from parley.models.tiny_diffusion import tiny_pipeline

from test_engine_core import baseline_outputs, frames_of, make_engine, open_ready, signal
from test_slack import FakeClock

GUARD = 0.003


@pytest.fixture(scope="module")
def sd():
    return stepper_for(tiny_pipeline("sd"))


def seeded_runner(clock: FakeClock, queue: ImageQueue, size: int) -> SlackRunner:
    runner = SlackRunner(clock.now, lambda: None, GUARD)
    queue.stepper.seed(runner.costs, queue, size, size)
    runner.add_source(queue)
    return runner


def events_of(request):
    return request.events.drain()


def manual_queue(stepper, **kwargs) -> tuple[ImageQueue, SlackRunner]:
    """A queue behind a runner with no deadline (`run_until(None)` runs everything offered)."""
    queue = ImageQueue(stepper, max_slack_s=1.0, **kwargs)
    runner = SlackRunner(lambda: 0.0, lambda: None, 0.0)
    runner.add_source(queue)
    return queue, runner


def one_job_under_way(stepper, size: int) -> tuple[ImageQueue, SlackRunner, ImageRequest]:
    """A fake-clock queue with one 50-step request encoded and a couple of steps in (call on a loop)."""
    clock = FakeClock()
    queue = ImageQueue(ClockedStepper(stepper, clock), max_slack_s=1.0)
    runner = seeded_runner(clock, queue, size)
    request = queue.submit(ImageSpec("x", size, size, steps=50, guidance=5.0, seed=1))
    runner.run_until(0.030)
    return queue, runner, request


def test_slack_scheduler_never_starts_an_image_item_whose_estimate_exceeds_the_slack_left(sd):
    async def main():
        clock = FakeClock()
        stepper = ClockedStepper(sd, clock)
        size = sd.default_size
        queue = ImageQueue(stepper, max_slack_s=0.080 - GUARD, max_batch=4, stream_events=8)
        runner = seeded_runner(clock, queue, size)
        requests = [queue.submit(ImageSpec(f"p{i}", size, size, steps=4, guidance=5.0, seed=i, partial_images=1))
                    for i in range(3)]
        deadlines = []
        for tick in range(60):
            start = tick * 0.080
            frame = 0.050 if tick < 30 else 0.020  # a loaded voice frame, then a light one
            clock.t = start + frame
            deadline = start + 0.080
            deadlines.append((clock.t, deadline))
            runner.run_until(deadline)
        return stepper.log, deadlines, runner.stats, requests, queue

    log, deadlines, stats, requests, queue = asyncio.run(main())
    assert stats.past_boundary == 0  # (overruns here are float noise of the fake clock's sums)
    for started, kind, cost in log:
        slack_end = next(d for s, d in deadlines if s <= started < d) - GUARD
        assert started + cost <= slack_end + 1e-9, (started, kind, cost)
    # With the 50 ms frame only 27 ms are left: no 30 ms final decode may start.
    assert all(kind != "decode" for started, kind, _ in log if started < 30 * 0.080)
    assert any(kind == "denoise" for started, kind, _ in log if started < 30 * 0.080)
    # Denoise steps were batched across the three requests.
    assert any(cost > DEFAULT_COSTS["denoise"] for _, kind, cost in log if kind == "denoise")
    for r in requests:
        events = events_of(r)
        assert [type(e) for e in events] == [ImagePartial, ImageResult, Terminal]
        assert events[-1].status is Status.COMPLETED
    assert queue.outstanding == 0 and queue.active_jobs == 0


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_images_equal_the_solo_stepper_and_n_uses_consecutive_seeds(sd, family):
    sd = sd if family == "sd" else stepper_for(tiny_pipeline("sd3"))
    size = sd.default_size

    async def main():
        queue, runner = manual_queue(sd, stream_events=4)
        request = queue.submit(ImageSpec("a red cat", size, size, steps=3, guidance=5.0, n=2, seed=11))
        runner.run_until(None)  # manual mode: everything offered runs
        return events_of(request)

    events = asyncio.run(main())
    results = [e for e in events if isinstance(e, ImageResult)]
    assert [r.seed for r in results] == [11, 12] and [r.image_index for r in results] == [0, 1]
    cond = sd.encode("a red cat", None, True)
    for r in results:
        job = sd.start(cond, size, size, 3, 5.0, r.seed)
        while not job.done:
            sd.denoise([job])
        solo = sd.to_uint8(sd.decode(job.latents))[0]
        assert r.pixels.shape == (size, size, 3) and r.pixels.dtype == np.uint8
        assert np.abs(r.pixels.astype(int) - solo.astype(int)).max() <= 1  # batched: rounding at most
    assert not np.array_equal(results[0].pixels, results[1].pixels)
    assert events[-1] == Terminal(Status.COMPLETED)


def test_a_full_stream_pauses_the_request_and_nothing_is_dropped(sd):
    size = sd.default_size

    async def main():
        queue, runner = manual_queue(sd, stream_events=1)
        request = queue.submit(ImageSpec("x", size, size, steps=8, guidance=5.0, seed=1, partial_images=3))
        got, rounds = [], 0
        while not got or not isinstance(got[-1], Terminal):
            runner.run_until(None)
            assert request.events.room() >= 0
            got.extend(events_of(request))
            rounds += 1
            assert rounds < 20
        return got, rounds, request.events.dropped

    got, rounds, dropped = asyncio.run(main())
    assert dropped == 0
    assert [type(e) for e in got] == [ImagePartial] * 3 + [ImageResult, Terminal]
    assert [e.partial_index for e in got[:3]] == [0, 1, 2]
    assert rounds == 4  # one event per round: the producer waited for the consumer each time


def test_cancel_drops_the_job_at_the_next_boundary_and_frees_its_tensors(sd):
    size = sd.default_size

    async def main():
        queue, runner, request = one_job_under_way(sd, size)
        assert queue.active_jobs == 1
        state = weakref.ref(request.jobs[0].state)
        request.cancel()
        runner.run_until(None)
        gc.collect()
        return request, queue, state

    request, queue, state = asyncio.run(main())
    assert queue.active_jobs == 0 and queue.outstanding == 0 and state() is None
    assert request.events.drain() == [Terminal(Status.CANCELLED, "the client went away")]
    assert queue.counters()["images_cancelled"] == 1


def test_engine_stop_ends_every_admitted_request_and_refuses_new_ones(sd):
    size = sd.default_size

    async def main():
        queue, runner, running = one_job_under_way(sd, size)
        waiting = queue.submit(ImageSpec("y", size, size, steps=50, guidance=5.0, seed=2))
        runner.stop_sources(Terminal(Status.FAILED, "the engine stopped after a device error"))
        with pytest.raises(ImageRefused, match="device error"):
            queue.submit(ImageSpec("z", size, size, steps=2, guidance=5.0))
        return running, waiting

    running, waiting = asyncio.run(main())
    for request in (running, waiting):
        assert request.events.drain()[-1] == Terminal(Status.FAILED, "the engine stopped after a device error")


def test_capacity_is_enforced_with_a_retry_hint(sd):
    size = sd.default_size

    async def main():
        queue = ImageQueue(sd, max_slack_s=1.0, capacity=3)
        queue.submit(ImageSpec("x", size, size, steps=2, guidance=5.0, n=2))
        with pytest.raises(ImageQueueFull, match="2 of 3 images") as full:
            queue.submit(ImageSpec("x", size, size, steps=2, guidance=5.0, n=2))
        queue.submit(ImageSpec("x", size, size, steps=2, guidance=5.0, n=1))  # exactly fills it
        return full.value

    assert asyncio.run(main()).retry_after_s >= 1


def test_a_size_that_can_never_fit_fails_then_is_refused_at_admission(sd):
    async def main():
        clock = FakeClock()
        queue = ImageQueue(ClockedStepper(sd, clock), max_slack_s=0.025)  # the 30 ms decode never fits
        size = sd.default_size
        runner = seeded_runner(clock, queue, size)
        request = queue.submit(ImageSpec("x", size, size, steps=2, guidance=5.0))
        for tick in range(5):
            clock.t = tick * 0.08
            runner.run_until(tick * 0.08 + 0.08)
        with pytest.raises(ImageRefused, match="too large"):
            queue.submit(ImageSpec("x", size, size, steps=2, guidance=5.0))
        return request.events.drain(), runner.stats, queue

    events, stats, queue = asyncio.run(main())
    assert events[-1].status is Status.FAILED and "too large" in events[-1].reason
    assert stats.past_boundary == 0 and queue.outstanding == 0


def fake_clock_queue(sd, costs: dict | None = None, exponent: float = 1.0, **queue_kwargs):
    """A queue whose stepper's calls cost scripted time on a fake clock that is also the queue's
    timer: its warm-up measures the script, never the machine (costs at 16 px, scaled by pixels
    to `exponent`)."""
    clock = FakeClock()
    stepper = ClockedStepper(sd, clock, costs, scale_from=sd.default_size, exponent=exponent)
    return clock, ImageQueue(stepper, now=clock.now, **queue_kwargs)


def test_warm_up_seeds_estimates_and_predicts_sizes_that_cannot_fit(sd):
    """Warm-up measures the default size (16 px) at every batch, twice its side at batch 1, and
    the smallest tiled size's tiles and blend, on the queue's clock (a fake one here: the costs are
    scripted, 10 ms a 16 px step, linear in pixels). A size whose step is predicted past twice an
    empty tick's slack is refused at admission, with the predicted cost."""
    _, queue = fake_clock_queue(sd, {"decode": 0.010}, max_slack_s=0.080, max_batch=2)
    runner = SlackRunner(lambda: 0.0, lambda: None, 0.0)
    measured = queue.warm_up(runner.costs)  # seeds the runner's cost model
    s, f = sd.default_size, 2 * sd.default_size
    p = 34  # the smallest tiled size (latents of 17 cells > the 16-cell tile): its tiles and blend
    assert set(measured) == {queue.encode_key(), queue.denoise_key(s, s, True, 1), queue.denoise_key(s, s, True, 2),
                             queue.preview_key(s, s), queue.decode_key(s, s), queue.tile_key(p, p),
                             queue.blend_key(p, p), queue.denoise_key(f, f, True, 1), queue.preview_key(f, f),
                             queue.decode_key(f, f)}
    assert measured[queue.denoise_key(s, s, True, 1)] == pytest.approx(0.010)
    assert measured[queue.denoise_key(f, f, True, 1)] == pytest.approx(0.040)
    assert queue.refusal(s, s) is None and queue.refusal(f, f) is None
    assert queue.refusal(48, 48) is None  # 90 ms predicted: within twice the slack, measured before refused
    # 80 px, 25x the pixels of 16 px: the batch-2 step's 14 ms scaled by them (a row count measured
    # at one size) is 350 ms, less than the two-size line's 250 ms grown past 4x 32 px's pixels.
    assert "a denoise item would take about 350 ms" in queue.refusal(80, 80)
    assert runner.costs.estimate(queue.decode_key(s, s)) == pytest.approx(measured[queue.decode_key(s, s)])


def test_two_warmed_sizes_predict_fixed_plus_per_pixel_costs(sd):
    """The demo's case: a step that is mostly fixed overhead (here 16 px 10 ms, 32 px 20 ms: cost
    to the 0.5 power of the pixels). Predicted linearly from 16 px alone, 64 px was 160 ms and
    refused against a 77 ms slack; the line through 16 and 32 px predicts 60 ms (6.7 ms fixed +
    13 us a pixel; it costs 40 ms), so it is admitted, and it runs in ticks with room for it.
    Past 4x the pixels of 32 px the line grows with the square of the pixels (attention)."""
    clock, queue = fake_clock_queue(sd, {"decode": 0.010}, exponent=0.5, max_slack_s=0.080 - GUARD,
                                    max_batch=1, stream_events=8)
    costs = CostModel()
    measured = queue.warm_up(costs)
    tile = (sd.vae_tile * sd.pipe.vae_scale_factor) ** 2
    step = predict(queue.denoise_key(64, 64, True, 1), measured.items(), tile)
    assert step == pytest.approx(0.010 - 256 * 0.010 / 768 + 4096 * 0.010 / 768)  # 60 ms
    far = predict(queue.denoise_key(128, 128, True, 1), measured.items(), tile)  # 16x the pixels of 32 px
    assert far == pytest.approx((0.010 - 256 * 0.010 / 768 + 16384 * 0.010 / 768) * 16384 / (4 * 1024))
    assert queue.refusal(64, 64) is None
    assert "too large" in queue.refusal(96, 96)  # 140 ms on the line, 2.25x that past 4x 32 px's pixels

    async def main():
        runner = SlackRunner(clock.now, lambda: None, GUARD)
        runner.costs = costs  # the warm-up's seeds
        runner.add_source(queue)
        request = queue.submit(ImageSpec("x", 64, 64, steps=3, guidance=5.0, seed=1))
        started = len(queue.stepper.log)
        for tick in range(20):
            clock.t = tick * 0.080 + 0.010  # a 10 ms voice frame: 67 ms of slack
            runner.run_until(tick * 0.080 + 0.080)
        return request, runner, queue.stepper.log[started:]

    request, runner, log = asyncio.run(main())
    assert [type(e) for e in request.events.drain()] == [ImageResult, Terminal]
    assert [kind for _, kind, _ in log].count("denoise") == 3
    assert runner.stats.past_boundary == 0


def test_a_failing_item_ends_its_request_only(sd):
    size = sd.default_size

    async def main():
        queue, runner = manual_queue(sd, max_batch=1, stream_events=4)
        bad = queue.submit(ImageSpec("x", size, size, steps=2, guidance=5.0, seed=1))
        good = queue.submit(ImageSpec("x", size, size, steps=2, guidance=5.0, seed=2))
        real_decode = sd.decode
        calls = []

        def decode(latents):  # the first decode (the bad request's) raises
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("simulated decode failure")
            return real_decode(latents)

        queue.stepper = type("S", (), {"__getattr__": lambda self, n: getattr(sd, n), "decode": staticmethod(decode)})()
        runner.run_until(None)
        return events_of(bad), events_of(good), queue, runner.stats

    bad, good, queue, stats = asyncio.run(main())
    assert bad[-1].status is Status.FAILED and "see the server log" in bad[-1].reason
    assert "simulated" not in bad[-1].reason
    assert [type(e) for e in good] == [ImageResult, Terminal] and good[-1].status is Status.COMPLETED
    assert stats.failed == 1 and queue.outstanding == 0


def test_preview_steps_are_evenly_spaced_and_bounded():
    assert preview_steps(20, 0) == ()
    assert preview_steps(20, 1) == (10,)
    assert preview_steps(20, 3) == (5, 10, 15)
    assert preview_steps(2, 3) == (1,)  # never more previews than steps before the last


def test_duplex_sessions_are_bit_identical_with_and_without_image_load(sd):
    baseline = baseline_outputs(8)
    size = sd.default_size

    async def main():
        engine, _ = make_engine(3)
        queue = ImageQueue(sd, max_slack_s=engine.config.tick_seconds - engine.config.slack_guard_s)
        engine.add_slack_source(queue)
        sessions = await open_ready(engine, 3)
        for i, s in enumerate(sessions):
            s.push_audio(signal(i, 8))
        images = [queue.submit(ImageSpec(f"p{i}", size, size, steps=3, guidance=5.0, seed=i, partial_images=1))
                  for i in range(2)]
        engine.run_ticks(8)
        out = [frames_of(s.events.drain()) for s in sessions]
        img_events = [events_of(r) for r in images]
        counters = engine.counters()
        engine.shutdown()
        return out, img_events, counters

    out, img_events, counters = asyncio.run(main())
    for events in img_events:
        assert events[-1] == Terminal(Status.COMPLETED)
    assert counters["slack_items"] > 0
    for i in range(3):
        assert [f.pcm.tobytes() for f in out[i]] == [f.pcm.tobytes() for f in baseline[i]]
        assert [f.text_token for f in out[i]] == [f.text_token for f in baseline[i]]


class FakeGraph:
    """Stands in for CUDAGraphRunner on the CPU: 'replays' by calling the captured function."""

    made: list["FakeGraph"] = []

    def __init__(self, fn, inputs, capture_stream=None) -> None:
        self.fn, self.shapes, self.replays = fn, [tuple(t.shape) for t in inputs], 0
        self.grad = torch.is_grad_enabled()  # a real capture records whatever autograd does then
        FakeGraph.made.append(self)

    def __call__(self, *inputs):
        assert [tuple(t.shape) for t in inputs] == self.shapes
        self.replays += 1
        return self.fn(*inputs)


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_warm_up_captures_one_graph_per_batch_bucket_and_steps_replay_them(family):
    FakeGraph.made = []
    sd = stepper_for(tiny_pipeline(family))
    size = sd.default_size
    # (a huge slack: warm-up timings on the shared CPU vary by 100x, and admission predicts from them)
    queue = ImageQueue(sd, max_slack_s=1e3, max_batch=2, stream_events=4, graph_factory=FakeGraph)
    queue.cuda_graphs = True  # (on a CPU stepper the queue turns graphs off by itself)
    queue.warm_up(CostModel())
    # the text encoder first (captured once, before the encodes it serves), the steps, then the VAE
    text, step1, step2, preview, decode = FakeGraph.made  # (the tiled probe's tiles stay eager)
    latent = tuple(sd.start(sd.encode("x", None, False), size, size, 2, 1.0, 0).latents.shape)
    assert text.shapes == [tuple(t.shape) for t in sd.text_tokens("x")]  # sd: ids; sd3: both CLIPs' ids
    assert [step1.shapes[0][0], step2.shapes[0][0]] == [2, 4]  # CFG rows: batch 1 and 2
    assert preview.shapes == decode.shapes == [latent]
    assert queue.graphed(queue.preview_key(size, size)) and queue.graphed(queue.decode_key(size, size))
    assert not any(g.grad for g in FakeGraph.made)  # captured without autograd, as the eager items run
    before = {g: g.replays for g in FakeGraph.made}

    async def main():
        runner = SlackRunner(lambda: 0.0, lambda: None, 0.0)
        runner.add_source(queue)
        graphed = queue.submit(ImageSpec("a cat", size, size, steps=3, guidance=5.0, seed=4, partial_images=1))
        eager = queue.submit(ImageSpec("a cat", 2 * size, size, steps=3, guidance=5.0, seed=4, partial_images=1))
        runner.run_until(None)
        return events_of(graphed), events_of(eager)

    graphed, eager = asyncio.run(main())
    replays = {g: g.replays - before[g] for g in FakeGraph.made}
    assert replays[step1] + replays[step2] == 3  # the 3 steps of the graphed bucket only
    assert replays[text] == 2  # each request's prompt (the negative "" is cached since warm-up)
    assert replays[preview] == replays[decode] == 1  # the warmed size's; the other size's ran eagerly
    job = sd.start(sd.encode("a cat", None, True), size, size, 3, 5.0, 4)
    sd.denoise([job])
    sd.denoise([job])  # preview_steps(3, 1) == (2,)
    assert np.array_equal(graphed[0].pixels, sd.to_uint8(sd.preview(job.latents))[0])
    sd.denoise([job])
    assert np.array_equal(graphed[1].pixels, sd.to_uint8(sd.decode(job.latents))[0])
    assert [type(e).__name__ for e in eager[:2]] == ["ImagePartial", "ImageResult"]
    assert eager[1].pixels.shape == (size, 2 * size, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphed_steps_equal_eager_steps_on_the_gpu():
    gpu = stepper_for(tiny_pipeline("sd").to("cuda"))
    size = gpu.default_size

    async def main():
        queue, runner = manual_queue(gpu, stream_events=4)
        queue.warm_up(runner.costs)
        assert queue.cuda_graphs and queue._graphs
        request = queue.submit(ImageSpec("a cat", size, size, steps=4, guidance=5.0, seed=4))
        runner.run_until(None)
        return events_of(request)

    events = asyncio.run(main())
    job = gpu.start(gpu.encode("a cat", None, True), size, size, 4, 5.0, 4)
    while not job.done:
        gpu.denoise([job])
    assert np.abs(events[0].pixels.astype(int) - gpu.to_uint8(gpu.decode(job.latents))[0].astype(int)).max() <= 1


def assert_close_bf16(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """Within bf16 rounding of the reference's scale (8 mantissa bits, compounded over the layers
    and two scheduler steps: a few units in the last place of the largest value)."""
    err = (ours.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    assert err <= 0.05 * scale + 1e-3, f"{what}: max |diff| {err:.4g} at scale {scale:.4g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_graphed_steps_with_speed_up_equal_eager_plain_ones_in_bf16_on_the_gpu(family):
    """Everything `speed_up` can apply (fused QKV, the loader's CUDA default, and channels_last),
    captured in the queue's CUDA graphs, computes what the plain eager components do, within bf16
    tolerance."""
    plain = stepper_for(tiny_pipeline(family).to("cuda", torch.bfloat16))
    fast_pipe = tiny_pipeline(family).to("cuda", torch.bfloat16)  # the same seed: the same weights
    applied = speed_up(fast_pipe)
    assert {"vae channels_last", "vae fused qkv", "unet fused qkv" if family == "sd" else "transformer fused qkv"} \
        <= set(applied)
    fast = stepper_for(fast_pipe)
    size = fast.default_size
    queue = ImageQueue(fast, max_slack_s=1.0, max_batch=2)
    queue.warm_up(CostModel())
    predict = queue.graphed_predict(size, size, True, 2)
    assert predict is not None
    jobs = {st: [st.start(st.encode(prompt, None, True), size, size, 4, 5.0, seed)
                 for prompt, seed in (("a red cat", 1), ("a dog", 2))] for st in (plain, fast)}
    x = torch.cat([j.latents for j in jobs[plain] for _ in range(2)])  # the rows one CFG batch-2 step takes
    t = torch.cat([j.timesteps[:1].expand(2) for j in jobs[plain]]).to("cuda")  # (a job's timesteps are the host's)
    emb = torch.cat([j.cond.embeds for j in jobs[plain]])
    pooled = None if family == "sd" else torch.cat([j.cond.pooled for j in jobs[plain]])
    assert_close_bf16(predict(x, t, emb, pooled), plain.predict(x, t, emb, pooled), "noise prediction")
    for _ in range(2):
        plain.denoise(jobs[plain])
        fast.denoise(jobs[fast], predict=predict)
    for ours, ref in zip(jobs[fast], jobs[plain]):
        assert_close_bf16(ours.latents, ref.latents, "latents after two graphed steps")
    latents = jobs[plain][0].latents
    for key, eager in ((queue.decode_key(size, size), plain.decode), (queue.preview_key(size, size), plain.preview)):
        replay = queue.graphed(key)
        assert replay is not None, key
        assert_close_bf16(replay(latents), eager(latents), key[1])
    queue.close_graphs()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_image_encodes_and_graphed_denoise_steps_queue_without_a_device_sync(family):
    """The engine queues slack items on the device back to back (engine/slack_queue.py): a prompt's
    encode, its jobs' start and a graphed denoise step must not wait for the device, or the engine
    thread sits through every item queued before them and queues nothing behind them."""
    gpu = stepper_for(tiny_pipeline(family).to("cuda"))
    size = gpu.default_size
    queue = ImageQueue(gpu, max_slack_s=1.0, max_batch=2)
    queue.warm_up(CostModel())
    embed, predict = queue.graphed_embed(), queue.graphed_predict(size, size, True, 2)
    assert embed is not None and predict is not None
    gpu.start(gpu.encode("warm", None, True, embed=embed), size, size, 4, 5.0, 1)  # the negative "" cached
    torch.cuda.set_sync_debug_mode("error")
    try:
        jobs = [gpu.start(gpu.encode(prompt, None, True, embed=embed), size, size, 4, 5.0, seed)
                for prompt, seed in (("a red cat", 1), ("a dog", 2))]
        while not jobs[0].done:
            gpu.denoise(jobs, predict=predict)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(job.done for job in jobs)
    queue.close_graphs()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_cuda_graphed_prompt_encode_preview_and_decode_equal_eager_on_the_gpu(family):
    gpu = stepper_for(tiny_pipeline(family).to("cuda"))
    queue = ImageQueue(gpu, max_slack_s=1.0, max_batch=1)
    queue.warm_up(CostModel())
    embed = queue.graphed_embed()
    assert embed is not None
    for prompt, negative, cfg in (("a red cat", None, True), ("a dog", "blurry", True), ("a cat", None, False)):
        graphed = stepper_for(gpu.pipe).encode(prompt, negative, cfg, embed=embed)  # (fresh negative caches)
        eager = stepper_for(gpu.pipe).encode(prompt, negative, cfg)
        assert torch.equal(graphed.embeds, eager.embeds), (prompt, negative, cfg)
        assert (eager.pooled is None) == (family == "sd")
        assert eager.pooled is None or torch.equal(graphed.pooled, eager.pooled)
    latents = gpu.start(gpu.encode("a cat", None, True), gpu.default_size, gpu.default_size, 4, 5.0, 4).latents
    size = gpu.default_size
    for key, eager in ((queue.preview_key(size, size), gpu.preview), (queue.decode_key(size, size), gpu.decode)):
        replay = queue.graphed(key)
        assert replay is not None, key
        first = replay(latents)
        replay(torch.randn_like(latents))  # the copy out survives the next replay
        assert torch.equal(first, eager(latents)), key
    kept = gpu.encode("a cat", "blurry", True, embed=embed).embeds.clone()
    gpu.encode("something else entirely", "noise", True, embed=embed)  # replays over the graph's buffers
    assert torch.equal(gpu.encode("a cat", "blurry", True, embed=embed).embeds, kept)  # cache holds copies


def run_clocked(sd, specs, ticks, frame=0.020, max_batch=4, stream_events=8, consume=True):
    """Requests through the queue on a fake 80 ms clock (a `frame`-long voice frame per tick);
    each request's events are drained every tick (a fast client). Returns the stepper's log."""
    async def main():
        clock = FakeClock()
        stepper = ClockedStepper(sd, clock)
        queue = ImageQueue(stepper, max_slack_s=0.080 - GUARD, max_batch=max_batch, stream_events=stream_events)
        runner = seeded_runner(clock, queue, specs[0].width)
        requests = [queue.submit(spec) for spec in specs]
        events = {r: [] for r in requests}
        for tick in range(ticks):
            clock.t = tick * 0.080 + frame
            runner.run_until(tick * 0.080 + 0.080)
            for r in requests:
                events[r].extend(events_of(r))
        return stepper.log, runner.stats, [events[r] for r in requests], queue

    return asyncio.run(main())


def test_jobs_waiting_for_previews_are_not_left_behind_by_the_oldest_job(sd):
    """Four requests at one size keep sharing denoise steps through their previews: output items
    run before denoise steps, so a job's preview never leaves it behind while the oldest job
    steps alone (it did when the oldest job's next item always went first)."""
    size = sd.default_size
    specs = [ImageSpec(f"p{i}", size, size, steps=8, guidance=5.0, seed=i, partial_images=3) for i in range(4)]
    log, stats, events, queue = run_clocked(sd, specs, ticks=12)
    rows = [round((cost - 0.010) / 0.004) + 1 for _, kind, cost in log if kind == "denoise"]
    assert sum(rows) == 4 * 8 and len(rows) <= 16  # 32 job-steps in shared steps of 2 or more on average
    assert sum(kind == "preview" for _, kind, _ in log) == 4 * 3
    done = [int(t // 0.080) for t, kind, _ in log if kind == "decode"]
    assert len(done) == 4 and max(done) <= 8
    for got in events:
        assert [type(e) for e in got] == [ImagePartial] * 3 + [ImageResult, Terminal]
    assert stats.past_boundary == 0 and queue.active_jobs == 0


def test_a_size_larger_than_one_vae_tile_decodes_tile_by_tile_within_the_slack(sd):
    """A 48 px image on the tiny SD (latents 24 > its 16-cell VAE tile): one item per tile and a
    blend item, each started only when it fits; the image equals diffusers' tiled_decode."""
    size = 48
    assert sd.tiled(size, size) and not sd.tiled(sd.default_size, sd.default_size)
    spec = ImageSpec("a red cat", size, size, steps=3, guidance=5.0, seed=5, partial_images=1)
    # A 62 ms voice frame: 15 ms of slack, so a 12 ms tile fits but never two in one tick.
    log, stats, (got,), queue = run_clocked(sd, [spec], ticks=20, frame=0.062)
    kinds = [kind for _, kind, _ in log]
    assert kinds.count("tile") == 4 and kinds.count("blend") == 1 and "decode" not in kinds
    tile_ticks = [int(t // 0.080) for t, kind, _ in log if kind == "tile"]
    assert len(set(tile_ticks)) == 4  # one tile per tick: each item sized to the slack
    assert stats.past_boundary == 0
    assert [type(e) for e in got] == [ImagePartial, ImageResult, Terminal]
    assert got[0].pixels.shape == got[1].pixels.shape == (size, size, 3)
    job = sd.start(sd.encode("a red cat", None, True), size, size, 3, 5.0, 5)
    while not job.done:
        sd.denoise([job])
    ref = sd.pipe.vae.tiled_decode(sd.vae_input(job.latents), return_dict=False)[0]
    assert np.array_equal(got[1].pixels, sd.to_uint8(ref)[0])


def test_warm_up_at_a_tiled_size_measures_tiles_and_the_blend(sd):
    queue = ImageQueue(sd, max_slack_s=1e3, max_batch=1, warm_sizes=[(48, 48, True)])
    measured = queue.warm_up(CostModel())
    assert set(measured) == {queue.encode_key(), queue.denoise_key(48, 48, True, 1), queue.preview_key(48, 48),
                             queue.tile_key(48, 48), queue.blend_key(48, 48), queue.denoise_key(96, 96, True, 1),
                             queue.preview_key(96, 96), queue.tile_key(96, 96), queue.blend_key(96, 96)}


def test_keys_are_measured_again_on_the_engine_thread_before_the_first_tick(sd):
    """A thread's first cuBLAS/cuDNN calls are cold: the queue re-measures every warmed key on
    the engine thread, before any tick, and records only warm calls (a recorded cold call would
    keep its key from fitting until the stale-key trial, 25 ticks later). Each method's first
    call on each thread costs 1 s of a fake timer, later calls 1 ms."""
    timer = FakeClock()
    threads, ticks_at_call, warmed = [], [], set()

    class Recording:
        def __getattr__(self, name):
            attr = getattr(sd, name)
            if name in ("encode", "denoise", "preview", "decode"):
                def call(*a, **k):
                    thread = threading.current_thread().name
                    threads.append((name, thread))
                    ticks_at_call.append(engine.counters()["ticks"])
                    timer.t += 0.001 if (name, thread) in warmed else 1.0
                    warmed.add((name, thread))
                    return attr(*a, **k)
                return call
            return attr

    engine, _ = make_engine(2, tick_seconds=0.5)
    queue = ImageQueue(Recording(), max_slack_s=1e3, max_batch=2, now=timer.now)
    measured = queue.warm_up(engine.slack_costs)
    warm_calls = len(threads)
    engine.add_slack_source(queue)
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while engine.counters()["ticks"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.shutdown()
    on_engine = threads[warm_calls:]
    assert {name for name, _ in on_engine} == {"encode", "denoise", "preview", "decode"}
    assert {thread for _, thread in on_engine} == {"parley-engine"}
    assert set(ticks_at_call[warm_calls:]) == {0}  # all before the first tick
    for key in (k for k in measured if k[1] not in ("tile", "blend")):  # (tiles run untimed here)
        # neither thread's cold first calls made it into an estimate
        assert engine.slack_costs.estimate(key) == pytest.approx(0.001), key


LOADED, LIGHT = 0.050, 0.020  # voice frames leaving 27 ms, then 57 ms of slack (80 ms ticks, 3 ms guard)


class ColdSize:
    """A fake-clock queue measured at the default size (16 px) only; other sizes' items cost the
    scripted 16 px costs (a 10 ms decode) scaled by pixels to `exponent` (ClockedStepper's
    scale_from)."""

    def __init__(self, sd, exponent: float, **queue_kwargs) -> None:
        self.clock = FakeClock()
        self.stepper = ClockedStepper(sd, self.clock, {"decode": 0.010}, scale_from=sd.default_size,
                                      exponent=exponent)
        self.queue = ImageQueue(self.stepper, max_slack_s=0.080 - GUARD, now=self.clock.now,
                                **{"stream_events": 8, **queue_kwargs})
        self.runner = seeded_runner(self.clock, self.queue, sd.default_size)
        self.tick = 0
        self.slacks: list[tuple[float, float]] = []  # (slack start, slack end) per tick

    def ticks(self, n: int, frame: float) -> list[str]:
        """Run n ticks with this voice frame; the kinds of the items started in them."""
        start = len(self.stepper.log)
        for _ in range(n):
            self.clock.t = self.tick * 0.080 + frame
            deadline = self.tick * 0.080 + 0.080
            self.slacks.append((self.clock.t, deadline - GUARD))
            self.runner.run_until(deadline)
            self.tick += 1
        return [kind for _, kind, _ in self.stepper.log[start:]]

    def idle_tick(self) -> list[tuple[float, str, float]]:
        """One tick with no session live: engine.py lets its slack run a period past the boundary
        (and the next tick starts on the grid after it). The (start, kind, cost) of its items."""
        start = len(self.stepper.log)
        self.clock.t = self.tick * 0.080
        deadline = self.tick * 0.080 + 2 * 0.080
        self.slacks.append((self.clock.t, deadline - GUARD))
        self.runner.run_until(deadline)
        self.tick = math.ceil(self.clock.t / 0.080)
        return self.stepper.log[start:]

    def assert_every_item_ended_in_its_slack(self) -> None:
        for started, kind, cost in self.stepper.log:
            end = next(e for s, e in self.slacks if s <= started < e)
            assert started + cost <= end + 1e-9, (started, kind, cost)
        assert self.runner.stats.past_boundary == 0


def test_an_unmeasured_size_waits_until_its_predicted_cost_fits_the_slack_left(sd):
    """32 px with only 16 px measured: a denoise step and the decode are predicted at 4x the
    16 px costs (40 ms, here exact). 27 ms of slack: only the (measured) encode starts; 57 ms:
    the rest runs, no item past its slack (an unmeasured key used to run as a tick's first item
    whatever it cost)."""
    async def main():
        cold = ColdSize(sd, exponent=1.0)
        request = cold.queue.submit(ImageSpec("x", 32, 32, steps=2, guidance=5.0, seed=1))
        loaded = cold.ticks(10, LOADED)
        waiting = events_of(request)
        light = cold.ticks(4, LIGHT)
        cold.assert_every_item_ended_in_its_slack()
        return loaded, waiting, light, events_of(request)

    loaded, waiting, light, events = asyncio.run(main())
    assert loaded == ["encode"] and waiting == []
    assert light == ["denoise", "denoise", "decode"]
    assert [type(e) for e in events] == [ImageResult, Terminal] and events[-1].status is Status.COMPLETED
    assert events[0].pixels.shape == (32, 32, 3)


def test_a_pessimistic_prediction_gives_way_to_the_first_measurement(sd):
    """Here 32 px costs only twice 16 px (a GPU fills better): predicted 40 ms, measured 20 ms.
    The step waits through 27 ms slacks, runs once 57 ms are free, and from then on its measured
    20 ms fits the 27 ms slacks (a prediction is never recorded as a cost)."""
    async def main():
        cold = ColdSize(sd, exponent=0.5)
        request = cold.queue.submit(ImageSpec("x", 32, 32, steps=6, guidance=5.0, seed=1))
        before = cold.ticks(5, LOADED)
        light = cold.ticks(1, LIGHT)
        measured = cold.runner.costs.estimate(cold.queue.denoise_key(32, 32, True, 1))
        after = cold.ticks(6, LOADED)
        waiting = events_of(request)
        last = cold.ticks(1, LIGHT)
        cold.assert_every_item_ended_in_its_slack()
        return before, light, measured, after, waiting, last, events_of(request)

    before, light, measured, after, waiting, last, events = asyncio.run(main())
    assert before == ["encode"]
    assert light == ["denoise", "denoise"]  # 20 ms measured after the first: a second fits the 37 ms left
    assert measured == pytest.approx(0.020)
    assert after == ["denoise"] * 4 and waiting == []  # one a tick; the decode, predicted 40 ms, waits
    assert last == ["decode"]
    assert [type(e) for e in events] == [ImageResult, Terminal] and events[-1].status is Status.COMPLETED


def test_a_size_predicted_a_little_over_the_slack_is_measured_once_in_an_idle_tick_then_served(sd):
    """48 px with only 16 px measured: its step is predicted at 9x the 16 px 10 ms, 90 ms, over an
    empty tick's 77 ms slack but within twice it; it costs 30 ms (a GPU-like 0.5 power). It is
    admitted (it was refused), waits through busy ticks, runs once as the first item of an idle
    tick (ahead of an older 16 px job's step), and from then on its 30 ms fits the busy ticks."""
    async def main():
        cold = ColdSize(sd, exponent=0.5)
        small = cold.queue.submit(ImageSpec("y", 16, 16, steps=40, guidance=5.0, seed=2))
        assert cold.queue.refusal(48, 48) is None
        request = cold.queue.submit(ImageSpec("x", 48, 48, steps=3, guidance=5.0, seed=1))
        cold.ticks(5, LIGHT)
        busy = list(cold.stepper.log)
        idle_at = cold.tick * 0.080
        idle = cold.idle_tick()
        cold.ticks(12, LIGHT)
        cold.assert_every_item_ended_in_its_slack()
        small.cancel()
        return busy, idle_at, idle, events_of(request), cold

    busy, idle_at, idle, events, cold = asyncio.run(main())
    steps = [cost for _, kind, cost in busy if kind == "denoise"]
    assert steps and all(cost == pytest.approx(0.010) for cost in steps)  # busy ticks: the 16 px job's only
    assert idle[0] == (idle_at, "denoise", pytest.approx(0.030))  # the probe: the idle tick's first item
    assert cold.runner.costs.estimate(cold.queue.denoise_key(48, 48, True, 1)) == pytest.approx(0.030)
    assert [type(e) for e in events] == [ImageResult, Terminal] and events[-1].status is Status.COMPLETED
    assert events[0].pixels.shape == (48, 48, 3)


def test_a_size_measured_over_the_slack_twice_is_refused_from_then_on(sd):
    """The same 48 px, but costing its predicted 90 ms: measured in an idle tick, it waits (one
    measurement may be a contended call), is measured again in the next idle tick, then the
    request fails and the size is refused at admission with the measured cost. 64 px, predicted
    at 160 ms (more than twice the slack), fails at its first step's offer, never measured."""
    async def main():
        cold = ColdSize(sd, exponent=1.0)
        request = cold.queue.submit(ImageSpec("x", 48, 48, steps=3, guidance=5.0, seed=1))
        larger = cold.queue.submit(ImageSpec("x", 64, 64, steps=3, guidance=5.0, seed=1))
        busy = cold.ticks(5, LOADED)
        idle = cold.idle_tick()
        between = cold.ticks(2, LIGHT)
        admitted_between = cold.queue.refusal(48, 48) is None
        again = cold.idle_tick()
        later = cold.ticks(2, LIGHT)
        with pytest.raises(ImageRefused, match="size 48x48 is too large .* denoise item would take about 90 ms"):
            cold.queue.submit(ImageSpec("x", 48, 48, steps=3, guidance=5.0))
        with pytest.raises(ImageRefused, match="size 64x64 is too large .* denoise item would take about 160 ms"):
            cold.queue.submit(ImageSpec("x", 64, 64, steps=3, guidance=5.0))
        return busy, idle, between, admitted_between, again, later, events_of(request), events_of(larger), cold

    busy, idle, between, admitted_between, again, later, events, larger, cold = asyncio.run(main())
    assert busy == ["encode", "encode"]
    assert [(kind, cost) for _, kind, cost in idle] == [("denoise", pytest.approx(0.090))]
    assert between == [] and admitted_between
    assert [(kind, cost) for _, kind, cost in again] == [("denoise", pytest.approx(0.090))]
    assert later == []
    assert events[-1].status is Status.FAILED and "48x48 is too large" in events[-1].reason
    assert larger[-1].status is Status.FAILED and "about 160 ms" in larger[-1].reason
    assert cold.queue.outstanding == 0


def test_one_contended_measurement_over_the_slack_does_not_refuse_a_size(sd):
    """48 px measured once at 90 ms on a loaded machine (over an empty tick's 77 ms slack), then at
    its real 30 ms when measured again in the next idle tick: the size stays served (the estimate
    is the second largest cost, 30 ms), the request completes in busy ticks, nothing is refused."""
    async def main():
        cold = ColdSize(sd, exponent=1.0)  # contended: 9x the 16 px 10 ms
        request = cold.queue.submit(ImageSpec("x", 48, 48, steps=4, guidance=5.0, seed=1))
        cold.ticks(5, LOADED)
        first = cold.idle_tick()
        cold.stepper.exponent = 0.5  # the load is gone: 3x, 30 ms
        cold.ticks(2, LIGHT)
        second = cold.idle_tick()
        cold.ticks(12, LIGHT)
        cold.assert_every_item_ended_in_its_slack()
        return first, second, events_of(request), cold

    first, second, events, cold = asyncio.run(main())
    assert [(kind, cost) for _, kind, cost in first] == [("denoise", pytest.approx(0.090))]
    assert second[0][1:] == ("denoise", pytest.approx(0.030))
    assert cold.queue.refusal(48, 48) is None and not cold.queue._sizes.refused
    assert [type(e) for e in events] == [ImageResult, Terminal] and events[-1].status is Status.COMPLETED


def test_the_sizes_refused_from_measured_costs_are_bounded_most_recent_kept(sd, monkeypatch):
    """Sizes are the client's to choose: ten distinct sizes, each predicted at 160 ms or more and
    refused at its first offer, leave at most MAX_REFUSED_SIZES (4 here) in the refusal table, the
    most recent ones; a forgotten size is admitted again and refused at its first offer again."""
    from parley.engine import image_sizes

    monkeypatch.setattr(image_sizes, "MAX_REFUSED_SIZES", 4)
    sizes = [(64 + 2 * i, 64) for i in range(10)]

    async def main():
        cold = ColdSize(sd, exponent=1.0)
        requests = [cold.queue.submit(ImageSpec("x", w, h, steps=2, guidance=5.0)) for w, h in sizes]
        cold.ticks(2, LIGHT)
        refused = [cold.queue.refusal(w, h) is not None for w, h in sizes]
        again = cold.queue.submit(ImageSpec("x", *sizes[0], steps=2, guidance=5.0))  # forgotten: admitted
        cold.ticks(2, LIGHT)
        return [events_of(r)[-1] for r in requests], refused, events_of(again)[-1], cold.queue

    ends, refused, again, queue = asyncio.run(main())
    assert all(end.status is Status.FAILED and "too large" in end.reason for end in ends)
    assert len(queue._sizes.refused) == 4
    assert refused == [False] * 6 + [True] * 4  # the last four refused are the ones remembered
    assert again.status is Status.FAILED and f"size {sizes[0][0]}x64 is too large" in again.reason
    assert queue.refusal(*sizes[0]) is not None and queue.refusal(*sizes[6]) is None  # sizes[6] went for it


def test_an_idle_ticks_longer_slack_never_makes_a_served_size_look_too_large(sd):
    """Steps of 40 ms + 15 ms a job: batches of 1 to 3 fit an empty tick's 77 ms, a batch of 4
    (85 ms) never does. In idle ticks (a period past the boundary: 157 ms) four jobs step in
    batches that fit an empty tick and complete; the idle slack used to pick the batch of 4,
    whose cost then refused the size it serves."""
    async def main():
        clock = FakeClock()
        stepper = ClockedStepper(sd, clock, {"denoise": 0.040, "denoise_row": 0.015})
        queue = ImageQueue(stepper, max_slack_s=0.080 - GUARD, stream_events=8, now=clock.now)
        runner = seeded_runner(clock, queue, sd.default_size)
        requests = [queue.submit(ImageSpec(f"p{i}", 16, 16, steps=2, guidance=5.0, seed=i)) for i in range(4)]
        for tick in range(0, 40, 2):  # each idle tick may run into the next period
            clock.t = tick * 0.080
            runner.run_until(tick * 0.080 + 2 * 0.080)
        return [events_of(r) for r in requests], stepper.log

    events, log = asyncio.run(main())
    assert all(e[-1] == Terminal(Status.COMPLETED) for e in events)
    steps = [cost for _, kind, cost in log if kind == "denoise"]
    assert max(steps) == pytest.approx(0.070)  # batches of 3 at most


def test_a_size_whose_predicted_step_never_fits_is_refused_at_admission(sd):
    """Warmed at 16 and 32 px without CFG at batch 1 only (one row; 10 and 40 ms): a 34 px step
    with CFG is two rows of 4.5x the 16 px pixels, 90 ms, more than twice a 40 ms slack, and is
    refused; without CFG it is 45 ms, near enough the slack to be admitted and measured."""
    async def main():
        clock = FakeClock()
        stepper = ClockedStepper(sd, clock, {"decode": 0.005, "preview": 0.003}, scale_from=sd.default_size)
        queue = ImageQueue(stepper, max_slack_s=0.040, max_batch=1, now=clock.now, warm_sizes=[(None, None, False)])
        queue.warm_up(CostModel())
        with pytest.raises(ImageRefused, match=r"size 34x34 is too large .* denoise item would take about 90 ms"):
            queue.submit(ImageSpec("x", 34, 34, steps=2, guidance=5.0))
        served = queue.submit(ImageSpec("x", 34, 34, steps=2, guidance=1.0))
        return queue, served

    queue, served = asyncio.run(main())
    assert queue.refusal(34, 34, cfg=False) is None and served.spec.width == 34
    assert queue.counters()["images_refused"] == 1


def test_a_request_with_no_item_run_for_the_stall_timeout_fails_while_a_running_one_never_does(sd, caplog):
    """27 ms of slack a tick: a 32 px step (predicted 40 ms) never starts, so after its encode the
    32 px request runs nothing and fails once 2 s have passed; a 16 px request beside it runs a
    step or two every tick and completes after 4 s, twice the timeout, without ever failing."""
    async def main():
        cold = ColdSize(sd, exponent=1.0, stall_timeout_s=2.0)
        stalled = cold.queue.submit(ImageSpec("x", 32, 32, steps=2, guidance=5.0, seed=1))
        running = cold.queue.submit(ImageSpec("y", 16, 16, steps=100, guidance=5.0, seed=2))
        cold.ticks(25, LOADED)  # the encode ended at 0.058 s; the 25th tick's slack starts at 1.97 s
        before = events_of(stalled)
        cold.ticks(2, LOADED)
        failed_at, after = cold.clock.t, events_of(stalled)
        done = []
        while not done or not isinstance(done[-1], Terminal):
            cold.ticks(1, LOADED)
            done.extend(events_of(running))
            assert cold.tick < 200
        cold.assert_every_item_ended_in_its_slack()
        return cold, before, failed_at, after, done

    with caplog.at_level("WARNING", logger="parley.engine.images"):
        cold, before, failed_at, after, done = asyncio.run(main())
    assert before == []
    assert after == [Terminal(Status.FAILED, "no slack for a 32x32 image for 2 s under the current voice and "
                                             "image load; retry later or ask for a smaller size")]
    assert 2.0 <= failed_at < 2.3
    stalls = [r for r in caplog.records if "no item run" in r.getMessage()]
    assert len(stalls) == 1 and "32x32" in stalls[0].getMessage()
    assert [type(e) for e in done] == [ImageResult, Terminal] and done[-1].status is Status.COMPLETED
    assert cold.clock.t > 2 * 2.0  # the running job took longer than the timeout
    counts = cold.queue.counters()
    assert counts["images_stalled"] == 1 and counts["images_failed"] == 0 and counts["images_completed"] == 1
    assert counts["images_outstanding"] == 0 and cold.queue.active_jobs == 0


def test_a_request_held_only_by_its_client_not_reading_is_not_failed_as_stalled(sd):
    """stream_events=1 and a client that reads nothing for 4 s (twice the timeout): the job waits
    on back-pressure with its first preview unread, then completes once the client reads."""
    async def main():
        cold = ColdSize(sd, exponent=1.0, stall_timeout_s=2.0, stream_events=1)
        request = cold.queue.submit(ImageSpec("x", 16, 16, steps=8, guidance=5.0, seed=1, partial_images=3))
        cold.ticks(50, LIGHT)
        held = request.events.room()
        got = []
        while not got or not isinstance(got[-1], Terminal):
            got.extend(events_of(request))
            cold.ticks(1, LIGHT)
            assert cold.tick < 100
        return cold, held, got

    cold, held, got = asyncio.run(main())
    assert held == 0
    assert [type(e) for e in got] == [ImagePartial] * 3 + [ImageResult, Terminal]
    assert got[-1].status is Status.COMPLETED
    assert cold.queue.counters()["images_stalled"] == 0


def test_the_stall_timeout_must_be_positive(sd):
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="stall_timeout_s must be more than 0"):
            ImageQueue(sd, max_slack_s=1.0, stall_timeout_s=bad)


def test_a_new_request_reaches_its_first_partial_after_its_own_steps_not_the_queues(sd):
    """Twelve 12-step requests outstanding (a partial after step 6; each replaced as soon as it
    completes), then a thirteenth: it takes denoise places ahead of the jobs past their partial,
    so its partial comes after about its own 6 steps (2-3 batches a tick: 4 ticks with its encode
    and preview). Oldest-first places made it wait behind the older jobs' remaining steps (17
    ticks), and batches stay as full as they were."""
    async def main():
        cold = ColdSize(sd, exponent=1.0)
        size = sd.default_size
        count = 0

        def submit() -> ImageRequest:
            nonlocal count
            count += 1
            return cold.queue.submit(ImageSpec(f"p{count}", size, size, steps=12, guidance=5.0, seed=count,
                                               partial_images=1))

        def tick_and_replace() -> None:
            cold.ticks(1, LIGHT)
            for r in list(others):
                if any(isinstance(e, Terminal) for e in events_of(r)):
                    others.remove(r)
                    others.append(submit())

        others = [submit() for _ in range(12)]
        for _ in range(20):  # past the start's burst: jobs at every stage
            tick_and_replace()
        new = submit()
        ticks = 0
        while not events_of(new):
            tick_and_replace()
            ticks += 1
            assert ticks < 40
        rows = [round((cost - 0.010) / 0.004) + 1 for _, kind, cost in cold.stepper.log if kind == "denoise"]
        cold.assert_every_item_ended_in_its_slack()
        return ticks, rows

    ticks, rows = asyncio.run(main())
    assert ticks <= 5, ticks
    assert sorted(rows)[len(rows) // 2] == 4  # batches stay full (the median step is 4 jobs)


def starvation_run(sd, age_limit_s: float, ticks: int) -> tuple[float | None, list[float]]:
    """One request with a partial image among seven without (each first in line for all its steps,
    and replaced as soon as it completes, so four of them always want every batch place). Returns
    when the one with a partial completed (s, None if not within `ticks`) and every replaced
    request's time from submission to completion."""
    async def main():
        cold = ColdSize(sd, exponent=1.0, capacity=8, age_limit_s=age_limit_s)
        size = sd.default_size

        def submit(i: int, partials: int) -> ImageRequest:
            return cold.queue.submit(ImageSpec(f"p{i}", size, size, steps=12, guidance=5.0, seed=i,
                                               partial_images=partials))

        old = submit(0, 1)
        others = {submit(i, 0): 0.0 for i in range(1, 8)}
        finished_at, spans, count = None, [], 8
        for _ in range(ticks):
            cold.ticks(1, LIGHT)
            if finished_at is None and any(isinstance(e, Terminal) for e in events_of(old)):
                finished_at = cold.clock.t
            for r in [r for r in others if any(isinstance(e, Terminal) for e in events_of(r))]:
                spans.append(cold.clock.t - others.pop(r))
                others[submit(count, 0)] = cold.clock.t
                count += 1
        cold.assert_every_item_ended_in_its_slack()
        return finished_at, spans

    return asyncio.run(main())


def test_a_job_past_its_first_partial_is_not_starved_by_requests_that_keep_arriving(sd):
    """Without the age rule (age_limit_s out of reach) the request with a partial image never gets
    a place again once past it: 4.8 s and it has not completed. With a 1 s age limit it is first in
    line again from then on and completes within a few ticks of it; no request waits much longer
    than that either."""
    starved, _ = starvation_run(sd, age_limit_s=1e9, ticks=60)
    assert starved is None
    finished_at, spans = starvation_run(sd, age_limit_s=1.0, ticks=60)
    assert finished_at is not None and 1.0 < finished_at <= 1.0 + 0.5
    assert len(spans) > 20 and max(spans) <= 1.0 + 0.5


def test_the_age_limit_must_be_a_positive_number_of_seconds(sd):
    for bad in (0, -1.0, float("nan"), math.inf):
        with pytest.raises(ValueError, match="age_limit_s must be a number of seconds more than 0"):
            ImageQueue(sd, max_slack_s=1.0, age_limit_s=bad)
