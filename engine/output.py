"""The output processor: the one place that loops over the batch and fans each row's
output out to its request's stream, by request id (never by batch position, which is
reused as soon as a session ends)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from .backend import HostOutput
from .host_rows import row_copy
from .metrics import EngineMetrics
from .scheduler import TickPlan
from .session import FrameOut
from .stream import OutputStream, schedule_wakes


class OutputProcessor:
    def __init__(self, text_piece: Callable[[int], str], metrics: EngineMetrics) -> None:
        self._text_piece = text_piece
        self._metrics = metrics
        self._lock = threading.Lock()  # register/unregister run on the loop, route on the engine
        self._streams: dict[str, OutputStream[FrameOut]] = {}

    def register(self, request_id: str, stream: OutputStream[FrameOut]) -> None:
        with self._lock:
            self._streams[request_id] = stream

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def route(self, plan: TickPlan, out: HostOutput) -> None:
        with self._lock:
            streams = [self._streams.get(rid) if rid is not None else None for rid in plan.request_ids]
        dropped = 0
        produced_at = time.monotonic()  # the tick's outputs are on the host: its end, for the edge
        wakes: list[OutputStream] = []
        valid, tokens = out.valid.tolist(), out.text_tokens.tolist()
        for row, stream in enumerate(streams):
            if stream is None or not valid[row]:
                continue  # idle row, a request that ended this tick, or still inside the delay
            token = tokens[row]
            frame = FrameOut(pcm=row_copy(out.pcm[row]), text=self._text_piece(token),
                             text_token=token, tick=plan.tick, produced_at=produced_at)
            if not stream.push(frame, wakes):
                dropped += 1
        schedule_wakes(wakes)  # one wake-up of the loop for the whole tick
        if dropped:
            self._metrics.inc("dropped_events", dropped)
