"""Which image sizes an empty tick's slack can serve (engine/image_queue.py's Limits).

A size is refused when an item no size can split (a batch-1 denoise step; the final decode:
whole, or a tile and the blend; a preview costs less than either by construction) cannot fit an
empty tick's slack (`max_slack_s`): at admission once that is known (`refusal`), from the
measured costs of the warm-up (`learn`) or, for a size never measured, from their prediction
(engine/image_costs.py). A prediction over that slack by at most `PROBE_FACTOR` is trusted
neither way: the queue admits the size and measures its item once, as the first item of an idle
tick (`ImageSchedule.pick`). A size whose item proves too large is refused from then on
(`refuse`): the table keeps the `MAX_REFUSED_SIZES` most recent, since sizes are the client's to
choose.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Hashable

from .image_costs import blend_key, decode_key, denoise_key, predict, tile_key
from .slack import CostModel

if TYPE_CHECKING:  # diffusers loads only with an image model (models/image_pipeline.py)
    from parley.models.image_pipeline import ImageStepper

log = logging.getLogger("parley.engine.images")

# A size whose item is predicted (never measured) to cost more than an empty tick's slack, by no
# more than this factor, is measured once before it is refused: predictions from two sizes are
# optimistic past them and from one size pessimistic (engine/image_costs.py), so near the slack
# neither settles it. The measurement runs as the first item of an idle tick (no session live:
# engine.py lets that slack run a period past the boundary, about twice an empty tick's slack).
PROBE_FACTOR = 2.0
# Sizes refused from measured costs (`refuse`), kept most recent last: sizes are the client's to
# choose, so the table is bounded. A size forgotten is refused again at its first offer (its cost
# stays in the runner's cost model), failing one more request.
MAX_REFUSED_SIZES = 256


class SizeLimits:
    """The sizes refused so far and the warm-up's measurements that admission predicts from.
    Read on the event loop (`refusal`), written by the warm-up and the engine thread."""

    def __init__(self, stepper: ImageStepper, max_slack_s: float) -> None:
        self.stepper = stepper
        self.max_slack_s = max_slack_s  # an empty tick's slack: an item costing more never fits
        self._lock = threading.Lock()  # guards refused and _measured
        self.refused: OrderedDict[tuple[int, int], str] = OrderedDict()  # at most MAX_REFUSED_SIZES
        self._measured: dict[Hashable, float] = {}  # every warm-up cost, kept: admission predicts from it
        self._tile_pixels = (stepper.vae_tile * stepper.pipe.vae_scale_factor) ** 2  # one VAE tile's output

    def learn(self, measured: dict) -> None:
        """Keep warm-up measurements (they replace earlier ones of the same keys)."""
        with self._lock:
            self._measured = {**self._measured, **measured}

    def refusal(self, width: int, height: int, cfg: bool = True) -> str | None:
        """Why images of this size (with classifier-free guidance or not) can never be served
        here, or None: an item no size can split measured over an empty tick's slack, or
        predicted over `PROBE_FACTOR` times it (nearer, the size is admitted and measured once)."""
        with self._lock:
            known = self.refused.get((width, height))
            measured = self._measured
        if known:
            return known
        if self.stepper.tiled(width, height):
            keys = [tile_key(width, height), blend_key(width, height)]
        else:
            keys = [decode_key(width, height)]
        for key in [denoise_key(width, height, cfg, 1)] + keys:
            cost = measured.get(key)
            limit = self.max_slack_s if cost is not None else PROBE_FACTOR * self.max_slack_s  # (PROBE_FACTOR)
            cost = predict(key, measured.items(), self._tile_pixels) if cost is None else cost
            if cost is not None and cost > limit:
                return self.too_large(width, height, key, cost)
        return None

    def too_large(self, width: int, height: int, key: tuple, cost: float) -> str:
        return (f"size {width}x{height} is too large for this server: a {key[1]} item would take about "
                f"{cost * 1e3:.0f} ms, more than the {self.max_slack_s * 1e3:.0f} ms a tick can spare; "
                "ask for a smaller size.")

    def refuse(self, width: int, height: int, key: tuple, estimate: float) -> str:
        """An item of this size can never fit: refuse the size from now on; returns the reason."""
        reason = self.too_large(width, height, key, estimate)
        log.warning("refusing images of %dx%d from now on: %s", width, height, reason)
        with self._lock:
            self.refused[(width, height)] = reason
            self.refused.move_to_end((width, height))
            while len(self.refused) > MAX_REFUSED_SIZES:
                self.refused.popitem(last=False)
        return reason

    def predict(self, key: tuple, costs: CostModel) -> float | None:
        """The key's cost predicted from the runner's measured keys (engine/image_costs.py)."""
        return predict(key, costs.estimates(), self._tile_pixels)

    def cost(self, key: tuple, costs: CostModel) -> float | None:
        """The key's estimate, or its prediction while it has none."""
        estimate = costs.estimate(key)
        return self.predict(key, costs) if estimate is None else estimate
