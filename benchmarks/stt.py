"""Transcription figures: paired STT in the duplex frame, standalone streams, REST throughput,
and the reference `moshi` package's batched STT on the same weights for the ratio.

Shapes: `--shapes full` = Moshi-7B duplex + Kyutai STT 1B (dim 2048, 16 layers, 32 codebooks,
text delay 6, 4 extra heads) + the real Mimi shape, random bf16 weights (compute and memory
traffic of real ones); `--shapes tiny` = Parley's tiny test shapes, so the script runs on a CPU.

    python benchmarks/stt.py --shapes tiny --device cpu --batch 4 --streams 4,8 --frames 10
    python benchmarks/stt.py --shapes full --device cuda --batch 64 --streams 64,128,256,400,512 --frames 60

Prints one table per part (times in ms; p50 / p99 over `--frames` steps after `--warmup`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from parley.engine.backend import ModelBackend  # noqa: E402
from parley.engine.scheduler import TickPlan  # noqa: E402
from parley.engine.slack import CostModel  # noqa: E402
from parley.engine.stt_paired import PairedTranscription  # noqa: E402
from parley.engine.stt_pool import SttPool  # noqa: E402
from parley.models.checkpoint import Checkpoint, SttCheckpoint, lm_config_dict, mimi_config_dict  # noqa: E402
from parley.models.config import (FRAME_SAMPLES, LMConfig, MimiConfig, QuantizerConfig, SamplingDefaults,  # noqa: E402
                                  tiny_lm_config, tiny_mimi_config)
from parley.models.lm import LMModel  # noqa: E402
from parley.models.mimi.codec import Mimi  # noqa: E402
from parley.models.stt import SttSettings  # noqa: E402
from parley.models.synthetic import tiny_stt_config  # noqa: E402
from parley.models.tokenizer import TextTokenizer, train_tiny_tokenizer  # noqa: E402
from profile_frame import graph_ms, kernel_breakdown  # noqa: E402
from write_models import STT_1B  # noqa: E402  (Kyutai stt-1b-en_fr's shapes)



def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def random_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """N(0, 1/fan_in) weights drawn on the module's device (fast for 7B on a GPU); Mimi codebooks usable."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("alpha") or ".norm" in name or p.dim() < 2:
            continue
        p.normal_(0, 1 / math.sqrt(p.shape[-1]), generator=gen)
    for m in module.modules():
        if hasattr(m, "refresh_embedding"):
            m.embedding_sum.normal_(generator=gen)
            m.cluster_usage.fill_(1.0)
            m._initialized.fill_(1.0)
            m.refresh_embedding()
    return module.eval()


def build(shapes: str, device: torch.device, dtype: torch.dtype, tokenizer: TextTokenizer):
    if shapes == "tiny":
        lm_cfg, stt_cfg = tiny_lm_config(), tiny_stt_config(n_q=16)
        mimi_cfg = tiny_mimi_config(8, levels=16)
    else:
        lm_cfg, stt_cfg = LMConfig(), STT_1B
        mimi_cfg = MimiConfig(quantizer=QuantizerConfig(n_q=32), num_codebooks=8)
    mimi = random_(Mimi(mimi_cfg).to(device), 1)
    lm = random_(LMModel(lm_cfg, device=device, dtype=dtype), 2)
    stt_lm = random_(LMModel(stt_cfg, device=device, dtype=dtype), 3)
    stt_mimi = Mimi(dataclasses.replace(mimi_cfg, num_codebooks=stt_cfg.n_q)).to(device)
    stt_mimi.load_state_dict(mimi.state_dict())
    stt_mimi.eval()
    duplex = Checkpoint(lm=lm, mimi=mimi, tokenizer=tokenizer, lm_config=lm_cfg, mimi_config=mimi_cfg,
                        voices_dir=None, sampling=SamplingDefaults(), model_type="moshi", path=Path("."))
    stt = SttCheckpoint(lm=stt_lm, mimi=stt_mimi, tokenizer=tokenizer, lm_config=stt_cfg, mimi_config=mimi_cfg,
                        settings=SttSettings(0.0, 0.5), path=Path("."))
    return duplex, stt


def timed(fn, device, frames: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(frames):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


@torch.no_grad()
def bench_paired(duplex, stt, batch: int, frames: int, warmup: int, device, breakdown: bool = False) -> dict:
    """The duplex frame (step + host copy) without and with paired transcription for every row:
    "in frame" (the server's way: the STT beside the LM, in the frame's graph on a side stream) and
    "after frame" (its own graph after the frame's, on codes the frame encoded). `breakdown` adds
    the frame encoding the STT's codebooks with no STT, the after-frame STT graph alone (CUDA
    events), `publish` (host side) and that graph's kernels by kind."""
    pcm = torch.randn(batch, FRAME_SAMPLES) * 0.1
    live = torch.ones(batch, dtype=torch.bool)
    plan = TickPlan(tick=0, request_ids=[f"r{i}" for i in range(batch)], live_mask=live, frames=pcm,
                    underruns=0, released=[], arrivals=[0.0] * batch)
    out = {}
    variants = ("plain", "in frame", "after frame") + (("encode only",) if breakdown else ())
    for variant in variants:
        paired = variant in ("in frame", "after frame")
        transcription = PairedTranscription(stt, batch, in_frame=variant == "in frame") if paired else None
        encode = stt.lm_config.n_q if variant in ("after frame", "encode only") else None
        backend = ModelBackend(duplex, batch, seed=0, encode_codebooks=encode,
                               side_work=transcription.frame_work if transcription is not None else None)
        if transcription is not None:
            loop = asyncio.new_event_loop()
            for i in range(batch):
                transcription.enable(i, f"r{i}", loop)
        publish: list[float] = []

        def frame():
            if transcription is not None:
                transcription.prepare(plan)
            result = backend.step(pcm, live)
            if transcription is not None:
                transcription.step(plan, result)
            result.to_host()
            if transcription is not None:
                start = time.perf_counter()
                transcription.publish()
                publish.append(time.perf_counter() - start)

        times = timed(frame, device, frames, warmup)
        out[variant] = (percentile(times, 50), percentile(times, 99))
        if variant == "after frame" and breakdown:
            out["publish"] = (percentile(publish, 50), percentile(publish, 99))
            if transcription.graphed:
                codes = torch.zeros(batch, stt.lm_config.n_q, dtype=torch.long, device=device)
                inputs = (codes, torch.ones(batch, dtype=torch.bool, device=device))
                graph = transcription._steps.graph(batch)
                out["stt graph"] = (graph_ms(graph, inputs, frames, warmup) / 1e3,) * 2
                out["stt kernels"] = kernel_breakdown(graph, inputs, replays=5)
        if transcription is not None:
            transcription.close()
        backend.close()
    return out


@torch.no_grad()
def bench_streams(stt, streams: int, frames: int, warmup: int, device) -> tuple[float, float]:
    """One batched standalone step (Mimi encode + STT + host copy) of an SttPool with every one of
    `streams` rows running, as the slack runs it (CUDA graphs after warm_up): p50 / p99 seconds."""
    pool = SttPool(stt, streams)
    pool.warm_up(CostModel())
    pcm = (0.1 * np.random.default_rng(0).standard_normal((streams, FRAME_SAMPLES))).astype(np.float32)
    run = [True] * streams
    times = timed(lambda: pool.run_device(pcm, run), device, frames, warmup)
    pool.close()
    return percentile(times, 50), percentile(times, 99)


@torch.no_grad()
def bench_reference(stt, streams: int, frames: int, warmup: int, device) -> tuple[float, float] | None:
    """The reference's batched STT (LMGen.step on Mimi codes, its own CUDA graphs) on the same weights."""
    try:
        from moshi.models import loaders
        from moshi.models.lm import LMGen
    except ImportError:
        return None
    kwargs = lm_config_dict(stt.lm_config)  # config.json's LMModel kwargs, as the reference reads them
    ref = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device=device, dtype=next(stt.lm.parameters()).dtype)
    ref.load_state_dict(stt.lm.state_dict(), strict=True)
    ref_mimi = loaders.get_mimi(None, mimi_config_dict(stt.mimi_config), device=device, num_codebooks=stt.lm_config.n_q)
    gen = LMGen(ref.eval(), temp=0.0, temp_text=0.0)
    pcm = torch.randn(streams, 1, FRAME_SAMPLES, device=device) * 0.1
    with gen.streaming(streams), ref_mimi.streaming(streams):
        times = timed(lambda: gen.step(ref_mimi.encode(pcm)), device, frames, warmup)
    return percentile(times, 50), percentile(times, 99)


def bench_rest(stt, slots: int, requests: int, seconds: float) -> float:
    """Audio seconds transcribed per wall second, requests back to back in manual mode."""
    pool = SttPool(stt, slots)
    pool.warm_up(CostModel())
    clip = (0.1 * np.random.default_rng(0).standard_normal(int(seconds * 24_000))).astype(np.float32)

    async def run() -> float:
        jobs = [pool.submit() for _ in range(requests)]
        for job in jobs:
            job.feed(clip)
            job.end_input()
        start = time.perf_counter()
        with torch.no_grad():
            pool.run_until_idle()
        return time.perf_counter() - start

    wall = asyncio.run(run())
    return requests * seconds / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=("tiny", "full"), default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64, help="duplex sessions for the paired figure")
    p.add_argument("--streams", default="64,128,256,400", help="standalone STT rows to time")
    p.add_argument("--rest-slots", type=int, default=64)
    p.add_argument("--rest-requests", type=int, default=128)
    p.add_argument("--rest-seconds", type=float, default=10.0, help="audio length of each REST request")
    p.add_argument("--frames", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="where the paired overhead goes (CUDA)")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)
    tokenizer = TextTokenizer(train_tiny_tokenizer(Path("/tmp/parley-bench-tokenizer.model"), 200))
    duplex, stt = build(args.shapes, device, dtype, tokenizer)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"device: {name}  torch {torch.__version__}  shapes: {args.shapes}  dtype: {dtype}")

    paired = bench_paired(duplex, stt, args.batch, args.frames, args.warmup, device,
                          breakdown=args.breakdown and device.type == "cuda")
    p50, p99 = paired["plain"]
    print(f"\nduplex frame at B={args.batch} (ms)          p50      p99")
    print(f"  without transcription                 {p50 * 1e3:7.2f}  {p99 * 1e3:7.2f}")
    if "encode only" in paired:
        e50, e99 = paired["encode only"]
        print(f"  encoding {stt.lm_config.n_q} codebooks, no STT           {e50 * 1e3:7.2f}  {e99 * 1e3:7.2f}")
    for variant in ("in frame", "after frame"):
        q50, q99 = paired[variant]
        print(f"  paired transcription, {variant:11s}     {q50 * 1e3:7.2f}  {q99 * 1e3:7.2f}   "
              f"(+{(q50 / p50 - 1) * 100:.1f} % p50)")
    for name in ("stt graph", "publish"):
        if name in paired:
            print(f"  after frame: {name:24s} {paired[name][0] * 1e3:7.2f}  {paired[name][1] * 1e3:7.2f}")
    for kind, k in sorted(paired.get("stt kernels", {}).items(), key=lambda item: -item[1]["ms"]):
        print(f"    STT kernels: {kind:36s} {k['ms']:6.3f} ms  {k['kernels']:5.0f} kernels")

    print("\nstandalone STT step (ms)   streams   p50      p99     real-time (p99 <= 80 ms)   reference p50   ratio")
    for streams in [int(s) for s in args.streams.split(",") if s]:
        s50, s99 = bench_streams(stt, streams, args.frames, args.warmup, device)
        ref = None if args.no_reference else bench_reference(stt, streams, args.frames, args.warmup, device)
        ref_txt = "      -" if ref is None else f"{ref[0] * 1e3:8.2f}   {ref[0] / s50:5.2f}x"
        print(f"                        {streams:6d}  {s50 * 1e3:7.2f}  {s99 * 1e3:7.2f}   {'yes' if s99 <= 0.08 else 'no':>5}"
              f"                    {ref_txt}")

    rate = bench_rest(stt, args.rest_slots, args.rest_requests, args.rest_seconds)
    print(f"\n/v1/audio/transcriptions rows ({args.rest_slots} slots, {args.rest_requests} x {args.rest_seconds:.0f} s, "
          f"steps back to back): {rate:.1f} audio seconds per wall second")


if __name__ == "__main__":
    main()
