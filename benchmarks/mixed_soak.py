"""Mixed soak: every kind of request at once against the demo server, and the memory trend.

    python benchmarks/mixed_soak.py --minutes 20
    python benchmarks/mixed_soak.py --in-process --minutes 5        # + the tracemalloc total
    python benchmarks/mixed_soak.py --trace 40                       # per kind: what grows per request

The load (issue 29's): 3 /api/chat sessions, each reconnecting every 30 s; POST /v1/audio/speech
every 3 s; /v1/audio/transcriptions every 5 s; /v1/images/generations every 10 s; a /v1/realtime
session every 45 s and a /v1/live/sessions session every 45 s (`--periods kind=seconds,...` changes
them). Client-chosen values vary on purpose (TTS voice and text, image size and negative prompt,
chat voice), so a cache keyed by them shows up as growth.

The server is `parley serve` (the demo: no --model) on a free 127.0.0.1 port in a child process, or
with `--in-process` on a thread of this one (then tracemalloc runs and its total is sampled too).
Printed: every `--sample` seconds a row (minute, server RSS MB, [traced MB], requests done and
errors per kind), then the RSS slope fitted over the run (MB/min). Every request has a timeout and
every loop ends at the deadline: the run stops by itself.

`--trace N` (in-process): per kind, N requests after a warm-up, a tracemalloc snapshot, N more, another
snapshot: the source lines whose allocations grew in both halves (growth that scales with requests).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gc
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
import wave
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import ROOT, free_port, stop_server  # noqa: E402

SR = 24000
FRAME = 1920  # 80 ms
TIMEOUT_S = 60.0  # per request: a hung one counts as an error, the loop goes on
PERIODS = {"chat": 30.0, "speech": 3.0, "transcription": 5.0, "image": 10.0, "realtime": 45.0, "live": 45.0}
CHAT_SESSIONS = 3
VOICES = ["alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse"]
CHAT_VOICES = ["NATF0", "NATF1", "NATM0", "VARF2", "VARM3"]


def tone(seconds: float, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def pcm16(pcm: np.ndarray) -> bytes:
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


def wav_bytes(pcm: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes(pcm16(pcm))
    return buf.getvalue()


def post(base: str, path: str, body: bytes, content_type: str) -> bytes:
    request = urllib.request.Request(f"http://{base}{path}", data=body, method="POST",
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.read()
    except urllib.error.HTTPError as exc:  # the status and the server's words, not urllib's
        raise RuntimeError(f"{path} {exc.code}: {exc.read()[:300]!r}") from None


# ---- one request of each kind (i: the request's number, to vary client-chosen values) ----

async def chat(base: str, i: int, hold_s: float) -> None:
    """An /api/chat session: handshake, `hold_s` of a tone as Ogg-Opus at real time, close."""
    import sphn
    from websockets.asyncio.client import connect

    query = f"voice_prompt={CHAT_VOICES[i % len(CHAT_VOICES)]}.pt&text_prompt=soak+{i}"
    async with connect(f"ws://{base}/api/chat?{query}", max_size=None, compression=None, open_timeout=10) as ws:
        while (await ws.recv())[:1] != b"\x00":  # the handshake
            pass
        writer, pcm, t0 = sphn.OpusStreamWriter(SR), tone(hold_s), time.monotonic()
        for k in range(pcm.size // FRAME):
            if page := writer.append_pcm(pcm[k * FRAME:(k + 1) * FRAME]):
                await ws.send(b"\x01" + bytes(page))
            await asyncio.sleep(max(0.0, t0 + (k + 1) * FRAME / SR - time.monotonic()))


async def speech(base: str, i: int) -> None:
    body = {"model": "tts-1", "input": f"Soak request number {i}, a short sentence.",
            "voice": VOICES[i % len(VOICES)], "response_format": "pcm"}
    audio = await asyncio.to_thread(post, base, "/v1/audio/speech", json.dumps(body).encode(), "application/json")
    if not audio:
        raise RuntimeError("no audio")


async def transcription(base: str, i: int) -> None:
    boundary = f"soak{i}"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'.encode(),
             f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
             f'Content-Type: audio/wav\r\n\r\n'.encode() + wav_bytes(tone(1.0 + (i % 3) * 0.5)) + b"\r\n",
             f"--{boundary}--\r\n".encode()]
    out = await asyncio.to_thread(post, base, "/v1/audio/transcriptions", b"".join(parts),
                                  f"multipart/form-data; boundary={boundary}")
    json.loads(out)


def image_size(i: int) -> str:
    """16 sizes at the demo's stride of 2, up to its default 16x16 (larger ones are refused on a CPU)."""
    return "auto" if i % 17 == 0 else f"{8 + 2 * (i % 4)}x{8 + 2 * (i // 4 % 4)}"


async def image(base: str, i: int) -> None:
    body = {"prompt": f"a soak image {i}", "size": image_size(i), "num_inference_steps": 2,
            "negative_prompt": f"blurry {i}"}
    out = json.loads(await asyncio.to_thread(post, base, "/v1/images/generations", json.dumps(body).encode(),
                                             "application/json"))
    if not out.get("data"):
        raise RuntimeError(f"no image: {out}")


async def realtime(base: str, i: int, hold_s: float = 2.0) -> None:
    """A /v1/realtime session: session.created, `hold_s` of pcm16 audio at real time, close."""
    from websockets.asyncio.client import connect

    async with connect(f"ws://{base}/v1/realtime?model=soak", max_size=None, open_timeout=10) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await _append_audio(ws, "input_audio_buffer.append", hold_s)


async def live(base: str, i: int, hold_s: float = 2.0) -> None:
    """A /v1/live/sessions session: session.start, `hold_s` of audio at real time, session.close."""
    from websockets.asyncio.client import connect

    async with connect(f"ws://{base}/v1/live/sessions", max_size=None, open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "session.start", "session": {"model": "gpt-live-1"}}))
        while (started := json.loads(await ws.recv()))["type"] != "session.started":
            if started["type"] == "error":
                raise RuntimeError(started["error"])
        await _append_audio(ws, "session.input_audio.append", hold_s)
        await ws.send(json.dumps({"type": "session.close"}))


async def _append_audio(ws, event_type: str, seconds: float) -> None:
    pcm, t0 = tone(seconds), time.monotonic()
    for k in range(pcm.size // FRAME):
        chunk = base64.b64encode(pcm16(pcm[k * FRAME:(k + 1) * FRAME])).decode()
        await ws.send(json.dumps({"type": event_type, "audio": chunk}))
        await asyncio.sleep(max(0.0, t0 + (k + 1) * FRAME / SR - time.monotonic()))


def request_for(kind: str, periods: dict):
    """kind -> an async (base, i) -> None making one request of that kind."""
    if kind == "chat":  # a session lasts its period, then the client reconnects
        return lambda base, i: chat(base, i, periods["chat"])
    return {"speech": speech, "transcription": transcription, "image": image, "realtime": realtime,
            "live": live}[kind]


# ---- the server ----

@contextlib.contextmanager
def child_server(extra: list[str]):
    """`parley serve` (the demo) in a child process: (base, pid)."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "parley.realtime.cli", "serve", "--port", str(port),
                                 "--host", "127.0.0.1", "--log-level", "warning", *extra],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(port, proc.poll, lambda: (log.seek(0), log.read()[-2000:])[1])
            yield f"127.0.0.1:{port}", proc.pid
        finally:
            stop_server(proc)


@contextlib.contextmanager
def thread_server(max_sessions: int):
    """The demo app on a uvicorn thread of this process: (base, this pid)."""
    import uvicorn

    from parley.realtime.server.serve import ServeConfig, build_app, uvicorn_config

    port = free_port()
    app = build_app(ServeConfig(model=None, max_sessions=max_sessions))
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_ready(port, lambda: None if thread.is_alive() else 1, lambda: "the server thread ended")
        yield f"127.0.0.1:{port}", os.getpid()
    finally:
        server.should_exit = True
        thread.join(30)


def wait_ready(port: int, exited, last_words, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if exited() is not None:
            raise SystemExit(f"the server ended before it was ready:\n{last_words()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit("the server did not become ready")
            time.sleep(0.3)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---- the mixed load ----

class Tally:
    def __init__(self, kinds: list[str]) -> None:
        self.done = dict.fromkeys(kinds, 0)
        self.errors = dict.fromkeys(kinds, 0)
        self.cut = dict.fromkeys(kinds, 0)  # still running at the deadline, stopped there: not errors
        self.last_error: dict[str, str] = {}


async def kind_loop(kind: str, base: str, period: float, end: float, tally: Tally, request, offset: int = 0) -> None:
    """One request every `period` s (or back to back when they take longer) until `end`."""
    i = offset
    while (start := time.monotonic()) < end:
        try:
            await asyncio.wait_for(request(base, i), min(TIMEOUT_S + period, max(end - start, 1.0) + 10))
            tally.done[kind] += 1
        except Exception as exc:  # counted and shown; the soak goes on
            if isinstance(exc, asyncio.TimeoutError) and time.monotonic() >= end:
                tally.cut[kind] += 1  # stopped at the deadline, not failed
            else:
                tally.errors[kind] += 1
                tally.last_error[kind] = f"{type(exc).__name__}: {exc}"[:200]
        i += 1000 if kind == "chat" else 1
        await asyncio.sleep(max(0.0, min(start + period, end) - time.monotonic()))


async def mixed(base: str, pid: int, minutes: float, sample_s: float, periods: dict, chat_sessions: int,
                traced: bool) -> list[dict]:
    kinds = list(periods)
    tally, start = Tally(kinds), time.monotonic()
    end = start + minutes * 60
    loops = [kind_loop(kind, base, period, end, tally, request_for(kind, periods))
             for kind, period in periods.items() if kind != "chat"]
    if "chat" in periods:
        loops += [kind_loop("chat", base, 0.0, end, tally, request_for("chat", periods), offset=n)
                  for n in range(chat_sessions)]
    tasks = [asyncio.create_task(loop) for loop in loops]
    first = tracemalloc.take_snapshot() if traced else None
    samples: list[dict] = []
    print("| minute | RSS MB |" + (" traced MB |" if traced else "") + "".join(f" {k} ok/err |" for k in kinds))
    print("|---|---|" + ("---|" if traced else "") + "---|" * len(kinds))
    while True:
        row = {"t": (time.monotonic() - start) / 60, "rss": rss_mb(pid),
               "traced": tracemalloc.get_traced_memory()[0] / 2**20 if traced else None}
        samples.append(row)
        print(f"| {row['t']:.2f} | {row['rss']:.1f} |" + (f" {row['traced']:.1f} |" if traced else "")
              + "".join(f" {tally.done[k]}/{tally.errors[k]} |" for k in kinds), flush=True)
        if time.monotonic() >= end:
            break
        await asyncio.sleep(min(sample_s, max(0.0, end - time.monotonic())))
    await asyncio.wait(tasks, timeout=TIMEOUT_S + max(periods.values()) + 30)
    for task in tasks:
        task.cancel()
    print("requests " + ", ".join(f"{k} {tally.done[k]} ({tally.errors[k]} errors, {tally.cut[k]} cut at the end)"
                                  for k in kinds))
    for kind, message in tally.last_error.items():
        print(f"last {kind} error: {message}")
    if first is not None:
        await asyncio.sleep(2.0)  # the server ends what the last requests left
        traced_growth(first, top=12)
    return samples


def traced_growth(first: tracemalloc.Snapshot, top: int) -> None:
    """The source lines whose live allocations grew most since `first` (after a gc)."""
    gc.collect()
    last = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    print(f"traced growth since the first sample, top {top} lines:")
    for stat in last.compare_to(first, "lineno")[:top]:
        frame = stat.traceback[0]
        print(f"    {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  "
              f"{frame.filename.replace(str(ROOT) + '/', '')}:{frame.lineno}")


def slope(samples: list[dict], key: str) -> str:
    t = np.array([s["t"] for s in samples])
    v = np.array([s[key] for s in samples], dtype=float)
    if v.size < 3 or not np.isfinite(v).all():
        return "n/a"
    return (f"{v[0]:.1f} -> {v[-1]:.1f} MB (max {v.max():.1f}), fitted slope {np.polyfit(t, v, 1)[0]:+.2f} MB/min "
            f"(over the second half {np.polyfit(t[v.size // 2:], v[v.size // 2:], 1)[0]:+.2f} MB/min)")


# ---- --trace: per kind, what grows per request ----

async def trace_kind(base: str, kind: str, n: int, periods: dict, top: int) -> None:
    request = request_for(kind, periods)

    errors: list[str] = []

    async def burst(first: int) -> None:
        for i in range(first, first + n):
            try:
                await asyncio.wait_for(request(base, i), TIMEOUT_S)
            except Exception as exc:  # refusals are requests too (a refusal may keep state)
                errors.append(f"{type(exc).__name__}: {exc}"[:160])

    def snapshot():
        gc.collect()
        return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])

    await burst(10_000)  # warm-up: first-use allocations (kernels, graphs, pools) are not growth
    await asyncio.sleep(1.0)  # let the server finish what the last request left (closes, logs)
    a = snapshot()
    await burst(0)
    await asyncio.sleep(1.0)
    b = snapshot()
    await burst(n)
    await asyncio.sleep(1.0)
    c = snapshot()
    first = {s.traceback: s for s in b.compare_to(a, "lineno")}
    second = c.compare_to(b, "lineno")
    total = [sum(s.size_diff for s in d) / 1024 for d in (first.values(), second)]
    print(f"{kind}: {n} requests {total[0]:+.1f} KiB, {n} more {total[1]:+.1f} KiB (traced, after gc); "
          f"{len(errors)} of {3 * n} ended in errors" + (f", the last: {errors[-1]}" if errors else ""), flush=True)
    growing = [(s, first[s.traceback]) for s in second if s.size_diff > 0 and s.traceback in first
               and first[s.traceback].size_diff > 0]
    for s2, s1 in sorted(growing, key=lambda p: -(p[0].size_diff + p[1].size_diff))[:top]:
        frame = s2.traceback[0]
        print(f"    {s1.size_diff / n:+8.0f} B/req then {s2.size_diff / n:+8.0f} B/req  "
              f"{frame.filename.replace(str(ROOT) + '/', '')}:{frame.lineno} (count {s2.count})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--sample", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--periods", default="", help="kind=seconds,... over the defaults " + json.dumps(PERIODS))
    ap.add_argument("--kinds", default=",".join(PERIODS), help="which kinds run (comma-separated)")
    ap.add_argument("--chat-sessions", type=int, default=CHAT_SESSIONS)
    ap.add_argument("--max-sessions", type=int, default=8, help="the server's duplex slots")
    ap.add_argument("--in-process", action="store_true", help="serve on a thread here; sample tracemalloc too")
    ap.add_argument("--trace", type=int, default=0, metavar="N", help="per kind, N + N requests, tracemalloc diff")
    ap.add_argument("--top", type=int, default=8, help="--trace: lines shown per kind")
    args = ap.parse_args()
    periods = {**PERIODS, **{k: float(v) for k, v in (p.split("=") for p in args.periods.split(",") if p)}}
    unknown = set(args.kinds.split(",")) - set(PERIODS) | set(periods) - set(PERIODS)
    if unknown or args.minutes <= 0 or args.sample <= 0:
        ap.error(f"unknown kinds {sorted(unknown)}" if unknown else "--minutes and --sample must be positive")
    periods = {k: periods[k] for k in args.kinds.split(",")}
    in_process = args.in_process or args.trace > 0
    with (thread_server(args.max_sessions) if in_process else
          child_server(["--max-sessions", str(args.max_sessions)])) as (base, pid):
        if in_process:  # after the warm-up: measured under tracemalloc, every image size would be too large
            tracemalloc.start(1)
        print(f"demo server at {base} ({'in this process' if in_process else f'child process {pid}'}), "
              f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}", flush=True)
        if args.trace:
            for kind in periods:
                asyncio.run(trace_kind(base, kind, args.trace, {**periods, "chat": min(periods.get("chat", 2), 2.0)},
                                       args.top))
            return
        samples = asyncio.run(mixed(base, pid, args.minutes, args.sample, periods, args.chat_sessions, in_process))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    print(f"RSS: {slope(samples, 'rss')}")
    if in_process:
        print(f"traced: {slope(samples, 'traced')}")


if __name__ == "__main__":
    main()
