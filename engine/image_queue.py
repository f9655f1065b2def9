"""Text-to-image requests as slack work: the lowest-priority source of engine/slack.py.

An image is a sequence of work items, each run on the engine thread in a tick's slack and
only when its estimated cost fits before the next boundary:

    encode  (prompt -> text conditioning, once per request; also starts the request's jobs)
    denoise (one step for a batch of jobs that share size and CFG; timesteps may differ)
    preview (a cheap reduced-resolution decode of a job's latents at evenly spaced steps)
    decode  (the final image; sizes larger than one VAE tile: one `tile` item per tile, then
             a `blend` item, so no item grows with the image)

Cost keys are ("image", kind, width, height[, cfg, batch]). `warm_up` measures every key of
a size before the engine starts (the model's default size unless told; and twice its side at
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
older job (oldest-first places, with 16 outstanding at 512 px and B = 64, measured 2.6 s p50 and
4.7 s max to a first partial on the H200). The age rule bounds the wait of a job past its first
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
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

import numpy as np
import torch

from parley.models.image_pipeline import Conditioning, ImageJob, ImageStepper, TiledDecode

from .config import DEFAULT_STALL_TIMEOUT_S
from .cuda_graph import CUDAGraphRunner, GraphError, sync_device
from .image_costs import BLEND, DECODE, DENOISE, ENCODE, PREVIEW, TILE, predict
from .slack import CostModel, Priority, SlackSource, WorkItem
from .stream import OutputStream, Status, Terminal

log = logging.getLogger("parley.engine.images")

DEFAULT_CAPACITY = 16
DEFAULT_MAX_BATCH = 4
# A job this old (s since its request was submitted) takes denoise places ahead of younger jobs
# past their first output: the bound on their wait (the module docstring's Order). Well above an
# image's time through a full queue (16 at 512 px, B = 64: about 4.6 s by Little's law from the
# replay of the H200's costs, benchmarks/image_queue_replay.py), so it acts only on a job being
# passed over, and well below the stall timeout (a job with no item for that long fails).
DEFAULT_AGE_LIMIT_S = 10.0
# A size whose item is predicted (never measured) to cost more than an empty tick's slack, by no
# more than this factor, is measured once before it is refused: predictions from two sizes are
# optimistic past them and from one size pessimistic (engine/image_costs.py), so near the slack
# neither settles it. The measurement runs as the first item of an idle tick (no session live:
# engine.py lets that slack run a period past the boundary, about twice an empty tick's slack).
PROBE_FACTOR = 2.0
# Sizes refused from measured costs (_refuse_size), kept most recent last: sizes are the client's to
# choose, so the table is bounded. A size forgotten is refused again at its first offer (its cost
# stays in the runner's cost model), failing one more request.
MAX_REFUSED_SIZES = 256
STALLED = "no slack for"  # how a stalled request's reason begins (the edge answers it 503)
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
        self.progress_at = 0.0  # queue clock: submitted, last item run, or last seen held by its client
        self.submitted_at = 0.0  # queue clock

    def cancel(self) -> None:
        """The client went away: the job is dropped at the next item boundary."""
        self.cancelled = True


@dataclass(eq=False)
class _Job:
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


class ImageQueue(SlackSource):
    """A slack source for one image pipeline (register with `engine.add_slack_source`)."""

    priority = Priority.IMAGES

    def __init__(self, stepper: ImageStepper, max_slack_s: float, *, capacity: int = DEFAULT_CAPACITY,
                 max_batch: int = DEFAULT_MAX_BATCH, stream_events: int = 2, cuda_graphs: bool = True,
                 graph_factory: Callable[..., Callable] = CUDAGraphRunner,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, age_limit_s: float = DEFAULT_AGE_LIMIT_S,
                 now: Callable[[], float] = time.perf_counter) -> None:
        if capacity < 1 or max_batch < 1 or stream_events < 1:
            raise ValueError("capacity, max_batch and stream_events must be at least 1.")
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be more than 0 (got {stall_timeout_s}).")
        if not 0 < age_limit_s < math.inf:
            raise ValueError(f"age_limit_s must be a number of seconds more than 0 (got {age_limit_s}).")
        self.stall_timeout_s = stall_timeout_s
        self.age_limit_s = age_limit_s
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
        self._refused_sizes: OrderedDict[tuple[int, int], str] = OrderedDict()  # at most MAX_REFUSED_SIZES
        self._jobs: list[_Job] = []  # engine thread only, oldest first
        self._tick_fresh = False  # engine thread: no item of ours has run in this tick's slack yet
        self._warm: dict[Hashable, float] = {}  # warm-up costs, recorded into the runner's model once
        self._warm_sizes: dict[tuple[int, int, bool], int] = {}  # (width, height, cfg) warmed -> batches measured
        self._step_s: float | None = None  # a batch-1 denoise step at the first warmed size (retry hints)
        self._measured: dict[Hashable, float] = {}  # every warm-up cost, kept: admission predicts from it
        self._tile_pixels = (stepper.vae_tile * stepper.pipe.vae_scale_factor) ** 2  # one VAE tile's output
        # Denoise steps as CUDA graphs, one per (width, height, cfg, batch) captured at warm-up,
        # each on its own capture stream; other buckets (and the CPU) run eagerly.
        self.cuda_graphs = cuda_graphs and stepper.device.type == "cuda"
        self._graph_factory = graph_factory
        self._now = now  # the warm-up's timer and the stall clock (tests pass a fake one)
        # key -> replay: denoise keys; the encode key (the text encoder, for stepper.encode(embed=));
        # the preview and whole-decode keys of warmed sizes (the VAE on their fixed latent shape)
        self._graphs: dict[tuple, Callable] = {}
        self._graph_runners: list = []  # to free their memory pools (close_graphs)
        self.counts = {"images_submitted": 0, "images_completed": 0, "images_cancelled": 0,
                       "images_failed": 0, "images_refused": 0, "images_stalled": 0,
                       "images_denoise_steps": 0}

    # ---- keys ----

    @staticmethod
    def denoise_key(width: int, height: int, cfg: bool, batch: int) -> tuple:
        return ("image", DENOISE, width, height, cfg, batch)

    @staticmethod
    def decode_key(width: int, height: int) -> tuple:
        return ("image", DECODE, width, height)

    @staticmethod
    def preview_key(width: int, height: int) -> tuple:
        return ("image", PREVIEW, width, height)

    @staticmethod
    def tile_key(width: int, height: int) -> tuple:
        return ("image", TILE, width, height)  # every tile of this size: the largest sets the estimate

    @staticmethod
    def blend_key(width: int, height: int) -> tuple:
        return ("image", BLEND, width, height)

    @staticmethod
    def encode_key() -> tuple:
        return ("image", ENCODE)

    # ---- start-up ----

    def warm_up(self, width: int | None = None, height: int | None = None, cfg: bool = True) -> dict:
        """Measure every item kind at one size (denoise at each batch size; the model's default
        size unless told), capturing the denoise graphs, before the engine starts; call once per
        size to serve. Also measures twice that side at batch 1, eagerly (no graphs kept for it),
        so that other sizes are predicted from two sizes (engine/image_costs.py: fixed + per-pixel
        cost). Returns the measured seconds per key."""
        st = self.stepper
        width, height = width or st.default_size, height or st.default_size
        measured = self._warm_size((width, height, cfg), self.max_batch, capture=self.cuda_graphs)
        if self._step_s is None:
            self._step_s = measured[self.denoise_key(width, height, cfg, 1)]
        fit = (2 * width, 2 * height, cfg)
        if self._warm_sizes.get(fit, 0) < 1:
            measured.update(self._warm_size(fit, 1, capture=False))
        return measured

    def _warm_size(self, size: tuple[int, int, bool], batches: int, capture: bool) -> dict:
        """Measure one size's items (denoise at batch 1 to `batches`) and keep them as warm-up costs."""
        measured = self._measure(*size, repeats=2, capture=capture, batches=batches)
        self._warm_sizes[size] = max(batches, self._warm_sizes.get(size, 0))
        self._warm.update(measured)
        with self._lock:
            self._measured = {**self._measured, **measured}
        return measured

    def slack_prepare(self, costs: CostModel) -> None:
        """On the engine thread, before its first tick: record the warm-up costs, then run every
        warmed key here twice and record the second round only (a thread's first cuBLAS/cuDNN
        calls are cold: recorded, they would keep every key from fitting for a long while)."""
        self._seed(costs)
        for (width, height, cfg), batches in self._warm_sizes.items():
            measured = self._measure(width, height, cfg, repeats=2, capture=False, batches=batches)
            for key, seconds in measured.items():
                costs.seed(key, seconds)
            with self._lock:
                self._measured = {**self._measured, **measured}

    def _seed(self, costs: CostModel) -> None:
        for key, seconds in self._warm.items():
            costs.seed(key, seconds)
        self._warm = {}

    def _measure(self, width: int, height: int, cfg: bool, repeats: int, capture: bool, batches: int) -> dict:
        """Run each item kind of one size `repeats` times (denoise at batch 1 to `batches`); the last
        round's seconds per key (the first call pays one-off allocation and dispatch costs; for
        tiles, the largest tile)."""
        st = self.stepper
        measured: dict[Hashable, float] = {}

        def timed(key, fn, keep_max: bool = False):
            start = self._now()
            out = fn()
            sync_device(st.device)
            spent = self._now() - start
            measured[key] = max(spent, measured[key]) if keep_max and key in measured else spent
            return out

        if capture and self.encode_key() not in self._graphs:
            self._capture_text()
        for _ in range(repeats):
            measured.clear()
            cond = timed(self.encode_key(), lambda: st.encode("warm up", None, cfg, embed=self.graphed_embed()))
            for b in range(1, batches + 1):
                key = self.denoise_key(width, height, cfg, b)
                jobs = [st.start(cond, width, height, 5, 5.0, i) for i in range(b)]
                if capture and key not in self._graphs:
                    self._capture(key, jobs)
                timed(key, lambda: st.denoise(jobs, predict=self._graphs.get(key)))
            latents = st.start(cond, width, height, 4, 5.0, 0).latents
            key = self.preview_key(width, height)
            if capture and key not in self._graphs:
                self._capture_vae(key, st.preview, latents)
            timed(key, lambda: st.to_uint8(self._vae(key, st.preview)(latents)))
            sizes = [(width, height)] if st.tiled(width, height) else [(width, height), self._tiled_probe()]
            for w, h in sizes:
                latents = st.start(cond, w, h, 4, 5.0, 0).latents
                if not st.tiled(w, h):
                    key = self.decode_key(w, h)
                    if capture and key not in self._graphs:
                        self._capture_vae(key, st.decode, latents)
                    timed(key, lambda: st.to_uint8(self._vae(key, st.decode)(latents)))
                    continue
                tiles = st.tiled_decode(latents)
                while not tiles.done:
                    timed(self.tile_key(w, h), tiles.step, keep_max=True)
                timed(self.blend_key(w, h), lambda: st.to_uint8(tiles.image()))
        return measured

    def _tiled_probe(self) -> tuple[int, int]:
        """The smallest square size whose final decode is tiled (2x2 tiles)."""
        st = self.stepper
        stride = st.latent_stride
        side = (st.vae_tile * st.pipe.vae_scale_factor) // stride * stride + stride
        return side, side

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

    def _capture_text(self) -> None:
        """The text encoder(s) on one prompt's tokens (their shapes never change)."""
        st = self.stepper
        tokens = [t.to(st.device) for t in st.text_tokens("warm up")]
        replay = self._graphed("prompt encodes", st.embed_text, tokens)
        if replay is not None:
            self._graphs[self.encode_key()] = replay

    def _capture_vae(self, key: tuple, fn: Callable[[torch.Tensor], torch.Tensor], latents: torch.Tensor) -> None:
        """A preview or whole decode of one size (its latents' shape is fixed by the size)."""
        replay = self._graphed(f"{key[1]} items of {key[2]}x{key[3]}", lambda x: (fn(x),), [latents])
        if replay is not None:
            self._graphs[key] = lambda x: replay(x)[0]

    def _graphed(self, what: str, fn: Callable[..., tuple], inputs: list[torch.Tensor]) -> Callable | None:
        """`fn` (returning a tuple of tensors) captured as a CUDA graph on its own capture stream,
        for inputs shaped as `inputs`; its replay returns copies of the outputs (the graph's
        buffers are overwritten by the next replay, and callers keep outputs: the negative-prompt
        cache, images). None, with a warning, when capture fails: `what` then run eagerly."""
        try:
            with torch.no_grad():  # as the eager items run (autograd would also keep activations in the pool)
                graph = self._graph_factory(fn, inputs,
                                            capture_stream=torch.cuda.Stream() if inputs[0].is_cuda else None)
        except GraphError as exc:
            log.warning("%s run eagerly (CUDA graph capture failed: %s)", what, exc)
            return None
        self._graph_runners.append(graph)
        return lambda *a: tuple(out.clone() for out in graph(*a))

    def _vae(self, key: tuple, eager: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The graphed preview/decode for `key`'s size, or the eager one."""
        return self._graphs.get(key, eager)

    def graphed(self, key: tuple) -> Callable | None:
        """The captured replay for an item key (denoise, encode, or a size's preview/decode), or None."""
        return self._graphs.get(key)

    def graphed_embed(self) -> Callable | None:
        """The captured text encoder (for `stepper.encode(..., embed=)`), or None."""
        return self._graphs.get(self.encode_key())

    def graphed_predict(self, width: int, height: int, cfg: bool, batch: int) -> Callable | None:
        """The captured denoiser for a bucket (for `stepper.denoise(..., predict=)`), or None."""
        return self._graphs.get(self.denoise_key(width, height, cfg, batch))

    def close_graphs(self) -> None:
        """Free the captured graphs' memory (steps and encodes run eagerly afterwards)."""
        self._graphs.clear()
        for runner in self._graph_runners:
            close = getattr(runner, "close", None)
            if close is not None:
                close()
        self._graph_runners.clear()

    # ---- the edge (event loop) ----

    def submit(self, spec: ImageSpec) -> ImageRequest:
        """Admit a request or raise ImageQueueFull / ImageRefused. Call on the consuming loop."""
        refused = self.refusal(spec.width, spec.height, self.stepper.cfg_for(spec.guidance))
        if spec.n > self.capacity:
            refused = f"n={spec.n} is more images than this server's image queue holds ({self.capacity})."
        if refused:
            with self._lock:
                self.counts["images_refused"] += 1
            raise ImageRefused(refused)
        request = ImageRequest(uuid.uuid4().hex, spec,
                               OutputStream(uuid.uuid4().hex, asyncio.get_running_loop(), self.stream_events))
        request.progress_at = request.submitted_at = self._now()
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
        self.slack_stop(Terminal(Status.CANCELLED, reason))

    def slack_stop(self, terminal: Terminal) -> None:
        """The engine stopped (shutdown or a fatal error): refuse new requests and end every
        admitted one with `terminal`."""
        with self._lock:
            self._closed = self._closed or terminal.reason or "the engine stopped"
            live, self._live = list(self._live), set()
        for request in live:
            request.events.finish(terminal)

    def refusal(self, width: int, height: int, cfg: bool = True) -> str | None:
        """Why images of this size (with classifier-free guidance or not) can never be served
        here, or None. From the warm-up's measurements for the items no size can split: a batch-1
        denoise step and the final decode (whole, or a tile and the blend; a preview costs less
        than either by construction), measured over an empty tick's slack, or predicted over
        `PROBE_FACTOR` times it (nearer, the size is admitted and measured once: `offer`)."""
        with self._lock:
            known = self._refused_sizes.get((width, height))
            measured = self._measured
        if known:
            return known
        if self.stepper.tiled(width, height):
            keys = [self.tile_key(width, height), self.blend_key(width, height)]
        else:
            keys = [self.decode_key(width, height)]
        for key in [self.denoise_key(width, height, cfg, 1)] + keys:
            cost = measured.get(key)
            limit = self.max_slack_s if cost is not None else PROBE_FACTOR * self.max_slack_s  # (PROBE_FACTOR)
            cost = predict(key, measured.items(), self._tile_pixels) if cost is None else cost
            if cost is not None and cost > limit:
                return self._too_large(width, height, key, cost)
        return None

    def _too_large(self, width: int, height: int, key: tuple, cost: float) -> str:
        return (f"size {width}x{height} is too large for this server: a {key[1]} item would take about "
                f"{cost * 1e3:.0f} ms, more than the {self.max_slack_s * 1e3:.0f} ms a tick can spare; "
                "ask for a smaller size.")

    def _retry_after(self, spec: ImageSpec) -> int:
        step = self._step_s
        if step is None:
            return 1
        # Each image in the queue needs its steps; assume images get about half of each tick.
        return max(1, math.ceil(self._outstanding * spec.steps * step / 0.5))

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    # ---- the slack source (engine thread) ----

    def slack_started(self, deadline: float | None) -> None:
        """Once a tick: fail the requests that have waited `stall_timeout_s` for an item."""
        self._tick_fresh = True
        self._intake()
        self._drop_ended()
        now = self._now()
        for request in {j.request: None for j in self._jobs}:  # oldest first, once each
            if request.events.room() == 0:  # held by its client, not by the engine
                request.progress_at = now
            elif now - request.progress_at >= self.stall_timeout_s:
                self._fail_stalled(request, now - request.progress_at)

    def _fail_stalled(self, request: ImageRequest, waited_s: float) -> None:
        spec = request.spec
        reason = (f"{STALLED} a {spec.width}x{spec.height} image for {self.stall_timeout_s:g} s under the current "
                  "voice and image load; retry later or ask for a smaller size")
        log.warning("image request %s failed after %.1f s with no item run (%dx%d, %d image(s)): no slack "
                    "for it under the current load", request.request_id, waited_s, spec.width, spec.height,
                    request.remaining)
        request.events.finish(Terminal(Status.FAILED, reason))
        self._end(request, "images_stalled")

    def offer(self, left_s: float | None, costs: CostModel) -> WorkItem | None:
        if self._warm:  # (no slack_prepare: an engine driven by hand, e.g. run_ticks in tests)
            self._seed(costs)
        self._intake()
        self._drop_ended()
        # Only an idle tick's slack reaches past an empty tick's (engine.py): a probe may run there.
        probe_now = self._tick_fresh and left_s is not None and left_s > self.max_slack_s
        fitting: WorkItem | None = None
        first: WorkItem | None = None
        for item in self._candidates(left_s, costs):
            estimate = costs.estimate(item.key, item.units)
            measured = estimate is not None
            if not measured:  # a size never measured: the runner starts it on its prediction
                estimate = item.predicted_s = self._predict(item.key, costs)
            if (left_s is not None and item.key[1] != ENCODE and estimate is not None
                    and estimate > self.max_slack_s):  # (manual mode, left_s None, runs anything)
                if measured or estimate > PROBE_FACTOR * self.max_slack_s:
                    self._refuse_size(item.key[2], item.key[3], item.key, estimate)
                    return self.offer(left_s, costs)  # that size's jobs are gone; look again
                if probe_now:  # measure it once: the runner runs an item with no estimate only first
                    item.predicted_s = None
                    return item
                continue  # wait for an idle tick
            if fitting is None and (left_s is None or estimate is None or estimate <= left_s):
                fitting = item  # fits (or nothing to predict from: the runner runs it only as a tick's first item)
                if not probe_now:  # (a probe would go ahead of it: look on)
                    break
            first = first or item
        return fitting or first  # nothing fits: the runner will decline it, and the next tick tries again

    def _predict(self, key: tuple, costs: CostModel) -> float | None:
        return predict(key, costs.estimates(), self._tile_pixels)

    def _cost(self, key: tuple, costs: CostModel) -> float | None:
        """The key's estimate, or its prediction while it has none."""
        estimate = costs.estimate(key)
        return self._predict(key, costs) if estimate is None else estimate

    def _candidates(self, left_s: float | None, costs: CostModel):
        """Every job's next item, in the order they should run (the module docstring's Order)."""
        for job in self._jobs:
            if job.phase == ENCODE:
                spec = job.request.spec
                units = self.stepper.encode_units(spec.negative, self.stepper.cfg_for(spec.guidance))
                yield self._item(self.encode_key(), [job], lambda job=job: self._encode(job), units)
        for job in self._jobs:
            if job.phase in (PREVIEW, DECODE) and job.request.events.room() > 0:  # else back-pressure
                yield self._output_item(job)
        ordered = self._denoise_order()
        buckets = set()
        for job in ordered:
            if job.bucket not in buckets:
                buckets.add(job.bucket)
                yield self._denoise_item([j for j in ordered if j.bucket == job.bucket], left_s, costs)

    def _denoise_order(self) -> list[_Job]:
        """The denoising jobs in the order they take batch places: those with no output yet or
        older than `age_limit_s` first, then the others; oldest first within each."""
        now = self._now()

        def rank(job: _Job) -> tuple[int, int]:
            first = not job.has_output or now - job.request.submitted_at >= self.age_limit_s
            return (0 if first else 1, job.order)
        return sorted((j for j in self._jobs if j.phase == DENOISE), key=rank)

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
            job.state = job.tiles = None
        request.cond = None
        with self._lock:
            self._live.discard(request)
            self._outstanding -= len(alive)
            if counter:
                self.counts[counter] += len(alive)

    def _output_item(self, job: _Job) -> WorkItem:
        spec = job.request.spec
        if job.phase == PREVIEW:
            return self._item(self.preview_key(spec.width, spec.height), [job], lambda: self._preview(job))
        if not self.stepper.tiled(spec.width, spec.height):
            return self._item(self.decode_key(spec.width, spec.height), [job], lambda: self._decode(job))
        if job.tiles is None or not job.tiles.done:
            return self._item(self.tile_key(spec.width, spec.height), [job], lambda: self._tile(job))
        return self._item(self.blend_key(spec.width, spec.height), [job], lambda: self._blend(job))

    def _denoise_item(self, peers: list[_Job], left_s: float | None, costs: CostModel) -> WorkItem:
        """One step for the first of a bucket's jobs (in `_denoise_order`), as many as fit."""
        job = peers[0]
        chosen = peers[:self._batch_size(job, len(peers[:self.max_batch]), left_s, costs)]
        return self._item(self.denoise_key(*job.bucket, len(chosen)), chosen, lambda: self._denoise(chosen))

    def _batch_size(self, job: _Job, available: int, left_s: float | None, costs: CostModel) -> int:
        """The largest batch whose estimate (or, unmeasured, prediction) fits, and would fit an
        empty tick (an idle tick's longer slack must not make a size look too large)."""
        if left_s is None:
            return available
        best = 1
        for b in range(1, available + 1):
            estimate = self._cost(self.denoise_key(*job.bucket, b), costs)
            if estimate is not None and estimate <= min(left_s, self.max_slack_s):
                best = b
        return best

    def _item(self, key: tuple, jobs: list[_Job], run: Callable[[], None], units: int = 1) -> WorkItem:
        """A work item for `jobs`: once it has run, their requests' stall clocks start again."""
        def run_and_note() -> None:
            self._tick_fresh = False
            run()
            now = self._now()
            for job in jobs:
                job.request.progress_at = now
        return WorkItem(key, run_and_note, self._failer(jobs), units=units)

    def _failer(self, jobs: list[_Job]):
        def fail(exc: Exception) -> None:
            ref = uuid.uuid4().hex[:8]
            log.error("image item failed (error %s); ending its request(s)", ref, exc_info=exc)
            for request in {j.request for j in jobs}:
                request.events.finish(Terminal(Status.FAILED, f"image generation failed (error {ref}, "
                                                              "see the server log)"))
                self._end(request, "images_failed")
        return fail

    def _refuse_size(self, width: int, height: int, key: tuple, estimate: float) -> None:
        """An item of this size can never fit: fail its requests and refuse the size from now on."""
        reason = self._too_large(width, height, key, estimate)
        log.warning("refusing images of %dx%d from now on: %s", width, height, reason)
        with self._lock:
            self._refused_sizes[(width, height)] = reason
            self._refused_sizes.move_to_end((width, height))
            while len(self._refused_sizes) > MAX_REFUSED_SIZES:
                self._refused_sizes.popitem(last=False)
        for request in {j.request for j in self._jobs if (j.request.spec.width, j.request.spec.height) == (width, height)}:
            request.events.finish(Terminal(Status.FAILED, reason))
            self._end(request, "images_failed")

    # ---- the items ----

    def _encode(self, job: _Job) -> None:
        request, spec, st = job.request, job.request.spec, self.stepper
        if request.cond is None:
            request.cond = st.encode(spec.prompt, spec.negative, st.cfg_for(spec.guidance), embed=self.graphed_embed())
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

    def _preview(self, job: _Job) -> None:
        spec = job.request.spec
        preview = self._vae(self.preview_key(spec.width, spec.height), self.stepper.preview)
        pixels = self.stepper.to_uint8(preview(job.state.latents))[0]
        job.request.events.push(ImagePartial(job.index, job.partials_sent, pixels))
        job.partials_sent += 1
        job.phase = DENOISE

    def _decode(self, job: _Job) -> None:
        spec = job.request.spec
        decode = self._vae(self.decode_key(spec.width, spec.height), self.stepper.decode)
        self._finish(job, self.stepper.to_uint8(decode(job.state.latents))[0])

    def _tile(self, job: _Job) -> None:
        if job.tiles is None:
            job.tiles = self.stepper.tiled_decode(job.state.latents)
        job.tiles.step()

    def _blend(self, job: _Job) -> None:
        self._finish(job, self.stepper.to_uint8(job.tiles.image())[0])

    def _finish(self, job: _Job, pixels: np.ndarray) -> None:
        request = job.request
        request.events.push(ImageResult(job.index, pixels, job.seed))
        job.state = job.tiles = None
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
