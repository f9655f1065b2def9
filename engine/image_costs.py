"""Conservative costs for image items of a size never measured (engine/image_queue.py).

Cost keys are ("image", kind, width, height[, cfg, batch]). A key with no observation yet is
bounded from the measured keys of its family, assuming an item's cost never falls as its rows
or its pixels grow, and grows at most linearly in each from any measured point (kernels have a
fixed overhead and fill the GPU better with more work: on an H200, SD-1.5 denoise at 512 px
costs 13.5 ms at batch 1 and 29.9 ms at batch 4, and 40.0 ms at 1024 px, four times the pixels):

    predicted(key) = min over measured keys k of
                     cost(k) * max(1, rows(key) / rows(k)) * max(1, pixels(key) / pixels(k))

The two factors never trade: fewer rows do not pay for more pixels (attention grows faster
with the pixels of one image than with the images of a batch: 512 px batch 4 costs 29.9 ms,
1024 px batch 1 40.0 ms). A denoise step's rows are its batch, times 2 with CFG (a conditioned
and an unconditioned row per image); other kinds have one. A tile's pixels are one VAE tile's
whatever the image's size (the final decode of an image no larger than one tile is bounded by
a tile, and the other way round). Encode has no size: it is always measured.
"""

from __future__ import annotations

from typing import Hashable, Iterable

ENCODE, DENOISE, PREVIEW, DECODE = "encode", "denoise", "preview", "decode"
TILE, BLEND = "tile", "blend"  # a tiled final decode: one item per tile, then the blend

FAMILY = {DENOISE: (DENOISE,), PREVIEW: (PREVIEW,), DECODE: (DECODE, TILE), TILE: (DECODE, TILE),
          BLEND: (BLEND,)}  # kind -> the measured kinds that bound it


def work(key: tuple, tile_pixels: int) -> tuple[int, int]:
    """(rows, pixels) of one item."""
    kind, width, height = key[1:4]
    if kind == TILE:
        return 1, tile_pixels
    if kind == DENOISE:
        cfg, batch = key[4:6]
        return batch * (2 if cfg else 1), width * height
    return 1, width * height


def bound(seconds: float, measured: tuple[int, int], wanted: tuple[int, int]) -> float:
    return seconds * max(1.0, wanted[0] / measured[0]) * max(1.0, wanted[1] / measured[1])


def predict(key: tuple, measured: Iterable[tuple[Hashable, float]], tile_pixels: int) -> float | None:
    """A conservative cost of `key` from (key, seconds) measurements; None with nothing to go on."""
    family = FAMILY.get(key[1])
    if family is None:
        return None
    need = work(key, tile_pixels)
    return min((bound(seconds, work(k, tile_pixels), need) for k, seconds in measured
                if isinstance(k, tuple) and len(k) >= 4 and k[0] == "image" and k[1] in family), default=None)
