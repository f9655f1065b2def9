"""Conservative costs for image items of a size never measured (engine/image_queue.py).

Cost keys are ("image", kind, width, height[, cfg, batch]). A key with no observation yet is
bounded from the measured keys of its family, assuming an item's cost never falls with more
work and grows at most linearly from any measured point (kernels have a fixed overhead and
fill the GPU better with more work: on an H200, SD-1.5 denoise at 512 px costs 13.5 ms at batch
1 and 29.9 ms at batch 4, and 40.0 ms at 1024 px, four times the pixels):

    predicted(key) = min over measured keys k of  cost(k) * max(1, work(key) / work(k))

A denoise step's work is pixels x batch x 2 with CFG (two rows per image); a preview's,
decode's and blend's the image's pixels; a tile's one VAE tile's pixels whatever the image's
size (the final decode of an image no larger than one tile is bounded by a tile, and the other
way round). Encode has no size: it is always measured.
"""

from __future__ import annotations

from typing import Hashable, Iterable

ENCODE, DENOISE, PREVIEW, DECODE = "encode", "denoise", "preview", "decode"
TILE, BLEND = "tile", "blend"  # a tiled final decode: one item per tile, then the blend

FAMILY = {DENOISE: (DENOISE,), PREVIEW: (PREVIEW,), DECODE: (DECODE, TILE), TILE: (DECODE, TILE),
          BLEND: (BLEND,)}  # kind -> the measured kinds that bound it


def work(key: tuple, tile_pixels: int) -> int:
    kind, width, height = key[1:4]
    if kind == TILE:
        return tile_pixels
    if kind == DENOISE:
        cfg, batch = key[4:6]
        return width * height * batch * (2 if cfg else 1)
    return width * height


def predict(key: tuple, measured: Iterable[tuple[Hashable, float]], tile_pixels: int) -> float | None:
    """A conservative cost of `key` from (key, seconds) measurements; None with nothing to go on."""
    family = FAMILY.get(key[1])
    if family is None:
        return None
    need = work(key, tile_pixels)
    return min((seconds * max(1.0, need / work(k, tile_pixels)) for k, seconds in measured
                if isinstance(k, tuple) and len(k) >= 4 and k[0] == "image" and k[1] in family), default=None)
