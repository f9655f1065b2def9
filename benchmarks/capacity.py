"""Capacity under traffic shaped like real calls: sessions arrive over time and last for lengths
drawn from a stated distribution, over real sockets (/api/chat, Ogg-Opus both ways, paced on
the 80 ms grid), against a `parley serve` this script starts or one already running.

    # the H200 run (issue 32): Moshi-7B shapes, random weights, fp8 KV, 10+ minutes
    python benchmarks/load_7b.py --dir /tmp/moshi7b --batches 1 --frames 1     # writes the checkpoint once
    python benchmarks/capacity.py --spawn /tmp/moshi7b --device cuda --target 256 --minutes 10 --steady \\
        --max-sessions 288 --procs 8 --serve-arg=--kv-dtype=fp8 --serve-arg=--kv-memory=108 \\
        --serve-arg=--kv-policy=shrink
    # in seconds on a CPU with the tiny model (the smoke test): every length and the clock x 0.02
    python benchmarks/capacity.py --spawn tiny --target 3 --minutes 0.3 --time-scale 0.02

Traffic. Session lengths are log-normal with median 120 s and sigma 0.541 = ln(240 / 120) / 1.2816
(z at 0.90), so 10 % of sessions last past 4 min (the window) and the mean is 139 s. Arrivals are
Poisson at rate target / mean length (Little's law: `--target` sessions live on average once
the first lengths have run out; with `--steady` the run starts there, `--target` sessions already
under way with the residual lengths of the steady state). The run lasts `--minutes`: a session
still live at the end is closed then, its length cut. `--time-scale` multiplies every length, the arrival gaps and the
report period (a minute), nothing else: frames stay 80 ms. A refused session (HTTP 503 before the
upgrade, or a close before the handshake) is counted and not retried.

Printed per period (a minute, scaled): sessions arrived, refused, the most live at once (the
server's /load, sampled every second, scaled), the engine's frame time p99 (the most /load's
tick_ms_p99 read in the period) and the share of frames over 60 ms (its tick histogram, exact at
that bound), late ticks, frames lost (sessions that ended in the period: input frames sent minus
output frames received, plus frames the engine dropped), KV blocks used (the most read), and the
CPU of the server's event loop and engine threads in cores (`parley_thread_cpu_seconds_total`):
they share one GIL, so a sum near 1 means the ticks wait for the loop's Python (with `--edge-workers`,
"loop" adds up every worker's loop). With `--edge-workers`, also the edge workers' CPU per live session
(ms of CPU a second, every worker process together over the mean live) and the engine process's CPU
per tick (`parley_process_cpu_seconds_total{process}`). Then where the
ticks' time went, mean ms per tick (`parley_engine_tick_*_seconds_total`): the plan (rows and
their input frames), the rows' changes before the step (resets, KV blocks), launching the step,
waiting for the device (and the output copy), and routing the outputs to the sessions' streams.
The progress lines (every 10 s) add the full garbage collections in the server and their pauses
(each stops every thread, the engine's too), and, with --spawn, the lines its log gained since the
last one (it logs warnings and errors: a late tick is one, naming what ran before it; at most
SERVER_LINES a progress line, the rest counted). Each period's server-side figures also go to
stderr as it ends (`minute N done: ...`), so a run whose final table is lost keeps them. At the
end: the most concurrent sessions held in a period with frame p99 <= 60 ms (at most 1 % of its
frames over 60 ms), 0 late ticks and 0 frames lost; and the server's own refusals by reason
(`parley_refusals_total`: `full` slots or KV `memory`), which a client's 503 does not tell apart.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from parley.engine import TICK_PHASES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import FRAME_S, ClientStats, client, process_cpu, spawned_server  # noqa: E402

MEDIAN_S = 120.0  # median session length
PAST_WINDOW = 0.10  # the share of sessions longer than WINDOW_S
WINDOW_S = 240.0  # Moshi's KV window (3000 frames)
SIGMA = math.log(WINDOW_S / MEDIAN_S) / 1.2815515655446004  # 0.541: P(length > 240 s) = 10 %
MEAN_S = MEDIAN_S * math.exp(SIGMA ** 2 / 2)  # 139 s
PERIOD_S = 60.0  # one report line per minute (scaled)
FRAME_P99_S = 0.060  # the frame-time bound a held period must keep
TAIL_S = 0.6  # load.client reads this long after its last frame
RAMP_S = 30.0  # --steady: the sessions under way at the start open over this long
PROGRESS_S = 10.0  # a progress line on stderr this often (scaled), for runs polled while they go
SERVER_LINES = 5  # the spawned server's new log lines shown with a progress line, at most


@dataclass
class Arrival:
    index: int
    at: float  # seconds after the start (scaled)
    length: float  # seconds of audio it streams (scaled)


def schedule(target: float, minutes: float, time_scale: float, seed: int, steady: bool = False) -> list[Arrival]:
    """Poisson arrivals over the run, each with a log-normal length, cut at the run's end.

    steady: the run starts in the steady state instead of empty. Besides the arrivals, Poisson(target)
    sessions are already under way (Little's law); a session in progress has a length-biased length
    (for a log-normal, log-normal again with mu + sigma^2) of which a uniform share is still to run.
    They open over the first RAMP_S (scaled), so the server takes no burst of handshakes at once,
    each ending when it would have in the steady state: from the ramp's end on, the load is full."""
    rng = np.random.default_rng(seed)
    rate = target / (MEAN_S * time_scale)  # sessions per (scaled) second
    end = minutes * 60 * time_scale
    drawn: list[tuple[float, float]] = []
    if steady:
        for _ in range(int(rng.poisson(target))):
            whole = float(rng.lognormal(math.log(MEDIAN_S) + SIGMA ** 2, SIGMA)) * time_scale
            left, opens = whole * float(rng.uniform()), float(rng.uniform(0, RAMP_S * time_scale))
            if left > opens + 3 * FRAME_S:  # else it would have ended before it opened
                drawn.append((opens, left - opens))
    t = rng.exponential(1 / rate)
    while t < end:
        drawn.append((t, float(rng.lognormal(math.log(MEDIAN_S), SIGMA)) * time_scale))
        t += rng.exponential(1 / rate)
    drawn.sort()
    return [Arrival(i, at, max(min(length, end - at), 3 * FRAME_S)) for i, (at, length) in enumerate(drawn)]


@dataclass
class Ended:
    """What the main process keeps of one session."""

    arrived: float  # seconds after the start
    ended: float
    refused: bool
    lost: int  # input frames sent minus output frames received since the first send


def _arrival_group(url: str, arrivals: list[Arrival], start_at: float) -> list[tuple[Arrival, ClientStats]]:
    """One client process: each session opens at its arrival time (monotonic clock, shared by
    every process on the host) and streams its length."""

    async def one(a: Arrival) -> tuple[Arrival, ClientStats]:
        await asyncio.sleep(max(0.0, start_at + a.at - time.monotonic()))
        gate = asyncio.Event()
        gate.set()
        return a, await client(url, a.index, a.length, gate)

    async def main() -> list[tuple[Arrival, ClientStats]]:
        return list(await asyncio.gather(*(one(a) for a in arrivals)))

    return asyncio.run(main())


def _ended(a: Arrival, stats: ClientStats, start_at: float) -> Ended:
    if stats.refused or stats.timed_out or not stats.sent_at:
        return Ended(a.at, a.at, True, 0)
    received = [t for t in stats.arrivals if t >= stats.sent_at[0]]
    end = max(stats.sent_at[-1], *(received or [0.0])) - start_at
    return Ended(a.at, end, False, max(0, len(stats.sent_at) - len(received)))


@dataclass
class Sample:
    t: float
    live: int
    tick_p99_ms: float | None
    kv_used: int | None
    late: float
    dropped: float
    ticks: float
    ticks_over: float  # ticks longer than FRAME_P99_S (the tick histogram's cumulative count)
    loop_cpu: float  # CPU seconds of the server's event loop and engine threads so far (nan: not exported)
    engine_cpu: float
    phases: tuple[float, ...] = ()  # seconds the ticks spent in each of TICK_PHASES so far (nan: not exported)
    # full collections so far, their seconds, and those forced with no slack to hold them
    gc_full: tuple[float, float, float] = (float("nan"),) * 3
    # CPU seconds so far of the edge worker processes together and of the engine process (`--edge-workers`;
    # nan in one process, whose loop and engine share it)
    edge_cpu: float = float("nan")
    engine_process_cpu: float = float("nan")


def phase_ms(later: Sample, earlier: Sample) -> str:
    """Each phase's mean ms per tick between two samples, "plan/rows/launch/device/route"."""
    ticks = later.ticks - earlier.ticks
    if ticks <= 0 or not later.phases or not earlier.phases:
        return "-"
    return "/".join(f"{1000 * (a - b) / ticks:.1f}" for a, b in zip(later.phases, earlier.phases))


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def sample(http: str, start_at: float) -> Sample:
    load = json.loads(urllib.request.urlopen(f"{http}/load", timeout=10).read())
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    count = _metric(text, "parley_engine_tick_seconds_count")
    within = _metric(text, f'parley_engine_tick_seconds_bucket{{le="{FRAME_P99_S}"}}')
    return Sample(time.monotonic() - start_at, int(load["live"]) + int(load["prefill"]), load["tick_ms_p99"],
                  load.get("kv_blocks_used"), _metric(text, "parley_engine_late_ticks_total"),
                  _metric(text, "parley_engine_dropped_events_total"), count, count - within,
                  _metric(text, 'parley_thread_cpu_seconds_total{thread="loop"}'),
                  _metric(text, 'parley_thread_cpu_seconds_total{thread="engine"}'),
                  tuple(_metric(text, f"parley_engine_tick_{phase}_seconds_total") for phase in TICK_PHASES),
                  tuple(_metric(text, f"parley_gc_full_{name}_total") for name in ("collections", "pause_seconds", "forced")),
                  *process_cpu(text))


@dataclass
class Period:
    index: int
    arrived: int = 0
    refused: int = 0
    live_max: int = 0
    tick_p99_ms: float = 0.0
    over_share: float = 0.0
    late: float = 0.0
    lost: float = 0.0
    kv_used: int | None = None
    loop_cores: float = float("nan")  # the event loop's and the engine thread's CPU, in cores (one GIL: their
    engine_cores: float = float("nan")  # sum near 1 means the engine waits for the loop's Python)
    phases: str = "-"  # mean ms per tick: plan/rows/launch/device/route
    edge_ms_per_session: float = float("nan")  # the edge workers' CPU per second, per live session (split only)
    engine_ms_per_tick: float = float("nan")  # the engine process's CPU per tick (split only)
    samples: list[Sample] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return self.over_share <= 0.01 and self.late == 0 and self.lost == 0

    def row(self) -> str:
        kv = "-" if self.kv_used is None else str(self.kv_used)
        return (f"| {self.index} | {self.arrived} | {self.refused} | {self.live_max} | "
                f"{self.tick_p99_ms:.1f} | {100 * self.over_share:.2f} | {self.late:.0f} | {self.lost:.0f} | {kv} | "
                f"{self.loop_cores:.2f} | {self.engine_cores:.2f} | {_ms(self.edge_ms_per_session)} | "
                f"{_ms(self.engine_ms_per_tick)} | {self.phases} | {'yes' if self.held else 'no'} |")

    def server_line(self) -> str:
        """The period's server-side figures, printed when it ends: a run whose final table is lost
        keeps them (arrivals, refusals and the clients' frame loss come only in that table)."""
        return (f"minute {self.index} done: live max {self.live_max}, frame p99 {self.tick_p99_ms:.1f} ms, "
                f"{100 * self.over_share:.2f} % of frames over 60 ms, late {self.late:.0f}, engine drops "
                f"{self.lost:.0f}, KV blocks {'-' if self.kv_used is None else self.kv_used}, loop / engine cores "
                f"{self.loop_cores:.2f} / {self.engine_cores:.2f}, edge CPU per session {_ms(self.edge_ms_per_session)} "
                f"ms/s, engine process CPU {_ms(self.engine_ms_per_tick)} ms per tick, tick ms {self.phases}")


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def periods(samples: list[Sample], ended: list[Ended], period_s: float, duration: float) -> list[Period]:
    out = [Period(i) for i in range(max(1, math.ceil(duration / period_s)))]

    def at(t: float) -> Period:
        return out[min(len(out) - 1, max(0, int(t // period_s)))]

    for e in ended:
        at(e.arrived).arrived += 1
        at(e.arrived).refused += e.refused
        at(e.ended).lost += e.lost
    for s in samples:
        at(s.t).samples.append(s)
    previous = samples[0] if samples else None
    for p in out:
        if not p.samples:
            continue
        p.live_max = max(s.live for s in p.samples)
        p.tick_p99_ms = max((s.tick_p99_ms or 0.0) for s in p.samples)
        used = [s.kv_used for s in p.samples if s.kv_used is not None]
        p.kv_used = max(used) if used else None
        last = p.samples[-1]
        ticks = last.ticks - previous.ticks
        p.over_share = (last.ticks_over - previous.ticks_over) / ticks if ticks > 0 else 0.0
        p.late = last.late - previous.late
        p.lost += last.dropped - previous.dropped
        if last.t > previous.t:
            p.loop_cores = (last.loop_cpu - previous.loop_cpu) / (last.t - previous.t)
            p.engine_cores = (last.engine_cpu - previous.engine_cpu) / (last.t - previous.t)
            live = sum(s.live for s in p.samples) / len(p.samples)
            if live > 0:
                p.edge_ms_per_session = 1000 * (last.edge_cpu - previous.edge_cpu) / (last.t - previous.t) / live
        if ticks > 0:
            p.engine_ms_per_tick = 1000 * (last.engine_process_cpu - previous.engine_process_cpu) / ticks
        p.phases = phase_ms(last, previous)
        previous = last
    return out


class ServerLog:
    """The spawned server's log, read on from where the last call stopped (whole lines only: one
    still being written waits for the next call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data.rfind(b"\n") + 1
        self.offset += whole
        return [line for line in data[:whole].decode(errors="replace").splitlines() if line.strip()]


def show_server_lines(lines: list[str]) -> None:
    for line in lines[:SERVER_LINES]:
        print(f"  server: {line}", file=sys.stderr)
    if len(lines) > SERVER_LINES:
        print(f"  server: ... {len(lines) - SERVER_LINES} more lines in its log", file=sys.stderr)
    sys.stderr.flush()


def progress(s: Sample, earlier: Sample) -> None:
    p99 = "-" if s.tick_p99_ms is None else f"{s.tick_p99_ms:.1f}"
    print(f"t {s.t:.0f} s: live {s.live}, tick p99 {p99} ms, ticks over 60 ms {s.ticks_over:.0f} of {s.ticks:.0f}, "
          f"late {s.late:.0f}, dropped {s.dropped:.0f}, KV blocks used {s.kv_used}, "
          f"tick ms {'/'.join(TICK_PHASES)} {phase_ms(s, earlier)}, full GCs {s.gc_full[0] - earlier.gc_full[0]:.0f} "
          f"({1000 * (s.gc_full[1] - earlier.gc_full[1]):.0f} ms, {s.gc_full[2] - earlier.gc_full[2]:.0f} forced)",
          file=sys.stderr, flush=True)


def server_refusals(http: str) -> dict[str, int]:
    """The server's own count of refusals by reason (`parley_refusals_total`, every door): a
    client sees a 503 alone, which does not say whether the slots or the KV memory were full."""
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    out: dict[str, int] = {}
    for reason, n in re.findall(r'^parley_refusals_total\{[^}]*reason="(\w+)"[^}]*\} ([0-9.eE+]+)$', text, re.M):
        out[reason] = out.get(reason, 0) + int(float(n))
    return {reason: n for reason, n in out.items() if n}


def describe_server(http: str) -> str:
    """The server's model and each codec's dtype (/api/info): what `--mimi-dtype auto` chose is on record."""
    info = json.loads(urllib.request.urlopen(f"{http}/api/info", timeout=10).read())
    codecs = ", ".join(f"{kind} {dtype}" for kind, dtype in info.get("mimi_dtypes", {}).items())
    return f"server: model {info['model']}, {info['max_sessions']} sessions at most, Mimi: {codecs or 'none'}"


async def run_capacity(url: str, target: float, minutes: float, time_scale: float, procs: int,
                       seed: int, steady: bool = False,
                       server_log: ServerLog | None = None) -> tuple[list[Period], dict[str, int]]:
    http = url.replace("ws://", "http://").replace("wss://", "https://")
    print(describe_server(http), file=sys.stderr, flush=True)
    arrivals = schedule(target, minutes, time_scale, seed, steady)
    duration = minutes * 60 * time_scale
    start_at = time.monotonic() + 1.0
    groups = [arrivals[p::procs] for p in range(procs)]
    samples: list[Sample] = []
    with concurrent.futures.ProcessPoolExecutor(procs) as pool:
        futures = [asyncio.wrap_future(pool.submit(_arrival_group, url, g, start_at)) for g in groups]
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        samples.append(await asyncio.to_thread(sample, http, start_at))
        every = max(0.2, time_scale)  # a sample a second, scaled (not below 0.2 s: each costs a scrape)
        shown = samples[0]
        done = 0  # periods whose server line is out
        period_s = PERIOD_S * time_scale
        while not all(f.done() for f in futures):
            await asyncio.sleep(every)
            samples.append(await asyncio.to_thread(sample, http, start_at))
            if samples[-1].t >= (done + 1) * period_s:
                ending = periods(samples, [], period_s, duration)
                for p in ending[done:min(len(ending), int(samples[-1].t // period_s))]:
                    print(p.server_line(), file=sys.stderr, flush=True)
                    done += 1
            if samples[-1].t >= shown.t + PROGRESS_S * time_scale:
                progress(samples[-1], shown)
                if server_log is not None:
                    show_server_lines(server_log.new_lines())
                shown = samples[-1]
        results = [pair for f in futures for pair in await f]
    ended = [_ended(a, stats, start_at) for a, stats in results]
    return periods(samples, ended, period_s, duration), await asyncio.to_thread(server_refusals, http)


def report(found: list[Period], refusals: dict[str, int], time_scale: float, target: float,
           steady: bool = False) -> None:
    print(f"sessions: log-normal lengths, median {MEDIAN_S:.0f} s, sigma {SIGMA:.3f} ({100 * PAST_WINDOW:.0f} % past "
          f"{WINDOW_S:.0f} s, mean {MEAN_S:.0f} s), Poisson arrivals for {target:g} live on average"
          f"{', started in the steady state' if steady else ''}; time scale {time_scale:g}")
    print("| minute (traffic time) | arrived | refused | live max | frame p99 ms | % frames > 60 ms | late ticks | frames lost "
          f"| KV blocks used | loop CPU, cores | engine CPU, cores | edge CPU per session, ms/s "
          f"| engine process CPU, ms per tick | tick ms: {'/'.join(TICK_PHASES)} | held |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for p in found:
        print(p.row())
    held = [p.live_max for p in found if p.held and p.samples]
    print(f"most concurrent sessions held (frame p99 <= {1000 * FRAME_P99_S:.0f} ms, 0 late ticks, 0 frames lost): "
          f"{max(held) if held else 0}")
    print(f"totals: arrived {sum(p.arrived for p in found)}, refused {sum(p.refused for p in found)}, late ticks "
          f"{sum(p.late for p in found):.0f}, frames lost {sum(p.lost for p in found):.0f}")
    by_reason = ", ".join(f"{reason} {n}" for reason, n in sorted(refusals.items()))
    print(f"the server's refusals by reason (docs/protocols.md): {by_reason or 'none'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. ws://127.0.0.1:8998")
    where.add_argument("--spawn", help="start `parley serve` on: tiny, echo, or a checkpoint dir / HF repo id")
    p.add_argument("--target", type=float, default=8, help="sessions live on average (sets the arrival rate)")
    p.add_argument("--minutes", type=float, default=10, help="minutes of arrivals (before --time-scale)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply session lengths, arrival gaps and the report period (0.02: a CPU smoke run)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="with --spawn: the server's --max-sessions (default: 1.5 x --target)")
    p.add_argument("--device", default="cpu", help="with --spawn: the server's device")
    p.add_argument("--procs", type=int, default=1, help="client processes (one tops out near 48 live clients)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="with --spawn: an extra `parley serve` argument (repeat), e.g. --serve-arg=--kv-memory=100")
    p.add_argument("--serve-log", type=Path, help="with --spawn: write the server's log here (kept after the run)")
    p.add_argument("--seed", type=int, default=0, help="the arrival schedule's seed")
    p.add_argument("--steady", action="store_true",
                   help="start in the steady state: about --target sessions already under way, opening over the "
                        f"first {RAMP_S:.0f} s (scaled), so every minute measures the full load")
    args = p.parse_args(argv)
    if not args.spawn and (args.serve_log or args.serve_arg or args.max_sessions):
        p.error("--serve-log, --serve-arg and --max-sessions apply to a server this script starts (--spawn)")
    if args.time_scale <= 0 or args.target <= 0 or args.minutes <= 0:
        p.error("--time-scale, --target and --minutes must be more than 0")
    run = lambda url, log=None: asyncio.run(run_capacity(url, args.target, args.minutes,  # noqa: E731
                                                         args.time_scale, args.procs, args.seed, args.steady, log))
    if args.spawn:
        rows = args.max_sessions or math.ceil(1.5 * args.target)
        with tempfile.TemporaryDirectory() as tmp:
            log_path = args.serve_log or Path(tmp) / "serve.log"
            with spawned_server(args.spawn, rows, args.device, args.serve_arg, log_path) as url:
                found, refusals = run(url, ServerLog(log_path))
    else:
        found, refusals = run(args.url.rstrip("/"))
    report(found, refusals, args.time_scale, args.target, args.steady)
    return 0


if __name__ == "__main__":
    sys.exit(main())
