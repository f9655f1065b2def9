"""Throughput work beside the frame: the overlap lane (`EngineConfig.overlap_images`, CUDA only).

A tick's slack (engine/slack.py) holds only what is estimated to end before the next boundary on
the engine thread's stream. Under mixed load the GPU then idles in every tick's tail that no item
fits, and an image step must fit what the frame and the realtime work leave of a period. On the
lane an overlapping source's items (images) run on a second CUDA stream of the lowest priority,
while the engine thread's own stream (the frame and every other slack item) takes the highest:
the GPU's block scheduler starts waiting blocks of the higher-priority stream first, so the
frame and the realtime items wait only for lane blocks already running, and image work fills
the time they leave, the tick's tail included.

Rules:
1. Sources marked `overlaps` (engine/image_queue.py) go on the lane when there is one, and only
   there. Their items are offered with no deadline (`offer(None, ...)`): none is fitted into a
   tick, none takes a share of the tick's slack (engine/slack_share.py).
2. The engine thread tops the lane up wherever the slack runner runs: at the start of a tick's
   slack, after each item it queues there, and at its end. It keeps at most `depth` items in
   flight and adds none once the work queued is estimated to run `horizon_s` past now: the next
   top-up is at most about a period away, so the lane does not run dry before it.
3. Each item is bracketed by two events on the lane's stream (engine/slack_queue.py rule 1): its
   cost is its device time there, slowed by what ran beside it, which is what the next estimate
   should hold. Host halves run once their end event is done, in launch order, and a source with
   one pending is not asked (slack_queue.py rule 4). An item with no estimate ends the top-up:
   the queued end after it is unknown.
4. The engine thread never waits for the lane, except when the engine stops.
5. The tick trace (engine/tick_trace.py) shows the engine thread's stream only.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from .slack_queue import DeviceTimeline, SlackQueue

if TYPE_CHECKING:
    from .slack import SlackSource

LANE_DEPTH = 8  # items in flight on the lane at most (rule 2)
HORIZON_PERIODS = 1.5  # the lane is filled while its queued work ends less than this many periods ahead


class OverlapLane:
    """The lane's queue, its sources, and how its items are put on its stream."""

    def __init__(self, timeline: DeviceTimeline, now: Callable[[], float], horizon_s: float,
                 on_lane: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 bind_thread: Callable[[], None] = lambda: None, depth: int = LANE_DEPTH) -> None:
        self.queue = SlackQueue(timeline, depth, now)
        self.horizon_s = horizon_s
        self.on_lane = on_lane  # a context in which device work (and events) go on the lane's stream
        self.bind_thread = bind_thread  # on the engine thread, before its first tick: its stream's priority
        self.sources: list["SlackSource"] = []
        self._now = now

    @classmethod
    def for_device(cls, device: Any, now: Callable[[], float], horizon_s: float) -> "OverlapLane":
        """On CUDA: the lane's stream at the lowest priority, the engine thread's at the highest."""
        import torch

        from .slack_queue import CudaTimeline

        lane = torch.cuda.Stream(device, priority=0)  # the default, which is CUDA's lowest
        engine = torch.cuda.Stream(device, priority=-1)  # a lower number is a higher priority

        def bind_thread() -> None:
            torch.cuda.synchronize(device)  # work queued on the default stream before (loads, warm-ups) ends first
            torch.cuda.set_stream(engine)

        return cls(CudaTimeline(), now, horizon_s, lambda: torch.cuda.stream(lane), bind_thread)

    def room(self) -> bool:
        """Whether another item may be queued (rule 2)."""
        return not self.queue.full and self.queue.queued_end() - self._now() < self.horizon_s
