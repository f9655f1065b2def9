"""Predicted costs for image items of a size never measured (engine/image_queue.py).

Cost keys are ("image", kind, width, height[, cfg, batch]). A key with no observation yet is
predicted from the measured keys of its family. Per row count (a denoise step's rows are its
batch, times 2 with CFG: a conditioned and an unconditioned row per image; other kinds have
one), the measured (pixels, seconds) points make a cost curve in pixels:

- one measured size: linear from it (cost(k) * pixels / pixels(k)), every cost taken as
  per-pixel work. A small size's cost is mostly fixed overhead (launches and host work), so
  this overstates larger sizes many times over, and the queue warms a second size for that
  reason;
- two or more sizes (the warm-up measures the default size and twice its side): fixed +
  per-pixel, the line through the measured points, extended past the largest with the slope
  of the last two (never below 0). Attention grows with the square of the tokens, so past the
  largest measured size the line is optimistic, more so the farther out. Two sizes whose costs are both mostly overhead give a slope near 0,
  so past `REACH` times the largest measured pixels (the 2x-side warm size's 2x side) the line
  is scaled by pixels / (REACH x largest), quadratic growth from there (128 px: 4x the line).
  And the queue never trusts a prediction past an empty tick's slack: such a size is measured
  once in an idle tick before it is served or refused (image_queue.py);
- at or below the smallest measured size: the smallest's cost (cost never falls as pixels grow).

Across rows the growth is at most linear from any measured row count, and rows never trade for
pixels (attention grows faster with the pixels of one image than with the images of a batch,
so one image of 4x the pixels costs more than a batch of 4):

    predicted(key) = min over measured row counts r of curve_r(pixels(key)) * max(1, rows(key) / r)

A tile's pixels are one VAE tile's whatever the image's size (the final decode of an image no
larger than one tile is bounded by a tile, and the other way round). Encode has no size: it is
always measured.
"""

from __future__ import annotations

from typing import Hashable, Iterable

ENCODE, DENOISE, PREVIEW, DECODE = "encode", "denoise", "preview", "decode"
TILE, BLEND = "tile", "blend"  # a tiled final decode: one item per tile, then the blend

# How far past the largest measured size (times its pixels) the fitted line is taken as it is;
# farther out it grows with the square of the pixels, as attention does (module docstring).
REACH = 4

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


def along(points: dict[int, float], pixels: int) -> float:
    """The cost at `pixels` on one row count's curve of measured {pixels: seconds} (module docstring)."""
    xs = sorted(points)
    ys = [points[xs[0]]]
    for x in xs[1:]:
        ys.append(max(ys[-1], points[x]))  # never falling: a lower cost at more pixels is noise
    if pixels <= xs[0]:
        return ys[0]
    if len(xs) == 1:
        return ys[0] * pixels / xs[0]
    i = next((i for i in range(1, len(xs)) if pixels <= xs[i]), len(xs) - 1)  # the segment (or the last)
    slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
    return (ys[i - 1] + slope * (pixels - xs[i - 1])) * max(1.0, pixels / (REACH * xs[-1]))


def predict(key: tuple, measured: Iterable[tuple[Hashable, float]], tile_pixels: int) -> float | None:
    """The predicted cost of `key` from (key, seconds) measurements; None with nothing to go on."""
    family = FAMILY.get(key[1])
    if family is None:
        return None
    rows, pixels = work(key, tile_pixels)
    curves: dict[int, dict[int, float]] = {}  # rows -> pixels -> seconds (the largest at equal pixels)
    for k, seconds in measured:
        if isinstance(k, tuple) and len(k) >= 4 and k[0] == "image" and k[1] in family:
            r, p = work(k, tile_pixels)
            curve = curves.setdefault(r, {})
            curve[p] = max(seconds, curve.get(p, 0.0))
    return min((along(curve, pixels) * max(1.0, rows / r) for r, curve in curves.items()), default=None)


# ---- the keys (the module docstring's layout; the queue's items, warm-up and cost model use them) ----

def denoise_key(width: int, height: int, cfg: bool, batch: int) -> tuple:
    return ("image", DENOISE, width, height, cfg, batch)


def decode_key(width: int, height: int) -> tuple:
    return ("image", DECODE, width, height)


def preview_key(width: int, height: int) -> tuple:
    return ("image", PREVIEW, width, height)


def tile_key(width: int, height: int) -> tuple:
    return ("image", TILE, width, height)  # every tile of this size: the largest sets the estimate


def blend_key(width: int, height: int) -> tuple:
    return ("image", BLEND, width, height)


def encode_key() -> tuple:
    return ("image", ENCODE)
