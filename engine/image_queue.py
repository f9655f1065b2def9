"""Text-to-image requests as slack work: throughput work for engine/slack.py (rule 1).

An image is a sequence of work items, each run on the engine thread in a tick's slack and
only when its estimated cost fits before the next boundary:

    encode  (prompt -> text conditioning, once per request; also starts the request's jobs)
    denoise (one step for a batch of jobs that share size and CFG; timesteps may differ)
    preview (a cheap reduced-resolution decode of a job's latents at evenly spaced steps)
    decode  (the final image; sizes larger than one VAE tile: one `tile` item per tile, then
             a `blend` item, so no item grows with the image)

Cost keys are ("image", kind, width, height[, cfg, batch]). `warm_up` measures every key of
each of `warm_sizes` before the engine starts (the model's default size unless set; and twice its side at
batch 1, eagerly, so that other sizes are predicted from two: fixed + per-pixel; it also captures the
denoise steps as CUDA graphs, one per batch size, each on its own capture stream, on CUDA;
for a size decoded whole, also the tiles and blend of the smallest tiled size, so larger sizes
have a measured tile and blend to scale from; on CUDA also the preview and whole decode of
each warmed size, and the text encoders once: prompts pad to one token shape, so one graph
serves every encode); `slack_prepare` measures them once more on the
engine thread before its first tick, since a thread's first library calls (cuBLAS and cuDNN
handles, workspaces) cost far more than later ones. So no live item runs with an unmeasured key
at a warmed size, and an item of any other size starts only when a prediction of its cost
(engine/image_costs.py, from the keys measured so far) fits; its first measurement then
replaces the prediction.

Order: pending encodes first (cheap; a started job can join the next shared step), then
output items (previews and final decodes: the client waits for them, and a job in preview
cannot join a denoise batch), then denoise steps. Denoise batch places go first to the jobs
that have not yet delivered their first output (their first partial image; the final image
when the request asked for no partials) and to jobs older than `age_limit_s` (since their
request was submitted), oldest first among them; then to the other jobs, oldest first. The
first job in that order picks the bucket; the bucket's other jobs come along in the same order
(up to `max_batch`), and the batch shrinks, dropping the last in that order, to what fits. So
batches stay as full as with oldest-first places (the same throughput), but a new request
reaches its first partial after its own steps instead of after the remaining steps of every
older job (with oldest-first places a new request waits out the queue ahead of it,
benchmarks/image_queue_replay.py). The age rule bounds the wait of a job past its first
output: requests that keep arriving with no partials (each one first in line for all its steps)
could otherwise take every place for as long as they come; once older than `age_limit_s` a job
is first in line again, ahead of every younger one. The first of those items that fits runs.
An item that raises fails the request(s) it was for (every request of a shared denoise batch).
Back-pressure: a job whose next item would push an event
(preview, final image) waits while its request's stream has no room, so nothing is ever
dropped and a slow client holds at most `stream_events` images in memory. Limits: at most
`capacity` images wait or run (`ImageQueueFull`, with a retry hint); a size whose smallest
item cannot fit in an empty tick's slack is refused (`ImageRefused`), at admission once it is
known and by prediction from the warm-up's measurements before that; a prediction over that slack
by at most `PROBE_FACTOR` is not trusted either way: the item runs once as the first item of an
idle tick, and its measurement serves or refuses the size. A cancelled request (client gone)
is dropped, and its tensors freed, at the next offer.

Stalls: a request that has had no item of its own run for `stall_timeout_s` seconds of the
queue's clock (since it was submitted, or since its last item ran) fails with a reason that says
so (`images_stalled`): a size that fits an empty tick's slack but not what the voice load leaves,
or a request queued behind others that long, must not keep its client waiting with no bound.
A request whose output stream is full is not failed (that wait is its client's, not reading; a
client that goes away cancels instead): its clock starts again from the last tick it was full.

Parts (each module opens with the rules it keeps): engine/image_request.py (the spec, request
and job types), engine/image_sizes.py (`SizeLimits`: which sizes an empty tick's slack can
serve; refusals), engine/image_book.py (`ImageBook`: admission against `capacity`, per-request
bookkeeping, the streams' only writer, stalls), engine/image_schedule.py (`ImageSchedule`: the
Order above and the item that fits), engine/image_items.py (`ImageItems`: what each item does),
engine/image_warm_up.py (`ImageWarmUp`: the measured costs) and engine/image_graphs.py
(`ImageGraphs`: the captured CUDA graphs). `ImageQueue` wires them and is the slack source.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Sequence

from . import image_costs
from .config import DEFAULT_STALL_TIMEOUT_S
from .cuda_graph import CUDAGraphRunner
from .image_book import STALLED, ImageBook
from .image_graphs import ImageGraphs
from .image_items import ImageItems
from .image_request import (MAX_PARTIAL_IMAGES, ImagePartial, ImageQueueFull, ImageRefused, ImageRequest,
                            ImageResult, ImageSpec, preview_steps)
from .image_schedule import LOOK_AGAIN, ImageSchedule
from .image_sizes import MAX_REFUSED_SIZES, PROBE_FACTOR, SizeLimits
from .image_warm_up import ImageWarmUp
from .slack import CostModel, Priority, SlackSource, WorkItem
from .stream import Status, Terminal

if TYPE_CHECKING:  # diffusers loads only with an image model (models/image_pipeline.py)
    from parley.models.image_pipeline import ImageStepper

__all__ = ["DEFAULT_AGE_LIMIT_S", "DEFAULT_CAPACITY", "DEFAULT_MAX_BATCH", "DEFAULT_STALL_TIMEOUT_S",
           "MAX_PARTIAL_IMAGES", "MAX_REFUSED_SIZES", "PROBE_FACTOR", "STALLED", "ImagePartial", "ImageQueue",
           "ImageQueueFull", "ImageRefused", "ImageRequest", "ImageResult", "ImageSpec", "preview_steps"]

DEFAULT_CAPACITY = 16
DEFAULT_MAX_BATCH = 4
# A job this old (s since its request was submitted) takes denoise places ahead of younger jobs
# past their first output: the bound on their wait (the module docstring's Order). Well above an
# image's time through a full queue (benchmarks/image_queue_replay.py replays it), so it acts only
# on a job being passed over, and well below the stall timeout (a job with no item for that long fails).
DEFAULT_AGE_LIMIT_S = 10.0


class ImageQueue(SlackSource):
    """A slack source for one image pipeline (register with `engine.add_slack_source`)."""

    priority = Priority.IMAGES

    # the cost keys (engine/image_costs.py), here for callers that hold the queue
    denoise_key = staticmethod(image_costs.denoise_key)
    decode_key = staticmethod(image_costs.decode_key)
    preview_key = staticmethod(image_costs.preview_key)
    tile_key = staticmethod(image_costs.tile_key)
    blend_key = staticmethod(image_costs.blend_key)
    encode_key = staticmethod(image_costs.encode_key)

    def __init__(self, stepper: ImageStepper, max_slack_s: float, *, capacity: int = DEFAULT_CAPACITY,
                 max_batch: int = DEFAULT_MAX_BATCH, stream_events: int = 2, cuda_graphs: bool = True,
                 graph_factory: Callable[..., Callable] = CUDAGraphRunner,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, age_limit_s: float = DEFAULT_AGE_LIMIT_S,
                 warm_sizes: Sequence[tuple[int | None, int | None, bool]] = ((None, None, True),),
                 now: Callable[[], float] = time.perf_counter) -> None:
        if capacity < 1 or max_batch < 1 or stream_events < 1:
            raise ValueError("capacity, max_batch and stream_events must be at least 1.")
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be more than 0 (got {stall_timeout_s}).")
        if not 0 < age_limit_s < math.inf:
            raise ValueError(f"age_limit_s must be a number of seconds more than 0 (got {age_limit_s}).")
        self.stall_timeout_s = stall_timeout_s
        # The sizes warm_up measures and captures, (width, height, cfg) each (None: the model's
        # default size); one per size to serve. Set before warm_up.
        self.warm_sizes: list[tuple[int | None, int | None, bool]] = list(warm_sizes)
        self._now = now  # the warm-up's timer and the stall clock (tests pass a fake one)
        # Denoise steps as CUDA graphs, one per (width, height, cfg, batch) captured at warm-up,
        # each on its own capture stream; other buckets (and the CPU) run eagerly.
        self._graphs = ImageGraphs(cuda_graphs and stepper.device.type == "cuda", graph_factory)
        self._sizes = SizeLimits(stepper, max_slack_s)  # which sizes fit; the sizes refused
        self._book = ImageBook(capacity, stream_events, now)  # requests, jobs, streams, counters
        self._warm_up = ImageWarmUp(stepper, self._graphs, self._sizes, now)  # the measured costs
        self._items = ImageItems(stepper, self._graphs, self._book)  # what each item does
        self._schedule = ImageSchedule(stepper, self._book, self._sizes, self._items,  # which item runs
                                       max_batch=max_batch, age_limit_s=age_limit_s, now=now)
        self.counts = self._book.counts

    # ---- settings ----

    @property
    def stepper(self) -> ImageStepper:
        return self._items.stepper

    @stepper.setter
    def stepper(self, stepper: ImageStepper) -> None:
        for part in (self._sizes, self._warm_up, self._items, self._schedule):
            part.stepper = stepper

    @property
    def max_slack_s(self) -> float:
        """An empty tick's slack: an item costing more never fits."""
        return self._sizes.max_slack_s

    @property
    def capacity(self) -> int:
        return self._book.capacity

    @property
    def stream_events(self) -> int:
        return self._book.stream_events

    @property
    def max_batch(self) -> int:
        return self._schedule.max_batch

    @property
    def age_limit_s(self) -> float:
        return self._schedule.age_limit_s

    @property
    def cuda_graphs(self) -> bool:
        return self._graphs.enabled

    @cuda_graphs.setter
    def cuda_graphs(self, on: bool) -> None:
        self._graphs.enabled = on

    # ---- start-up ----

    def warm_up(self, costs: CostModel) -> dict:
        """Measure every item kind at each of `warm_sizes` (denoise at each batch size), capturing
        the denoise graphs, before the engine starts, and seed those costs in `costs`. Also measures
        twice each size's side at batch 1, eagerly (no graphs kept for it), so that other sizes are
        predicted from two sizes (engine/image_costs.py: fixed + per-pixel cost). Returns the
        measured seconds per key."""
        measured: dict = {}
        for width, height, cfg in self.warm_sizes:
            measured.update(self._warm_up.warm_up(width, height, cfg, self.max_batch))
        self._warm_up.seed(costs)
        return measured

    def slack_prepare(self, costs: CostModel) -> None:
        """On the engine thread, before its first tick: record the warm-up costs, then measure
        every warmed key once more there (engine/image_warm_up.py)."""
        self._warm_up.prepare(costs)

    def graphed(self, key: tuple) -> Callable | None:
        """The captured replay for an item key (denoise, encode, or a size's preview/decode), or None."""
        return self._graphs.get(key)

    def graphed_embed(self) -> Callable | None:
        """The captured text encoder (for `stepper.encode(..., embed=)`), or None."""
        return self._graphs.embed()

    def graphed_predict(self, width: int, height: int, cfg: bool, batch: int) -> Callable | None:
        """The captured denoiser for a bucket (for `stepper.denoise(..., predict=)`), or None."""
        return self._graphs.get(self.denoise_key(width, height, cfg, batch))

    def close_graphs(self) -> None:
        """Free the captured graphs' memory (steps and encodes run eagerly afterwards)."""
        self._graphs.close()

    # ---- the edge (event loop) ----

    def submit(self, spec: ImageSpec) -> ImageRequest:
        """Admit a request or raise ImageQueueFull / ImageRefused. Call on the consuming loop."""
        refused = self.refusal(spec.width, spec.height, self.stepper.cfg_for(spec.guidance))
        if spec.n > self.capacity:
            refused = f"n={spec.n} is more images than this server's image queue holds ({self.capacity})."
        if refused:
            self._book.count("images_refused")
            raise ImageRefused(refused)
        return self._book.admit(spec, self._warm_up.step_s)

    def close(self, reason: str) -> None:
        """Refuse new requests and end every admitted one (CANCELLED). Call once the engine
        thread has stopped (server shutdown): requests it will never finish must not hang."""
        self.slack_stop(Terminal(Status.CANCELLED, reason))

    def slack_stop(self, terminal: Terminal) -> None:
        """The engine stopped (shutdown or a fatal error): refuse new requests and end every
        admitted one with `terminal`."""
        self._book.stop(terminal)

    def refusal(self, width: int, height: int, cfg: bool = True) -> str | None:
        """Why images of this size (with classifier-free guidance or not) can never be served
        here, or None (engine/image_sizes.py)."""
        return self._sizes.refusal(width, height, cfg)

    @property
    def outstanding(self) -> int:
        return self._book.outstanding

    # ---- the slack source (engine thread) ----

    def slack_started(self, deadline: float | None) -> None:
        """Once a tick: fail the requests that have waited `stall_timeout_s` for an item."""
        self._schedule.tick_started()
        self._book.intake()
        self._book.drop_ended()
        self._book.fail_stalled(self.stall_timeout_s)

    def offer(self, left_s: float | None, costs: CostModel) -> WorkItem | None:
        while True:
            if self._warm_up.unseeded:  # (no slack_prepare: an engine driven by hand, e.g. run_ticks in tests)
                self._warm_up.seed(costs)
            self._book.intake()
            self._book.drop_ended()
            item = self._schedule.pick(left_s, costs)
            if item is not LOOK_AGAIN:  # (a size was refused and its jobs are gone: look again)
                return item

    # ---- introspection ----

    @property
    def active_jobs(self) -> int:
        """Jobs the engine thread holds (tensors included); tests check cancel frees them."""
        return len(self._book.jobs)

    def counters(self) -> dict:
        return self._book.counters()
