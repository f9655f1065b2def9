"""With no session live or starting, the slack may run one period past the boundary (engine.py):
a TTS- or image-only server does not lose the end of every tick; with a session live nothing
changes; a session that opens meanwhile stops the run at the next item."""

from __future__ import annotations

import asyncio
from typing import Callable

from parley.engine import Engine, SessionOptions
from parley.engine.clock import TickClock
from parley.engine.slack import CostModel, Priority, SlackSource, WorkItem
from delay_backend import DelayBackend, FakeTime

ITEM_S = 0.030  # 30 ms items: two fit an idle tick's 77 ms, a third does not


class Busy(SlackSource):
    """Always has a 30 ms item (on the fake clock), like a TTS pool with fast clients."""

    priority = Priority.TTS

    def __init__(self, fake: FakeTime, log: list, on_item: Callable[[int], None] | None = None) -> None:
        self.fake, self.log, self.on_item, self.items = fake, log, on_item, 0

    def slack_prepare(self, costs: CostModel) -> None:
        costs.record(("busy",), ITEM_S)

    def offer(self, left_s: float | None, costs: CostModel) -> WorkItem:
        return WorkItem(key=("busy",), run=self._run, fail=lambda exc: None)

    def _run(self) -> None:
        self.items += 1
        self.log.append(("item", round(self.fake.t, 4)))
        self.fake.t += ITEM_S
        if self.on_item is not None:
            self.on_item(self.items)


def engine_with(fake: FakeTime, source_factory, step_s: float = 0.0, log: list | None = None):
    def on_step(i, frames, mask):
        fake.t += step_s

    def on_prefill(row, frames):
        if log is not None:
            log.append(("prefill", round(fake.t, 4)))

    backend = DelayBackend(2, on_step=on_step, on_prefill=on_prefill)
    engine = Engine(backend, clock=TickClock(0.08, now=fake.now, sleep=fake.sleep))
    source = source_factory(engine)
    engine.add_slack_source(source)
    return engine, source


def test_an_idle_engine_runs_slack_work_back_to_back_and_counts_no_late_tick():
    fake = FakeTime()
    engine, busy = engine_with(fake, lambda e: Busy(fake, []))
    engine.serve_ticks(20)
    rate = busy.items / fake.t
    # Inside the ticks two 30 ms items fit each 80 ms (25/s); past the boundary they run on.
    assert rate > 31, f"{busy.items} items in {fake.t:.3f} s"
    counters = engine.counters()
    assert (counters["late_ticks"], counters["skipped_ticks"]) == (0, 0)
    assert counters["slack_past_boundary"] == 0
    engine.shutdown()


def test_with_a_live_session_slack_stays_inside_the_tick():
    fake = FakeTime()
    engine, busy = engine_with(fake, lambda e: Busy(fake, []), step_s=0.02)

    async def main():
        session = engine.open_nowait(SessionOptions())
        engine.serve_ticks(1)
        await session.ready
        before, start = busy.items, fake.t
        engine.serve_ticks(20)
        return busy.items - before, fake.t - start

    items, elapsed = asyncio.run(main())
    assert items == 20  # one 30 ms item per tick after a 20 ms frame (two need 60 of 57 ms)
    assert abs(elapsed - 20 * 0.08) < 0.08
    counters = engine.counters()
    assert (counters["late_ticks"], counters["slack_past_boundary"]) == (0, 0)
    engine.shutdown()


def test_a_session_opening_during_idle_slack_stops_it_at_the_next_item():
    fake = FakeTime()
    log: list = []
    opened: list = []

    def make(engine: Engine) -> Busy:
        def on_item(n: int) -> None:
            if n == 3:  # a client connects while the idle slack runs
                opened.append(engine.open_nowait(SessionOptions()))
                log.append(("open", round(fake.t, 4)))
        return Busy(fake, log, on_item)

    engine, _ = engine_with(fake, make, step_s=0.02, log=log)

    async def main():
        engine.serve_ticks(6)
        await asyncio.wait_for(opened[0].ready, 5)

    asyncio.run(main())
    at = log.index(next(e for e in log if e[0] == "open"))
    assert log[at + 1][0] == "prefill"  # no further idle item ran before its prompt
    assert log[at + 1][1] - log[at][1] <= 0.08  # within a tick of the open
    assert engine.counters()["late_ticks"] == 0
    engine.shutdown()
