"""What the fp8 KV cache changes in the text logits, against the bf16 cache, same inputs.

Moshi-7B shapes with random bf16 weights (pass --tiny for the tiny CPU config). Both caches
see the same random tokens; printed: max |logit difference|, that relative to the max |logit|,
and how often the greedy text token agrees. Random weights give flat logits (argmax flips
easily): re-measure on real weights before making fp8 the default.

    python benchmarks/kv_drift.py --batch 4 --frames 100
    python benchmarks/kv_drift.py --batch 4 --prefix 2000 --frames 50
"""

from __future__ import annotations

import argparse

import torch


from parley.models.config import LMConfig, tiny_lm_config
from parley.models.lm import LMModel


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--frames", type=int, default=100, help="compared frames")
    parser.add_argument("--prefix", type=int, default=0, help="frames prefilled first (in passes of up to 500)")
    parser.add_argument("--tiny", action="store_true", help="the tiny config on the CPU")
    args = parser.parse_args()
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    cfg = tiny_lm_config() if args.tiny else LMConfig()
    torch.manual_seed(0)
    model = LMModel(cfg, device=device, dtype=dtype).eval()
    states = [model.transformer.init_state(args.batch, kv_dtype=kv) for kv in (None, torch.float8_e4m3fn)]
    tokens = torch.randint(0, cfg.card, (args.batch, args.prefix + args.frames, cfg.num_codebooks), device=device)
    tokens[..., 0] = torch.randint(0, cfg.text_card, tokens.shape[:2], device=device)
    x = model.embed(tokens)
    chunk = min(500, model.transformer.capacity)  # a prefill call may not wrap the ring
    for start in range(0, args.prefix, chunk):
        for state in states:
            model.temporal(x[:, start:min(start + chunk, args.prefix)], state)
    diff, scale, agree = 0.0, 0.0, 0
    for t in range(args.prefix, args.prefix + args.frames):
        ref, fp8 = (model.temporal(x[:, t:t + 1], state)[1].float() for state in states)
        diff = max(diff, (ref - fp8).abs().max().item())
        scale = max(scale, ref.abs().max().item())
        agree += (ref.argmax(-1) == fp8.argmax(-1)).sum().item()
    print(f"{args.frames} frames after a {args.prefix}-frame prefix, B={args.batch}: max |text-logit diff| "
          f"{diff:.4f} ({100 * diff / scale:.2f} % of max |logit| {scale:.2f}); greedy text agreement "
          f"{100 * agree / (args.frames * args.batch):.1f} %")


if __name__ == "__main__":
    main()
