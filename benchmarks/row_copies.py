"""The engine thread's per-row audio work, alone and beside a thread running Python.

    python benchmarks/row_copies.py --rows 270 --stt-rows 64

numpy gives the GIL up for any copy of more than a few hundred elements, and an audio frame is 1920
samples; beside a thread running Python (the event loop of hundreds of sockets), each give-up can
wait out the switch interval to take the GIL back. This times, on the real code paths, the three
places where the engine thread handles audio row by row every tick: the scheduler's plan (each
session's input frame into the tick's array), the output route (each row's output frame copied out
to its session's stream) and the STT pool's step input (each transcription row's next frame), each
beside the per-row numpy copies it replaced (`frames[row] = frame`, `pcm[row].copy()`; the STT one
approximated), at the engine's switch interval (`engine.GIL_SWITCH_S`). Medians over `--repeats`
runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time

import numpy as np
import torch

from parley.engine.backend import HostOutput
from parley.engine.engine import GIL_SWITCH_S
from parley.engine.host_rows import join_rows
from parley.engine.input_buffer import InputBuffer
from parley.engine.metrics import EngineMetrics
from parley.engine.output import OutputProcessor
from parley.engine.scheduler import Scheduler
from parley.engine.stream import OutputStream
from parley.engine.stt_pool import SttRequest
from parley.models.config import FRAME_SAMPLES


class _Row:  # what Scheduler.plan reads of a session
    def __init__(self, i: int) -> None:
        self.request_id, self.row, self.input = f"r{i}", i, InputBuffer(max_frames=8)


def cases(rows: int, stt_rows: int, loop: asyncio.AbstractEventLoop):
    """name -> (prepare, timed) pairs: prepare refills the inputs untimed; timed is the work."""
    pcm = (np.random.default_rng(0).standard_normal(FRAME_SAMPLES) * 0.1).astype(np.float32)
    scheduler = Scheduler(rows, FRAME_SAMPLES)
    sessions = [_Row(i) for i in range(rows)]
    for s in sessions:
        scheduler.activate(s)

    def feed_sessions():
        for s in sessions:
            s.input.push(pcm)

    def numpy_plan():  # the plan as it was: a copy per row into the tick's array
        frames = np.zeros((rows, FRAME_SAMPLES), np.float32)
        for s in sessions:
            frame, _ = s.input.pop()
            frames[s.row] = frame

    processor = OutputProcessor(lambda token: "", EngineMetrics())
    streams = [OutputStream(f"r{i}", loop, 1 << 20) for i in range(rows)]
    for i, stream in enumerate(streams):
        processor.register(f"r{i}", stream)
    out = HostOutput(pcm=np.tile(pcm, (rows, 1)), text_tokens=np.zeros(rows, np.int64), valid=np.ones(rows, bool))
    plan = scheduler.plan(0)

    def drain():
        for stream in streams:
            stream.drain()

    def numpy_route():  # the copy-out as it was: .copy() per row
        for row in range(rows):
            streams[row].push(out.pcm[row].copy())

    requests = [SttRequest(f"s{i}", OutputStream(f"s{i}", loop, 1 << 20), 600.0) for i in range(stt_rows)]

    def feed_stt():
        for r in requests:
            for chunk in np.split(pcm, 3):  # clients' chunks rarely match the frame
                r.feed(chunk)

    def stt_input():
        join_rows([r._take()[0] for r in requests], FRAME_SAMPLES)

    # The STT pool's input as it was, approximately: today's bytes take, then the three numpy copies a
    # row the old one made (concatenate, slice, row copy; the old one ran the first under the lock).
    def numpy_stt_input():
        frames = np.zeros((stt_rows, FRAME_SAMPLES), np.float32)
        for i, r in enumerate(requests):
            frame = np.frombuffer(r._take()[0], np.float32)
            buffer = np.concatenate([np.zeros(0, np.float32), frame])
            one = np.zeros(FRAME_SAMPLES, np.float32)
            one[:] = buffer[:FRAME_SAMPLES]
            frames[i] = one

    return {
        f"plan, {rows} rows": (feed_sessions, lambda: scheduler.plan(1)),
        f"plan, {rows} rows, a numpy copy per row": (feed_sessions, numpy_plan),
        f"route, {rows} rows": (drain, lambda: processor.route(plan, out)),
        f"route, {rows} rows, a numpy copy per row": (drain, numpy_route),
        f"STT input, {stt_rows} rows": (feed_stt, stt_input),
        f"STT input, {stt_rows} rows, numpy copies per row": (feed_stt, numpy_stt_input),
    }


def time_case(prepare, timed, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        prepare()
        t0 = time.perf_counter()
        timed()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=270, help="duplex sessions (plan, route)")
    p.add_argument("--stt-rows", type=int, default=64, help="transcription rows")
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args(argv)
    if args.rows < 1 or args.stt_rows < 1 or args.repeats < 1:
        p.error("--rows, --stt-rows and --repeats must be at least 1")
    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()  # the streams' consumer loop (never run: nothing waits on them)
    work = cases(args.rows, args.stt_rows, loop)
    sys.setswitchinterval(GIL_SWITCH_S)
    alone = {name: time_case(*fns, args.repeats) for name, fns in work.items()}
    stop = threading.Event()

    def python_loop() -> None:  # a thread that always wants the GIL, as a busy event loop does
        while not stop.is_set():
            sum(range(64))

    thread = threading.Thread(target=python_loop, daemon=True)
    thread.start()
    try:
        beside = {name: time_case(*fns, args.repeats) for name, fns in work.items()}
    finally:
        stop.set()
        thread.join()
    print(f"switch interval {1000 * GIL_SWITCH_S:g} ms; medians of {args.repeats}")
    print("| work | alone ms | beside a busy thread ms |")
    print("|---|---:|---:|")
    for name in work:
        print(f"| {name} | {alone[name]:.2f} | {beside[name]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
