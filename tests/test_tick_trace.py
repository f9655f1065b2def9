"""The tick timeline (engine/tick_trace.py): what a traced engine writes, tick by tick, and what an
untraced one pays (nothing). A fabricated backend on a fake clock, with fabricated device events whose
times are that clock's, so every figure is known; the real CUDA events behind the `gpu` mark."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
import torch

from parley.engine import Engine, EngineConfig, TickClock, TickTrace
from parley.engine.slack import Priority, SlackSource, WorkItem
from parley.engine.tick_trace import LAG_TICKS, MAX_PENDING, CudaEvents
from delay_backend import DelayBackend, FakeTime, serve_one_session

STEP_S, ITEM_S = 0.010, 0.005  # what the fabricated step and each slack item take on the fake clock
IN_ORDER = ["plan", "rows", "launch", "beside", "wait", "route", "gc", "slack"]


class FakeEvent:
    def __init__(self, t: float) -> None:
        self.t = t


class FakeEvents:
    """Device events at the fake clock's time when recorded; `done` says whether the device got there."""

    def __init__(self, fake: FakeTime) -> None:
        self.fake, self.made, self.recorded, self.reads, self.ready = fake, 0, 0, 0, True
        self.free: list[FakeEvent] = []

    def record(self) -> FakeEvent:
        self.recorded += 1
        if self.free:
            event = self.free.pop()
        else:
            self.made += 1
            event = FakeEvent(0.0)
        event.t = self.fake.t
        return event

    def done(self, event: FakeEvent) -> bool:
        return self.ready

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        self.reads += 1
        return 1000 * (end.t - start.t)

    def release(self, events: list) -> None:
        self.free.extend(events)


class ImageSteps(SlackSource):
    """`n` throughput items of ITEM_S each (an image queue's steps)."""

    priority = Priority.IMAGES

    def __init__(self, fake: FakeTime, n: int) -> None:
        self.fake, self.left = fake, n

    def offer(self, left_s, costs):
        if self.left <= 0:
            return None

        def run() -> None:
            self.left -= 1
            self.fake.t += ITEM_S

        return WorkItem(key=("image", 64, "step"), run=run, fail=lambda exc: None)


def traced_engine(fake: FakeTime, trace: TickTrace | None, items: int = 3) -> Engine:
    """Two rows, a queued step of STEP_S, `items` image steps, on a clock of 80 ms ticks."""
    backend = DelayBackend(2, on_step=lambda *_: setattr(fake, "t", fake.t + STEP_S), queue_wait=lambda: None)
    engine = Engine(backend, EngineConfig(input_frames=64), clock=TickClock(0.08, now=fake.now, sleep=fake.sleep),
                    trace=trace)
    engine.add_slack_source(ImageSteps(fake, items))
    return engine


def read(out: io.StringIO | Path) -> tuple[dict, list[dict]]:
    text = out.getvalue() if isinstance(out, io.StringIO) else out.read_text()
    header, *ticks = [json.loads(line) for line in text.splitlines()]
    return header, ticks


def manual_ticks(engine: Engine, ticks: int) -> None:
    """One session opened, then `ticks` manual ticks (no deadline: no GC pass beside the step)."""

    async def main() -> None:
        engine.open_nowait()
        engine.run_ticks(ticks)

    asyncio.run(main())


class Kept(io.StringIO):
    def close(self) -> None:  # the trace closes its file; the test still reads it
        pass


def test_a_traced_engine_writes_each_ticks_phases_in_order_with_its_slack_items_and_device_times():
    fake = FakeTime()
    out, events = Kept(), FakeEvents(fake)
    engine = traced_engine(fake, TickTrace(out, 100, events, now=fake.now, cpu=lambda: 0.0, wall=fake.now))
    serve_one_session(engine, 3)
    engine.shutdown()
    header, ticks = read(out)
    assert header == {"trace": "parley tick timeline", "period_ms": 80.0, "gpu": True, "max_ticks": 100}
    # The first tick admits the session (its prompt, forced, is its slack); the image steps follow the
    # next tick's frame (an unmeasured key runs only first in a tick, slack.py rule 2).
    assert [t["tick"] for t in ticks] == [0, 1, 2, 3]
    assert [p[0] for p in ticks[0]["phases"]] == ["plan", "rows", "gc", "slack"] and ticks[0]["gpu"]["frame"] is None
    assert [item["kind"] for item in ticks[0]["slack"]] == ["prefill"]
    assert [item["kind"] for item in ticks[1]["slack"]] == ["images"] * 3
    for t in ticks[1:]:
        assert [p[0] for p in t["phases"]] == IN_ORDER
        starts, ends = [p[1] for p in t["phases"]], [p[2] for p in t["phases"]]
        assert starts[0] == 0 and starts[1:] == ends[:-1]  # each phase begins where the one before ended
        phase = {p[0]: p[2] - p[1] for p in t["phases"]}
        assert phase["launch"] == pytest.approx(1000 * STEP_S)  # the fabricated step runs in its launch
        assert all(p[3] == 0 for p in t["phases"])  # no CPU time passed on the fake thread clock
        assert t["gpu"]["frame"] == pytest.approx([0.0, 1000 * STEP_S])
        assert t["gpu"]["end"] == pytest.approx(ends[-1])
    slack_phase = ticks[1]["phases"][-1]
    for item in ticks[1]["slack"]:
        assert item["key"] == ["image", 64, "step"] and item["realtime"] is False and item["failed"] is False
        assert item["end"] - item["start"] == pytest.approx(1000 * ITEM_S)
        assert item["start"] <= item["queued"] <= item["end"]
        assert slack_phase[1] <= item["start"] and item["end"] <= slack_phase[2]
        assert item["gpu"] == pytest.approx([item["start"], item["queued"]])  # after the frame's, on the device


def test_a_manual_tick_has_no_gc_pass_beside_the_step_and_a_step_run_on_the_host_is_all_launch():
    fake = FakeTime()
    out = Kept()
    backend = DelayBackend(1, on_step=lambda *_: setattr(fake, "t", fake.t + STEP_S))  # not queued: a host step
    engine = Engine(backend, trace=TickTrace(out, 10, None, now=fake.now, cpu=fake.now, wall=fake.now))
    manual_ticks(engine, 3)
    engine.shutdown()
    header, ticks = read(out)
    assert header["gpu"] is False
    for t in ticks[1:]:
        assert [p[0] for p in t["phases"]] == ["plan", "rows", "launch", "route", "gc", "slack"]
        launch = next(p for p in t["phases"] if p[0] == "launch")
        assert launch[2] - launch[1] == pytest.approx(1000 * STEP_S) == launch[3]  # all on the CPU
        assert t["gpu"] is None and t["slack"] == []


def test_the_trace_is_bounded_by_its_tick_count_and_then_stops():
    fake = FakeTime()
    out = Kept()
    engine = traced_engine(fake, TickTrace(out, 3, FakeEvents(fake), now=fake.now, wall=fake.now), items=0)
    serve_one_session(engine, 10)
    assert out.getvalue().count("\n") == 1 + 3
    trace = engine._ticks.trace
    assert trace.written == 3 and trace._out is None and not trace._pending  # closed once the last was written
    engine.shutdown()


def test_device_times_are_read_back_late_without_waiting_and_a_tick_never_done_is_written_without_them():
    fake = FakeTime()
    out, events = Kept(), FakeEvents(fake)
    trace = TickTrace(out, 1000, events, now=fake.now, wall=fake.now)
    trace.start(0.08)

    def tick(n: int) -> None:
        trace.begin(n)
        trace.step(None)()
        fake.t += STEP_S
        trace.step_returned()
        trace.end()

    tick(0)
    assert trace.written == 0 and events.reads == 0  # not read in the tick that recorded them
    for n in range(1, LAG_TICKS + 1):
        tick(n)
    assert trace.written == 1 and events.reads > 0
    for n in range(LAG_TICKS + 1, 20):
        tick(n)
    assert trace.written == 20 - LAG_TICKS
    assert events.made == 4 * (LAG_TICKS + 1)  # four a tick, reused once read: as many as the ticks held
    events.ready = False  # the device never gets there: held, then written without device times
    for n in range(20, 20 + MAX_PENDING + LAG_TICKS + 5):
        tick(n)
        assert len(trace._pending) <= MAX_PENDING
    _, ticks = read(out)
    assert ticks[-1]["gpu"] is None and ticks[0]["gpu"] is not None
    assert [t["tick"] for t in ticks] == list(range(len(ticks)))  # in order, none lost


def test_off_cpu_time_is_a_phases_wall_time_less_the_engine_threads_cpu_time():
    fake, cpu = FakeTime(), FakeTime()
    out = Kept()
    trace = TickTrace(out, 10, None, now=fake.now, cpu=cpu.now, wall=fake.now)
    trace.start(0.08)
    trace.begin(0)
    fake.t += 0.004
    cpu.t += 0.001  # 3 ms of the plan's 4 off the CPU: the GIL, or a core
    trace.phase("plan")
    trace.item_started("tts", ("tts", 8), True)
    fake.t, cpu.t = fake.t + 0.002, cpu.t + 0.002
    trace.item_queued()
    fake.t += 0.006  # the device's work, waited for asleep
    trace.item_ended(failed=False)
    trace.phase("slack")
    trace.end()
    trace.close()
    (t,) = read(out)[1]
    assert t["phases"] == [["plan", 0.0, 4.0, 1.0], ["slack", 4.0, 12.0, 2.0]]
    (item,) = t["slack"]
    assert (item["kind"], item["key"], item["cpu_run"], item["cpu_sync"]) == ("tts", ["tts", 8], 2.0, 0.0)
    assert (item["start"], item["queued"], item["end"]) == (4.0, 6.0, 12.0)


def test_an_untraced_engine_makes_no_trace_call_and_no_device_event(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a trace call on an untraced engine")

    for name in ("begin", "phase", "step", "step_returned", "item_started", "item_queued", "item_ended", "end",
                 "close", "start"):
        monkeypatch.setattr(TickTrace, name, refuse)
    monkeypatch.setattr(CudaEvents, "record", refuse)
    monkeypatch.setattr(torch.cuda, "Event", refuse)
    fake = FakeTime()
    engine = traced_engine(fake, None)
    serve_one_session(engine, 3)
    assert engine._ticks.trace is None and engine._slack.trace is None
    assert engine.counters()["slack_items"] == 4  # the prompt and three image steps ran, untraced
    engine.shutdown()


def test_a_trace_file_that_cannot_be_written_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="tick_trace .*cannot be written"):
        TickTrace.open(tmp_path / "no such dir" / "t.jsonl", 10, cuda=False)
    with pytest.raises(ValueError, match="tick_trace_ticks must be a whole number of at least 1"):
        TickTrace(io.StringIO(), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_event_times_are_positive_and_inside_their_tick(tmp_path):
    x = torch.randn(2048, 2048, device="cuda")

    def work(*_) -> None:
        for _ in range(8):
            torch.mm(x, x)

    class CudaItems(SlackSource):  # two items a tick
        priority = Priority.TTS
        left = 0

        def slack_started(self, deadline) -> None:
            self.left = 2

        def offer(self, left_s, costs):
            if self.left == 0:
                return None
            self.left -= 1
            return WorkItem(key=("tts", 2048), run=work, fail=lambda exc: None, realtime=True)

    backend = DelayBackend(2, on_step=work, queue_wait=torch.cuda.synchronize)
    backend.synchronize = torch.cuda.synchronize  # each item waited for, as a model backend does (rule 4)
    path = tmp_path / "trace.jsonl"
    engine = Engine(backend, trace=TickTrace.open(path, 100, cuda=True))
    engine.add_slack_source(CudaItems())
    manual_ticks(engine, LAG_TICKS + 4)  # the admission, then steps
    engine.shutdown()
    header, ticks = read(path)
    assert header["gpu"] is True and len(ticks) == LAG_TICKS + 4
    for t in ticks[1:]:
        start, end = t["gpu"]["frame"]
        assert 0 <= start < end <= t["gpu"]["end"]
        for item in t["slack"]:
            assert end <= item["gpu"][0] < item["gpu"][1] <= t["gpu"]["end"]
        assert t["gpu"]["end"] <= t["phases"][-1][2] + 1.0  # the device's span fits the host's (a launch's latency)


@pytest.mark.parametrize(("flags", "error"), [
    (["--tick-trace", "/no/such/dir/t.jsonl"], "--tick-trace '/no/such/dir/t.jsonl' must be a file in an existing directory"),
    (["--tick-trace", "/tmp"], "--tick-trace '/tmp' must be a file in an existing directory"),
    (["--tick-trace-ticks", "5"], "--tick-trace-ticks needs --tick-trace"),
    (["--tick-trace", "/tmp/t.jsonl", "--tick-trace-ticks", "0"], "--tick-trace-ticks must be at least 1 (got 0)"),
], ids=["no directory", "a directory", "ticks alone", "no ticks"])
def test_serve_refuses_a_tick_trace_flag_it_cannot_honour_by_name(flags, error):
    from parley.realtime.cli import build_parser, serve_flag_error

    assert serve_flag_error(build_parser().parse_args(["serve", *flags])) == error
    assert serve_flag_error(build_parser().parse_args(["serve", "--tick-trace", "/tmp/t.jsonl"])) is None
