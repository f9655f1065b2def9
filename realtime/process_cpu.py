"""CPU seconds of worker processes (the codec's, WebRTC's), read from Linux /proc: what /metrics and
the benchmarks report beside process_cpu_seconds_total, which covers the server process only."""

from __future__ import annotations

import os
from typing import Iterable


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU of the processes (all their threads); one that is gone counts 0."""
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, IndexError, ValueError):
            continue
    return total
