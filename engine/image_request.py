"""What an image request is, from the edge's spec to the engine's jobs (engine/image_queue.py).

The edge builds an `ImageSpec` (validated there; the queue trusts it), submits it and holds the
`ImageRequest` it gets back: its `events` stream yields `ImagePartial` / `ImageResult` and then
exactly one `Terminal`. On the engine thread a request is `spec.n` `Job`s, one per image, each
moving through the phases of its items (encode, denoise, preview, decode; a tiled decode's
tiles and blend are the decode phase). Also the two refusals `submit` raises.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .image_costs import ENCODE
from .stream import OutputStream

if TYPE_CHECKING:
    from parley.models.image_pipeline import Conditioning, ImageJob, TiledDecode

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
        self.jobs: list[Job] = []
        self.remaining = spec.n
        self.progress_at = 0.0  # queue clock: submitted, last item run, or last seen held by its client
        self.submitted_at = 0.0  # queue clock

    def cancel(self) -> None:
        """The client went away: the job is dropped at the next item boundary."""
        self.cancelled = True


@dataclass(eq=False)
class Job:
    """One image of a request, on the engine thread: its phase, its latents and what it has sent."""

    request: ImageRequest
    index: int
    seed: int
    phase: str = ENCODE
    state: ImageJob | None = None
    previews_at: tuple[int, ...] = ()  # steps after which a preview is sent
    tiles: TiledDecode | None = None  # a tiled final decode in progress
    partials_sent: int = 0
    order: int = field(default_factory=itertools.count().__next__)

    @property
    def has_output(self) -> bool:
        """Its first output is out (a final image ends the job, so only a partial counts)."""
        return self.partials_sent > 0

    @property
    def bucket(self) -> tuple:
        s = self.request.spec
        return (s.width, s.height, self.state.cfg)


def preview_steps(steps: int, partial_images: int) -> tuple[int, ...]:
    """Evenly spaced steps (1-based, before the last) after which a preview goes out."""
    k = min(partial_images, steps - 1)
    return tuple(sorted({round(steps * (i + 1) / (k + 1)) for i in range(k)} - {0, steps}))
