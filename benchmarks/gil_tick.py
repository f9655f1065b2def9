"""The engine's tick beside a busy event loop: what the GIL's switch interval costs each tick.

    python benchmarks/gil_tick.py --sessions 256 --seconds 10

The engine thread shares the GIL with the event loop, and every torch call in its tick gives the
GIL up and takes it back. This runs the real Engine on its thread over the tests' DelayBackend (no
model: its step sleeps `--frame-ms`, as the host waits on a GPU frame with the GIL released),
`--sessions` sessions fed a frame each tick and drained on the asyncio loop, and beside them a
load on the loop that runs Python for `--busy` of every 10 ms without yielding (the protocol work
of hundreds of sockets). For Python's default switch interval (5 ms) and the engine's
(`engine.GIL_SWITCH_S`): the tick p50 / p99 (the engine's own histogram: plan to routed outputs),
late ticks, and the load's work per second (what the shorter interval costs the loop).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # delay_backend: the fabricated model the tests use

from delay_backend import DelayBackend  # noqa: E402

from parley.engine import Engine  # noqa: E402
from parley.engine.engine import GIL_SWITCH_S  # noqa: E402
from parley.models.config import FRAME_RATE, FRAME_SAMPLES  # noqa: E402


async def one_run(sessions: int, frame_s: float, busy: float, seconds: float, interval: float) -> dict:
    engine = Engine(DelayBackend(sessions, step_seconds=frame_s))
    engine.start()
    sys.setswitchinterval(interval)  # after start(), which lowers it to GIL_SWITCH_S
    opened = [await engine.open() for _ in range(sessions)]
    pcm = (np.random.default_rng(0).standard_normal(FRAME_SAMPLES) * 0.1).astype(np.float32)
    stop = time.monotonic() + seconds
    work = 0

    async def feed() -> None:  # a frame a tick into every session; outputs drained as the edge would
        nxt = time.monotonic()
        while time.monotonic() < stop:
            for s in opened:
                s.push_audio(pcm)
                s.events.drain()
            nxt += 1 / FRAME_RATE
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    async def load() -> None:  # Python that holds the GIL for `busy` of every 10 ms
        nonlocal work
        while time.monotonic() < stop:
            until = time.perf_counter() + 0.010 * busy
            while time.perf_counter() < until:
                sum(range(64))
                work += 1
            await asyncio.sleep(0.010 * (1 - busy))

    start = engine.counters()
    await asyncio.gather(feed(), load())
    end = engine.counters()
    await asyncio.to_thread(engine.shutdown)
    ticks = end["ticks"] - start.get("ticks", 0)
    return {"interval": interval, "ticks": ticks, "p50": end["tick_ms_p50"], "p99": end["tick_ms_p99"],
            "late": end.get("late_ticks", 0) - start.get("late_ticks", 0), "work": work / seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=256)
    p.add_argument("--frame-ms", type=float, default=40.0, help="the backend's step, GIL released (a GPU frame)")
    p.add_argument("--busy", type=float, default=0.95, help="share of every 10 ms the loop's load holds the GIL")
    p.add_argument("--seconds", type=float, default=10.0, help="per switch interval")
    args = p.parse_args(argv)
    if not 0 <= args.busy < 1 or args.sessions < 1 or args.seconds <= 0:
        p.error("--busy must be in [0, 1), --sessions at least 1, --seconds more than 0")
    print(f"{args.sessions} sessions, a {args.frame_ms:g} ms frame, the loop's load holding the GIL "
          f"{100 * args.busy:.0f} % of the time; {args.seconds:g} s each")
    print("| switch interval | ticks | tick p50 ms | tick p99 ms | late ticks | loop load, work/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for interval in (0.005, GIL_SWITCH_S):
        r = asyncio.run(one_run(args.sessions, args.frame_ms / 1000, args.busy, args.seconds, interval))
        print(f"| {1000 * r['interval']:g} ms | {r['ticks']} | {r['p50']:.1f} | {r['p99']:.1f} | {r['late']} | "
              f"{r['work']:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
