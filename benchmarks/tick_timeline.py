"""Where a tick's period goes, from the engine's tick timeline (`parley serve --tick-trace PATH`).

    python benchmarks/tick_timeline.py /tmp/together.jsonl
    # the together phase of every kind at once, traced and cut out by mixed_load.py (docs/benchmarks.md):
    python benchmarks/mixed_load.py --models /tmp/models --duplex 48 --tts 12 --transcription 48 --images 4 \\
        --image-size 512x512 --image-steps 20 --duration 15 --procs 4 --serve-arg=--device=cuda \\
        --serve-arg=--kv-dtype=fp8 --tick-trace /tmp/together.jsonl

One table, per traced tick (ms): its mean, p99 and the mean's share of the period, for
- the device (CUDA traces): the frame's span; slack spans by kind (prefill, transcription, tts,
  images); gaps inside the tick's work (its span, anchor to end, less the frame's and the items'); the
  idle tail, from the tick's work's end to the period; the frame's return (its device end to its
  output on the host: the host copy, the thread's wake-up and its GIL wait);
- the host: each phase of engine/tick_trace.py (plan, rows, launch, beside, wait, route, gc), the
  slack items by kind and the slack runner's own time between them; the engine thread's idle tail;
- the GIL: off-CPU time (wall less thread CPU) in the phases that make no device wait (plan, rows,
  launch, beside, route, gc): an upper bound on the GIL wait, the GIL wait itself where a core is
  free; and the same in slack items' `run` (which may wait on the device: no GIL figure);
- the trace's own bookkeeping.
What each span includes is engine/tick_trace.py's rule 4: idle inside a span counts in the span.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

HEADER = "parley tick timeline"  # engine/tick_trace.py's header line
NO_DEVICE_WAIT = ("plan", "rows", "launch", "beside", "route", "gc")  # host phases with no device wait
HOST_PHASES = ("plan", "rows", "launch", "beside", "wait", "route", "gc")


def read_trace(path: Path) -> tuple[dict, list[dict]]:
    """(header, tick lines) of a trace; SystemExit naming the file when it is not one."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or lines[0].get("trace") != HEADER:
        raise SystemExit(f"tick_timeline.py: {path} is not a tick trace (parley serve --tick-trace)")
    return lines[0], lines[1:]


def device_figures(tick: dict, period: float) -> dict[str, float]:
    """The tick's device rows (empty without device times)."""
    gpu = tick.get("gpu")
    if gpu is None:
        return {}
    rows: dict[str, float] = defaultdict(float)
    frame = gpu["frame"]
    rows["device: frame"] = frame[1] - frame[0] if frame else 0.0
    for item in tick["slack"]:
        if item.get("gpu"):
            rows[f"device: slack {item['kind']}"] += item["gpu"][1] - item["gpu"][0]
    busy = sum(rows.values())
    rows["device: gaps inside the tick's work"] = gpu["end"] - busy
    rows["device: idle tail to the period"] = max(0.0, period - gpu["end"])
    wait = phase(tick, "wait")
    if frame and wait is not None:
        rows["device -> host: frame end to output on host"] = wait[2] - frame[1]
    return rows


def host_figures(tick: dict, period: float) -> dict[str, float]:
    """The tick's host rows: phases, slack items by kind, the runner between them, the idle tail."""
    rows: dict[str, float] = defaultdict(float)
    for name, start, end, _ in tick["phases"]:
        if name in HOST_PHASES:
            rows[f"host: {name}"] += end - start
    items = 0.0
    for item in tick["slack"]:
        rows[f"host: slack {item['kind']}"] += item["end"] - item["start"]
        items += item["end"] - item["start"]
    slack = phase(tick, "slack")
    if slack is not None:
        rows["host: between slack items (the runner)"] = slack[2] - slack[1] - items
    rows["host: idle tail to the period"] = max(0.0, period - tick["phases"][-1][2])
    return rows


def gil_figures(tick: dict) -> dict[str, float]:
    off_cpu = sum(end - start - cpu for name, start, end, cpu in tick["phases"] if name in NO_DEVICE_WAIT)
    in_items = sum(item["queued"] - item["start"] - item["cpu_run"] for item in tick["slack"])
    return {"GIL: off-CPU in plan/rows/launch/beside/route/gc": off_cpu, "off-CPU in slack items' run": in_items,
            "trace bookkeeping": tick["trace_ms"]}


def phase(tick: dict, name: str) -> list | None:
    return next((p for p in tick["phases"] if p[0] == name), None)


# The table's order: a row goes with the first of these its name starts with (kinds alphabetical among them).
ORDER = ("device: frame", "device: slack", "device: gaps", "device: idle", "device -> host",
         *(f"host: {name}" for name in HOST_PHASES), "host: slack", "host: between", "host: idle", "GIL",
         "off-CPU", "trace")


def rank(name: str) -> int:
    return next(i for i, prefix in enumerate(ORDER) if name.startswith(prefix))


def p99(values: list[float]) -> float:
    """Nearest rank: the value 99 % of the ticks are at or below."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def summarize(header: dict, ticks: list[dict]) -> list[tuple[str, float, float, float]]:
    """(row, mean ms, p99 ms, mean's share of the period) for every row; a row a tick lacks counts 0 there."""
    period = header["period_ms"]
    per_tick = [{**device_figures(t, period), **host_figures(t, period), **gil_figures(t)} for t in ticks]
    names: list[str] = []
    for figures in per_tick:
        names += [name for name in figures if name not in names]
    names.sort(key=lambda name: (rank(name), name))
    out = []
    for name in names:
        values = [figures.get(name, 0.0) for figures in per_tick]
        mean = sum(values) / len(values)
        out.append((name, mean, p99(values), mean / period))
    return out


def table(header: dict, ticks: list[dict]) -> list[str]:
    period = header["period_ms"]
    framed = sum(1 for t in ticks if phase(t, "wait") or phase(t, "launch"))
    lines = [f"{len(ticks)} ticks ({framed} with a frame), period {period:g} ms, device times: "
             f"{'yes' if header['gpu'] else 'no'}",
             f"| per tick | mean ms | p99 ms | share of {period:g} ms |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {mean:.2f} | {high:.2f} | {100 * share:.1f} % |"
              for name, mean, high, share in summarize(header, ticks)]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a tick trace (parley serve --tick-trace, mixed_load.py --tick-trace)")
    args = p.parse_args(argv)
    header, ticks = read_trace(args.trace)
    if not ticks:
        raise SystemExit(f"tick_timeline.py: {args.trace} holds no tick")
    print("\n".join(table(header, ticks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
