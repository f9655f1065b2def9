"""Where a TTS step's time goes, at a given number of live rows (CUDA only).

    python benchmarks/profile_tts.py --rows 1,4,16
    python benchmarks/profile_tts.py --rows 1,4,16 --slots 16   # n live rows in a 16-slot pool

kyutai/tts-1.6b-en_fr shapes (tts_load.py's `--shapes 1.6b`), random bf16 weights, Mimi fp32. Per row
count, rows 0..n-1 holding a live request (the default paragraph, a random voice of 125 frames),
in a pool of `--slots` rows (default: n, every row live):

1. The pool's own CUDA graphs timed over replays (median, CUDA events), those of the row bucket
   the live rows run in (the smallest of 1, 2, 4, ..., slots holding them): the text step
   (backbone + text sampling + DSM state machine), the full step (plus depformer and Mimi decode)
   and the admission's device part (always the whole pool); beside them Mimi decode alone as its
   own graph, so depformer + its sampling = full - text - Mimi decode.
2. Every bucket's text and full step (the live rows it holds active): what a step costs as the
   pool's lowest live rows grow or shrink.
3. Kernels of one full step by kind, from torch.profiler over graph replays (profile_frame.py's
   kinds): time per replay and kernel count; many short kernels mean launch- or latency-bound work.

These are what a TTS row's slack items cost (tts_load.py prints the same items' costs as measured
by the engine, host work included).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_frame import graph_ms, kernel_breakdown  # noqa: E402
from tts_load import TEXT, tts_config_dict  # noqa: E402

from parley.engine.cuda_graph import CUDAGraphRunner  # noqa: E402
from parley.engine.slack import CostModel  # noqa: E402
from parley.engine.tts_pool import TtsPool, TtsRequest  # noqa: E402
from parley.models.config import MimiConfig  # noqa: E402
from parley.models.dsm import split_words  # noqa: E402
from parley.models.mimi.codec import Mimi  # noqa: E402
from parley.models.tts import TtsConfig, TtsLM  # noqa: E402

VOICE_FRAMES = 125  # a published voice file's speaker_wavs frames


def build(device: str) -> tuple[TtsLM, Mimi]:
    torch.manual_seed(0)
    cfg = TtsConfig.from_dict(tts_config_dict("1.6b"))
    lm = TtsLM(cfg, dtype=torch.bfloat16).to(device).eval()
    mimi = Mimi(MimiConfig(num_codebooks=cfg.lm.n_q)).to(device).eval()
    return lm, mimi


def fill_rows(pool: TtsPool, lm: TtsLM, rows: int) -> None:
    """Every row holds a request (a fake tokenizer: one token per character, in the text card)."""
    cfg = lm.cfg
    encode = lambda word: [1 + ord(c) % (cfg.lm.text_card - 2) for c in word]  # noqa: E731
    conditions = {name: cfg.lut_values(name)[0] for name in cfg.fuse_sum}
    for row in range(rows):
        voice = torch.randn(1, cfg.speaker.dim, VOICE_FRAMES, generator=torch.Generator().manual_seed(row))
        pool._load_row(row, TtsRequest(tuple(split_words(TEXT, encode, 12.5)), (voice,), conditions))


@torch.no_grad()
def profile_rows(lm: TtsLM, mimi: Mimi, rows: int, slots: int, replays: int, warmup: int) -> dict:
    pool = TtsPool(lm, mimi, slots, voice_frames=VOICE_FRAMES)
    pool.warm_up(CostModel())
    fill_rows(pool, lm, rows)

    def active(n: int) -> torch.Tensor:  # a bucket of n rows, the live ones among them active
        return torch.arange(n, device="cuda") < rows

    per_bucket = {n: {kind: graph_ms(pool._steps[kind].graph(n), (active(n),), replays, warmup)
                      for kind in ("text", "full")} for n in pool.buckets}
    n = pool.bucket(range(rows))
    result = {"bucket": n, **per_bucket[n]}
    index = torch.zeros(1, dtype=torch.long, device="cuda")
    voice = [t.to("cuda") for t in pool._gen.voice_inputs((torch.randn(1, lm.cfg.speaker.dim, VOICE_FRAMES),))]
    idle = torch.zeros(slots, dtype=torch.bool, device="cuda")
    result["admit (device part)"] = graph_ms(pool._admit_graph, (idle, index, *voice), replays, warmup)
    state = mimi.init_state(n, "cuda")
    codes = torch.randint(0, lm.cfg.lm.card, (n, mimi.num_codebooks), device="cuda")
    decode = CUDAGraphRunner(lambda c, m: (mimi.decode_step(c, state, m),), (codes, active(n)))
    result["mimi decode"] = graph_ms(decode, (codes, active(n)), replays, warmup)
    result["depformer + sampling"] = result["full"] - result["text"] - result["mimi decode"]
    result["per bucket"] = per_bucket
    result["kernels (full step)"] = kernel_breakdown(pool._steps["full"].graph(n), (active(n),), 5)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16", help="live rows (the lowest ones), one profile each")
    parser.add_argument("--slots", type=int, default=None,
                        help="pool rows (default: each --rows value, every row live); at least the largest --rows")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    counts = [int(x) for x in args.rows.split(",")]
    if args.slots is not None and args.slots < max(counts):
        parser.error(f"--slots {args.slots} cannot hold {max(counts)} live rows")
    if not torch.cuda.is_available():
        sys.exit("profile_tts.py needs a CUDA device")
    lm, mimi = build("cuda")
    print(f"TTS 1.6b shapes ({sum(p.numel() for p in lm.parameters()) / 1e6:.0f}M params, bf16), "
          f"{torch.cuda.get_device_name()}")
    for rows in counts:
        slots = args.slots or rows
        r = profile_rows(lm, mimi, rows, slots, args.replays, args.warmup)
        print(f"\nrows {rows}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in r.items() if isinstance(v, float))
              + f" (bucket {r['bucket']} of a {slots}-slot pool)")
        print("    per bucket (text / full ms): " + ", ".join(
            f"{n}: {c['text']:.2f} / {c['full']:.2f}" for n, c in r["per bucket"].items()))
        for kind, k in sorted(r["kernels (full step)"].items(), key=lambda item: -item[1]["ms"]):
            top = "; ".join(f"{name} {ms:.2f} ms x{k['top_counts'][name]:.0f}" for name, ms in k["top"].items())
            print(f"    {kind:38s} {k['ms']:6.2f} ms  {k['kernels']:6.0f} kernels   top: {top}")


if __name__ == "__main__":
    main()
