"""TTS under load: `/v1/audio/speech` from real HTTP clients beside live duplex sessions, and the
reference `moshi` TTSModel on the same weights.

    # CPU smoke (tiny shapes, fabricated duplex backend): seconds
    python benchmarks/tts_load.py --shapes tiny --duplex delay --streams 1,2 --sessions 0,2 --device cpu
    # CPU smoke of the --duplex 7b path (ModelBackend over a tiny random LM and Mimi)
    python benchmarks/tts_load.py --shapes tiny --duplex tiny --streams 1 --sessions 1 --device cpu
    # H200: 1.6B TTS shapes (random bf16) beside Moshi-7B shapes (random bf16), and the reference
    python benchmarks/tts_load.py --shapes 1.6b --duplex 7b --streams 1,16,32 --sessions 0,64 --device cuda --reference
    # one stream in a 16-slot pool (row buckets: it should cost what a 1-slot pool does)
    python benchmarks/tts_load.py --shapes 1.6b --duplex 7b --streams 1 --slots 16 --sessions 0,64 --device cuda

For every (TTS streams, duplex sessions) pair it starts Parley's server in-process (uvicorn on a
free 127.0.0.1 port; the engine's clock is real), opens the duplex sessions through the engine
API (fed 80 ms of noise per tick), then fires `streams` concurrent `POST /v1/audio/speech`
requests (pcm, read as fast as they come) and prints:

- TTFB p50 / p99: request sent -> first body byte, as the HTTP client sees it;
- x real time per stream (median, min): seconds of audio / seconds from request to last byte;
- duplex frame p50 / p99: the engine's frame step (backend step + device sync), and late ticks;
  with `streams` 0 the same numbers without TTS load, for the comparison;
- TTS pool counters (steps, starved, forced), and Python's full garbage collections during the
  case (count, milliseconds in them: each one stalls the engine thread; the script freezes the loaded
  objects first, as `parley serve` does);
- with `--delivery http,direct`, each case also with the requests handed to the pool and read on
  the benchmark's loop, no HTTP server between (what the edge's work costs the duplex frame);
- under a case, the duplex frames 3 ms over the median with their time into the measuring
  window and, on CUDA, the host's launch time and the GPU's time of each (by CUDA events: a slow
  frame is one or the other); with `--watch-stalls MS`, the times a watchdog thread could not run
  for MS ms, with every thread's stack (Python work holding the GIL, benchmarks/stall_watch.py);
  and (CUDA) the caching allocator's cudaMalloc / cudaFree calls and retries during it
  (places a one-off stall against the requests: the first TTS case of a run had one, until the
  edge stopped importing modules on its first request, realtime/server/app.py `load_lazy_modules`);
- under each TTS row, where its slack went: items, ms per item and the estimate per TTS item key
  (admit; text and full steps per row bucket, e.g. `full/4`: a full step over the lowest 4 rows).

By default the HTTP clients run in a process of their own (benchmarks/tts_clients.py, started
before each case's measuring window), so this process holds only the server's work (uvicorn,
the engine, the feeder standing in for the edge's duplex input): real clients are remote, and
every byte a client here reads is Python work that competes with the engine thread for the GIL
(each torch call on the engine thread releases and retakes it), which shows in the duplex frame's
p99 under many streams. `--clients-in-process` runs them on this process's loop instead, to show
what client work in the server's process costs. `--delivery direct` is in-process by definition.

With `--reference`, the reference `moshi.models.tts.TTSModel` runs on the very same weight
tensors, batched as Kyutai's server batches it (all rows start together, one `LMGen.step` per
frame for the batch, Mimi decode per frame): time to the first audio frame and x real time,
at each `--streams` value, each after a short warm-up run at that batch size (the reference
captures its CUDA graphs per batch size on its first steps). Weights are random (shapes, compute
and memory traffic of the real ones); the text (`--text`, default a fixed English paragraph) goes
through a small SentencePiece model.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # delay_backend: the tests' fake model

from frame_setup import bench_checkpoint, random_models  # noqa: E402

import httpx2 as httpx  # noqa: E402  (the HTTP client the pinned openai SDK ships on)
import uvicorn  # noqa: E402
from stall_watch import StallWatch  # noqa: E402
from tts_clients import ClientProcess, failure_summary, gather_requests, one_request  # noqa: E402
from write_models import tts_config_dict  # noqa: E402  (the published TTS shapes)

from parley.engine import Engine, SpeechFrontEnd  # noqa: E402
from parley.engine.backend import ModelBackend, default_dtype  # noqa: E402
from parley.engine.gc_pauses import FULL_COLLECTIONS, freeze_loaded_objects  # noqa: E402
from parley.engine.no_duplex import NoDuplexBackend  # noqa: E402
from delay_backend import DelayBackend  # noqa: E402
from parley.engine.stream import Terminal  # noqa: E402
from parley.engine.tts_pool import STEP_KINDS, TtsAudio, TtsPool, step_key  # noqa: E402
from parley.models.checkpoint import mimi_config_dict  # noqa: E402
from parley.models.config import FRAME_SAMPLES, MimiConfig, tiny_mimi_config  # noqa: E402
from parley.models.lm import published_state  # noqa: E402
from parley.models.mimi.codec import Mimi  # noqa: E402
from parley.models.tokenizer import TextTokenizer, train_tiny_tokenizer  # noqa: E402
from parley.models.tts import TtsConfig, TtsLM  # noqa: E402
from parley.models.tts_checkpoint import VoiceStore, write_voice  # noqa: E402
from parley.realtime.server.app import ServerInfo, create_app  # noqa: E402
from parley.realtime.server.services import Services, register_slack_source  # noqa: E402
from parley.realtime.server.serve import uvicorn_config  # noqa: E402
from parley.realtime.http.speech import SpeechService, parse_request  # noqa: E402

TEXT = ("Good morning, and welcome to the show. Today we are going to talk about the weather, music, and "
        "books. It was a bright cold day in April, and the clocks were striking thirteen. Please wait "
        "while I look that up for you.")
WARM_UP_TEXT = "Hello."
VOICE_SUFFIX = ".bench@0.safetensors"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def build_models(shapes: str, device: str, dtype: torch.dtype):
    """Reference LM + Mimi with random weights, and Parley's sharing the very same tensors."""
    from moshi.models import loaders

    torch.manual_seed(0)
    raw = tts_config_dict(shapes)
    lm_kwargs = {k: copy.deepcopy(v) for k, v in raw.items() if k not in (  # the reference edits them in place
        "moshi_name", "mimi_name", "tokenizer_name", "lm_gen_config", "tts_config", "model_id")}
    ref_lm = loaders.get_moshi_lm(None, lm_kwargs=lm_kwargs, device=device, dtype=dtype)
    cfg = TtsConfig.from_dict(raw)
    with torch.device("meta"):
        lm = TtsLM(cfg, dtype=dtype)
    lm.load_state_dict(published_state(ref_lm.state_dict()), assign=True, strict=True)
    lm.eval()
    mimi_cfg = tiny_mimi_config(num_codebooks=cfg.lm.n_q) if shapes == "tiny" else MimiConfig(num_codebooks=cfg.lm.n_q)
    ref_mimi = loaders.get_mimi(None, mimi_config_dict(mimi_cfg) if shapes == "tiny" else None, device=device,
                                num_codebooks=cfg.lm.n_q)
    mimi = Mimi(mimi_cfg).to("meta")
    mimi.load_state_dict(ref_mimi.state_dict(), assign=True, strict=True)
    mimi.eval()
    return cfg, ref_lm, ref_mimi, lm, mimi


# --duplex choices over real models: the same ModelBackend path, only the shapes differ.
DUPLEX_MODELS = {"7b": "moshi", "tiny": "tiny"}  # frame_setup.random_models kinds


def build_duplex(kind: str, sessions: int, device: str, tokenizer: TextTokenizer):
    if kind == "none":
        return NoDuplexBackend(device), 1
    if kind == "delay":
        return DelayBackend(max(sessions, 1), step_seconds=0.002), max(sessions, 1)
    lm, mimi, lm_cfg, mimi_cfg = random_models(DUPLEX_MODELS[kind], device, default_dtype(device))
    ckpt = bench_checkpoint(lm, mimi, lm_cfg, mimi_cfg, tokenizer)
    return ModelBackend(ckpt, max(sessions, 1), cuda_graphs=True, seed=0), max(sessions, 1)


def device_allocations() -> dict:
    """The CUDA caching allocator's cudaMalloc / cudaFree calls and failed-then-retried allocations
    so far (each can stall the thread that allocates; a retry frees every cached block, which
    synchronises the device); empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


class TimedBackend:
    """The duplex backend with each frame step timed (step + device sync). Built once per
    sessions count and reused by its cases: an engine's shutdown does not close it (`release` does)."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.times: list[float] = []
        self.starts: list[float] = []  # perf_counter at each timed step (where the slow ones fell)
        self.split: list[tuple[float, float]] = []  # (host ms, GPU ms) of each timed step

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def step(self, frames, live_mask):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if torch.cuda.is_available() else None
        start = time.perf_counter()
        if events:
            events[0].record()
        out = self._backend.step(frames, live_mask)
        if events:
            events[1].record()
        launched = time.perf_counter()
        self._backend.synchronize()
        self.times.append(time.perf_counter() - start)
        self.starts.append(start)
        # (host ms to launch the step, GPU ms between its events): a slow frame is one or the other
        self.split.append(((launched - start) * 1000, events[0].elapsed_time(events[1]) if events else float("nan")))
        return out

    def clear(self) -> None:
        self.times.clear()
        self.starts.clear()
        self.split.clear()

    def close(self) -> None:
        """The engine's shutdown: keep the backend for the next case (its rows reset on admission)."""

    def release(self) -> None:
        self._backend.close()


def start_server(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


async def one_direct_request(service: SpeechService, voice: str, text: str, delay_s: float = 0.0,
                             received: list[int] | None = None, index: int = 0) -> tuple[float, float, float]:
    """As `one_request`, but submitted to the pool and read from its stream on this loop, with
    no HTTP in between (--delivery direct: what the edge costs the duplex frame)."""
    await asyncio.sleep(delay_s)
    start = time.perf_counter()
    params = parse_request({"model": "tts", "input": text, "voice": voice, "response_format": "pcm"}, service.front_end)
    request, _ = service.front_end.request(params.text, params.voice, params.speed)
    job = service.pool.submit(request, asyncio.get_running_loop())
    first = None
    size = 0
    async for event in job.stream:
        if isinstance(event, TtsAudio):
            if first is None:
                first = time.perf_counter() - start
            size += event.pcm.size * 2  # as pcm16 bytes, like the HTTP client counts them
            if received is not None:
                received[index] = size
        elif isinstance(event, Terminal):
            break
    return first or float("nan"), size / 2 / 24000, time.perf_counter() - start


async def run_case(args, models, voices_dir: Path, timed: TimedBackend, streams: int, sessions: int) -> dict:
    cfg, _, _, lm, mimi = models
    timed.clear()
    engine = Engine(timed)
    pool = TtsPool(lm, mimi, args.slots or max(streams, 1), voice_frames=args.voice_frames)
    store = VoiceStore.open(voices_dir, VOICE_SUFFIX, cfg.speaker.dim)
    tokenizer = TextTokenizer(voices_dir.parent / "tok.model")
    service = SpeechService(pool=pool, front_end=SpeechFrontEnd(tokenizer.encode, store), codebooks=cfg.lm.n_q)
    pool.warm_conditions = service.front_end.conditions  # as `parley serve` does: warm admissions carry them
    register_slack_source(engine, pool)  # warm-up, then add
    app = create_app(Services(engine, info=ServerInfo(model="bench"), codec_workers=0, speech=service))
    server, thread, url = start_server(app)
    try:
        return await unless_engine_fails(engine, measure(args, engine, timed, pool, service, url, streams, sessions))
    finally:
        server.should_exit = True
        thread.join(30)


async def unless_engine_fails(engine: Engine, work) -> dict:
    """`work`'s result, or exit at once naming the error if the engine fails first: a failed engine
    fails its sessions but not a TTS request already waiting, which would hang the run."""
    task = asyncio.ensure_future(work)
    while not task.done():
        if not engine.healthy:
            task.cancel()
            sys.exit(f"the engine failed: {engine.fatal_error} (its traceback is logged above)")
        await asyncio.wait({task}, timeout=0.1)
    return task.result()


async def report_progress(engine: Engine, pool: TtsPool, every_s: float, received: list[int]) -> None:
    """--progress: the pool's and engine's counters, and the audio the clients have received so far,
    every `every_s` seconds (a slow case shows whether the engine or the delivery is behind)."""
    start = time.perf_counter()
    while True:
        await asyncio.sleep(every_s)
        c = {**pool.slack_counters(), **engine.counters()}
        bucket = pool.bucket(range(c["tts_live"]))  # (the bucket of that many rows, taken lowest first)
        estimates = {kind: (engine.slack_costs.estimate(step_key(kind, bucket)) or 0) * 1000 for kind in STEP_KINDS}
        print(f"    {time.perf_counter() - start:5.1f} s: live {c['tts_live']}, steps {c['tts_steps_text']} text + "
              f"{c['tts_steps_full']} full (est {estimates['text']:.1f} / {estimates['full']:.1f} ms in bucket "
              f"{bucket}), frames "
              f"{c['tts_frames']}, starved {c['tts_starved']}, forced {c['tts_forced']}, late ticks {c['late_ticks']}, "
              f"ended {c['tts_completed']} completed / {c['tts_failed']} failed / {c['tts_cancelled']} cancelled; "
              f"clients received {min(received, default=0) / 48000:.1f} - {max(received, default=0) / 48000:.1f} s "
              "of audio", flush=True)


async def measure(args, engine: Engine, timed: TimedBackend, pool: TtsPool, service: SpeechService, url: str,
                  streams: int, sessions: int) -> dict:
    store = service.voices
    live = [engine.open_nowait() for _ in range(sessions)]
    for s in live:
        await asyncio.wait_for(s.ready, 120)
    stop = asyncio.Event()

    async def feed() -> None:  # every session gets 80 ms of noise per tick and is drained
        noise = (np.random.default_rng(0).standard_normal(FRAME_SAMPLES) * 0.05).astype(np.float32)
        while not stop.is_set():
            for s in live:
                s.push_audio(noise)
                s.events.drain()
            await asyncio.sleep(0.08)

    feeder = asyncio.create_task(feed())
    clients = None
    try:
        if streams and args.delivery == "http" and not args.clients_in_process:  # started before the window
            clients = await ClientProcess.start(url, store.names(), args.text, streams, args.stagger,
                                                args.request_timeout, args.progress)
        await asyncio.sleep(args.settle)
        timed.clear()
        window_start = time.perf_counter()
        before = engine.counters()
        gc_before = FULL_COLLECTIONS.snapshot()
        alloc_before = device_allocations()
        outcomes = []
        received = [0] * streams  # bytes each client has read so far
        reporter = (asyncio.create_task(report_progress(engine, pool, args.progress, received))
                    if args.progress else None)
        if clients is not None:
            outcomes = await clients.run(received)
        elif streams:
            async with httpx.AsyncClient(timeout=args.request_timeout) as client:
                def request(i: int):
                    voice, delay = store.names()[i % len(store.names())], i * args.stagger
                    if args.delivery == "direct":
                        return one_direct_request(service, voice, args.text, delay, received, i)
                    return one_request(client, url, voice, args.text, delay, received, i)
                outcomes = await gather_requests(request, streams, args.stagger, args.request_timeout)
        else:
            await asyncio.sleep(args.idle_seconds)
    finally:
        if clients is not None:
            await clients.close()
    results = [(o["ttfb_s"], o["audio_s"], o["total_s"]) for o in outcomes if "error" not in o]
    failures = failure_summary(outcomes)
    if failures:  # said, not hidden: the figures below are over the requests that completed
        print(f"    {failures}", flush=True)
    stop.set()
    await feeder
    if reporter is not None:
        reporter.cancel()
    frame_ms = [t * 1000 for t in timed.times]
    frame_p50 = percentile(frame_ms, 50)
    counters = pool.slack_counters()
    gc_after = FULL_COLLECTIONS.snapshot()
    allocations = {k: v - alloc_before[k] for k, v in device_allocations().items() if v != alloc_before[k]}
    return {
        "streams": streams, "sessions": sessions,
        "ttfb_p50": percentile([r[0] for r in results], 50) * 1000 if results else float("nan"),
        "ttfb_p99": percentile([r[0] for r in results], 99) * 1000 if results else float("nan"),
        "xrt_median": statistics.median(r[1] / r[2] for r in results) if results else float("nan"),
        "xrt_min": min(r[1] / r[2] for r in results) if results else float("nan"),
        "frame_p50": frame_p50, "frame_p99": percentile(frame_ms, 99),
        # frames 3 ms over the median: (seconds into the window, ms), to place a spike against the requests
        "slow": [(t0 - window_start, ms, host, gpu) for t0, ms, (host, gpu) in zip(timed.starts, frame_ms, timed.split)
                 if ms > frame_p50 + 3],
        "stalls": [s.describe(window_start) for s in args.watch.stalls_since(window_start)] if args.watch else [],
        "late_ticks": engine.counters()["late_ticks"] - before["late_ticks"],
        # slack items that ended after the next boundary: a late tick with none was not theirs
        "past_boundary": engine.counters()["slack_past_boundary"] - before["slack_past_boundary"],
        "tts_steps": counters["tts_steps_text"] + counters["tts_steps_full"],
        "starved": counters["tts_starved"], "forced": counters["tts_forced"],
        "gc_full": gc_after["gc_full_collections"] - gc_before["gc_full_collections"],
        "slack": {"/".join(map(str, key[1:])): (items, seconds / items * 1000,
                                                (engine.slack_costs.estimate(key) or 0) * 1000)
                  for key, (items, seconds) in engine.slack_by_key().items() if key[0] == "tts" and items},
        # (the timer's longest pause is the process's, not the window's: its total is a difference)
        "gc_ms": (gc_after["gc_full_seconds"] - gc_before["gc_full_seconds"]) * 1000,
        "allocations": allocations,
    }


@torch.no_grad()
def run_reference(models, voices_dir: Path, streams: int, tokenizer_path: Path, text: str) -> dict:
    """moshi's TTSModel batched as Kyutai's server does: all rows together, Mimi decode per frame."""
    from moshi.models import tts as ref_tts
    from sentencepiece import SentencePieceProcessor

    cfg, ref_lm, ref_mimi, _, _ = models
    machine = ref_tts.StateMachine(ref_tts.TokenIds(cfg.lm.text_card + 1), second_stream_ahead=2,
                                   max_padding=8, initial_padding=2)
    model = ref_tts.TTSModel(lm=ref_lm, mimi=ref_mimi, tokenizer=SentencePieceProcessor(str(tokenizer_path)),
                             voice_suffix=VOICE_SUFFIX, voice_repo=str(voices_dir), machine=machine,
                             delay_steps=cfg.audio_delay_frames, n_q=cfg.lm.n_q, temp=0.6)
    voice = sorted(voices_dir.rglob(f"*{VOICE_SUFFIX}"))[0]
    entries = [model.prepare_script([text], padding_between=1) for _ in range(streams)]
    attributes = [model.make_condition_attributes([voice], cfg_coef=2.0) for _ in range(streams)]
    first_audio = []
    frames = [0]
    start = time.perf_counter()
    with model.mimi.streaming(streams):
        def on_frame(frame: torch.Tensor) -> None:
            frames[0] += 1
            if frames[0] > cfg.audio_delay_frames:
                model.mimi.decode(frame[:, 1:, :].clamp(min=0)).cpu()
                if not first_audio and frames[0] > cfg.audio_delay_frames + 2:
                    first_audio.append(time.perf_counter() - start)

        result = model.generate(entries, attributes, on_frame=on_frame)
    total = time.perf_counter() - start
    audio_s = [(end or frames[0]) / 12.5 for end in result.end_steps]
    return {"streams": streams, "first_audio_ms": first_audio[0] * 1000 if first_audio else float("nan"),
            "xrt_median": statistics.median(a / total for a in audio_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=("tiny", "1.6b"), default="tiny")
    parser.add_argument("--duplex", choices=("none", "delay", *DUPLEX_MODELS), default="delay",
                        help="duplex backend beside TTS: none, delay (fabricated), 7b (Moshi-7B shapes, "
                        "random weights) or tiny (the same ModelBackend path at tiny shapes, for CPU)")
    parser.add_argument("--streams", default="1,2", help="concurrent TTS requests per case (0: duplex alone)")
    parser.add_argument("--sessions", default="0,2", help="live duplex sessions per case")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reference", action="store_true", help="also time moshi's TTSModel at each --streams")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds of duplex traffic before measuring")
    parser.add_argument("--text", default=TEXT, help="what every request speaks (default: a fixed paragraph)")
    parser.add_argument("--stagger", type=float, default=0.0,
                        help="seconds between the requests' starts (0: all at once; e.g. 0.25 has each "
                        "new request arrive beside speaking ones, as a live service sees them)")
    parser.add_argument("--delivery", default="http",
                        help="http: real HTTP clients (the figures to quote); direct: the requests go to the "
                        "pool and are read from its streams on the benchmark's loop, no HTTP server work (so "
                        "the difference is what the edge costs); or both, e.g. http,direct")
    parser.add_argument("--clients-in-process", action="store_true",
                        help="--delivery http: run the HTTP clients on this process's loop, beside the server, "
                        "instead of in their own process (the default: real clients are remote, and their "
                        "Python work here competes with the engine thread for the GIL); shows what that costs")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a TTS request may take before it counts as failed")
    parser.add_argument("--progress", type=float, default=0.0,
                        help="print the TTS pool's counters every this many seconds during a case (0: never)")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="measuring time of the 0-stream cases")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the run, in seconds (default: Python's, 0.005): how long "
                        "the engine thread may wait for the GIL while the server's HTTP thread (and with "
                        "--clients-in-process the clients) run")
    parser.add_argument("--watch-stalls", type=float, default=None, metavar="MS",
                        help="run a watchdog thread (benchmarks/stall_watch.py) and print, under each case, the "
                        "times it could not run for MS milliseconds, with every thread's stack: Python work "
                        "holding the GIL, which the engine thread waits for too")
    parser.add_argument("--slots", type=int, default=None,
                        help="TTS pool rows (default: each case's stream count); at least the largest --streams")
    args = parser.parse_args()
    if args.switch_interval is not None:
        if args.switch_interval <= 0:
            parser.error("--switch-interval must be positive")
        sys.setswitchinterval(args.switch_interval)
    deliveries = args.delivery.split(",")
    streams_list = [int(x) for x in args.streams.split(",")]
    if args.slots is not None and args.slots < max(max(streams_list), 1):
        parser.error(f"--slots {args.slots} cannot hold {max(streams_list)} streams")
    if not set(deliveries) <= {"http", "direct"}:
        parser.error(f"--delivery {args.delivery!r}: expected http, direct or both")
    if args.request_timeout <= 0 or args.stagger < 0 or args.progress < 0:
        parser.error("--request-timeout must be positive, --stagger and --progress not negative")
    if args.clients_in_process and "http" not in deliveries:
        parser.error("--clients-in-process applies to --delivery http (direct runs in-process by definition)")
    if args.watch_stalls is not None and args.watch_stalls <= 0:
        parser.error("--watch-stalls must be positive")
    args.watch = StallWatch(args.watch_stalls / 1000).start() if args.watch_stalls else None
    if args.device == "cpu":
        torch.set_num_threads(1)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    models = build_models(args.shapes, args.device, dtype)
    cfg = models[0]
    args.voice_frames = 10 if args.shapes == "tiny" else 125
    work = Path(tempfile.mkdtemp(prefix="tts-bench-"))
    tokenizer_path = train_tiny_tokenizer(work / "tok.model", min(cfg.lm.text_card, 200))
    voices_dir = work / "voices"
    for i in range(4):
        write_voice(voices_dir / f"v{i}{VOICE_SUFFIX}",
                    torch.randn(1, cfg.speaker.dim, args.voice_frames, generator=torch.Generator().manual_seed(i)))
    sessions_list = [int(x) for x in args.sessions.split(",")]
    if args.reference:
        print("| reference TTSModel streams | first audio (ms) | x real time (median) |")
        print("|---:|---:|---:|")
        for streams in streams_list:
            if streams:  # a short warm-up run first: the reference captures its graphs per batch size
                run_reference(models, voices_dir, streams, tokenizer_path, WARM_UP_TEXT)
                r = run_reference(models, voices_dir, streams, tokenizer_path, args.text)
                print(f"| {streams} | {r['first_audio_ms']:.0f} | {r['xrt_median']:.2f} |", flush=True)
        print()
    print(f"TTS {args.shapes} ({sum(p.numel() for p in models[3].parameters()) / 1e6:.0f}M params) on {args.device}, "
          f"duplex backend {args.duplex}, GIL switch interval {sys.getswitchinterval() * 1000:g} ms, HTTP clients "
          + ("in the server's process" if args.clients_in_process else "in their own process"))
    print("| delivery | TTS streams | duplex sessions | TTFB p50 / p99 (ms) | x real time (median, min) | "
          "duplex frame p50 / p99 (ms) | late ticks | slack items past the boundary | TTS steps | starved | forced | "
          "full GCs (ms in them) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    # As `parley serve` does: what is loaded now stays out of full collections (engine/gc_pauses.py).
    freeze_loaded_objects()
    for sessions in sessions_list:
        if args.duplex == "none" and sessions:
            continue
        backend, _ = build_duplex(args.duplex, sessions, args.device, TextTokenizer(tokenizer_path))
        timed = TimedBackend(backend)
        try:
            for delivery, streams in [("-", 0)] + [(d, n) for d in deliveries for n in streams_list if n]:
                args.delivery = delivery
                r = asyncio.run(run_case(args, models, voices_dir, timed, streams, sessions))
                print(f"| {delivery} | {streams} | {sessions} | {r['ttfb_p50']:.0f} / {r['ttfb_p99']:.0f} | "
                      f"{r['xrt_median']:.2f} / {r['xrt_min']:.2f} | {r['frame_p50']:.2f} / {r['frame_p99']:.2f} | "
                      f"{r['late_ticks']} | {r['past_boundary']} | {r['tts_steps']} | {r['starved']} | {r['forced']} | "
                      f"{r['gc_full']} ({r['gc_ms']:.1f}) |", flush=True)
                if r["slow"]:
                    print(f"    {len(r['slow'])} frames 3 ms over the median, at (s into the window, ms; host "
                          "launch ms, GPU ms): " + ", ".join(f"{t:.2f} {ms:.1f} ({host:.1f}, {gpu:.1f})"
                                                            for t, ms, host, gpu in r["slow"][:12]))
                for stall in r["stalls"][:8]:
                    print("    " + stall.replace("\n", "\n    "))
                if r["allocations"]:
                    print("    CUDA allocator during the window: "
                          + ", ".join(f"{k} +{v}" for k, v in sorted(r["allocations"].items())))
                if r["slack"]:
                    print("    slack by item: " + ", ".join(f"{kind} {n} x {ms:.1f} ms (est {est:.1f})"
                                                        for kind, (n, ms, est) in sorted(r["slack"].items())))
        finally:
            timed.release()


if __name__ == "__main__":
    main()
