"""Write a Moshi-7B-shaped checkpoint (random bf16 weights) in the published layout, load it
through Parley's loader, and step it: load time, peak host memory, GPU memory, frame time.

The loader must not materialise the weights twice: it reads one tensor at a time, so the
peak host memory (VmHWM, reset before loading) stays far below one copy of the LM (15.4 GB).
With `--kind personaplex` it also writes a voice prompt (`--voice-frames` frames, .pt form)
and times a session's prefill (voice, silence, persona, silence) next to the others' frame.
`--kind hibiki-zero-3b`: a Hibiki-Zero 3B shaped translation checkpoint instead (frame_setup.py's
`hibiki_zero_3b_config`: grouped KV heads, rope_concat; config.json with model_type hibiki, its
`description` conditioner and the 48k tokenizer's file name), served as `parley serve` loads it
(conditioned on `description: very_good`); the line after the load names each transformer's
attention path.

    python benchmarks/load_7b.py --dir /tmp/moshi7b [--kind moshi|personaplex|hibiki-zero-3b] [--batches 1,32]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


from parley.engine.backend import ModelBackend
from parley.engine.config import SessionOptions
from parley.models.checkpoint import load_checkpoint, lm_config_dict, write_checkpoint
from parley.models.config import FRAME_SAMPLES, TOKENIZER_FILE, LMConfig, MimiConfig, SamplingDefaults
from parley.models.lm import LMModel
from parley.models.mimi.codec import Mimi
from parley.models.persona_prompt import voice_to_pt
from parley.models.synthetic import HIBIKI_TOKENIZER_FILE
from parley.models.voices import VoicePrompt, save_voice_pt
from parley.models.tokenizer import train_tiny_tokenizer

from frame_latency import attention_paths  # (this script's folder) which attention each transformer runs


def host_peak_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def reset_host_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


PERSONA = ("You are a wise and friendly teacher. Answer questions or provide advice in a clear "
           "and engaging way.")  # PersonaPlex's example persona


@torch.no_grad()
def write_random_7b(directory: Path, kind: str, voice_frames: int, device: str = "cuda") -> None:
    """`device` meta: the layout with sparse zero weights (benchmarks/write_models.py's config check)."""
    if kind == "hibiki-zero-3b":
        from frame_setup import hibiki_zero_3b_config  # (this script's folder: the frame benchmarks' shapes)
        cfg = hibiki_zero_3b_config()
    else:
        cfg = LMConfig(dep_q=16 if kind == "personaplex" else 8)
    lm = LMModel(cfg, device=device, dtype=torch.bfloat16)  # default init, on the GPU: seconds
    voices = {}
    if kind == "personaplex":
        codes = torch.randint(0, cfg.card, (voice_frames, cfg.n_agent))
        embed = lm.embed
        voice = voice_to_pt(VoicePrompt(source="VOICE0", codes=codes), lambda t: embed(t.to(device)).cpu(), cfg)
        save_voice_pt(directory / ".VOICE0.pt", voice)
        voices["VOICE0"] = directory / ".VOICE0.pt"
    state = {k: v if v.is_meta else v.cpu() for k, v in lm.state_dict().items()}
    del lm
    tokenizer = train_tiny_tokenizer(directory / ".spm.model", 200)
    config = lm_config_dict(cfg) if kind == "personaplex" else None
    if kind == "hibiki-zero-3b":  # the published translation layout: its model type, sampling and tokenizer name
        config = {**lm_config_dict(cfg), "model_type": "hibiki", "tokenizer_name": HIBIKI_TOKENIZER_FILE,
                  "lm_gen_config": SamplingDefaults().to_lm_gen_config()}
    with torch.device("meta" if device == "meta" else "cpu"):
        mimi = Mimi(MimiConfig())  # the published Mimi's 32 levels (a Hibiki reads 16)
    write_checkpoint(directory, state, mimi.state_dict(), tokenizer, config, voices)
    tokenizer.unlink()  # scratch: copied into the layout's file
    if kind == "hibiki-zero-3b":
        (directory / TOKENIZER_FILE).rename(directory / HIBIKI_TOKENIZER_FILE)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="where to write the checkpoint")
    parser.add_argument("--kind", choices=("moshi", "personaplex", "hibiki-zero-3b"), default="moshi")
    parser.add_argument("--batches", default="1,32", help="batch sizes to step")
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--voice-frames", type=int, default=100, help="personaplex: voice prompt length")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    if not (args.dir / "model.safetensors").exists():
        started = time.perf_counter()
        write_random_7b(args.dir, args.kind, args.voice_frames)
        print(f"wrote {args.dir} in {time.perf_counter() - started:.1f} s "
              f"({(args.dir / 'model.safetensors').stat().st_size / 1e9:.1f} GB LM file)")
    reset_host_peak()
    rss_before = host_peak_gib()
    started = time.perf_counter()
    ckpt = load_checkpoint(args.dir, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    params = sum(p.numel() for p in ckpt.lm.parameters())
    print(f"loaded {params / 1e9:.2f} B LM parameters ({ckpt.model_type}, dep_q {ckpt.lm_config.dep_q}) in "
          f"{seconds:.1f} s; host peak {host_peak_gib():.2f} GiB (RSS before {rss_before:.2f} GiB); "
          f"GPU {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    print(f"attention: {attention_paths(ckpt.lm)}")
    for batch in (int(b) for b in args.batches.split(",")):
        backend = ModelBackend(ckpt, batch, cuda_graphs=True, seed=0)
        pcm = torch.randn(batch, FRAME_SAMPLES) * 0.1
        live = torch.ones(batch, dtype=torch.bool)
        times = []
        for i in range(args.frames + 5):
            start = time.perf_counter()
            backend.step(pcm, live).to_host()
            if i >= 5:
                times.append((time.perf_counter() - start) * 1000)
        times.sort()
        print(f"B={batch}: frame p50 {times[len(times) // 2]:.2f} ms, max {times[-1]:.2f} ms "
              f"(whole frame, CUDA graph, from a loaded checkpoint)")
        if ckpt.model_type == "personaplex":
            options = SessionOptions(persona=PERSONA, voice="VOICE0")
            prefill = []
            for _ in range(6):  # row 0 re-opened while the other rows stay live
                torch.cuda.synchronize()
                start = time.perf_counter()
                backend.reset_rows(torch.arange(batch) == 0)
                backend.prefill(0, options)
                torch.cuda.synchronize()
                prefill.append((time.perf_counter() - start) * 1000)
                backend.step(pcm, live).to_host()
            print(f"B={batch}: PersonaPlex prefill ({args.voice_frames}-frame voice + persona of "
                  f"{len(ckpt.tokenizer.encode(PERSONA))} tokens): first {prefill[0]:.1f} ms, "
                  f"then p50 {sorted(prefill[1:])[2]:.1f} ms, max {max(prefill[1:]):.1f} ms")
        backend.close()  # frees its states and graph; the loaded weights stay in `ckpt`
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
