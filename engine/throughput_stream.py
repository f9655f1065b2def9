"""Throughput work beside the frame: a thread of its own and a low-priority CUDA stream
(`EngineConfig.throughput_stream`, `parley serve --throughput-stream`).

In the ticks' slack (engine/slack.py) the device runs one item at a time and only what fits before
the next boundary, so it idles for the slack's tail and whenever the host is between items. A source
whose every item is throughput work on state no other source touches (`SlackSource.beside_frame`:
the image queue) can instead run here, back to back and with no deadline, while the engine thread
runs the frame and the realtime slack. The rules:

1. The engine thread's work goes on a stream of the device's highest priority (engine/engine.py sets
   it on that thread, after the work queued before it), this thread's on the lowest. Where both have
   work waiting, the GPU hands free multiprocessors to the frame's kernels first, so an image step
   running beside a tick slows the frame by what the two share (memory bandwidth, multiprocessors a
   running image kernel still holds), not by the step's length.
2. Each source is asked for its next item with no deadline (`offer(None, ...)`); the item runs here,
   the thread waits for this stream alone (never the whole device), and its cost is recorded in
   this thread's own cost model. With nothing offered the thread sleeps `IDLE_WAIT_S`.
3. Failure containment as in the slack (engine/slack.py rule 6): an item's exception fails its
   request, unless it leaves the device's state unknown, which is fatal for the engine (`on_fatal`).
4. `stop` ends the thread (joined, bounded), then the engine ends the sources' requests.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch

from .config import OptionsError
from .slack import CostModel, SlackSource, SlackStats, WorkItem, fatal_for_device
from .stream import Terminal

if TYPE_CHECKING:
    from .config import EngineConfig

log = logging.getLogger("parley.engine.throughput")

IDLE_WAIT_S = 0.005  # how long the thread sleeps when no source offers work (a new request waits at most this)


def throughput_stream(backend: object, config: "EngineConfig", stop: threading.Event,
                      on_fatal: Callable[[BaseException], None]) -> "ThroughputStream | None":
    """The engine's throughput stream when its config asks for one (OptionsError off CUDA), else None."""
    if not config.throughput_stream:
        return None
    device = torch.device(getattr(backend, "device", "cpu"))
    if device.type != "cuda":
        raise OptionsError(f"throughput_stream runs work beside the frame on a CUDA stream; this backend runs on {device}.")
    return ThroughputStream(device, stop, on_fatal)


class ThroughputStream:
    """Runs `beside_frame` sources' items on one thread and one low-priority stream."""

    def __init__(self, device: torch.device, stop: threading.Event, on_fatal: Callable[[BaseException], None],
                 stream: "torch.cuda.Stream | None" = None, now: Callable[[], float] = time.perf_counter) -> None:
        # stream: tests pass a fake with `synchronize()` (and the thread runs without a CUDA stream).
        self.device = device
        self._stop = stop
        self._on_fatal = on_fatal
        self._stream = stream
        self._now = now
        self.costs = CostModel()
        self.stats = SlackStats()
        self._sources: list[SlackSource] = []
        self._thread: threading.Thread | None = None

    def add_source(self, source: SlackSource) -> None:
        if self._thread is not None:
            raise RuntimeError("add sources before the throughput stream starts.")
        self._sources.append(source)

    @property
    def sources(self) -> tuple[SlackSource, ...]:
        return tuple(self._sources)

    def start(self) -> None:
        if self._thread is None and self._sources:
            self._thread = threading.Thread(target=self._serve, name="parley-throughput", daemon=True)
            self._thread.start()

    def put_this_thread_first(self) -> None:
        """On the engine thread: its work goes on a stream of the device's highest priority, after the
        work queued before it (rule 1)."""
        _least, greatest = torch.cuda.Stream.priority_range()
        stream = torch.cuda.Stream(self.device, priority=greatest)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        torch.cuda.set_stream(stream)

    def join(self, timeout: float | None) -> bool:
        """Wait for the thread after the engine's stop event was set; False if it is still running."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def stop_sources(self, terminal: Terminal) -> None:
        for source in self._sources:
            source.slack_stop(terminal)

    def counters(self) -> dict:
        out = {"throughput_items": self.stats.items, "throughput_seconds": self.stats.seconds,
               "throughput_failed": self.stats.failed}
        for source in self._sources:
            out.update(source.slack_counters())
        return out

    def _serve(self) -> None:
        stream = self._stream
        if stream is None:  # CUDA: the lowest priority (rule 1), after the work queued at start
            least, _greatest = torch.cuda.Stream.priority_range()
            stream = torch.cuda.Stream(self.device, priority=least)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            self._stream = stream
        try:
            with torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext():
                self._prepare()
                while not self._stop.is_set():
                    if not self._run_one_round():
                        self._stop.wait(IDLE_WAIT_S)
        except BaseException as exc:  # rule 3: only errors that leave the device unknown get here
            self._on_fatal(exc)

    def _prepare(self) -> None:
        """This thread's first library calls (cuBLAS handles) cost more: each source measures its keys here."""
        for source in self._sources:
            try:
                source.slack_prepare(self.costs)
            except Exception as exc:
                if fatal_for_device(exc):
                    raise
                log.warning("%s could not measure its work on the throughput stream: %s: %s",
                            type(source).__name__, type(exc).__name__, exc)

    def _run_one_round(self) -> bool:
        """One item from each source that offers one (rule 2); whether any ran."""
        ran = False
        for source in self._sources:
            if self._stop.is_set():
                break
            item = source.offer(None, self.costs)
            if item is not None:
                self._run(item)
                ran = True
        return ran

    def _run(self, item: WorkItem) -> None:
        start = self._now()
        try:
            if item.launch is not None:
                finish = item.launch()
                self._stream.synchronize()
                finish()
            else:
                item.run()
                self._stream.synchronize()
        except Exception as exc:
            if fatal_for_device(exc):
                raise
            self.stats.failed += 1
            log.warning("throughput item %r failed; ending its request: %s: %s", item.key, type(exc).__name__, exc)
            item.fail(exc)
            return
        spent = self._now() - start
        self.costs.record(item.key, spent, item.units)
        self.stats.items += 1
        self.stats.seconds += spent

