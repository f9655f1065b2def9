"""Network-edge CPU: where the server's CPU goes per session, codec threads vs codec processes.

    python benchmarks/edge_cpu.py --sessions 32 --codec-workers 0 --duration 15   # threads
    python benchmarks/edge_cpu.py --sessions 32 --codec-workers 2 --duration 15   # 2 processes

Starts a server over the fabricated `DelayBackend` (no model work: what is left is the edge)
in a subprocess, runs `benchmarks/load.py`'s paced /api/chat clients against it, and reads
per-thread CPU of the server from /proc before and after: the event-loop thread (uvicorn's,
the process's main thread), the engine thread, the codec threads (`opus_*`), and the codec
worker processes. Prints each as a share of one core, in total and per session, plus the
load run's delivery figures. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # delay_backend: the fabricated model the tests use
TICK = os.sysconf("SC_CLK_TCK")


def _name_os_threads() -> None:
    """Give every Python thread its name at the OS level (/proc/.../comm), so CPU can be split
    by role: Python does not do it itself."""
    import ctypes
    import threading

    libc = ctypes.CDLL(None)
    bootstrap = threading.Thread._bootstrap_inner

    def named(self):
        libc.prctl(15, self.name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
        bootstrap(self)

    threading.Thread._bootstrap_inner = named


def serve_main(port: int, sessions: int, codec_workers: int) -> None:
    import uvicorn

    from parley.engine import Engine
    from delay_backend import DelayBackend
    from parley.realtime.server.app import ServerInfo, create_app
    from parley.realtime.server.services import Services
    from parley.realtime.server.serve import uvicorn_config

    _name_os_threads()
    backend = DelayBackend(sessions)
    app = create_app(Services(Engine(backend), info=ServerInfo(model="delay"),
                     codec_workers=codec_workers, web_dir=None))
    uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning")).run()


def _cpu(stat_path: str) -> tuple[str, float]:
    with open(stat_path) as f:
        raw = f.read()
    name = raw[raw.index("(") + 1:raw.rindex(")")]
    fields = raw.rsplit(")", 1)[1].split()
    return name, (int(fields[11]) + int(fields[12])) / TICK


def sample(pid: int) -> dict[str, float]:
    """CPU seconds by role: loop (main thread), engine, codec threads, other threads, workers."""
    out = {"loop": 0.0, "engine": 0.0, "codec_threads": 0.0, "other_threads": 0.0, "workers": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, cpu = _cpu(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        if int(tid) == pid:
            out["loop"] += cpu
        elif name.startswith("parley-engine"):
            out["engine"] += cpu
        elif name.startswith("opus"):
            out["codec_threads"] += cpu
        else:
            out["other_threads"] += cpu
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            children = open(f"/proc/{pid}/task/{tid}/children").read().split()
        except OSError:
            continue
        for child in children:
            try:
                out["workers"] += _cpu(f"/proc/{child}/stat")[1]
            except OSError:
                pass
    return out


def frame_delay_metrics(text: str) -> dict:
    """Mean and bucketed p50 / p99 of /metrics' parley_frame_delay_seconds (tick end -> socket)."""
    import re
    buckets = [(float(b.replace("+Inf", "inf")), float(c)) for b, c in
               re.findall(r'^parley_frame_delay_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)]
    count = float(re.search(r"^parley_frame_delay_seconds_count (\S+)$", text, re.M).group(1))
    total = float(re.search(r"^parley_frame_delay_seconds_sum (\S+)$", text, re.M).group(1))
    out = {"edge_delay_mean_ms": 1000 * total / max(count, 1)}
    for q in (50, 99):
        bound = next((b for b, c in buckets if c >= q / 100 * count), float("nan"))
        out[f"edge_delay_p{q}_le_ms"] = 1000 * bound
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--codec-workers", type=int, default=0, help="0: threads; N: N worker processes")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_port is not None:
        serve_main(args.serve_port, args.sessions, args.codec_workers)
        return 0

    from load import free_port, run_load, stop_server

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-port", str(port), "--sessions", str(args.sessions),
                             "--codec-workers", str(args.codec_workers)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("server did not start")
                time.sleep(0.2)

        async def run() -> tuple[dict, dict, dict, float]:
            # the clients' handshakes and the start gate happen inside run_load; sample around it
            before, t0 = sample(proc.pid), time.monotonic()
            report = await run_load(f"ws://127.0.0.1:{port}", args.sessions, args.duration)
            after, wall = sample(proc.pid), time.monotonic() - t0
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            report.update(frame_delay_metrics(text))
            return before, after, report, wall

        before, after, report, wall = asyncio.run(run())
    finally:
        stop_server(proc)
    served = max(1, report["served"])
    print(f"sessions {args.sessions}  codec_workers {args.codec_workers}  wall {wall:.1f} s  served {served}")
    for role in before:
        cores = (after[role] - before[role]) / wall
        print(f"  cpu {role:<14} {100 * cores:6.1f}% of a core   {100 * cores / served:6.2f}% per session")
    total = sum(after[r] - before[r] for r in before) / wall
    print(f"  cpu total          {100 * total:6.1f}% of a core   {100 * total / served:6.2f}% per session")
    for key in ("jitter_p50_ms", "jitter_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "underruns", "frames_lost",
                "engine_dropped", "late_ticks", "skipped_ticks", "edge_delay_mean_ms", "edge_delay_p50_le_ms",
                "edge_delay_p99_le_ms"):
        value = report[key]
        print(f"  {key:<16} {value:.2f}" if isinstance(value, float) else f"  {key:<16} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
