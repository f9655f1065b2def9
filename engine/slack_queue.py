"""Slack items queued on the device back to back (engine/slack.py rule 8): the items in flight, their
device costs and the estimated end of the work queued.

On CUDA the runner launches up to `depth` items without waiting for the device between them
(`EngineConfig.slack_queue_depth`; 1: each item is waited for, as on CPU). The rules:
1. Each item is bracketed by two events on the engine thread's stream (`DeviceTimeline`). Its cost
   is the device time between them, read only once its end event is done (`done`): never a wait to
   read a cost. It counts the device idle inside the item (a launch slower than the device runs),
   not the items queued before it (its start event runs when they end).
2. The queued end: when the work already queued should end, on the host's clock. Folded over the
   items in flight from the end of the last completed one: an item starts when the one before it
   ends, or when its launch began if later, and ends its estimate after that start, and never
   before its launch returned. A completed item's end is its start plus its device cost, and no
   later than when the host saw it done. The runner fits the next item after the queued end, so a
   tick's slack is never queued past the deadline by the estimates.
3. An item with no estimate is waited for at once (nothing may be queued behind a cost unknown).
4. An item's host half (`WorkItem.launch`'s returned call: its outputs read and handed out) runs
   only once its end event is done, items in the order they were launched; a source with a host half
   pending is not asked for more (its rows' host state is one step behind), so no session's outputs
   are lost or reordered. While a realtime item's host half is pending, no throughput item is
   queued behind it: its source's next realtime step (a TTS row's next step before its first audio)
   would otherwise wait out the throughput item (an image's denoise steps) once the host half ran.
5. The host waits on the device in two places only: the oldest item's end event when `depth` items
   are in flight (the device still has the others queued), and at the end of the slack, for all
   of them (the tick's slack ends with every output handed out, as before).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Protocol

from .tick_trace import CudaEvents

if TYPE_CHECKING:
    import torch

    from .slack import SlackSource, WorkItem


class DeviceTimeline(Protocol):
    """Events on the engine thread's device stream (CudaTimeline; tests fabricate one)."""

    def record(self) -> Any: ...
    def done(self, event: Any) -> bool: ...
    def wait(self, event: Any) -> None: ...
    def elapsed_s(self, start: Any, end: Any) -> float: ...
    def release(self, events: list) -> None: ...


class CudaTimeline(CudaEvents):
    """The tick trace's pooled CUDA events, waited on and read in seconds (every slack item records two)."""

    def wait(self, event: Any) -> None:
        event.synchronize()

    def elapsed_s(self, start: Any, end: Any) -> float:
        return self.elapsed_ms(start, end) / 1000.0


def device_timeline(backend: object) -> CudaTimeline | None:
    """The timeline slack items are queued on beside `backend` (its `device`; None off CUDA: the CPU
    runs each item to its end before `run` returns, so there is nothing to queue)."""
    import torch

    device = getattr(backend, "device", None)
    try:
        kind = torch.device(device).type if device is not None else None
    except (TypeError, RuntimeError):
        return None
    return CudaTimeline() if kind == "cuda" else None


def host_copy(tensor: "torch.Tensor") -> "torch.Tensor":
    """`tensor` copied to the host on the device's stream without waiting (pinned memory on CUDA):
    read it only once the item's end event is done (rule 4). Off CUDA, the copy itself."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    import torch

    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


@dataclass
class InFlight:
    """One item launched and not yet completed."""

    source: "SlackSource"
    item: "WorkItem"
    events: tuple[Any, Any]  # (start, end) on the device stream
    launched_at: float  # host clock when its launch began
    queued_at: float  # host clock when its launch returned
    estimate: float | None  # seconds, what it was fitted with (None: waited for at once, rule 3)
    charged: float  # seconds charged to its source's share at launch (corrected at completion)
    trial: bool  # a stale key's trial (slack.py rule 5)
    finish: Callable[[], None] | None  # its host half (rule 4)


@dataclass
class Completed:
    """An item whose end event is done: its device cost and its end on the host's clock (rule 2)."""

    flight: InFlight
    seconds: float
    end: float


class SlackQueue:
    """The items in flight, oldest first, on one device timeline."""

    def __init__(self, timeline: DeviceTimeline, depth: int, now: Callable[[], float]) -> None:
        self.timeline, self.depth, self._now = timeline, depth, now
        self._flights: deque[InFlight] = deque()
        self._last_end = -math.inf  # the last completed item's end (host clock)

    def begin(self) -> None:
        """A tick's slack starts: the device has finished everything (the frame's host copy, or the
        last slack's end), so nothing queued holds the next item back."""
        self._flights.clear()  # (only after a fatal error left some: the engine has stopped serving)
        self._last_end = -math.inf

    @property
    def full(self) -> bool:
        return len(self._flights) >= self.depth

    @property
    def empty(self) -> bool:
        return not self._flights

    def busy_sources(self) -> set[Hashable]:
        """Sources with a host half pending (rule 4: not asked until it has run)."""
        return {f.source for f in self._flights if f.finish is not None}

    def realtime_pending(self) -> bool:
        """A realtime item in flight whose host half is pending (rule 4: nothing throughput behind it)."""
        return any(f.finish is not None and f.item.realtime for f in self._flights)

    def queued_end(self) -> float:
        """When the work queued should end (rule 2), at the earliest now."""
        end = self._last_end
        for f in self._flights:
            end = max(max(end, f.launched_at) + (f.estimate or 0.0), f.queued_at)
        return max(end, self._now())

    def start(self) -> Any:
        """The start event of an item about to launch."""
        return self.timeline.record()

    def push(self, flight: InFlight) -> None:
        self._flights.append(flight)

    def end(self) -> Any:
        """The end event of an item just launched."""
        return self.timeline.record()

    def completed(self, wait: bool = False) -> list[Completed]:
        """The items in flight whose end event is done, oldest first, taken off the queue; with
        `wait`, the oldest is waited for first (rule 5)."""
        out: list[Completed] = []
        if wait and self._flights:
            self.timeline.wait(self._flights[0].events[1])
        while self._flights and self.timeline.done(self._flights[0].events[1]):
            seen_at = self._now()
            flight = self._flights.popleft()
            seconds = self.timeline.elapsed_s(*flight.events)
            self.timeline.release(list(flight.events))
            self._last_end = min(max(self._last_end, flight.launched_at) + seconds, seen_at)
            out.append(Completed(flight, seconds, self._last_end))
        return out
