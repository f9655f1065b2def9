"""benchmarks/tick_timeline.py: a small fabricated tick trace read into its one table, to known figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tick_timeline

HEADER = {"trace": "parley tick timeline", "period_ms": 80.0, "gpu": True, "max_ticks": 100}
# A tick with a frame (GC beside it) and two slack items, then one with no frame and one TTS item.
FRAMED = {"tick": 7, "wall": 1.0, "trace_ms": 0.2,
          "phases": [["plan", 0, 1, 0.5], ["rows", 1, 2, 1], ["launch", 2, 5, 2], ["beside", 5, 6, 1],
                     ["wait", 6, 20, 0.5], ["route", 20, 22, 2], ["gc", 22, 23, 1], ["slack", 23, 53, 20]],
          "slack": [{"kind": "tts", "key": ["tts", 8], "realtime": True, "start": 24, "queued": 30, "end": 34,
                     "cpu_run": 5, "cpu_sync": 4, "failed": False, "gpu": [25, 33]},
                    {"kind": "images", "key": ["image", 512], "realtime": False, "start": 35, "queued": 40,
                     "end": 50, "cpu_run": 5, "cpu_sync": 10, "failed": False, "gpu": [36, 49]}],
          "gpu": {"frame": [3, 19], "end": 53.5}}
SLACK_ONLY = {"tick": 8, "wall": 1.08, "trace_ms": 0.4,
              "phases": [["plan", 0, 1, 1], ["rows", 1, 2, 1], ["gc", 2, 3, 1], ["slack", 3, 13, 10]],
              "slack": [{"kind": "tts", "key": ["tts", 8], "realtime": True, "start": 3, "queued": 5, "end": 13,
                         "cpu_run": 1, "cpu_sync": 8, "failed": False, "gpu": [4, 12]}],
              "gpu": {"frame": None, "end": 13}}


def write(path: Path, *lines: dict) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_table_gives_each_rows_mean_p99_and_share_of_the_period(tmp_path, capsys):
    assert tick_timeline.main([str(write(tmp_path / "t.jsonl", HEADER, FRAMED, SLACK_ONLY))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["2 ticks (1 with a frame), period 80 ms, device times: yes",
                       "| per tick | mean ms | p99 ms | share of 80 ms |", "|---|---:|---:|---:|"]
    assert out[3:] == [
        "| device: frame | 8.00 | 16.00 | 10.0 % |",
        "| device: slack images | 6.50 | 13.00 | 8.1 % |",
        "| device: slack tts | 8.00 | 8.00 | 10.0 % |",
        "| device: gaps inside the tick's work | 10.75 | 16.50 | 13.4 % |",  # 53.5 - 37 and 13 - 8
        "| device: idle tail to the period | 46.75 | 67.00 | 58.4 % |",
        "| device -> host: frame end to output on host | 0.50 | 1.00 | 0.6 % |",  # wait's end 20, frame's 19
        "| host: plan | 1.00 | 1.00 | 1.2 % |",
        "| host: rows | 1.00 | 1.00 | 1.2 % |",
        "| host: launch | 1.50 | 3.00 | 1.9 % |",
        "| host: beside | 0.50 | 1.00 | 0.6 % |",
        "| host: wait | 7.00 | 14.00 | 8.8 % |",
        "| host: route | 1.00 | 2.00 | 1.2 % |",
        "| host: gc | 1.00 | 1.00 | 1.2 % |",
        "| host: slack images | 7.50 | 15.00 | 9.4 % |",
        "| host: slack tts | 10.00 | 10.00 | 12.5 % |",
        "| host: between slack items (the runner) | 2.50 | 5.00 | 3.1 % |",  # 30 - 25, 10 - 10
        "| host: idle tail to the period | 47.00 | 67.00 | 58.8 % |",
        "| GIL: off-CPU in plan/rows/launch/beside/route/gc | 0.75 | 1.50 | 0.9 % |",  # plan 0.5 + launch 1
        "| off-CPU in slack items' run | 1.00 | 1.00 | 1.2 % |",
        "| trace bookkeeping | 0.30 | 0.40 | 0.4 % |",
    ]


def test_p99_is_the_nearest_rank():
    assert tick_timeline.p99(list(range(1, 101))) == 99
    assert tick_timeline.p99([5.0]) == 5.0


def test_a_file_that_is_not_a_trace_is_refused_by_name(tmp_path):
    path = write(tmp_path / "x.jsonl", {"tick": 1})
    with pytest.raises(SystemExit, match="x.jsonl is not a tick trace"):
        tick_timeline.main([str(path)])
