"""Fair shares of the slack among the sources of one class of work (engine/slack.py rule 1).

The runner keeps one ledger per class (realtime, throughput) and tries a class's items least
served first, by the seconds that class's items of each source have taken. Seconds, not items:
a source of 40 ms items beside one of 5 ms items gets the same time, not the same count. So no
throughput source starves another (a TTS stream generating ahead of its listener, file
transcriptions, image steps each get an equal share of what realtime work leaves), and realtime
sources that do not all fit one tick's slack take turns. The least served source whose item fits
runs; when its item does not fit what is left, another source's smaller one may (the slack is not
wasted), and the next tick starts with the least served again, so a large item gets the whole
slack left then.

A source with no item of the class on offer is lifted to the least served of those that have one:
time a source did not use is not owed to it (a source back from idle would otherwise take every
tick until its count caught up with the others'). Shares are equal; ties go to the source asked
first (slack.py's `Priority`). With items queued on the device (engine/slack_queue.py), a source is
charged an item's estimate at launch and the difference to its device cost at completion, and a
source not asked because an item of its own is in flight is not lifted.
"""

from __future__ import annotations

from typing import Collection, Hashable, Sequence, TypeVar

T = TypeVar("T")


class FairShares:
    """Seconds of one class of work served per source (the source object, or any other hashable)."""

    def __init__(self) -> None:
        self._served: dict[Hashable, float] = {}

    def order(self, offers: Sequence[tuple[Hashable, T]], busy: Collection[Hashable] = ()) -> list[tuple[Hashable, T]]:
        """`offers` ((source, item), in the order asked), least served first. Sources not among
        them are lifted to the least served of them, except those in `busy` (not asked: an item of
        theirs is still on the device, engine/slack_queue.py); a source never seen starts there too."""
        if not offers:
            return []
        served = self._served
        known = [served[s] for s, _ in offers if s in served]
        start = min(known) if known else min(served.values(), default=0.0)
        for source, _ in offers:
            served.setdefault(source, start)
        floor = min(served[s] for s, _ in offers)
        offering = {s for s, _ in offers}
        for source in served:
            if source not in offering and source not in busy and served[source] < floor:
                served[source] = floor
        return sorted(offers, key=lambda offer: served[offer[0]])  # stable: ties keep the order asked

    def charge(self, source: Hashable, seconds: float) -> None:
        """An item of `source` in this class ran for `seconds` (measured)."""
        self._served[source] = self._served.get(source, 0.0) + seconds
