"""POST /v1/images/generations with the stock `openai` SDK (sync and async, streaming and not)
against a real uvicorn server whose engine runs the tiny SD pipeline in its slack."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

from parley.engine import Engine, EngineConfig
from parley.engine.image_queue import ImageQueue
from delay_backend import DelayBackend
from parley.realtime.server.app import ServerInfo, create_app
from parley.realtime.server.services import Services
from parley.realtime.cli import main
from parley.realtime.server.demo_model import DEMO_IMAGE_MODEL, demo_image_stepper
from parley.realtime.http.images import ImageService
from parley.realtime.server.serve import ServeConfig, ServeError
from parley.realtime.server.services import build_images, register_slack_source

from server_harness import serve

openai = pytest.importorskip("openai")

# Generous: on the shared 2-core CPU a tiny step has taken up to 4 s under load, and an item that cannot
# fit in an empty tick's slack is refused. The slack rule is the same at any period.
TICK = 3.0
CAPACITY = 2


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    engine = Engine(DelayBackend(2), EngineConfig(tick_seconds=TICK))
    stepper = demo_image_stepper()
    queue = ImageQueue(stepper, max_slack_s=TICK - engine.config.slack_guard_s, capacity=CAPACITY)
    register_slack_source(engine, queue)  # warm-up, then add: as build_images does
    app = create_app(Services(engine, info=ServerInfo(model="delay"), codec_workers=0,
                     images=ImageService(queue, engine, stepper.name)))
    with serve(app) as base:
        yield base, queue, stepper


def client(base: str):
    return openai.OpenAI(api_key="sk-test", base_url=f"http://{base}/v1", max_retries=0, timeout=60)


def pixels(b64: str, fmt: str = "PNG") -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == fmt
    return np.asarray(image)


def test_generate_returns_n_images_reproducible_by_seed(server):
    base, _, stepper = server
    c = client(base)
    extra = {"seed": 5, "num_inference_steps": 2}
    first = c.images.generate(prompt="a red cat", n=2, size="16x16", extra_body=extra)
    again = c.images.generate(prompt="a red cat", n=1, size="auto", model=DEMO_IMAGE_MODEL, extra_body=extra)
    assert len(first.data) == 2 and first.size == "16x16" and first.output_format == "png"
    a, b = (pixels(d.b64_json) for d in first.data)
    assert a.shape == (16, 16, 3)
    assert not np.array_equal(a, b)  # image i uses seed + i
    single = pixels(again.data[0].b64_json)
    # The same seed: `a` shared its denoise steps with image 1 (a batch of 2), `again` ran alone,
    # and batched CPU convolutions may take other kernels than unbatched ones: one uint8 level.
    assert np.abs(single.astype(int) - a.astype(int)).max() <= 1
    # The same image the stepper makes by hand at batch 1 (guidance: the pipeline's default, 7.5):
    # the same shapes on the same device, so bit for bit.
    job = stepper.start(stepper.encode("a red cat", None, True), 16, 16, 2, 7.5, 5)
    while not job.done:
        stepper.denoise([job])
    assert np.array_equal(stepper.to_uint8(stepper.decode(job.latents))[0], single)


def test_output_formats_and_sizes(server):
    base, _, _ = server
    c = client(base)
    jpeg = c.images.generate(prompt="x", size="32x16", output_format="jpeg", output_compression=80,
                             quality="low", extra_body={"num_inference_steps": 1})
    assert pixels(jpeg.data[0].b64_json, "JPEG").shape == (16, 32, 3)
    webp = c.images.generate(prompt="x", output_format="webp", extra_body={"num_inference_steps": 1})
    assert pixels(webp.data[0].b64_json, "WEBP").shape == (16, 16, 3)


def test_stream_sends_partial_images_then_one_completed(server):
    base, _, _ = server
    stream = client(base).images.generate(prompt="a dog", stream=True, partial_images=3,
                                          extra_body={"num_inference_steps": 4, "seed": 1})
    events = list(stream)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 3 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:3]] == [0, 1, 2]
    finals = [pixels(e.b64_json) for e in events]
    assert all(f.shape == (16, 16, 3) for f in finals)
    assert not np.array_equal(finals[0], finals[-1])  # a preview is an earlier state, not the final image


def test_async_client_streaming_and_not(server):
    base, _, _ = server

    async def main():
        c = openai.AsyncOpenAI(api_key="sk-test", base_url=f"http://{base}/v1", max_retries=0, timeout=60)
        plain = await c.images.generate(prompt="a cat", extra_body={"num_inference_steps": 2, "seed": 9})
        stream = await c.images.generate(prompt="a cat", stream=True, partial_images=0,
                                         extra_body={"num_inference_steps": 2, "seed": 9})
        events = [e async for e in stream]
        await c.close()
        return plain, events

    plain, events = asyncio.run(main())
    assert [e.type for e in events] == ["image_generation.completed"]
    assert np.array_equal(pixels(events[0].b64_json), pixels(plain.data[0].b64_json))


@pytest.mark.parametrize("kwargs, param, fragment", [
    ({"response_format": "url"}, "response_format", "not supported"),
    ({"size": "17x16"}, "size", "multiples of 2"),
    ({"size": "huge"}, "size", "WIDTHxHEIGHT"),
    ({"model": 3}, "model", "a model name"),  # a wrong name is 404 (tests/test_served_models.py)
    ({"n": 3}, "n", "from 1 to 2"),  # at most the queue's capacity (2 here; 10 at most)
    ({"background": "transparent"}, "background", "opaque"),
    ({"quality": "ultra"}, "quality", "low, medium, high"),
    ({"output_format": "png", "output_compression": 50}, "output_compression", "jpeg and webp"),
    ({"extra_body": {"partial_images": 2}}, "partial_images", "stream: true"),
    ({"extra_body": {"style": "vivid"}}, "style", "unknown parameter"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_requests_are_openai_shaped_400s(server, kwargs, param, fragment):
    base, _, _ = server
    with pytest.raises(openai.BadRequestError) as err:
        client(base).images.generate(prompt="x", **kwargs)
    assert err.value.status_code == 400 and err.value.param == param
    assert fragment in err.value.message


def test_a_full_queue_answers_429_and_a_disconnect_cancels_the_job(server):
    base, queue, _ = server
    cancelled_before = queue.counters()["images_cancelled"]
    checked = threading.Event()

    def long_stream():  # fills the queue (n=2 of capacity 2), then hangs up mid-generation
        stream = client(base).images.generate(prompt="slow", n=2, stream=True, partial_images=1,
                                              extra_body={"num_inference_steps": 100})
        checked.wait(60)
        stream.close()

    thread = threading.Thread(target=long_stream)
    thread.start()
    deadline = time.monotonic() + 30
    while queue.outstanding < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as err:
        client(base).images.generate(prompt="x")
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert "queue is full" in err.value.message
    checked.set()
    thread.join(60)
    while queue.outstanding:  # dropped at the next item boundary after the hang-up
        assert time.monotonic() < deadline + 30
        time.sleep(0.05)
    assert queue.counters()["images_cancelled"] == cancelled_before + 2
    assert queue.active_jobs == 0


def test_a_server_without_an_image_model_says_so():
    engine = Engine(DelayBackend(1))
    with serve(create_app(Services(engine, info=ServerInfo(model="delay"), codec_workers=0))) as base:
        with pytest.raises(openai.NotFoundError, match="--image-model"):
            client(base).images.generate(prompt="x")


def test_serve_flags_are_checked(tmp_path, capsys):
    assert main(["serve", "--image-queue", "0"]) == 2
    assert "--image-queue must be at least 1" in capsys.readouterr().err
    for bad in ("0", "-3", "nan", "inf"):
        assert main(["serve", "--image-stall-timeout", bad]) == 2
        assert "--image-stall-timeout must be a number of seconds more than 0" in capsys.readouterr().err
    engine = Engine(DelayBackend(1))
    with pytest.raises(ServeError, match="--image-model: cannot read a diffusers pipeline"):
        build_images(ServeConfig(model="x", image_model=str(tmp_path / "missing")), engine, torch.device("cpu"),
                     torch.float32, demo=False)
    assert build_images(ServeConfig(model="x"), engine, torch.device("cpu"), torch.float32, demo=False) is None
    demo = build_images(ServeConfig(model=None, image_stall_timeout=7.5), engine, torch.device("cpu"),
                        torch.float32, demo=True)
    assert demo.queue.stall_timeout_s == 7.5


def test_a_stalled_request_is_answered_503_with_the_reason(server):
    """A timeout shorter than the time to the next tick: the request fails before its first item."""
    base, queue, _ = server
    before, timeout = queue.counters()["images_stalled"], queue.stall_timeout_s
    queue.stall_timeout_s = 1e-3
    try:
        with pytest.raises(openai.InternalServerError, match="no slack for a 16x16 image for 0.001 s") as error:
            client(base).images.generate(prompt="x", size="16x16", extra_body={"num_inference_steps": 2})
    finally:
        queue.stall_timeout_s = timeout
    assert error.value.status_code == 503 and error.value.code == "image_stalled"
    assert queue.counters()["images_stalled"] == before + 1 and queue.outstanding == 0
    body = urllib.request.urlopen(f"http://{base}/metrics", timeout=30).read().decode()
    assert f"parley_images_stalled_total {before + 1}.0" in body


def test_a_client_that_hangs_up_before_the_json_answer_cancels_its_job(server):
    base, queue, _ = server
    httpx = pytest.importorskip("httpx2")
    before = queue.counters()["images_cancelled"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"http://{base}/v1/images/generations", timeout=0.3,  # far less than 2 x 100 steps take
                   json={"prompt": "slow", "num_inference_steps": 100, "n": 2})
    deadline = time.monotonic() + 60
    while queue.counters()["images_cancelled"] < before + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert queue.outstanding == 0 and queue.active_jobs == 0


def test_metrics_count_images(server):
    base, queue, _ = server
    client(base).images.generate(prompt="x", extra_body={"num_inference_steps": 1})
    text = urllib.request.urlopen(f"http://{base}/metrics", timeout=10).read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("parley_images")}
    assert values["parley_images_completed_total"] == queue.counters()["images_completed"] >= 1
    assert values["parley_images_denoise_steps_total"] >= 1 and values["parley_images_outstanding"] == 0


def test_stream_with_n_images_tags_each_event_with_its_image(server):
    base, _, _ = server
    events = list(client(base).images.generate(prompt="two", n=2, stream=True, partial_images=1,
                                               extra_body={"num_inference_steps": 2, "seed": 3}))
    kinds = [(e.type.rsplit(".", 1)[1], e.model_extra["image_index"]) for e in events]
    assert sorted(kinds) == [("completed", 0), ("completed", 1), ("partial_image", 0), ("partial_image", 1)]
    assert kinds.index(("partial_image", 0)) < kinds.index(("completed", 0))  # per image: partials first
    assert kinds.index(("partial_image", 1)) < kinds.index(("completed", 1))
