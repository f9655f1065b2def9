"""engine/throughput_stream.py: sources that may run beside the frame get a thread and a stream of their own.

On the CPU the stream is a fake (the thread's rules: items run there with no deadline, costs are
recorded, a failing item fails only its request, a device error is fatal, stop ends the thread); the
CUDA test checks the priorities (rule 1) with a real engine.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from parley.engine import Engine, EngineConfig, OptionsError
from parley.engine.no_duplex import NoDuplexBackend
from parley.engine.slack import Priority, SlackSource, WorkItem
from parley.engine.stream import Status, Terminal
from parley.engine.throughput_stream import ThroughputStream


class FakeStream:
    def __init__(self) -> None:
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1


class Source(SlackSource):
    """Offers `items` items, each recording the thread it ran on and the stream priority there."""

    priority = Priority.IMAGES
    beside_frame = True

    def __init__(self, items: int, fail_at: set[int] = frozenset(), raise_at: dict[int, Exception] | None = None,
                 work=lambda: None) -> None:
        self.left, self.fail_at, self.raise_at, self.work = items, fail_at, raise_at or {}, work
        self.ran: list[tuple[int, str, int | None]] = []
        self.failed: list[tuple[int, str]] = []
        self.offers_left: list[float | None] = []
        self.stopped: Terminal | None = None
        self.prepared_on: str | None = None
        self.done = threading.Event()

    def slack_prepare(self, costs) -> None:
        self.prepared_on = threading.current_thread().name

    def offer(self, left_s, costs):
        self.offers_left.append(left_s)
        if self.left == 0:
            self.done.set()
            return None
        self.left -= 1
        n = len(self.ran) + len(self.failed)

        def run() -> None:
            if n in self.raise_at:
                raise self.raise_at[n]
            self.work()
            priority = torch.cuda.current_stream().priority if torch.cuda.is_available() else None
            self.ran.append((n, threading.current_thread().name, priority))

        return WorkItem(("beside", n % 2), run, lambda exc: self.failed.append((n, str(exc))))

    def slack_stop(self, terminal: Terminal) -> None:
        self.stopped = terminal


def started(source: Source, stream=None) -> tuple[ThroughputStream, threading.Event, list]:
    stop, fatal = threading.Event(), []
    lane = ThroughputStream(torch.device("cpu"), stop, fatal.append, stream=stream or FakeStream())
    lane.add_source(source)
    lane.start()
    return lane, stop, fatal


def test_items_run_on_their_own_thread_with_no_deadline_and_their_costs_are_recorded():
    source, stream = Source(5), FakeStream()
    lane, stop, fatal = started(source, stream)
    assert source.done.wait(10)
    stop.set()
    assert lane.join(5)
    assert [n for n, _, _ in source.ran] == [0, 1, 2, 3, 4]
    assert {thread for _, thread, _ in source.ran} == {"parley-throughput"} and source.prepared_on == "parley-throughput"
    assert set(source.offers_left) == {None}  # no tick deadline beside the frame (rule 2)
    assert stream.syncs == 5  # the thread waits for its own stream after each item
    assert lane.counters()["throughput_items"] == 5 and not fatal
    assert lane.costs.estimate(("beside", 0)) is not None and lane.costs.estimate(("beside", 1)) is not None


def test_a_failing_item_fails_only_its_request_and_the_next_items_run():
    source = Source(4, raise_at={1: ValueError("bad prompt")})
    lane, stop, fatal = started(source)
    assert source.done.wait(10)
    stop.set()
    assert lane.join(5)
    assert source.failed == [(1, "bad prompt")] and [n for n, _, _ in source.ran] == [0, 2, 3]
    assert lane.counters()["throughput_failed"] == 1 and not fatal
    lane.stop_sources(Terminal(Status.CANCELLED, "shutting down"))
    assert source.stopped.status is Status.CANCELLED


def test_a_device_error_is_fatal_and_ends_the_thread():
    source = Source(3, raise_at={1: RuntimeError("CUDA error: an illegal memory access was encountered")})
    lane, stop, fatal = started(source)
    assert lane.join(10)  # ended by the error, with no stop asked
    assert not stop.is_set() and len(fatal) == 1 and "illegal memory access" in str(fatal[0])
    assert source.failed == [] and [n for n, _, _ in source.ran] == [0]


def test_stop_ends_an_idle_thread_promptly():
    source = Source(0)
    lane, stop, _ = started(source)
    assert source.done.wait(10)
    stop.set()
    began = time.monotonic()
    assert lane.join(5) and time.monotonic() - began < 2


def test_the_engine_refuses_a_throughput_stream_off_cuda_naming_it():
    with pytest.raises(OptionsError, match="throughput_stream runs work beside the frame on a CUDA stream"):
        Engine(NoDuplexBackend("cpu"), EngineConfig(throughput_stream=True))
    with pytest.raises(OptionsError, match="throughput_stream must be True or False"):
        EngineConfig(throughput_stream="yes")


class SlackItems(SlackSource):
    """A slack source (not beside the frame): records where its items ran."""

    priority = Priority.TTS

    def __init__(self) -> None:
        self.ran: list[tuple[str, int]] = []

    def offer(self, left_s, costs):
        if len(self.ran) >= 3:
            return None

        def run() -> None:
            torch.ones(64, 64, device="cuda").sum()
            self.ran.append((threading.current_thread().name, torch.cuda.current_stream().priority))
        return WorkItem(("slack", 0), run, lambda exc: None, predicted_s=0.001)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_engine_runs_at_the_highest_priority_and_images_beside_it_at_the_lowest():
    least, greatest = torch.cuda.Stream.priority_range()
    assert greatest < least, "this device has one stream priority: nothing could go first"
    x = torch.randn(512, 512, device="cuda")
    beside, slack = Source(20, work=lambda: (x @ x).sum()), SlackItems()
    engine = Engine(NoDuplexBackend("cuda"), EngineConfig(throughput_stream=True))
    engine.add_slack_source(beside)
    engine.add_slack_source(slack)
    engine.start()
    try:
        assert beside.done.wait(30)
        deadline = time.monotonic() + 30
        while len(slack.ran) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.shutdown()
    assert {(thread, priority) for _, thread, priority in beside.ran} == {("parley-throughput", least)}
    assert set(slack.ran) == {("parley-engine", greatest)}
    assert engine.counters()["throughput_items"] == 20
    assert beside.stopped is not None and beside.stopped.status is Status.CANCELLED
