"""Slack work: everything the engine runs besides the duplex frame.

The duplex frame is the only hard deadline. Prefill chunks, TTS steps, standalone
transcription and diffusion steps are *work items* that run on the engine thread after
the tick's outputs are out, and only when their estimated cost ends before the next
boundary (minus a guard). The rules, one per concern:

1. Two classes of work, decided by the source for each item it offers (`WorkItem.realtime`),
   applied here. Realtime work is what someone waits on now, bounded by what real time asks
   of its source: admission progress (prefill), steps of live transcription sessions (the audio
   that has arrived), TTS admissions and rows that have not yet reached their first audio or
   a real-time lead over their listener (engine/tts_pool.py). Throughput work is the rest: TTS
   generating ahead for a client that downloads faster than real time, file transcriptions,
   image steps. Each pick asks every source once, in `Priority` order (prefill, standalone
   transcription, TTS, images). The realtime items due now are tried first (`WorkItem.due_s`:
   a live transcription's frame, a prompt, a TTS row's first audio or a row with no lead left
   over its listener), then the realtime items due later, earliest first (a TTS step that only
   adds to a row's lead is due when that lead would run out), then the throughput items. Items
   due now, and throughput items, go least served first (engine/slack_share.py: seconds of that
   class's work each source has had, ties in `Priority` order; a source offering only later
   work counts as offering none). The first that fits runs. Then the runner asks again,
   until nothing fits. So no throughput source starves another (each gets an equal share of the
   time realtime work leaves), and when the slack cannot hold every realtime item due now (a
   loaded CPU: a TTS step before first audio and a live transcription step that do not fit one
   tick together) they take turns instead of the first starving the next. (Strict priority let
   a TTS stream read as fast as it came take every tick's slack: issue 32, live transcription
   deltas 200 -> 24 and images 101 -> 1 beside it on the CPU demo.)
2. A cost estimate is the largest cost seen at least twice among the last `COST_WINDOW`
   observed costs for the item's key (the second largest; with one observation, that one),
   per unit of work (a prefill chunk's unit is one prompt frame, a graphed step's is the
   step). One observation alone never sets the estimate: a single cold or preempted call
   would otherwise hold it for the whole window, and a declined key gets no new
   observations to push it out (issue 14: a CPU-contended STT step whose one worst cost, well
   above its typical and its second worst, kept it out of slack that fits it and starved live
   rows). The price:
   a real rise in cost is believed on its second observation, so it overruns twice, not once
   (both counted). Sources should seed their keys with a warm-up at start, and measure
   them once more on the engine thread in `slack_prepare` (called there before the first
   tick: a thread's first cuBLAS/cuDNN calls create handles and workspaces, so a key warmed on
   another thread runs cold once here). An item whose key has no estimate yet runs on its
   source's conservative prediction (`WorkItem.predicted_s`, e.g. an image at a size never
   measured, scaled from the measured sizes) when it has one: it starts only when that fits,
   and its first measurement replaces the prediction (a prediction is never recorded, so a
   pessimistic one cannot keep the key out once it has run). With no prediction it runs only
   as the first item of a tick's slack (so a first measurement can cost at most one unknown
   item a tick). Warm-up measurements are seeds (`CostModel.seed`): they stand in for a key
   only until it has two live measurements, then they are dropped. They were taken on an idle
   GPU around graph captures and first calls, often well above the live cost (an image
   preview's, for one), and kept in the window they would set the
   estimate for the key's first 31 live items, each then needing more slack than it takes.
3. A source may mark an item `forced`: it runs as the first item of a tick even when it
   does not fit, whatever its class (the first forced item offered, in `Priority` order).
   Admission progress uses this (a prompt must advance even when the frame leaves no slack),
   and the TTS pool's liveness step (a pool whose rows had no step for `force_after_ticks`
   ticks); everything else waits.
4. Every item is measured after a device synchronisation (its cost is real, not launch
   time), or when queued on CUDA by its device time (rule 8). An item that took longer than its
   estimate is an overrun, and one that ended after the boundary is counted too (`/metrics`).
5. A stale estimate heals: when a key's items were offered and declined (not fitting) for
   `STALE_TICKS` ticks in a row and the observation setting its estimate is an outlier (more
   than twice the next largest), the key goes on trial: its next item may run on that next cost,
   but only as the first item of a tick (the whole slack free, so even a repeat of a slow call
   has the most room before the boundary). If the trial costs at most half the outlier, the
   outlier is dropped (it was one cold call or GC pause, which must not keep a source from
   ever running again); if not, the outlier stays and the key waits again. A key whose costs
   agree keeps them: an item that truly does not fit still waits (its source must split or
   refuse it), and an item still starts only when its estimate fits.
6. Failure containment: an exception from an item is that item's request's failure
   (`WorkItem.fail`), unless it leaves shared device state unknown (a CUDA error), which
   is fatal and propagates to the engine.
7. With a tick trace (engine/tick_trace.py, opt-in: `trace`), each item's start, end of `run` and end
   after the sync are marked in it, with its source's kind; without one (None) no trace call is made.
   Items queued (rule 8) end when their launch returned; their device spans are the trace's events.
8. On CUDA with `EngineConfig.slack_queue_depth` over 1, items are queued on the device back to back,
   without a host round trip between them (engine/slack_queue.py): up to that many in flight, each
   costed by the device time between two CUDA events read once they are done (never a wait for a
   cost), and fitted after the estimated end of the work already queued (the queued end), not after
   the host's clock. An item's `WorkItem.launch` queues its device work and returns its host half,
   run once that work is done, items in launch order; a source with a host half pending is not
   asked again until it has run, and no throughput item is queued behind a realtime one whose host
   half is pending (that source's next realtime step would wait it out). Every item is done and handed out before the slack ends. Depth 1,
   and the CPU, run each item and wait for the device (rule 4) as before.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Hashable, TypeVar

import torch

from .slack_queue import Completed, DeviceTimeline, InFlight, SlackQueue, device_timeline
from .slack_share import FairShares
from .stream import Terminal

if TYPE_CHECKING:
    from .config import EngineConfig
    from .tick_trace import TickTrace

T = TypeVar("T")

log = logging.getLogger("parley.engine.slack")

COST_WINDOW = 32  # observed costs kept per key; the estimate is their second largest (rule 2)
STALE_TICKS = 25  # ticks (2 s) a key may be declined in a row before an outlier cost is dropped
# Distinct keys whose costs (and per-key stats) are kept, least recently recorded evicted first:
# image keys carry a client-chosen size, so their number must not grow with the requests.
MAX_KEYS = 4096


class Priority(enum.IntEnum):
    """The order sources are asked in (lower first): the tie-break between equally served
    sources of a class of work (rule 1), and between forced items (rule 3)."""

    PREFILL = 0
    TRANSCRIPTION = 1  # a live session's realtime work is the audio that arrived: a step a tick
    TTS = 2  # its realtime work includes a cushion over the listener (engine/tts_pool.py)
    IMAGES = 3


@dataclass
class WorkItem:
    """One bounded, GPU-synchronous piece of slack work."""

    key: Hashable  # what its cost is estimated by, e.g. ("tts", pool, batch_bucket, kind)
    run: Callable[[], None]  # does the work; the runner synchronises the device afterwards
    fail: Callable[[Exception], None]  # ends the item's request(s) after `run` raised
    units: int = 1  # units of work under `key` (prefill: prompt frames)
    forced: bool = False  # may run as a tick's first item even when it does not fit (rule 3)
    predicted_s: float | None = None  # the source's cost bound while `key` has no estimate (rule 2)
    realtime: bool = False  # realtime work (goes first) or throughput work (after it): rule 1
    due_s: float = 0.0  # a realtime item: seconds before anyone waits on it (0: now); earliest first (rule 1)
    # Queued on the device (rule 8): queues the device work, reads nothing back, and returns the host
    # half (the outputs read and handed out), which the runner calls once the work is done. None: `run`
    # does it all (a device read inside it waits for the device, correct but not overlapped).
    launch: Callable[[], Callable[[], None]] | None = None


class SlackSource:
    """What every slack source is: `priority` and `offer` are required; the hooks do nothing
    unless a source overrides them.

    Warm-up, one protocol for every source: `warm_up(costs)`, called once before the engine
    starts, captures the source's graphs (CUDA) and measures its keys, seeds them in `costs`
    (the engine's cost model, `Engine.slack_costs`: `CostModel.seed`, rule 2) and returns what
    it measured, {key: seconds}, for the start-up log. Anything source-specific a warm-up needs
    (the TTS conditions its admissions carry, the image sizes to capture) is a constructor
    argument or an attribute set before it, never a warm-up parameter. One owner calls it:
    `realtime/server/services.py`'s `register_slack_source` warms a source and adds it to the engine,
    for every source the server serves (tests and benchmarks driving a source alone call
    `warm_up` themselves, with the cost model they use). `slack_prepare` then measures the keys
    once more on the engine thread."""

    priority: Priority

    def warm_up(self, costs: "CostModel") -> dict:
        """Before the engine starts: capture this source's graphs, measure its keys, seed them in
        `costs` and return {key: seconds} measured (nothing to warm: {})."""
        return {}

    def offer(self, left_s: float | None, costs: "CostModel") -> WorkItem | None:
        """The next item this source wants to run, sized to `left_s` seconds where it can be
        (None: no deadline, e.g. manual ticks in tests), or None when it has nothing to do.
        The runner may decline the item (its estimate does not fit): an offer must not take
        anything it cannot give back (a queued request stays queued until the item runs)."""
        raise NotImplementedError

    def slack_started(self, deadline: float | None) -> None:
        """Once at the start of each tick's slack, before any offer (per-tick accounting)."""

    def slack_prepare(self, costs: "CostModel") -> None:
        """Once on the engine thread before its first clocked tick: measure this source's keys
        there and seed them in `costs` (`CostModel.seed`, rule 2)."""

    def slack_stop(self, terminal: Terminal) -> None:
        """The engine stopped (shutdown or a fatal error): end every request with `terminal`."""

    def slack_counters(self) -> dict:
        """This source's counters, for /metrics."""
        return {}


def second_call_cost(run: Callable[[], T], sync: Callable[[], None] = lambda: None,
                     now: Callable[[], float] = time.perf_counter) -> tuple[float, T]:
    """(seconds, result) of the second of two calls of `run`, each followed by `sync` (the device's,
    so the cost is real): the first pays one-time costs (kernel loading, a thread's first cuBLAS
    handle), so the second is what a seed should say (rule 2)."""
    for _ in range(2):
        start = now()
        result = run()
        sync()
        spent = now() - start
    return spent, result


class CostModel:
    """Per-key cost estimates: the second largest of the last COST_WINDOW costs per unit (rule 2;
    for a key on trial, rule 5, the next one down). Warm-up seeds count with them until a key has
    two live costs (rule 2)."""

    LIVE_BEFORE_SEEDS_GO = 2  # live costs that make a key's seeds redundant (the second largest needs two)

    def __init__(self, window: int = COST_WINDOW, max_keys: int = MAX_KEYS) -> None:
        self._window, self._max_keys = window, max_keys
        self._seen: OrderedDict[Hashable, deque[float]] = OrderedDict()
        self._seeds: dict[Hashable, list[float]] = {}  # warm-up costs per unit, until live ones replace them
        self._trials: dict[Hashable, float] = {}  # key on trial -> the outlier cost per unit it may drop

    def _ranked(self, key: Hashable) -> tuple[list[float], int]:
        """The key's costs (live, and seeds while any are kept), largest first, and the index
        of the one setting its estimate."""
        ranked = sorted([*self._seen.get(key, ()), *self._seeds.get(key, ())], reverse=True)
        return ranked, min(1, len(ranked) - 1) + (key in self._trials)

    def estimate(self, key: Hashable, units: int = 1) -> float | None:
        ranked, i = self._ranked(key)
        return ranked[i] * units if ranked else None

    def one_live_cost(self, key: Hashable) -> bool:
        """Whether the key's estimate rests on a single live cost, with no seed or second cost
        beside it (a warm-up seed is already the second of two calls: rule 2)."""
        return len(self._seen.get(key, ())) == 1 and not self._seeds.get(key)

    def on_trial(self, key: Hashable) -> bool:
        return key in self._trials

    def start_trial(self, key: Hashable) -> bool:
        """Put `key` on trial if the cost setting its estimate is an outlier (more than twice the next)."""
        ranked, i = self._ranked(key)
        if key in self._trials or len(ranked) < i + 2:
            return False
        worst, second = ranked[i:i + 2]
        if worst <= 2 * second:
            return False
        self._trials[key] = worst
        return True

    def end_trial(self, key: Hashable, seconds: float, units: int = 1) -> bool:
        """Record the trial's cost; drop the outlier if the trial cost at most half of it."""
        worst = self._trials.pop(key)
        per_unit = seconds / max(units, 1)
        seen = self._costs(key)
        seeds = self._seeds.get(key, [])
        dropped = per_unit <= worst / 2 and (worst in seen or worst in seeds)
        if dropped:
            (seen if worst in seen else seeds).remove(worst)
        self._live(key, seen, per_unit)
        return dropped

    def record(self, key: Hashable, seconds: float, units: int = 1) -> None:
        """A live cost (an item the runner ran and measured)."""
        self._live(key, self._costs(key), seconds / max(units, 1))

    def seed(self, key: Hashable, seconds: float, units: int = 1) -> None:
        """A warm-up cost: it counts until the key has two live costs (rule 2), then goes."""
        seen = self._costs(key)
        if len(seen) < self.LIVE_BEFORE_SEEDS_GO:
            self._seeds.setdefault(key, []).append(seconds / max(units, 1))

    def _live(self, key: Hashable, seen: deque[float], per_unit: float) -> None:
        seen.append(per_unit)
        if len(seen) >= self.LIVE_BEFORE_SEEDS_GO:
            self._seeds.pop(key, None)

    def _costs(self, key: Hashable) -> deque[float]:
        """The key's window, made most recent (a new key past MAX_KEYS evicts the stalest)."""
        seen = self._seen.get(key)
        if seen is not None:
            self._seen.move_to_end(key)
            return seen
        seen = self._seen[key] = deque(maxlen=self._window)
        while len(self._seen) > self._max_keys:
            evicted, _ = self._seen.popitem(last=False)
            self._trials.pop(evicted, None)
            self._seeds.pop(evicted, None)
        return seen

    def estimates(self) -> list[tuple[Hashable, float]]:
        """(key, estimate per unit) for every key observed (sources predict unseen keys from them)."""
        return [(key, self.estimate(key)) for key, seen in self._seen.items() if seen or key in self._seeds]


def fatal_for_device(exc: BaseException) -> bool:
    """Errors after which shared device state is unknown (a CUDA error poisons the context)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


@dataclass
class SlackStats:
    """What the runner did, for /metrics and benchmarks (monotonic counters)."""

    items: int = 0
    seconds: float = 0.0  # time spent in items
    overruns: int = 0  # items that took longer than their estimate
    past_boundary: int = 0  # items that ended after the next tick's boundary
    failed: int = 0  # items whose request failed
    stale_drops: int = 0  # outlier costs dropped after a trial of a stale key (rule 5)
    stale_trials: int = 0  # trial items of stale keys (rule 5)
    by_key: dict = field(default_factory=dict)  # key -> [items, seconds] (as many keys as the cost model)


class SlackRunner:
    """Runs sources' items after each tick until nothing more fits before the deadline."""

    def __init__(self, now: Callable[[], float], synchronize: Callable[[], None],
                 guard_s: float, queue_depth: int = 1, timeline: "DeviceTimeline | None" = None) -> None:
        self._now = now
        self._synchronize = synchronize
        # Items queued back to back on the device (rule 8): only with a device timeline (CUDA) and a
        # depth over 1; otherwise each item is waited for (the CPU's own calls end before they return).
        self._queue = SlackQueue(timeline, queue_depth, now) if timeline is not None and queue_depth > 1 else None
        self.guard_s = guard_s
        self.costs = CostModel()
        self.stats = SlackStats()
        self._sources: list[SlackSource] = []
        self._declined: dict[Hashable, int] = {}  # key -> ticks in a row its items did not fit
        # Seconds of work per source, one ledger per class (True: realtime), for rule 1's order.
        self.shares = {True: FairShares(), False: FairShares()}
        self.trace: "TickTrace | None" = None  # the tick timeline's items (rule 7), set by engine/tick.py

    @classmethod
    def for_backend(cls, backend: Any, now: Callable[[], float], config: "EngineConfig") -> "SlackRunner":
        """The engine's runner: the backend's device waited for (`backend.synchronize`), and on CUDA
        items queued up to `config.slack_queue_depth` (rule 8)."""
        return cls(now, backend.synchronize, config.slack_guard_s, config.slack_queue_depth, device_timeline(backend))

    def stop_sources(self, terminal: Terminal) -> None:
        """The engine stopped (shutdown or a fatal error): sources end their requests with
        `terminal`, so no client waits on work that will never run."""
        for source in self._sources:
            source.slack_stop(terminal)

    def counters(self) -> dict:
        """The runner's totals, then every source's counters, for /metrics (Engine.counters)."""
        stats = self.stats
        return {"slack_items": stats.items, "slack_seconds": stats.seconds, "slack_overruns": stats.overruns,
                "slack_past_boundary": stats.past_boundary, "slack_failed": stats.failed,
                "slack_stale_drops": stats.stale_drops, "slack_stale_trials": stats.stale_trials,
                **self.source_counters()}

    def source_counters(self) -> dict:
        """Every source's counters, for /metrics."""
        out: dict = {}
        for source in self._sources:
            out.update(source.slack_counters())
        return out

    def prepare_sources(self) -> None:
        """On the engine thread before its first clocked tick: each source measures its keys
        (rule 2). A source whose warm-up raises keeps its earlier estimates (a CUDA error is fatal)."""
        for source in self._sources:
            try:
                source.slack_prepare(self.costs)
            except Exception as exc:
                if fatal_for_device(exc):
                    raise
                log.warning("slack source %s could not measure its work on the engine thread: %s: %s",
                            type(source).__name__, type(exc).__name__, exc)

    def add_source(self, source: SlackSource) -> None:
        self._sources.append(source)
        self._sources.sort(key=lambda s: s.priority)  # stable: equal priorities keep their order

    def run_until(self, deadline: float | None, interrupt: Callable[[], bool] | None = None) -> None:
        """deadline: the next tick's boundary (None: run everything offered, manual mode).
        interrupt: asked before each item; True stops the run there (the engine has a tick to plan)."""
        for source in self._sources:  # sources that account per tick (e.g. TTS starvation) hear of it
            source.slack_started(deadline)
        declined: set[Hashable] = set()  # keys offered this tick whose estimate did not fit
        ran: set[Hashable] = set()
        if self._queue is None:
            self._run_each(deadline, interrupt, declined, ran)
        else:
            self._run_queued(deadline, interrupt, declined, ran)
        self._age_declined(declined - ran)

    def _run_each(self, deadline: float | None, interrupt: Callable[[], bool] | None, declined: set[Hashable],
                  ran: set[Hashable]) -> None:
        """Each item run, then the device waited for, before the next is chosen (CPU; depth 1)."""
        first = True
        while interrupt is None or not interrupt():
            picked = self._next_fitting(deadline, first, declined, self._now())
            if picked is None:
                break
            source, item = picked
            if self.trace is not None:
                self.trace.item_started(source.priority.name.lower(), item.key, item.realtime)
            spent = self._run(item, deadline)
            if self.trace is not None:
                self.trace.item_ended(failed=spent is None)
            if spent is not None:
                self.shares[item.realtime].charge(source, spent)
            ran.add(item.key)
            first = False

    def _run_queued(self, deadline: float | None, interrupt: Callable[[], bool] | None, declined: set[Hashable],
                    ran: set[Hashable]) -> None:
        """Items launched back to back, up to the queue's depth in flight, each fitted after the end
        of the work already queued (rule 8, engine/slack_queue.py); every one completed and its
        outputs handed out before this returns."""
        queue = self._queue
        assert queue is not None
        queue.begin()
        first = True
        while interrupt is None or not interrupt():
            self._complete(queue.completed(wait=queue.full), deadline)
            picked = self._next_fitting(deadline, first, declined, queue.queued_end(), queue.busy_sources())
            if picked is None or (not picked[1].realtime and queue.realtime_pending()):
                if queue.empty:
                    break
                self._complete(queue.completed(wait=True), deadline)  # it may free a source or end early
                continue
            self._launch(*picked)
            ran.add(picked[1].key)
            first = False
        while not queue.empty:
            self._complete(queue.completed(wait=True), deadline)

    def _age_declined(self, declined: set[Hashable]) -> None:
        """Rule 5: count the ticks in a row each key was declined; at STALE_TICKS a key whose
        largest cost is an outlier goes on trial."""
        self._declined = {key: self._declined.get(key, 0) + 1 for key in declined}
        for key, ticks in list(self._declined.items()):
            if ticks >= STALE_TICKS:
                del self._declined[key]
                self.costs.start_trial(key)

    def _next_fitting(self, deadline: float | None, first: bool, declined: set[Hashable], start: float,
                      busy: Collection[Hashable] = ()) -> tuple[SlackSource, WorkItem] | None:
        """(source, item) to run next, starting at `start` (host clock: now, or the queued end, rule 8):
        a forced item first in a tick (rule 3), else the first that fits of the realtime items due now
        (least served first), of those due later (earliest first), then of the throughput items (least
        served first): rule 1. Sources in `busy` (a host half pending, rule 8) are not asked. None if
        nothing fits."""
        left = None if deadline is None else deadline - self.guard_s - start
        offers: dict[bool, list[tuple[SlackSource, WorkItem]]] = {True: [], False: []}
        for source in self._sources:
            if source in busy:
                continue
            item = source.offer(left, self.costs)
            if item is None:
                continue
            if item.forced and first:
                return source, item
            offers[item.realtime].append((source, item))
        due_now = [offer for offer in offers[True] if offer[1].due_s <= 0]
        due_later = sorted((offer for offer in offers[True] if offer[1].due_s > 0), key=lambda o: o[1].due_s)
        ordered = [*self.shares[True].order(due_now, busy), *due_later, *self.shares[False].order(offers[False], busy)]
        for source, item in ordered:
            if self._fits(item, left, first, declined):
                return source, item
        return None

    def _fits(self, item: WorkItem, left: float | None, first: bool, declined: set[Hashable]) -> bool:
        """Whether `item` may start with `left` seconds to go (rules 2, 3 and 5); an item whose
        estimate is over `left` is declined (its key's stale count, rule 5)."""
        if left is None:
            return True
        estimate = self._estimate(item)
        if estimate is None or item.forced:
            return first
        if self.costs.on_trial(item.key):
            return first and estimate <= left  # a trial runs only with the whole slack free (rule 5)
        if estimate <= left:
            return True
        declined.add(item.key)
        return False

    def _estimate(self, item: WorkItem) -> float | None:
        estimate = self.costs.estimate(item.key, item.units)
        return item.predicted_s if estimate is None else estimate

    def _run(self, item: WorkItem, deadline: float | None) -> float | None:
        """Run `item` and measure it; returns the seconds it took (None: it failed)."""
        estimate = self._estimate(item)
        trial = self.costs.on_trial(item.key)
        start = self._now()
        try:
            item.run()
            if self.trace is not None:
                self.trace.item_queued()
            self._synchronize()
        except Exception as exc:
            self._failed(item, exc)
            return None
        end = self._now()
        self._account(item, end - start, estimate, trial, end, deadline)
        return end - start

    def _launch(self, source: SlackSource, item: WorkItem) -> None:
        """Queue `item` on the device between two events (rule 8): its launch half when it has one,
        else its whole `run`; its share is charged its estimate now, corrected at completion."""
        queue = self._queue
        assert queue is not None
        estimate, trial = self._estimate(item), self.costs.on_trial(item.key)
        if self.trace is not None:
            self.trace.item_started(source.priority.name.lower(), item.key, item.realtime)
        launched_at = self._now()
        start = queue.start()
        finish = None
        try:
            if item.launch is not None:
                finish = item.launch()
            else:
                item.run()
        except Exception as exc:
            queue.timeline.release([start])
            if self.trace is not None:
                self.trace.item_ended(failed=True)
            self._failed(item, exc)
            return
        end = queue.end()
        if self.trace is not None:
            self.trace.item_queued()
            self.trace.item_ended(failed=False)
        charged = estimate or 0.0
        self.shares[item.realtime].charge(source, charged)
        queue.push(InFlight(source, item, (start, end), launched_at, self._now(), estimate, charged, trial, finish))
        while estimate is None and not queue.empty:  # nothing queued behind an unknown cost (rule 8)
            self._complete(queue.completed(wait=True), None)

    def _complete(self, done: list[Completed], deadline: float | None) -> None:
        """Completed items, oldest first: the host half (outputs handed out), then the device cost
        into the cost model and the shares (rule 8)."""
        for completed in done:
            flight = completed.flight
            item = flight.item
            try:
                if flight.finish is not None:
                    flight.finish()
            except Exception as exc:
                self.shares[item.realtime].charge(flight.source, -flight.charged)
                self._failed(item, exc)
                continue
            self.shares[item.realtime].charge(flight.source, completed.seconds - flight.charged)
            self._account(item, completed.seconds, flight.estimate, flight.trial, completed.end, deadline)

    def _failed(self, item: WorkItem, exc: Exception) -> None:
        """An item raised: its request fails (rule 6), unless the device's state is unknown."""
        if fatal_for_device(exc):
            raise exc
        self.stats.failed += 1
        log.warning("slack item %r failed; ending its request: %s: %s", item.key, type(exc).__name__, exc)
        item.fail(exc)

    def _account(self, item: WorkItem, spent: float, estimate: float | None, trial: bool, end: float,
                 deadline: float | None) -> None:
        """An item's measured cost into the cost model (rules 2 and 5) and the counters (rule 4)."""
        stats = self.stats
        if trial:
            stats.stale_trials += 1
            stats.stale_drops += self.costs.end_trial(item.key, spent, item.units)
        else:
            self.costs.record(item.key, spent, item.units)
        stats.items += 1
        stats.seconds += spent
        tally = stats.by_key.setdefault(item.key, [0, 0.0])
        if len(stats.by_key) > MAX_KEYS:  # bounded like the cost model (oldest key first)
            del stats.by_key[next(iter(stats.by_key))]
        tally[0] += 1
        tally[1] += spent
        if estimate is not None and spent > estimate:
            stats.overruns += 1
        if deadline is not None and end > deadline:
            stats.past_boundary += 1
