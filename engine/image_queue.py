"""Text-to-image requests as slack work: the lowest-priority source of engine/slack.py.

An image is a sequence of work items, each run on the engine thread in a tick's slack and
only when its estimated cost fits before the next boundary:

    encode (prompt -> text conditioning, once per request; also starts the request's jobs)
    denoise (one step for a batch of jobs that share size and CFG; timesteps may differ)
    preview (VAE decode of a job's current latents at evenly spaced steps: a partial image)
    decode  (the final image)

Cost keys are ("image", kind, width, height[, cfg, batch]); `warm_up` measures the model's
default size once before the engine starts (capturing its denoise steps as CUDA graphs, one
per batch size, each on its own capture stream, on CUDA) and the measurements seed the
runner's cost model on the first offer, so the first live tick does not pay for a first
measurement.

Fairness: pending encodes first (cheap; a started job can join the next shared step), then
the oldest job whose next item fits; a denoise step takes along every other job of the same
bucket (oldest first, up to `max_batch`), shrinking the batch to what fits. An item that
raises fails the request(s) it was for (every request of a shared denoise batch). Back-pressure: a job whose next item would push an event (preview, final image)
waits while its request's stream has no room, so nothing is ever dropped and a slow client
holds at most `stream_events` images in memory. Limits: at most `capacity` images wait or
run (`ImageQueueFull`, with a retry hint); a size whose smallest item cannot fit in an
empty tick's slack is refused (`ImageRefused`), at admission once it is known and by
prediction from the default size before that. A cancelled request (client gone) is
dropped, and its tensors freed, at the next offer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

import numpy as np
import torch

from parley.models.image_pipeline import Conditioning, ImageJob, ImageStepper

from .cuda_graph import CUDAGraphRunner, GraphError
from .slack import CostModel, Priority, SlackSource, WorkItem
from .stream import OutputStream, Status, Terminal

log = logging.getLogger("parley.engine.images")

DEFAULT_CAPACITY = 16
DEFAULT_MAX_BATCH = 4
MAX_PARTIAL_IMAGES = 3


class ImageQueueFull(RuntimeError):
    """More images than `capacity` would wait or run; try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ImageRefused(ValueError):
    """A request this engine can never serve (e.g. a size too large for any tick's slack)."""


@dataclass(frozen=True)
class ImageSpec:
    """A validated text-to-image request (the edge validates; the queue trusts it)."""

    prompt: str
    width: int
    height: int
    steps: int
    guidance: float
    n: int = 1
    negative: str | None = None
    seed: int | None = None  # image i uses seed + i; None: random
    partial_images: int = 0  # previews per image, 0..3


@dataclass(frozen=True)
class ImagePartial:
    """A preview of image `image_index`: HWC uint8 pixels."""

    image_index: int
    partial_index: int
    pixels: np.ndarray


@dataclass(frozen=True)
class ImageResult:
    """A finished image: HWC uint8 pixels, and the seed that reproduces it."""

    image_index: int
    pixels: np.ndarray
    seed: int


class ImageRequest:
    """The edge's handle: `events` yields ImagePartial/ImageResult, then one Terminal."""

    def __init__(self, request_id: str, spec: ImageSpec, events: OutputStream) -> None:
        self.request_id = request_id
        self.spec = spec
        self.events = events
        self.cancelled = False  # set on the loop; read by the engine thread at the next offer
        self.cond: Conditioning | None = None
        self.jobs: list[_Job] = []
        self.remaining = spec.n

    def cancel(self) -> None:
        """The client went away: the job is dropped at the next item boundary."""
        self.cancelled = True


ENCODE, DENOISE, PREVIEW, DECODE = "encode", "denoise", "preview", "decode"


@dataclass(eq=False)
class _Job:
    request: ImageRequest
    index: int
    seed: int
    phase: str = ENCODE
    state: ImageJob | None = None
    previews_at: tuple[int, ...] = ()  # steps after which a preview is sent
    partials_sent: int = 0
    order: int = field(default_factory=itertools.count().__next__)

    @property
    def bucket(self) -> tuple:
        s = self.request.spec
        return (s.width, s.height, self.state.cfg)


def preview_steps(steps: int, partial_images: int) -> tuple[int, ...]:
    """Evenly spaced steps (1-based, before the last) after which a preview goes out."""
    k = min(partial_images, steps - 1)
    return tuple(sorted({round(steps * (i + 1) / (k + 1)) for i in range(k)} - {0, steps}))


class ImageQueue(SlackSource):
    """A slack source for one image pipeline (register with `engine.add_slack_source`)."""

    priority = Priority.IMAGES

    def __init__(self, stepper: ImageStepper, max_slack_s: float, *, capacity: int = DEFAULT_CAPACITY,
                 max_batch: int = DEFAULT_MAX_BATCH, stream_events: int = 2, cuda_graphs: bool = True,
                 graph_factory: Callable[..., Callable] = CUDAGraphRunner) -> None:
        if capacity < 1 or max_batch < 1 or stream_events < 1:
            raise ValueError("capacity, max_batch and stream_events must be at least 1.")
        self.stepper = stepper
        self.max_slack_s = max_slack_s  # an empty tick's slack: an item costing more never fits
        self.capacity = capacity
        self.max_batch = max_batch
        self.stream_events = stream_events
        self._lock = threading.Lock()  # guards _incoming, _outstanding, _refused_sizes
        self._incoming: deque[ImageRequest] = deque()
        self._live: set[ImageRequest] = set()  # admitted and not ended: close() ends them
        self._closed: str | None = None
        self._outstanding = 0  # images admitted and not yet ended
        self._refused_sizes: dict[tuple[int, int], str] = {}
        self._jobs: list[_Job] = []  # engine thread only, oldest first
        self._warm: dict[Hashable, float] = {}  # warm-up costs, recorded into the runner's model once
        self._per_pixel_s: float | None = None  # the costliest warm-up item per output pixel
        # Denoise steps as CUDA graphs, one per (width, height, cfg, batch) captured at warm-up,
        # each on its own capture stream; other buckets (and the CPU) run eagerly.
        self.cuda_graphs = cuda_graphs and stepper.device.type == "cuda"
        self._graph_factory = graph_factory
        self._graphs: dict[tuple, Callable] = {}  # denoise key -> replay
        self._graph_runners: list = []  # to free their memory pools (close_graphs)
        self.counts = {"images_submitted": 0, "images_completed": 0, "images_cancelled": 0,
                       "images_failed": 0, "images_refused": 0, "images_denoise_steps": 0}

    # ---- keys ----

    @staticmethod
    def denoise_key(width: int, height: int, cfg: bool, batch: int) -> tuple:
        return ("image", DENOISE, width, height, cfg, batch)

    @staticmethod
    def decode_key(width: int, height: int) -> tuple:
        return ("image", DECODE, width, height)

    @staticmethod
    def encode_key() -> tuple:
        return ("image", ENCODE)

    # ---- start-up ----

    def warm_up(self, width: int | None = None, height: int | None = None, cfg: bool = True) -> dict:
        """Run every item kind once (denoise at each batch size) at one size, before the engine
        starts, so live ticks start with estimates. Returns the measured seconds per key."""
        st = self.stepper
        width, height = width or st.default_size, height or st.default_size
        measured: dict[Hashable, float] = {}

        def timed(key, fn):
            for _ in range(2):  # the first call pays one-off allocation and dispatch costs
                start = time.perf_counter()
                out = fn()
                synchronize(st)
                measured[key] = time.perf_counter() - start
            return out

        cond = timed(self.encode_key(), lambda: st.encode("warm up", None, cfg))
        for b in range(1, self.max_batch + 1):
            key = self.denoise_key(width, height, cfg, b)
            jobs = [st.start(cond, width, height, 5, 5.0, i) for i in range(b)]
            if self.cuda_graphs:
                self._capture(key, jobs)
            timed(key, lambda: st.denoise(jobs, predict=self._graphs.get(key)))
        job = st.start(cond, width, height, 4, 5.0, 0)
        timed(self.decode_key(width, height), lambda: st.decode(job.latents))
        self._warm.update(measured)
        worst = max(measured[self.denoise_key(width, height, cfg, 1)], measured[self.decode_key(width, height)])
        self._per_pixel_s = worst / (width * height)
        return measured

    def _capture(self, key: tuple, jobs: list[ImageJob]) -> None:
        """Capture the denoiser for this bucket during its first warm-up step (eager on failure)."""
        graph = None

        def capture(x, t, emb, pooled):
            nonlocal graph
            inputs = [x, t, emb] + ([] if pooled is None else [pooled])
            graph = self._graph_factory(lambda *a: (self.stepper.predict(*a[:3], a[3] if len(a) > 3 else None),),
                                        inputs, capture_stream=torch.cuda.Stream() if x.is_cuda else None)
            return graph(*inputs)[0]

        try:
            self.stepper.denoise(jobs, predict=capture)
        except GraphError as exc:
            log.warning("image denoise steps run eagerly (CUDA graph capture failed: %s)", exc)
            self.cuda_graphs = False
            return

        def replay(x, t, emb, pooled):
            # The output is the graph's own buffer: copy it out (schedulers may keep it).
            return graph(*([x, t, emb] + ([] if pooled is None else [pooled])))[0].clone()

        self._graphs[key] = replay
        self._graph_runners.append(graph)

    def graphed_predict(self, width: int, height: int, cfg: bool, batch: int) -> Callable | None:
        """The captured denoiser for a bucket (for `stepper.denoise(..., predict=)`), or None."""
        return self._graphs.get(self.denoise_key(width, height, cfg, batch))

    def close_graphs(self) -> None:
        """Free the captured graphs' memory (steps run eagerly afterwards)."""
        self._graphs.clear()
        for runner in self._graph_runners:
            close = getattr(runner, "close", None)
            if close is not None:
                close()
        self._graph_runners.clear()

    # ---- the edge (event loop) ----

    def submit(self, spec: ImageSpec) -> ImageRequest:
        """Admit a request or raise ImageQueueFull / ImageRefused. Call on the consuming loop."""
        refused = self.refusal(spec.width, spec.height)
        if spec.n > self.capacity:
            refused = f"n={spec.n} is more images than this server's image queue holds ({self.capacity})."
        if refused:
            with self._lock:
                self.counts["images_refused"] += 1
            raise ImageRefused(refused)
        request = ImageRequest(uuid.uuid4().hex, spec,
                               OutputStream(uuid.uuid4().hex, asyncio.get_running_loop(), self.stream_events))
        with self._lock:
            if self._closed:
                raise ImageRefused(self._closed)
            if self._outstanding + spec.n > self.capacity:
                self.counts["images_refused"] += 1
                raise ImageQueueFull(f"the image queue is full ({self._outstanding} of {self.capacity} images "
                                     "waiting or running); retry later.", self._retry_after(spec))
            self._outstanding += spec.n
            self.counts["images_submitted"] += spec.n
            self._incoming.append(request)
            self._live.add(request)
        return request

    def close(self, reason: str) -> None:
        """Refuse new requests and end every admitted one (CANCELLED). Call once the engine
        thread has stopped (server shutdown): requests it will never finish must not hang."""
        with self._lock:
            self._closed = reason
            live, self._live = list(self._live), set()
        for request in live:
            request.events.finish(Terminal(Status.CANCELLED, reason))

    def refusal(self, width: int, height: int) -> str | None:
        """Why images of this size can never be served here, or None."""
        with self._lock:
            known = self._refused_sizes.get((width, height))
        if known:
            return known
        if self._per_pixel_s is not None:
            predicted = self._per_pixel_s * width * height
            if predicted > self.max_slack_s:
                return (f"size {width}x{height} is too large for this server: one step would take about "
                        f"{predicted * 1e3:.0f} ms, more than the {self.max_slack_s * 1e3:.0f} ms a tick can "
                        "spare; ask for a smaller size.")
        return None

    def _retry_after(self, spec: ImageSpec) -> int:
        step = self._warm.get(self.denoise_key(self.stepper.default_size, self.stepper.default_size, True, 1))
        if step is None:
            return 1
        # Each image in the queue needs its steps; assume images get about half of each tick.
        return max(1, math.ceil(self._outstanding * spec.steps * step / 0.5))

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    # ---- the slack source (engine thread) ----

    def offer(self, left_s: float | None, costs: CostModel) -> WorkItem | None:
        if self._warm:
            for key, seconds in self._warm.items():
                costs.record(key, seconds)
            self._warm = {}
        self._intake()
        self._drop_ended()
        first: WorkItem | None = None
        # Encodes first (cheap, and a started job can join the next shared denoise batch), then
        # the oldest job whose item fits.
        for job in sorted(self._jobs, key=lambda j: j.phase != ENCODE):
            item = self._item_for(job, left_s, costs)
            if item is None:
                continue
            estimate = costs.estimate(item.key, item.units)
            if (left_s is not None and item.key[1] != ENCODE and estimate is not None
                    and estimate > self.max_slack_s):  # (manual mode, left_s None, runs anything)
                self._refuse_size(job, item.key, estimate)
                return self.offer(left_s, costs)  # that job is gone; look again
            if left_s is None or estimate is None or estimate <= left_s:
                return item  # fits (or unknown: the runner runs it only as a tick's first item)
            first = first or item
        return first  # nothing fits: the runner will decline it, and the next tick tries again

    def _intake(self) -> None:
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
        for request in incoming:
            seed0 = random.getrandbits(31) if request.spec.seed is None else request.spec.seed
            request.jobs = [_Job(request, i, seed0 + i) for i in range(request.spec.n)]
            self._jobs.extend(request.jobs)

    def _drop_ended(self) -> None:
        for request in {j.request for j in self._jobs if j.request.cancelled or j.request.events.finished}:
            if request.cancelled:
                request.events.finish(Terminal(Status.CANCELLED, "the client went away"))
            self._end(request, "images_cancelled" if request.cancelled else None)

    def _end(self, request: ImageRequest, counter: str | None) -> None:
        """Forget a request's jobs and free their tensors; count what ended."""
        alive = [j for j in request.jobs if j in self._jobs]
        self._jobs = [j for j in self._jobs if j.request is not request]
        for job in request.jobs:
            job.state = None
        request.cond = None
        with self._lock:
            self._live.discard(request)
            self._outstanding -= len(alive)
            if counter:
                self.counts[counter] += len(alive)

    def _item_for(self, job: _Job, left_s: float | None, costs: CostModel) -> WorkItem | None:
        spec = job.request.spec
        if job.phase == ENCODE:
            return WorkItem(self.encode_key(), lambda: self._encode(job), self._failer([job]))
        if job.phase in (PREVIEW, DECODE):
            if job.request.events.room() <= 0:
                return None  # back-pressure: the client has not taken the last image yet
            run = self._preview if job.phase == PREVIEW else self._decode
            return WorkItem(self.decode_key(spec.width, spec.height), lambda: run(job), self._failer([job]))
        peers = [j for j in self._jobs if j.phase == DENOISE and j.bucket == job.bucket]
        batch = self._batch_size(job, len(peers[:self.max_batch]), left_s, costs)
        chosen = [job] + [j for j in peers if j is not job][:batch - 1]
        return WorkItem(self.denoise_key(*job.bucket, len(chosen)), lambda: self._denoise(chosen),
                        self._failer(chosen))

    def _batch_size(self, job: _Job, available: int, left_s: float | None, costs: CostModel) -> int:
        """The largest batch known to fit; one more when linear extrapolation says it would
        (to measure it: an unknown key runs only as a tick's first item)."""
        if left_s is None:
            return available
        best = 1
        for b in range(1, available + 1):
            estimate = costs.estimate(self.denoise_key(*job.bucket, b))
            if estimate is None:
                smaller = costs.estimate(self.denoise_key(*job.bucket, b - 1)) if b > 1 else None
                if smaller is not None and smaller * b / (b - 1) <= left_s:
                    best = b
                break
            if estimate <= left_s:
                best = b
        return best

    def _failer(self, jobs: list[_Job]):
        def fail(exc: Exception) -> None:
            ref = uuid.uuid4().hex[:8]
            log.error("image item failed (error %s); ending its request(s)", ref, exc_info=exc)
            for request in {j.request for j in jobs}:
                request.events.finish(Terminal(Status.FAILED, f"image generation failed (error {ref}, "
                                                              "see the server log)"))
                self._end(request, "images_failed")
        return fail

    def _refuse_size(self, job: _Job, key: tuple, estimate: float) -> None:
        spec = job.request.spec
        reason = (f"size {spec.width}x{spec.height} is too large for this server: a {key[1]} item takes "
                  f"{estimate * 1e3:.0f} ms, more than the {self.max_slack_s * 1e3:.0f} ms a tick can spare; "
                  "ask for a smaller size.")
        log.warning("refusing images of %dx%d from now on: %s", spec.width, spec.height, reason)
        with self._lock:
            self._refused_sizes[(spec.width, spec.height)] = reason
        job.request.events.finish(Terminal(Status.FAILED, reason))
        self._end(job.request, "images_failed")

    # ---- the items ----

    def _encode(self, job: _Job) -> None:
        request, spec, st = job.request, job.request.spec, self.stepper
        if request.cond is None:
            request.cond = st.encode(spec.prompt, spec.negative, st.cfg_for(spec.guidance))
        for j in request.jobs:  # starting a job is cheap host work: latents and a scheduler copy
            j.state = st.start(request.cond, spec.width, spec.height, spec.steps, spec.guidance, j.seed)
            j.previews_at = preview_steps(spec.steps, spec.partial_images)
            j.phase = DENOISE

    def _denoise(self, jobs: list[_Job]) -> None:
        states = [j.state for j in jobs]
        self.stepper.denoise(states, predict=self._graphs.get(self.denoise_key(*jobs[0].bucket, len(jobs))))
        with self._lock:
            self.counts["images_denoise_steps"] += len(jobs)
        for j in jobs:
            if j.state.done:
                j.phase = DECODE
            elif j.state.step in j.previews_at:
                j.phase = PREVIEW

    def _pixels(self, job: _Job) -> np.ndarray:
        return self.stepper.to_uint8(self.stepper.decode(job.state.latents))[0]

    def _preview(self, job: _Job) -> None:
        job.request.events.push(ImagePartial(job.index, job.partials_sent, self._pixels(job)))
        job.partials_sent += 1
        job.phase = DENOISE

    def _decode(self, job: _Job) -> None:
        request = job.request
        request.events.push(ImageResult(job.index, self._pixels(job), job.seed))
        job.state = None
        self._jobs.remove(job)
        request.remaining -= 1
        with self._lock:
            self._outstanding -= 1
            self.counts["images_completed"] += 1
        if request.remaining == 0:
            request.cond = None
            with self._lock:
                self._live.discard(request)
            request.events.finish(Terminal(Status.COMPLETED))

    # ---- introspection ----

    @property
    def active_jobs(self) -> int:
        """Jobs the engine thread holds (tensors included); tests check cancel frees them."""
        return len(self._jobs)

    def counters(self) -> dict:
        with self._lock:
            return {**self.counts, "images_outstanding": self._outstanding}


def synchronize(stepper: ImageStepper) -> None:
    if stepper.device.type == "cuda":
        torch.cuda.synchronize(stepper.device)
