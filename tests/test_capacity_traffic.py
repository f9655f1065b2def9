"""benchmarks/capacity.py's traffic: the load it claims (Little's law) is the load it offers.

The capacity figure is the most sessions held at once, so the schedule must put `--target`
sessions live: from the start with --steady, after the first lengths have run out without it;
and no session may outlast the run (the run's end closes it).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
capacity = pytest.importorskip("capacity")


def live_at(arrivals, t: float) -> int:
    return sum(a.at <= t < a.at + a.length for a in arrivals)


def mean_live(target: float, t: float, steady: bool, seeds: range) -> float:
    return float(np.mean([live_at(capacity.schedule(target, 20, 1.0, s, steady), t) for s in seeds]))


def test_steady_start_holds_the_target_from_the_ramp_on():
    # 40 s: just past the ramp; 5 and 15 min: long after the first lengths ran out
    for t in (40.0, 300.0, 900.0):
        assert mean_live(200, t, True, range(12)) == pytest.approx(200, rel=0.06), t


def test_empty_start_reaches_the_target_only_after_the_lengths_run_out():
    assert mean_live(200, 40.0, False, range(12)) < 0.4 * 200
    assert mean_live(200, 900.0, False, range(12)) == pytest.approx(200, rel=0.06)


def test_sessions_are_ordered_and_end_with_the_run():
    for steady in (False, True):
        arrivals = capacity.schedule(64, 3, 1.0, 1, steady)
        assert [a.index for a in arrivals] == list(range(len(arrivals)))
        assert all(x.at <= y.at for x, y in zip(arrivals, arrivals[1:]))
        assert all(0 <= a.at < 180 and a.at + a.length <= 180 + 3 * capacity.FRAME_S for a in arrivals)
        assert sum(a.at + a.length >= 180 - 1e-6 for a in arrivals) > 10  # cut at the end, not dropped


def test_server_log_lines_come_once_and_whole(tmp_path, capsys):
    path = tmp_path / "serve.log"
    log = capacity.ServerLog(path)
    assert log.new_lines() == []  # not written yet
    path.write_text("a WARNING tick 7 started 12.0 ms late\nhalf a li")
    assert log.new_lines() == ["a WARNING tick 7 started 12.0 ms late"]
    with open(path, "a") as f:
        f.write("ne\n\nb ERROR x\n")
    assert log.new_lines() == ["half a line", "b ERROR x"]  # the held-back line whole, the blank one dropped
    assert log.new_lines() == []
    capacity.show_server_lines([f"line {i}" for i in range(capacity.SERVER_LINES + 3)])
    shown = capsys.readouterr().err.splitlines()
    assert shown[:capacity.SERVER_LINES] == [f"  server: line {i}" for i in range(capacity.SERVER_LINES)]
    assert shown[capacity.SERVER_LINES:] == ["  server: ... 3 more lines in its log"]


def test_a_period_ends_with_its_server_side_line():
    start = capacity.Sample(0.0, 0, None, 0, 0, 0, 0, 0, 0.0, 0.0, (0.0,) * 5, (0.0, 0.0, 0.0))
    end = capacity.Sample(59.0, 250, 52.5, 4934, 1, 0, 750, 3, 25.0, 30.0, (0.9, 0.6, 0.7, 29.0, 2.4), (6.0, 0.2, 0.0))
    p = capacity.periods([start, end], [], 60.0, 120.0)[0]
    assert p.server_line() == ("minute 0 done: live max 250, frame p99 52.5 ms, 0.40 % of frames over 60 ms, late 1, "
                               "engine drops 0, KV blocks 4934, loop / engine cores 0.42 / 0.51, edge CPU per session "
                               "- ms/s, engine process CPU - ms per tick, tick ms 1.2/0.8/0.9/38.7/3.2")


def test_a_split_servers_process_cpu_per_session_and_per_tick():
    """With edge workers the scrape names each process's CPU: the edges' per live session, the engine's per tick."""
    text = ('parley_process_cpu_seconds_total{process="edge-0"} 10.0\n'
            'parley_process_cpu_seconds_total{process="edge-1"} 2.0\n'
            'parley_process_cpu_seconds_total{process="engine"} 40.0\n')
    assert capacity.process_cpu(text) == (12.0, 40.0)
    assert [math.isnan(v) for v in capacity.process_cpu("process_cpu_seconds_total 3.0\n")] == [True, True]
    start = capacity.Sample(0.0, 100, None, 0, 0, 0, 0, 0, 0.0, 0.0, (0.0,) * 5, (0.0,) * 3, 0.0, 0.0)
    mid = capacity.Sample(10.0, 100, 40.0, 0, 0, 0, 125, 0, 1.0, 1.0, (0.0,) * 5, (0.0,) * 3, 3.0, 5.0)
    end = capacity.Sample(20.0, 100, 40.0, 0, 0, 0, 250, 0, 2.0, 2.0, (0.0,) * 5, (0.0,) * 3, 6.0, 10.0)
    p = capacity.periods([start, mid, end], [], 60.0, 60.0)[0]
    assert p.edge_ms_per_session == pytest.approx(1000 * 6.0 / 20.0 / 100)  # 0.3 cores over 100 live
    assert p.engine_ms_per_tick == pytest.approx(1000 * 10.0 / 250)
