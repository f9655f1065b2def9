"""Which image item runs next in the slack left (engine/image_queue.py's Order and Limits).

`pick` walks every job's next item in the order of the module docstring of engine/image_queue.py
(pending encodes; previews and final decodes whose stream has room; then one denoise batch per
bucket, its places taken in `denoise_order`) and returns the first that fits the slack left, by its
estimate or, for a key never measured, its prediction. An item over an empty tick's slack refuses
its size (its requests fail; `SizeLimits.refuse`) unless it is only predicted so, or measured so
once, by at most `PROBE_FACTOR`: then it waits for an idle tick and runs there first, to be
measured (again). One live measurement may be a contended call on a loaded machine, and a refusal
is kept for every later request of that size, so it takes two costs over the slack (live, or the
warm-up's; the estimate is then the second largest). Every item is
wrapped so that running it restarts its requests' stall clocks and an exception fails them.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Callable, TypeVar

from .image_book import ImageBook
from .image_costs import DECODE, DENOISE, ENCODE, PREVIEW, blend_key, decode_key, denoise_key, encode_key
from .image_costs import preview_key, tile_key
from .image_items import ImageItems
from .image_request import Job
from .image_sizes import PROBE_FACTOR, SizeLimits
from .slack import CostModel, WorkItem

if TYPE_CHECKING:  # diffusers loads only with an image model (models/image_pipeline.py)
    from parley.models.image_pipeline import ImageStepper

log = logging.getLogger("parley.engine.images")

T = TypeVar("T")

LOOK_AGAIN = object()  # `pick` refused a size (its jobs are gone): look again


class ImageSchedule:
    """The order of the image items and the choice of the one that fits."""

    def __init__(self, stepper: ImageStepper, book: ImageBook, sizes: SizeLimits, items: ImageItems, *,
                 max_batch: int, age_limit_s: float, now: Callable[[], float]) -> None:
        self.stepper = stepper
        self.max_batch = max_batch
        self.age_limit_s = age_limit_s
        self._book = book
        self._sizes = sizes
        self._items = items
        self._now = now
        self._tick_fresh = False  # no item of ours has run in this tick's slack yet

    def tick_started(self) -> None:
        self._tick_fresh = True

    def pick(self, left_s: float | None, costs: CostModel) -> WorkItem | None | object:
        """The item to run in `left_s` (None: anything, in manual mode), the first item when none
        fits (the runner declines it), None when there is none, or LOOK_AGAIN after refusing a size."""
        max_slack_s = self._sizes.max_slack_s
        # Only an idle tick's slack reaches past an empty tick's (engine.py): a probe may run there.
        probe_now = self._tick_fresh and left_s is not None and left_s > max_slack_s
        fitting: WorkItem | None = None
        first: WorkItem | None = None
        for item in self._candidates(left_s, costs):
            estimate = costs.estimate(item.key, item.units)
            measured = estimate is not None
            if not measured:  # a size never measured: the runner starts it on its prediction
                estimate = item.predicted_s = self._sizes.predict(item.key, costs)
            if (left_s is not None and item.key[1] != ENCODE and estimate is not None
                    and estimate > max_slack_s):  # (manual mode, left_s None, runs anything)
                confirmed = measured and not costs.one_live_cost(item.key)
                beyond_idle = probe_now and measured and estimate > left_s  # not even an idle tick fits it
                if confirmed or beyond_idle or estimate > PROBE_FACTOR * max_slack_s:
                    self._refuse_size(item.key[2], item.key[3], item.key, estimate)
                    return LOOK_AGAIN  # that size's jobs are gone
                if probe_now:  # measure it (again): the runner runs an item with no estimate only first
                    item.predicted_s = None
                    return item
                continue  # wait for an idle tick
            if fitting is None and (left_s is None or estimate is None or estimate <= left_s):
                fitting = item  # fits (or nothing to predict from: the runner runs it only as a tick's first item)
                if not probe_now:  # (a probe would go ahead of it: look on)
                    break
            first = first or item
        return fitting or first  # nothing fits: the runner will decline it, and the next tick tries again

    def _refuse_size(self, width: int, height: int, key: tuple, estimate: float) -> None:
        """An item of this size can never fit: fail its requests and refuse the size from now on."""
        self._book.fail_size(width, height, self._sizes.refuse(width, height, key, estimate))

    def _candidates(self, left_s: float | None, costs: CostModel):
        """Every job's next item, in the order they should run (the module docstring's Order)."""
        for job in self._book.jobs:
            if job.phase == ENCODE:
                spec = job.request.spec
                units = self.stepper.encode_units(spec.negative, self.stepper.cfg_for(spec.guidance))
                yield self._item(encode_key(), [job], lambda job=job: self._items.encode(job), units)
        for job in self._book.jobs:
            if job.phase in (PREVIEW, DECODE) and job.request.events.room() > 0:  # else back-pressure
                yield self._output_item(job)
        ordered = self.denoise_order()
        buckets = set()
        for job in ordered:
            if job.bucket not in buckets:
                buckets.add(job.bucket)
                yield self._denoise_item([j for j in ordered if j.bucket == job.bucket], left_s, costs)

    def denoise_order(self) -> list[Job]:
        """The denoising jobs in the order they take batch places: those with no output yet or
        older than `age_limit_s` first, then the others; oldest first within each."""
        now = self._now()

        def rank(job: Job) -> tuple[int, int]:
            first = not job.has_output or now - job.request.submitted_at >= self.age_limit_s
            return (0 if first else 1, job.order)
        return sorted((j for j in self._book.jobs if j.phase == DENOISE), key=rank)

    def _output_item(self, job: Job) -> WorkItem:
        spec, items = job.request.spec, self._items
        if job.phase == PREVIEW:
            return self._output(preview_key(spec.width, spec.height), job, items.preview)
        if not self.stepper.tiled(spec.width, spec.height):
            return self._output(decode_key(spec.width, spec.height), job, items.decode)
        if job.tiles is None or not job.tiles.done:
            return self._item(tile_key(spec.width, spec.height), [job], lambda: items.tile(job))
        return self._output(blend_key(spec.width, spec.height), job, items.blend)

    def _output(self, key: tuple, job: Job, hand_out: Callable[..., Callable[[], None]]) -> WorkItem:
        """An item that hands out an image: run whole, or queued with its host half (slack.py rule 8)."""
        return self._item(key, [job], lambda: hand_out(job)(), launch=lambda: hand_out(job, queued=True))

    def _denoise_item(self, peers: list[Job], left_s: float | None, costs: CostModel) -> WorkItem:
        """One step for the first of a bucket's jobs (in `denoise_order`), as many as fit."""
        job = peers[0]
        chosen = peers[:self._batch_size(job, len(peers[:self.max_batch]), left_s, costs)]
        return self._item(denoise_key(*job.bucket, len(chosen)), chosen, lambda: self._items.denoise(chosen))

    def _batch_size(self, job: Job, available: int, left_s: float | None, costs: CostModel) -> int:
        """The largest batch whose estimate (or, unmeasured, prediction) fits, and would fit an
        empty tick (an idle tick's longer slack must not make a size look too large)."""
        if left_s is None:
            return available
        best = 1
        for b in range(1, available + 1):
            estimate = self._sizes.cost(denoise_key(*job.bucket, b), costs)
            if estimate is not None and estimate <= min(left_s, self._sizes.max_slack_s):
                best = b
        return best

    def _item(self, key: tuple, jobs: list[Job], run: Callable[[], None], units: int = 1,
              launch: Callable[[], Callable[[], None]] | None = None) -> WorkItem:
        """A work item for `jobs`: once it has run (or been queued: `launch`), their requests' stall
        clocks start again."""
        def noted(body: Callable[[], T]) -> Callable[[], T]:
            def call() -> T:
                self._tick_fresh = False
                result = body()
                now = self._now()
                for job in jobs:
                    job.request.progress_at = now
                return result
            return call
        return WorkItem(key, noted(run), self._failer(jobs), units=units,
                        launch=None if launch is None else noted(launch))

    def _failer(self, jobs: list[Job]):
        def fail(exc: Exception) -> None:
            ref = uuid.uuid4().hex[:8]
            log.error("image item failed (error %s); ending its request(s)", ref, exc_info=exc)
            self._book.fail({j.request for j in jobs},
                            f"image generation failed (error {ref}, see the server log)")
        return fail
