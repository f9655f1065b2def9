"""Full garbage collections: frozen loaded objects leave them short, they are counted, and while an
engine ticks they run in its slack."""

from __future__ import annotations

import gc

import pytest

from delay_backend import DelayBackend, FakeTime, serve_one_session
from parley.engine import Engine, TickClock
from parley.engine.gc_pauses import FULL_COLLECTIONS, FullCollections, SlackCollections, freeze_loaded_objects
from parley.realtime.http.metrics import EdgeMetrics


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the rest of the test session collects as usual
    FULL_COLLECTIONS.uninstall()


def test_full_collections_are_counted_and_timed():
    timer = FullCollections().install()
    try:
        gc.collect(1)  # a younger generation is not a full collection
        assert timer.snapshot()["gc_full_collections"] == 0
        gc.collect()
        gc.collect()
    finally:
        timer.uninstall()
    snap = timer.snapshot()
    assert snap["gc_full_collections"] == 2
    assert 0 < snap["gc_full_max_seconds"] <= snap["gc_full_seconds"]
    gc.collect()
    assert timer.snapshot()["gc_full_collections"] == 2  # uninstalled: no longer counted


def test_frozen_objects_are_not_walked_again(unfrozen):
    keep = [[i] for i in range(50_000)]  # loaded state: tracked containers that stay alive
    frozen = freeze_loaded_objects()
    assert frozen >= len(keep) and gc.get_freeze_count() == frozen
    tracked = len(gc.get_objects())
    assert tracked < frozen  # a full pass now walks what was made since, not the loaded objects
    cycle = []
    cycle.append(cycle)  # garbage made while serving is still collected
    del cycle
    assert gc.collect() >= 1
    assert FULL_COLLECTIONS in gc.callbacks


def test_metrics_expose_full_collections(unfrozen):
    freeze_loaded_objects()
    gc.collect()
    text = EdgeMetrics().render().decode()
    line = next(x for x in text.splitlines() if x.startswith("parley_gc_full_collections_total "))
    assert float(line.split()[1]) >= 1
    assert "parley_gc_full_pause_max_seconds " in text
    assert "parley_gc_full_forced_total " in text


def test_a_process_that_froze_its_objects_exits_without_leak_reports():
    """Frozen objects are unfrozen at exit, so the interpreter's last collection frees them:
    Triton's nanobind extension counted its still-alive objects at teardown and printed ~45
    lines of "nanobind: leaked ..." at every server exit."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = ("import triton.language\nfrom parley.engine.gc_pauses import freeze_loaded_objects\n"
              "freeze_loaded_objects()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "leaked" not in done.stderr, done.stderr[-2000:]



def test_thread_cpu_is_read_per_named_thread():
    """parley_thread_cpu_seconds: each named thread's own CPU time, from its OS id (Linux /proc);
    a thread not started yet (None) is left out."""
    import os
    import threading
    import time

    from parley.realtime.server.workers import cpu_seconds

    ids: dict[str, int | None] = {"loop": threading.get_native_id(), "engine": None}
    burned, release = threading.Event(), threading.Event()

    def burn() -> None:
        ids["engine"] = threading.get_native_id()
        start = time.thread_time()
        while time.thread_time() - start < 0.3:  # CPU time, not wall: the box may be loaded
            sum(range(100))
        burned.set()
        release.wait(30)

    def read() -> dict[str, float]:
        text = EdgeMetrics(threads=lambda: dict(ids)).render().decode()
        return {x.split('"')[1]: float(x.split()[1]) for x in text.splitlines()
                if x.startswith("parley_thread_cpu_seconds_total{")}

    assert set(read()) == {"loop"}
    worker = threading.Thread(target=burn)
    worker.start()
    try:
        assert burned.wait(30)
        seconds = read()
    finally:
        release.set()
        worker.join()
    assert set(seconds) == {"loop", "engine"}
    assert 0.15 <= seconds["engine"] < 5  # its 0.3 s, as /proc counts it (10 ms ticks, sampled on some kernels)
    # each thread's own CPU, not its process's: the burnt 0.3 s is not the loop's
    assert seconds["loop"] <= cpu_seconds([os.getpid()]) - 0.15


def test_slack_collections_run_between_ticks_and_give_the_thresholds_back():
    clock = FakeTime()
    slack = SlackCollections(now=clock.now, min_interval_s=10.0, max_interval_s=60.0)
    before = gc.get_threshold()
    assert not slack.maybe_collect(None)  # not taken over: CPython's own passes
    slack.take_over()
    slack.take_over()  # a second engine in the process
    try:
        assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] > 10 ** 8
        clock.t = 9.9
        assert not slack.maybe_collect(None)  # too soon since the last
        clock.t = 10.0
        assert slack.maybe_collect(1.0) and slack.in_slack == 1 and slack.last_pause_s > 0
        clock.t = 25.0
        assert not slack.maybe_collect(0.0)  # due, but no slack can hold it
        clock.t = 69.9
        assert not slack.maybe_collect(0.0)
        clock.t = 70.0
        assert slack.maybe_collect(0.0) and slack.forced == 1  # bounded: forced after max_interval_s
        slack.give_back()
        assert gc.get_threshold()[2] > 10 ** 8  # the other engine still ticks
    finally:
        slack.give_back()
    assert gc.get_threshold() == before


def _serve_twelve_ticks(fake: FakeTime, backend: DelayBackend):
    """One session served 12 clocked ticks with full passes due every 0.3 s (fake time): the
    engine, its collector, and the fake times at which full passes started."""
    passes = []

    def on_gc(phase, info):
        if phase == "start" and info["generation"] == 2:
            passes.append(fake.t)

    engine = Engine(backend, clock=TickClock(0.08, now=fake.now, sleep=fake.sleep))
    engine.collections = slack = SlackCollections(now=fake.now, min_interval_s=0.3, max_interval_s=60.0)
    slack.take_over()
    gc.callbacks.append(on_gc)
    try:
        serve_one_session(engine, 12)
    finally:
        gc.callbacks.remove(on_gc)
        slack.give_back()
        engine.shutdown()
    return engine, slack, passes


def test_a_clocked_engine_runs_its_full_collections_where_the_slack_holds_them():
    """Steps of 70 ms leave 10 ms before the next tick: a due pass waits (its first estimate is
    50 ms) until a 10 ms step leaves room, and never runs inside a step."""
    fake = FakeTime()
    steps = []

    def on_step(i, frames, mask):
        steps.append(fake.t)
        fake.t += 0.07 if i < 8 else 0.01

    engine, slack, passes = _serve_twelve_ticks(fake, DelayBackend(2, on_step=on_step))
    assert slack.forced == 0 and slack.in_slack >= 1
    first = passes[0]
    assert first > steps[8]  # the 70 ms steps' slack could not hold it
    assert all(not (t <= first < t + 0.01) for t in steps)  # between ticks, not inside a step
    assert engine.counters()["late_ticks"] == 0


def test_a_due_full_collection_runs_beside_the_queued_device_step():
    """At 256 live a tick takes ~45 ms of its 80, and no slack after it holds a 35-50 ms pass (H200
    run, docs/benchmarks.md). A step queued on the device (10 ms to launch, 60 ms to compute) leaves
    the host free meanwhile: the due pass runs there, not forced later, and the tick stays on time."""
    fake = FakeTime()
    waits = []
    done = [0.0]

    def on_step(i, frames, mask):
        fake.t += 0.01  # launching
        done[0] = fake.t + 0.06  # the device's share

    def queue_wait():
        waits.append((done[0] - 0.06, done[0]))
        fake.t = max(fake.t, done[0])

    engine, slack, passes = _serve_twelve_ticks(fake, DelayBackend(2, on_step=on_step, queue_wait=queue_wait))
    assert slack.forced == 0 and slack.in_slack >= 1 and passes
    # each pass started while a queued step computed: after its launch, before the wait for it
    assert all(any(launched <= t < ready for launched, ready in waits) for t in passes)
    assert engine.counters()["late_ticks"] == 0
