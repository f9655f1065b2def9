"""An image stepper whose calls cost scripted time on a fake clock, for replaying the image
queue's scheduling exactly on the CPU: fake-clock tests (tests/test_image_queue.py) and
`benchmarks/image_queue_replay.py`, which replays GPU-measured item costs.

The wrapped stepper (a tiny real one) does the arithmetic, so jobs, previews, tiles and
results are real; only time is scripted. Each call appends (start time, kind, cost) to `log`.
Costs hold at every size unless `scale_from` names the side (px) they hold at: then a denoise
step's, preview's, decode's and blend's cost scales with the image's pixels to `exponent` (a
tile's is one tile's whatever the image; 1: linear, below 1: larger images fill the device
better, as on a GPU).
"""

from __future__ import annotations

from typing import Protocol


class FakeTime(Protocol):
    t: float


DEFAULT_COSTS = {"encode": 0.004, "denoise": 0.010, "denoise_row": 0.004, "decode": 0.030, "preview": 0.006,
                 "tile": 0.012, "blend": 0.003}  # seconds; a denoise step costs denoise + denoise_row per extra job


class ClockedStepper:
    def __init__(self, inner, clock: FakeTime, costs: dict[str, float] | None = None,
                 scale_from: int | None = None, exponent: float = 1.0) -> None:
        self.inner, self.clock, self.log = inner, clock, []
        self.costs = {**DEFAULT_COSTS, **(costs or {})}
        self.scale_from, self.exponent = scale_from, exponent

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def denoise_cost(self, batch: int) -> float:
        return self.costs["denoise"] + self.costs["denoise_row"] * (batch - 1)

    def _scaled(self, cost: float, pixels: int) -> float:
        return cost if self.scale_from is None else cost * (pixels / self.scale_from ** 2) ** self.exponent

    def _pixels(self, latents) -> int:
        return latents.shape[-2] * latents.shape[-1] * self.inner.pipe.vae_scale_factor ** 2

    def _spend(self, kind: str, cost: float) -> None:
        self.log.append((self.clock.t, kind, cost))
        self.clock.t += cost

    def encode(self, prompt, negative, cfg, embed=None):
        self._spend("encode", self.costs["encode"])
        return self.inner.encode(prompt, negative, cfg, embed)

    def denoise(self, jobs, predict=None):
        self._spend("denoise", self._scaled(self.denoise_cost(len(jobs)), jobs[0].width * jobs[0].height))
        return self.inner.denoise(jobs, predict)

    def decode(self, latents):
        self._spend("decode", self._scaled(self.costs["decode"], self._pixels(latents)))
        return self.inner.decode(latents)

    def preview(self, latents):
        self._spend("preview", self._scaled(self.costs["preview"], self._pixels(latents)))
        return self.inner.preview(latents)

    def tiled_decode(self, latents):
        tiles = self.inner.tiled_decode(latents)
        step, image = tiles.step, tiles.image

        def clocked_step():
            self._spend("tile", self.costs["tile"])
            step()

        def clocked_image():
            self._spend("blend", self._scaled(self.costs["blend"], self._pixels(latents)))
            return image()

        tiles.step, tiles.image = clocked_step, clocked_image
        return tiles

    def seed(self, costs_model, queue, width: int, height: int) -> None:
        """Seed every key of this size at its scripted cost, as a warm-up does (a whole decode, or
        for a tiled size its tiles and blend)."""
        costs_model.seed(queue.encode_key(), self.costs["encode"])
        for b in range(1, queue.max_batch + 1):
            costs_model.seed(queue.denoise_key(width, height, True, b), self.denoise_cost(b))
        decode = ((queue.tile_key, "tile"), (queue.blend_key, "blend")) if self.inner.tiled(width, height) \
            else ((queue.decode_key, "decode"),)
        for key, kind in ((queue.preview_key, "preview"),) + decode:
            costs_model.seed(key(width, height), self.costs[kind])
