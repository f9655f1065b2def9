"""Soak with faults: many paced /api/chat sessions for minutes while, once a minute, one
misbehaving client class (benchmarks/attacks.py's attacks, in turn) hits the server.

    python benchmarks/soak.py --spawn DIR --device cuda --sessions 64 --minutes 8 --kv-dtype fp8
    python benchmarks/soak.py --url ws://127.0.0.1:8998 --sessions 64 --minutes 8

Printed: every 10 s a sample (RSS, GPU memory used when nvidia-smi answers, late and skipped
ticks, frames the engine dropped, frames dropped for lag); each attack's outcome; at the end the
frames lost per session (input frames sent minus output frames received), and the RSS and GPU
memory trend (first and last minute's mean, and the slope per minute). The server needs
`--sessions` + 2 slots (the attacks take one or two).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import FRAME_S, _client_group, spawned_server  # noqa: E402
from attacks import ATTACKS, metric  # noqa: E402

SAMPLE_S = 10.0


def gpu_memory_mb() -> float:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(sum(float(x) for x in out.split()))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return float("nan")


def sample(http: str, start: float) -> dict:
    return {"t": time.monotonic() - start,
            "rss_mb": metric(http, "process_resident_memory_bytes") / 2**20,
            "gpu_mb": gpu_memory_mb(),
            "late": metric(http, "parley_engine_late_ticks_total"),
            "skipped": metric(http, "parley_engine_skipped_ticks_total"),
            "dropped": metric(http, "parley_engine_dropped_events_total"),
            "lag_dropped": sum(metric(http, "parley_lag_dropped_frames_total", f'{{protocol="{p}"}}')
                               for p in ("moshi", "openai"))}


def trend(samples: list[dict], key: str) -> str:
    t = np.array([s["t"] for s in samples]) / 60
    v = np.array([s[key] for s in samples])
    if v.size < 2 or not np.isfinite(v).all():
        return "n/a"
    first, last = v[t <= t[0] + 1].mean(), v[t >= t[-1] - 1].mean()
    slope = np.polyfit(t, v, 1)[0]
    return f"first minute {first:.1f} MB, last minute {last:.1f} MB, slope {slope:+.2f} MB/min"


async def soak(url: str, sessions: int, minutes: float, procs: int) -> None:
    http = url.replace("ws://", "http://")
    duration = minutes * 60
    # The paced clients run in `procs` processes (each client's Opus work holds its process's GIL;
    # one process tops out near 48 clients), all streaming from one instant once admitted.
    start_at = time.monotonic() + min(30.0, 2.0 + sessions * 0.2)
    groups = [list(range(sessions))[p::procs] for p in range(procs)]
    pool = concurrent.futures.ProcessPoolExecutor(procs)
    clients = [asyncio.wrap_future(pool.submit(_client_group, url, g, duration, start_at)) for g in groups]
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    start = time.monotonic()
    samples = [sample(http, start)]
    names = [n for n in ATTACKS if ATTACKS[n] is not None]

    async def sampler() -> None:
        while (left := duration - (time.monotonic() - start)) > 0:
            await asyncio.sleep(min(SAMPLE_S, left))  # the last sample at the end, not up to 10 s past it
            s = sample(http, start)
            samples.append(s)
            print(f"t={s['t']:.0f}s rss={s['rss_mb']:.1f}MB gpu={s['gpu_mb']:.0f}MB late={s['late']:.0f} "
                  f"skipped={s['skipped']:.0f} dropped={s['dropped']:.0f} lag_dropped={s['lag_dropped']:.0f}",
                  flush=True)

    async def attacker() -> None:
        minute = 0
        while (minute + 1) * 60 < duration:
            await asyncio.sleep(start + (minute + 0.5) * 60 - time.monotonic())
            name = names[minute % len(names)]
            try:
                result = await ATTACKS[name](url, http)
            except Exception as exc:  # an attack's own client failing is a result too
                result = {"client_error": f"{type(exc).__name__}: {exc}"}
            print(f"minute {minute}: {name}: {result}", flush=True)
            minute += 1

    await asyncio.gather(sampler(), attacker())
    stats = [st for group in await asyncio.gather(*clients) for st in group]
    pool.shutdown()
    # Only the streaming window counts: output frames that arrived once the client began sending.
    # The server speaks every tick, so a session can receive a few more frames than it sent.
    lost = [max(0, len(st.sent_at) - len([a for a in st.arrivals if st.sent_at and a >= st.sent_at[0]]))
            for st in stats if not st.refused]
    refused = sum(st.refused for st in stats)
    print(f"sessions {sessions} ({refused} refused, {procs} client processes), {duration / 60:.1f} min, "
          f"{int(duration / FRAME_S)} frames each")
    if lost:
        print(f"frames lost per session: mean {np.mean(lost):.1f}, max {max(lost)}, total {sum(lost)}")
    first, last = samples[0], samples[-1]
    print(f"late ticks {last['late'] - first['late']:.0f}, skipped {last['skipped'] - first['skipped']:.0f}, "
          f"engine-dropped {last['dropped'] - first['dropped']:.0f}, "
          f"lag-dropped {last['lag_dropped'] - first['lag_dropped']:.0f}")
    print(f"RSS: {trend(samples, 'rss_mb')}")
    print(f"GPU memory: {trend(samples, 'gpu_mb')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server, ws://HOST:PORT")
    p.add_argument("--spawn", default=None, help="tiny | echo | checkpoint dir: run `parley serve` for the run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--kv-dtype", choices=("fp8",), default=None)
    p.add_argument("--procs", type=int, default=4, help="client processes (one tops out near 48 clients)")
    args = p.parse_args(argv)
    if (args.url is None) == (args.spawn is None):
        p.error("give --url or --spawn")
    if args.url:
        asyncio.run(soak(args.url, args.sessions, args.minutes, args.procs))
        return 0
    extra = ["--kv-dtype", args.kv_dtype] if args.kv_dtype else []
    with spawned_server(args.spawn, args.sessions + 2, args.device, extra) as url:
        asyncio.run(soak(url, args.sessions, args.minutes, args.procs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
