"""Measuring the image items before the engine starts (engine/image_queue.py's cost keys).

`warm_up` runs every item kind of one size (denoise at each batch size; the model's default size
unless told) and twice its side at batch 1, eagerly, so other sizes are predicted from two
(engine/image_costs.py: fixed + per-pixel); for a size decoded whole, also the tiles and blend of
the smallest tiled size, so larger sizes have a measured tile and blend to scale from. On CUDA it
captures the warmed size's graphs as it goes (engine/image_graphs.py). Its costs seed the runner's
cost model once (`seed`); `prepare` measures every warmed key once more on the engine thread
before its first tick, since a thread's first library calls (cuBLAS and cuDNN handles,
workspaces) cost far more than later ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Hashable

from .cuda_graph import sync_device
from .image_costs import blend_key, decode_key, denoise_key, encode_key, preview_key, tile_key
from .image_graphs import ImageGraphs
from .image_sizes import SizeLimits
from .slack import CostModel

if TYPE_CHECKING:  # diffusers loads only with an image model (models/image_pipeline.py)
    from parley.models.image_pipeline import ImageStepper


class ImageWarmUp:
    """The warmed sizes, their measured costs (kept in `SizeLimits` for admission) and the
    costs still to seed into the runner's cost model."""

    def __init__(self, stepper: ImageStepper, graphs: ImageGraphs, sizes: SizeLimits,
                 now: Callable[[], float]) -> None:
        self.stepper = stepper
        self._graphs = graphs
        self._sizes = sizes
        self._now = now  # the timer (tests pass a fake one)
        self._warm: dict[Hashable, float] = {}  # warm-up costs, recorded into the runner's model once
        self._warm_sizes: dict[tuple[int, int, bool], int] = {}  # (width, height, cfg) warmed -> batches measured
        self.step_s: float | None = None  # a batch-1 denoise step at the first warmed size (retry hints)

    @property
    def unseeded(self) -> bool:
        """Warm-up costs not yet recorded into the runner's cost model."""
        return bool(self._warm)

    def warm_up(self, width: int | None, height: int | None, cfg: bool, batches: int) -> dict:
        """Measure one size (denoise at batch 1 to `batches`), capturing its graphs when they are
        on, and twice its side at batch 1, eagerly; the measured seconds per key."""
        st = self.stepper
        width, height = width or st.default_size, height or st.default_size
        measured = self._warm_size((width, height, cfg), batches, capture=self._graphs.enabled)
        if self.step_s is None:
            self.step_s = measured[denoise_key(width, height, cfg, 1)]
        fit = (2 * width, 2 * height, cfg)
        if self._warm_sizes.get(fit, 0) < 1:
            measured.update(self._warm_size(fit, 1, capture=False))
        return measured

    def _warm_size(self, size: tuple[int, int, bool], batches: int, capture: bool) -> dict:
        """Measure one size's items (denoise at batch 1 to `batches`) and keep them as warm-up costs."""
        measured = self._measure(*size, repeats=2, capture=capture, batches=batches)
        self._warm_sizes[size] = max(batches, self._warm_sizes.get(size, 0))
        self._warm.update(measured)
        self._sizes.learn(measured)
        return measured

    def prepare(self, costs: CostModel) -> None:
        """On the engine thread, before its first tick: record the warm-up costs, then run every
        warmed key here twice and record the second round only (a thread's first cuBLAS/cuDNN
        calls are cold: recorded, they would keep every key from fitting for a long while)."""
        self.seed(costs)
        for (width, height, cfg), batches in self._warm_sizes.items():
            measured = self._measure(width, height, cfg, repeats=2, capture=False, batches=batches)
            for key, seconds in measured.items():
                costs.seed(key, seconds)
            self._sizes.learn(measured)

    def seed(self, costs: CostModel) -> None:
        """Record the warm-up costs into the runner's cost model (once)."""
        for key, seconds in self._warm.items():
            costs.seed(key, seconds)
        self._warm = {}

    def _measure(self, width: int, height: int, cfg: bool, repeats: int, capture: bool, batches: int) -> dict:
        """Run each item kind of one size `repeats` times (denoise at batch 1 to `batches`); the last
        round's seconds per key (the first call pays one-off allocation and dispatch costs; for
        tiles, the largest tile)."""
        st, graphs = self.stepper, self._graphs
        measured: dict[Hashable, float] = {}

        def timed(key, fn, keep_max: bool = False):
            start = self._now()
            out = fn()
            sync_device(st.device)
            spent = self._now() - start
            measured[key] = max(spent, measured[key]) if keep_max and key in measured else spent
            return out

        if capture and encode_key() not in graphs:
            graphs.capture_text(st)
        for _ in range(repeats):
            measured.clear()
            cond = timed(encode_key(), lambda: st.encode("warm up", None, cfg, embed=graphs.embed()))
            for b in range(1, batches + 1):
                key = denoise_key(width, height, cfg, b)
                jobs = [st.start(cond, width, height, 5, 5.0, i) for i in range(b)]
                if capture and key not in graphs:
                    graphs.capture_denoise(st, key, jobs)
                timed(key, lambda: st.denoise(jobs, predict=graphs.get(key)))
            latents = st.start(cond, width, height, 4, 5.0, 0).latents
            key = preview_key(width, height)
            if capture and key not in graphs:
                graphs.capture_vae(key, st.preview, latents)
            timed(key, lambda: st.to_uint8(graphs.get(key, st.preview)(latents)))
            sizes = [(width, height)] if st.tiled(width, height) else [(width, height), self._tiled_probe()]
            for w, h in sizes:
                latents = st.start(cond, w, h, 4, 5.0, 0).latents
                if not st.tiled(w, h):
                    key = decode_key(w, h)
                    if capture and key not in graphs:
                        graphs.capture_vae(key, st.decode, latents)
                    timed(key, lambda: st.to_uint8(graphs.get(key, st.decode)(latents)))
                    continue
                tiles = st.tiled_decode(latents)
                while not tiles.done:
                    timed(tile_key(w, h), tiles.step, keep_max=True)
                timed(blend_key(w, h), lambda: st.to_uint8(tiles.image()))
        return measured

    def _tiled_probe(self) -> tuple[int, int]:
        """The smallest square size whose final decode is tiled (2x2 tiles)."""
        st = self.stepper
        stride = st.latent_stride
        side = (st.vae_tile * st.pipe.vae_scale_factor) // stride * stride + stride
        return side, side
