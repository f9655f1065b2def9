"""Per-request bookkeeping of the image queue, and the one place its requests' streams are written.

On the event loop: `admit` (at most `capacity` images wait or run; beyond, `ImageQueueFull` with a
retry hint) and `stop` (no more requests; every admitted one ended). On the engine thread:
`intake` turns admitted requests into jobs (oldest first in `jobs`); `partial` and `complete`
push a job's images into its request's stream, `fail`, `fail_size` and `fail_stalled` end
requests with a reason, `drop_ended` forgets the cancelled and finished ones, and `end` frees a
request's tensors and counts what ended (module docstring of engine/image_queue.py: Stalls).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import uuid
from collections import deque
from typing import Callable, Iterable

import numpy as np

from .image_request import ImagePartial, ImageQueueFull, ImageRefused, ImageRequest, ImageResult, ImageSpec, Job
from .stream import OutputStream, Status, Terminal

log = logging.getLogger("parley.engine.images")

STALLED = "no slack for"  # how a stalled request's reason begins (the edge answers it 503)


def retry_after_s(outstanding: int, steps: int, step_s: float | None) -> int:
    """The Retry-After hint of a full queue: each image in it needs its steps; assume images get
    about half of each tick."""
    if step_s is None:
        return 1
    return max(1, math.ceil(outstanding * steps * step_s / 0.5))


class ImageBook:
    """The requests admitted and not ended, their jobs, and the queue's counters."""

    def __init__(self, capacity: int, stream_events: int, now: Callable[[], float]) -> None:
        self.capacity = capacity
        self.stream_events = stream_events
        self._now = now  # the stall clock (tests pass a fake one)
        self._lock = threading.Lock()  # guards _incoming, _live, _closed, _outstanding, counts
        self._incoming: deque[ImageRequest] = deque()
        self._live: set[ImageRequest] = set()  # admitted and not ended: stop() ends them
        self._closed: str | None = None
        self._outstanding = 0  # images admitted and not yet ended
        self.jobs: list[Job] = []  # engine thread only, oldest first
        self.counts = {"images_submitted": 0, "images_completed": 0, "images_cancelled": 0,
                       "images_failed": 0, "images_refused": 0, "images_stalled": 0,
                       "images_denoise_steps": 0}

    # ---- the event loop ----

    def count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self.counts[counter] += n

    def admit(self, spec: ImageSpec, step_s: float | None) -> ImageRequest:
        """A request with its own stream, or ImageRefused (closed) / ImageQueueFull."""
        request = ImageRequest(uuid.uuid4().hex, spec,
                               OutputStream(uuid.uuid4().hex, asyncio.get_running_loop(), self.stream_events))
        request.progress_at = request.submitted_at = self._now()
        with self._lock:
            if self._closed:
                raise ImageRefused(self._closed)
            if self._outstanding + spec.n > self.capacity:
                self.counts["images_refused"] += 1
                raise ImageQueueFull(f"the image queue is full ({self._outstanding} of {self.capacity} images "
                                     "waiting or running); retry later.",
                                     retry_after_s(self._outstanding, spec.steps, step_s))
            self._outstanding += spec.n
            self.counts["images_submitted"] += spec.n
            self._incoming.append(request)
            self._live.add(request)
        return request

    def stop(self, terminal: Terminal) -> None:
        """Refuse new requests and end every admitted one with `terminal`."""
        with self._lock:
            self._closed = self._closed or terminal.reason or "the engine stopped"
            live, self._live = list(self._live), set()
        for request in live:
            request.events.finish(terminal)

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    def counters(self) -> dict:
        with self._lock:
            return {**self.counts, "images_outstanding": self._outstanding}

    # ---- the engine thread ----

    def intake(self) -> None:
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
        for request in incoming:
            seed0 = random.getrandbits(31) if request.spec.seed is None else request.spec.seed
            request.jobs = [Job(request, i, seed0 + i) for i in range(request.spec.n)]
            self.jobs.extend(request.jobs)

    def drop_ended(self) -> None:
        for request in {j.request for j in self.jobs if j.request.cancelled or j.request.events.finished}:
            if request.cancelled:
                request.events.finish(Terminal(Status.CANCELLED, "the client went away"))
            self.end(request, "images_cancelled" if request.cancelled else None)

    def fail_stalled(self, timeout_s: float) -> None:
        """Fail the requests that have waited `timeout_s` for an item of their own; a request
        whose stream is full is held by its client, not by the engine: its clock starts again."""
        now = self._now()
        for request in {j.request: None for j in self.jobs}:  # oldest first, once each
            if request.events.room() == 0:  # held by its client, not by the engine
                request.progress_at = now
            elif now - request.progress_at >= timeout_s:
                self._fail_stalled(request, now - request.progress_at, timeout_s)

    def _fail_stalled(self, request: ImageRequest, waited_s: float, timeout_s: float) -> None:
        spec = request.spec
        reason = (f"{STALLED} a {spec.width}x{spec.height} image for {timeout_s:g} s under the current "
                  "voice and image load; retry later or ask for a smaller size")
        log.warning("image request %s failed after %.1f s with no item run (%dx%d, %d image(s)): no slack "
                    "for it under the current load", request.request_id, waited_s, spec.width, spec.height,
                    request.remaining)
        request.events.finish(Terminal(Status.FAILED, reason))
        self.end(request, "images_stalled")

    def fail(self, requests: Iterable[ImageRequest], reason: str) -> None:
        """End these requests FAILED with `reason` (counted in images_failed)."""
        for request in requests:
            request.events.finish(Terminal(Status.FAILED, reason))
            self.end(request, "images_failed")

    def fail_size(self, width: int, height: int, reason: str) -> None:
        """Fail every request of this size (refused from now on)."""
        self.fail({j.request for j in self.jobs if (j.request.spec.width, j.request.spec.height) == (width, height)},
                  reason)

    def end(self, request: ImageRequest, counter: str | None) -> None:
        """Forget a request's jobs and free their tensors; count what ended."""
        alive = [j for j in request.jobs if j in self.jobs]
        self.jobs = [j for j in self.jobs if j.request is not request]
        for job in request.jobs:
            job.state = job.tiles = None
        request.cond = None
        with self._lock:
            self._live.discard(request)
            self._outstanding -= len(alive)
            if counter:
                self.counts[counter] += len(alive)

    def partial(self, job: Job, pixels: np.ndarray) -> None:
        """Push a preview of the job's image."""
        job.request.events.push(ImagePartial(job.index, job.partials_sent, pixels))
        job.partials_sent += 1

    def complete(self, job: Job, pixels: np.ndarray) -> None:
        """Push the job's final image and forget the job; the request's last one completes it."""
        request = job.request
        request.events.push(ImageResult(job.index, pixels, job.seed))
        job.state = job.tiles = None
        self.jobs.remove(job)
        request.remaining -= 1
        with self._lock:
            self._outstanding -= 1
            self.counts["images_completed"] += 1
        if request.remaining == 0:
            request.cond = None
            with self._lock:
                self._live.discard(request)
            request.events.finish(Terminal(Status.COMPLETED))
