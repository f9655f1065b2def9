"""What each image work item does, on the engine thread (engine/image_queue.py's item kinds).

`encode` (the prompt, once per request; starts its jobs), `denoise` (one step of a batch of jobs
sharing a bucket), `preview`, and the final image: `decode` whole, or `tile` by tile then
`blend`. Each runs on the stepper (a captured graph where engine/image_graphs.py has one for its
key), moves its jobs to their next phase, and hands images to the book, which pushes them into
the requests' streams. The items that hand out an image (`preview`, `decode`, `blend`) return their
host half: queued on the device (engine/slack_queue.py) their pixels cross to the host without a
wait, and the host half hands them out once the device is done; called at once otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from .image_book import ImageBook
from .image_costs import DECODE, DENOISE, PREVIEW, decode_key, denoise_key, preview_key
from .image_graphs import ImageGraphs
from .image_request import Job, preview_steps
from .slack_queue import host_copy

if TYPE_CHECKING:  # diffusers loads only with an image model (models/image_pipeline.py)
    from parley.models.image_pipeline import ImageStepper


class ImageItems:
    """The item bodies: each moves its jobs one phase on."""

    def __init__(self, stepper: ImageStepper, graphs: ImageGraphs, book: ImageBook) -> None:
        self.stepper = stepper
        self._graphs = graphs
        self._book = book

    def encode(self, job: Job) -> None:
        request, spec, st = job.request, job.request.spec, self.stepper
        if request.cond is None:
            request.cond = st.encode(spec.prompt, spec.negative, st.cfg_for(spec.guidance), embed=self._graphs.embed())
        for j in request.jobs:  # starting a job is cheap host work: latents and a scheduler copy
            j.state = st.start(request.cond, spec.width, spec.height, spec.steps, spec.guidance, j.seed)
            j.previews_at = preview_steps(spec.steps, spec.partial_images)
            j.phase = DENOISE

    def denoise(self, jobs: list[Job]) -> None:
        states = [j.state for j in jobs]
        self.stepper.denoise(states, predict=self._graphs.get(denoise_key(*jobs[0].bucket, len(jobs))))
        self._book.count("images_denoise_steps", len(jobs))
        for j in jobs:
            if j.state.done:
                j.phase = DECODE
            elif j.state.step in j.previews_at:
                j.phase = PREVIEW

    def preview(self, job: Job, queued: bool = False) -> Callable[[], None]:
        spec = job.request.spec
        preview = self._graphs.get(preview_key(spec.width, spec.height), self.stepper.preview)
        pixels = self._pixels(preview(job.state.latents), queued)
        job.phase = DENOISE  # the next step writes new latents, after this read on the stream
        return lambda: self._book.partial(job, pixels())

    def decode(self, job: Job, queued: bool = False) -> Callable[[], None]:
        spec = job.request.spec
        decode = self._graphs.get(decode_key(spec.width, spec.height), self.stepper.decode)
        pixels = self._pixels(decode(job.state.latents), queued)
        return lambda: self._book.complete(job, pixels())

    def tile(self, job: Job) -> None:
        if job.tiles is None:
            job.tiles = self.stepper.tiled_decode(job.state.latents)
        job.tiles.step()

    def blend(self, job: Job, queued: bool = False) -> Callable[[], None]:
        pixels = self._pixels(job.tiles.image(), queued)
        return lambda: self._book.complete(job, pixels())

    def _pixels(self, image: torch.Tensor, queued: bool) -> Callable[[], object]:
        """The first image's uint8 HWC pixels, read once its host half runs: copied on the stream
        without a wait when queued (read only once the item's end event is done), else now."""
        pixels = self.stepper.uint8_pixels(image)
        host = host_copy(pixels) if queued else pixels.cpu()
        return lambda: host.numpy()[0]
