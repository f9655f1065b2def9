"""Full garbage collections: frozen loaded objects leave them short, and they are counted."""

from __future__ import annotations

import gc

import pytest

from parley.engine.gc_pauses import FULL_COLLECTIONS, FullCollections, freeze_loaded_objects
from parley.realtime.metrics_api import EdgeMetrics


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

    from parley.realtime.worker_processes import cpu_seconds

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
