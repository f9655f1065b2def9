"""Shared pieces of the frame benchmarks (frame_latency.py, profile_frame.py, tts_load.py): random
Moshi-7B shaped models (or Hibiki-Zero 3B ones, or tiny ones for CPU smoke runs) and their
checkpoint, placing rows in a window, timing, and the memory-bandwidth floor of a frame.

Hibiki-Zero 3B shapes (`hibiki_zero_3b_config`) are those of `kyutai/hibiki-zero-3b-pytorch-bf16`
as public ports of it describe them (its config.json is not read here): temporal dim 2048, 28
layers, 16 heads over 8 KV heads (kv_repeat 2), FFN hidden scale 6, rope_concat with period 20000,
context 3000, text vocabulary 48000, 32 audio streams (16 source, 16 translated), a 16-step
depformer (dim 1024, 6 layers, 16 heads, one KV head per query head) over 9 weight slices, and
the `description` LUT conditioner. Parameters differ from the real model's only in value.

The floor: a frame must read every weight once (the LM's and Mimi's) and every live row's filled
KV window once (keys and values of every layer, plus the fp8 scales), at the GPU's copy
bandwidth (about 4.3 TB/s on an H200, measured by a device-to-device copy). No kernel runs
faster than that; `floor_ms` is that time, and a measured frame's "fraction of the floor" is
floor / measured (1.0 = at the floor).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from parley.models.checkpoint import Checkpoint
from parley.models.config import LMConfig, MimiConfig, SamplingDefaults, tiny_lm_config, tiny_mimi_config
from parley.models.synthetic import tiny_hibiki_config
from parley.models.lm import LMModel
from parley.models.lm_gen import LMGenState
from parley.models.mimi.codec import Mimi
from parley.models.paged_kv import block_size_for, ring_blocks
from parley.models.tokenizer import TextTokenizer
from parley.models.transformer import ring_slot_positions

WINDOWS = ("empty", "spread", "full")
H200_COPY_TBPS = 4.3  # measured device-to-device copy bandwidth (bytes read + written) on the H200


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


MODEL_KINDS = ("moshi", "personaplex", "tiny", "hibiki-zero-3b", "tiny-hibiki-zero")
HIBIKI_KINDS = ("hibiki-zero-3b", "tiny-hibiki-zero")  # model_type hibiki: conditioned on description very_good


def hibiki_zero_3b_config() -> LMConfig:
    """Hibiki-Zero 3B's LM shapes (see the module doc), on the tiny Hibiki-Zero's structure."""
    return dataclasses.replace(
        tiny_hibiki_config("hibiki-zero", context=3000), dim=2048, text_card=48000, num_heads=16, num_layers=28,
        hidden_scale=6.0, depformer_dim=1024, depformer_dim_feedforward=4096, depformer_num_heads=16,
        depformer_num_layers=6, depformer_kv_repeat=1)


def model_configs(kind: str) -> tuple[LMConfig, MimiConfig]:
    """Moshi-7B (dep_q 8), PersonaPlex-7B (dep_q 16), Hibiki-Zero 3B (16 codebooks a stream), or
    the tiny CPU test shapes of Moshi's or Hibiki-Zero's structure."""
    if kind == "tiny":
        return tiny_lm_config(), tiny_mimi_config()
    if kind in ("moshi", "personaplex"):
        return LMConfig(dep_q=16 if kind == "personaplex" else 8), MimiConfig()
    if kind == "hibiki-zero-3b":
        return hibiki_zero_3b_config(), MimiConfig(num_codebooks=16)
    if kind == "tiny-hibiki-zero":
        return tiny_hibiki_config("hibiki-zero"), tiny_mimi_config(num_codebooks=16, levels=32)
    raise ValueError(f"model kind {kind!r}: expected one of {', '.join(MODEL_KINDS)}")


def random_models(kind: str = "moshi", device: str = "cuda",
                  dtype: torch.dtype = torch.bfloat16) -> tuple[LMModel, Mimi, LMConfig, MimiConfig]:
    """An LM of `kind`'s shapes (see `model_configs`) with random weights, and Mimi."""
    torch.manual_seed(0)
    lm_cfg, mimi_cfg = model_configs(kind)
    lm = LMModel(lm_cfg, device=device, dtype=dtype)  # built on the device: PyTorch's random init
    return lm.eval(), random_mimi(mimi_cfg, device), lm_cfg, mimi_cfg


def random_mimi(cfg: MimiConfig, device: str = "cuda") -> Mimi:
    """Mimi with PyTorch's random init and random codebooks, so codes and audio are not degenerate."""
    mimi = Mimi(cfg).to(device)
    for module in mimi.modules():
        if hasattr(module, "refresh_embedding"):
            module.embedding_sum.normal_()
            module.refresh_embedding()
    return mimi.eval()


def graph_ms(runner, inputs, frames: int, warmup: int) -> float:
    """Median GPU time of one replay of a `CUDAGraphRunner`, by CUDA events."""
    times = []
    for i in range(warmup + frames):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner(*inputs)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return percentile(times, 50)


def bench_checkpoint(lm: LMModel, mimi: Mimi, lm_cfg: LMConfig, mimi_cfg: MimiConfig,
                     tokenizer: TextTokenizer | None = None, model_type: str = "moshi") -> Checkpoint:
    """A checkpoint over in-memory models (the one place benchmarks build it). The frame
    benchmarks step the backend directly and need no tokenizer; serving sessions does."""
    return Checkpoint(lm=lm, mimi=mimi, tokenizer=tokenizer, lm_config=lm_cfg, mimi_config=mimi_cfg,
                      voices_dir=None, sampling=SamplingDefaults(), model_type=model_type, path=Path("."))


def window_positions(batch: int, window: str, context: int, device) -> torch.Tensor:
    """Each row's position: `empty` 0, `spread` evenly over 0..context, `full` past the context."""
    if window == "empty":
        return torch.zeros(batch, dtype=torch.long, device=device)
    if window == "spread":
        return torch.linspace(0, context, batch, device=device).long()
    if window == "full":
        return torch.full((batch,), 10 * context, dtype=torch.long, device=device)
    raise ValueError(f"window {window!r}: expected one of {', '.join(WINDOWS)}")


KV_POOLS = ("fit", "full")  # --kv-blocks besides a number: what the placed rows need, or a full window each


def paged_blocks(positions: torch.Tensor, capacity: int, block_size: int, ahead: int) -> list[int]:
    """Blocks each row at `positions` holds for its filled window and `ahead` more frames (a paged
    row holds logical blocks 0 .. k - 1 until its ring wraps, then all of them)."""
    blocks = ring_blocks(capacity, block_size)
    return [min(blocks, -(-(p + ahead) // block_size)) for p in positions.tolist()]


def kv_pool(choice: str | None, batch: int, windows, cfg: LMConfig, block_frames: int | None,
            ahead: int, divides: bool = False) -> tuple[int, int] | None:
    """(usable blocks, frames per block) for --kv-blocks `choice`: a number, `fit` (what the rows
    of the most demanding window write over `ahead` frames) or `full` (a whole window for every
    row); None (dense rings) without one. Block frames default as the model's (paged_kv; with
    `divides`, as page-list attention needs)."""
    if choice is None:
        return None
    block_frames = block_size_for(cfg.context, block_frames, divides)
    if choice == "full":
        return batch * ring_blocks(cfg.context, block_frames), block_frames
    if choice == "fit":
        need = (sum(paged_blocks(window_positions(batch, w, cfg.context, "cpu"), cfg.context, block_frames, ahead))
                for w in windows)
        return max(need), block_frames
    if not choice.isdigit():
        raise ValueError(f"--kv-blocks {choice}: a number of blocks, or one of {', '.join(KV_POOLS)}")
    return int(choice), block_frames


def place_rows(state: LMGenState, window: str, context: int, ahead: int = 0) -> None:
    """Move every row of an LM state to its window position (KV contents stay: timing only). A
    paged state's rows also get the blocks that window and `ahead` more frames write."""
    tr = state.transformer
    pos = window_positions(tr.pos.shape[0], window, context, tr.pos.device)
    if tr.paged:
        need = paged_blocks(pos, tr.capacity, tr.block_size, ahead)
        if sum(need) > tr.num_blocks - 1:
            raise ValueError(f"B={len(need)} rows at window {window!r} need {sum(need)} KV blocks of "
                             f"{tr.block_size} frames over the run; the pool holds {tr.num_blocks - 1}")
        first = 1
        for row, n in enumerate(need):
            tr.release_row(row)
            tr.assign_blocks(row, list(range(n)), list(range(first, first + n)))
            first += n
    tr.pos.copy_(pos)
    tr.slot_pos.copy_(ring_slot_positions(pos, tr.slot_pos.shape[1]))
    state.offsets.copy_(pos)


def page_list_planner(backend, window: str, context: int, live: torch.Tensor):
    """For page-list attention (`ModelBackend(paged_attention="flashinfer")`): a callable that hands
    the backend the next frame's positions and when each block was taken, as the engine's KV pool
    does before each step, for rows placed by `place_rows` (block j first written at position
    j * block; rows not `live` do not step). Call it before each `backend.step`."""
    tr = backend._lm_state.transformer
    pos = np.where(live.numpy(), window_positions(len(live), window, context, "cpu").numpy(), -1)
    taken_at = np.broadcast_to(np.arange(tr.block_table.shape[1]) * tr.block_size, tr.block_table.shape).copy()

    def plan() -> None:
        backend.plan_kv_step(pos.copy(), taken_at)
        pos[pos >= 0] += 1
    return plan


def time_frames(run_frame, frames: int, warmup: int) -> list[float]:
    """Wall time of each call in ms, synchronized before and after (so it includes the host side;
    without CUDA, as on a CPU smoke run, there is nothing to wait for)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for i in range(warmup + frames):
        sync()
        start = time.perf_counter()
        run_frame()
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1000)
    return times


def weight_bytes(lm: torch.nn.Module, mimi: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in (lm, mimi) for p in m.parameters())


def kv_bytes(cfg: LMConfig, positions: torch.Tensor, kv_dtype: torch.dtype | None) -> int:
    """Bytes of filled KV window the temporal transformer reads in one frame, over the live rows
    at `positions` (see `window_positions`). Grouped heads (kv_repeat r) keep num_heads / r KV heads."""
    filled = positions.clamp(max=cfg.context).sum().item()
    fp8 = kv_dtype == torch.float8_e4m3fn
    kv_heads = cfg.num_heads // cfg.kv_repeat
    kv_dim = kv_heads * (cfg.dim // cfg.num_heads)
    per_slot = 2 * kv_dim * (1 if fp8 else 2) + (2 * kv_heads * 4 if fp8 else 0)  # K + V (+ scales)
    return int(filled * per_slot * cfg.num_layers)


def floor_ms(weights: int, kv: int, tbps: float = H200_COPY_TBPS) -> float:
    return (weights + kv) / (tbps * 1e12) * 1e3
