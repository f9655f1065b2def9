"""Random-weight checkpoints of every kind `parley serve` loads, each in the exact layout its loader
reads, at real shapes (or tiny ones for CPU tests): nothing is downloaded (tokenizers are trained
here on built-in text, voices drawn here). Each kind goes to `--dir/<kind>`; each directory is
printed with its size.

    # H200 (about a minute to write): every kind at real shapes on the GPU, then all of them through one server
    python benchmarks/write_models.py --dir /tmp/models --device cuda && \\
    python benchmarks/mixed_load.py --models /tmp/models --duplex 64 --tts 16 --transcription 64 --images 4 \\
        --image-size 512x512 --image-steps 20 --duration 20 --procs 4 --serve-arg=--device=cuda
    # CPU: tiny shapes (tests/test_benchmarks_smoke.py serves them)
    python benchmarks/write_models.py --dir /tmp/tiny --shapes tiny --device cpu
    # CPU: the real-shape layouts with sparse zero weights (no memory, no disk), each read back by
    # Parley's loaders on the meta device (config, file names, every key and shape; no tensor kept)
    python benchmarks/write_models.py --dir /tmp/layouts --device meta --kinds duplex,tts,stt --check

Kinds (`--kinds`, default all four):
- duplex: Moshi-7B (load_7b.py's writer: bf16 LM, fp32 Mimi, a 200-piece SentencePiece);
  tiny: `write_tiny_checkpoint(kind="moshi")`.
- tts: Kyutai TTS 1.6B shapes (kyutai/tts-1.6b-en_fr's config.json, 32 codebooks, its file names:
  dsm_tts_1e68beda@240.safetensors, bf16 with fp32 conditioners), the duplex model's Mimi file (the
  published TTS ships that same file, so the server holds it once), voices in tts/voices
  (`speaker_wavs` [1, 512, 125], the model's suffix) and tts/voice_map.json naming them with
  OpenAI's 13 voice names; tiny: `write_tiny_tts_checkpoint` with the same voice map.
- stt: Kyutai STT 1B shapes (kyutai/stt-1b-en_fr's: dim 2048, 16 layers, 32 codebooks, text delay
  6, 4 extra heads; benchmarks/stt.py's `full`), bf16, reading the duplex model's Mimi so the
  server pairs it with the duplex frame; tiny: `write_tiny_stt_checkpoint` on the tiny duplex Mimi.
- image: Stable Diffusion 1.5 shapes (`sd15_shaped`: benchmarks/diffusion_interference.py's),
  diffusers layout, fp32 as published; tiny: `write_tiny_pipeline("sd")`. Not written on meta.

The duplex Mimi comes from `--mimi-from`, else `--dir/duplex` when it is there; without one the
TTS and STT get a random Mimi of their own (then the server neither shares nor pairs them).
The real shapes live here; tts_load.py, profile_tts.py and stt.py build theirs from them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from parley.models.checkpoint import (MIMI_CONFIG_FILE, load_checkpoint, load_stt_checkpoint,  # noqa: E402
                                     save_tensors)
from parley.models.config import MIMI_FILE, LMConfig, MimiConfig  # noqa: E402
from parley.models.lm import LMModel  # noqa: E402
from parley.models.mimi.codec import Mimi  # noqa: E402
from parley.models.synthetic import (TINY_TTS_VOICES, checkpoint_mimi, random_tts_lm, tiny_tts_config,  # noqa: E402
                                     write_stt_checkpoint, write_tiny_checkpoint, write_tiny_stt_checkpoint,
                                     write_tiny_tts_checkpoint)
from parley.models.tokenizer import train_tiny_tokenizer  # noqa: E402
from parley.models.tts import TtsConfig, TtsLM  # noqa: E402
from parley.models.tts_checkpoint import (TTS_TOKENIZER_FILE, VoiceStore, load_tts_checkpoint,  # noqa: E402
                                          write_tts_lm, write_voice)
from parley.realtime.server.demo_model import OPENAI_VOICE_NAMES  # noqa: E402

KINDS = ("duplex", "tts", "stt", "image")
VOICE_MAP = "voice_map.json"
TOKENIZER_PIECES = 200  # the built-in corpus's size; below every real text_card, as the loaders require

# Kyutai stt-1b-en_fr shapes as its config.json gives them (docs/transcription.md).
STT_1B = LMConfig(dim=2048, text_card=8000, num_heads=16, num_layers=16, hidden_scale=4.125, context=375,
                  max_period=100000.0, n_q=32, dep_q=0, delays=(6,) + (0,) * 32,
                  extra_heads_num_heads=4, extra_heads_dim=6)
STT_SETTINGS = {"audio_silence_prefix_seconds": 1.0, "audio_delay_seconds": 5.0}  # the reference script's
# kyutai/tts-1.6b-en_fr's file names and model id (its voices end in .1e68beda@240.safetensors)
TTS_PUBLISHED = {"model_id": {"sig": "1e68beda", "epoch": 240}, "moshi_name": "dsm_tts_1e68beda@240.safetensors",
                 "mimi_name": MIMI_FILE, "tokenizer_name": TTS_TOKENIZER_FILE}
TTS_VOICES, TTS_VOICE_FRAMES = 4, 125


def tts_config_dict(shapes: str) -> dict:
    """config.json of a DSM TTS: `tiny` (4 codebooks) or `1.6b`, the published kyutai/tts-1.6b-en_fr shapes."""
    raw = tiny_tts_config(n_q=4 if shapes == "tiny" else 32)
    if shapes == "1.6b":  # docs: shared/reference/tts.md
        raw.update(dim=2048, text_card=8000, num_heads=16, num_layers=16, context=500, depformer_dim=1024,
                   depformer_dim_feedforward=3072, depformer_num_heads=16, depformer_num_layers=4,
                   depformer_context=32, depformer_low_rank_embeddings=128,
                   depformer_weights_per_step_schedule=list(range(8)) + [8] * 8 + [9] * 8 + [10] * 8)
        raw["conditioners"]["speaker_wavs"]["tensor"]["dim"] = 512
        raw["conditioners"]["cfg"]["lut"]["dim"] = 16
        raw["conditioners"]["control"]["lut"]["dim"] = 2048
    return raw


def serve_args(directory: Path) -> list[str]:
    """`parley serve` flags for what this script wrote under `directory` (the kinds present)."""
    directory = Path(directory)
    flags = {"duplex": ["--model={}"], "stt": ["--stt-model={}"], "image": ["--image-model={}"],
             "tts": ["--tts-model={}", "--tts-voices={}/voices", f"--tts-voice-map={{}}/{VOICE_MAP}"]}
    return [flag.format(directory / kind) for kind in KINDS if (directory / kind).is_dir() for flag in flags[kind]]


# ---- the duplex model's Mimi, shared by the TTS and the STT ----

def duplex_mimi(mimi_dir: Path | None, device: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(Mimi config in the reference layout, {} = built-in; weights): `mimi_dir`'s, else a fresh one
    (on meta always: its layout is the built-in one, and its zeros stay unwritten)."""
    if mimi_dir is not None and device != "meta":
        return checkpoint_mimi(mimi_dir)
    with torch.device(device):
        return {}, Mimi(MimiConfig()).state_dict()  # PyTorch's init, as load_7b.py's duplex Mimi


def write_voices(out: Path, names: list[str]) -> None:
    """voice_map.json: OpenAI's voice names (what clients send by default) over `names`, in turn."""
    (out / VOICE_MAP).write_text(json.dumps({n: names[i % len(names)] for i, n in enumerate(OPENAI_VOICE_NAMES)},
                                            indent=2))


# ---- one writer per kind: (out, shapes, device, mimi_dir) ----

def write_duplex(out: Path, shapes: str, device: str, mimi_dir: Path | None) -> None:
    if shapes == "tiny":
        write_tiny_checkpoint(out, kind="moshi")
        return
    from load_7b import write_random_7b  # the GPU benchmark's writer: its imports only here

    write_random_7b(out, "moshi", 0, device)


@torch.no_grad()
def write_tts(out: Path, shapes: str, device: str, mimi_dir: Path | None) -> None:
    if shapes == "tiny":
        write_tiny_tts_checkpoint(out)
        write_voices(out, list(TINY_TTS_VOICES))
        return
    raw = {**tts_config_dict("1.6b"), **TTS_PUBLISHED}
    cfg = TtsConfig.from_dict(raw)
    generator = None if device == "meta" else torch.Generator(device).manual_seed(0)
    lm = random_tts_lm(TtsLM(cfg, device=device, dtype=torch.bfloat16), generator)
    write_tts_lm(out / raw["moshi_name"], lm, torch.bfloat16)
    del lm
    mimi_raw, mimi = duplex_mimi(mimi_dir, device)
    if mimi_raw:  # a Mimi of other shapes than the built-in one, which the published TTS names no config for
        (out / MIMI_CONFIG_FILE).write_text(json.dumps(mimi_raw, indent=2))
        raw["mimi_config_name"] = MIMI_CONFIG_FILE
    save_tensors(out / MIMI_FILE, {k: v.detach().to("meta" if v.is_meta else "cpu").float().contiguous().clone()
                                   for k, v in mimi.items()})
    train_tiny_tokenizer(out / TTS_TOKENIZER_FILE, TOKENIZER_PIECES)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    names = [f"bench/v{i}" for i in range(TTS_VOICES)]
    for i, name in enumerate(names):
        speaker = torch.randn(1, cfg.speaker.dim, TTS_VOICE_FRAMES, generator=torch.Generator().manual_seed(10 + i))
        write_voice(out / "voices" / f"{name}{cfg.voice_suffix}", speaker)
    write_voices(out, names)


@torch.no_grad()
def write_stt(out: Path, shapes: str, device: str, mimi_dir: Path | None) -> None:
    if shapes == "tiny":
        write_tiny_stt_checkpoint(out, mimi_from=mimi_dir)
        return
    lm = LMModel(STT_1B, device=device, dtype=torch.bfloat16)  # PyTorch's init on the device: seconds
    with torch.no_grad():  # ids past the tokenizer's pieces are empty text: a random greedy head picked
        lm.text_linear.weight[TOKENIZER_PIECES:] = 0  # them, so no delta came; their logits 0 now, a piece wins
    tokenizer = train_tiny_tokenizer(out / ".spm.model", TOKENIZER_PIECES)
    mimi_raw, mimi = duplex_mimi(mimi_dir, device)
    write_stt_checkpoint(out, lm.state_dict(), STT_1B, tokenizer, mimi_raw, mimi, settings=STT_SETTINGS)
    tokenizer.unlink()


def write_image(out: Path, shapes: str, device: str, mimi_dir: Path | None) -> None:
    from parley.models.tiny_diffusion import sd15_shaped, write_tiny_pipeline  # diffusers: only here

    if shapes == "tiny":
        write_tiny_pipeline(out, "sd")
        return
    with torch.device(device):  # the 1 B parameters drawn on the GPU: seconds, not a minute of CPU
        pipe = sd15_shaped()
    pipe.to("cpu").save_pretrained(out)  # fp32 safetensors, as SD-1.5 is published


WRITERS = {"duplex": write_duplex, "tts": write_tts, "stt": write_stt, "image": write_image}


# ---- reading back (--check) ----

def check(kind: str, out: Path, device: str) -> str:
    """Load `out` with the loader `parley serve` uses for `kind`; what was read."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if kind == "duplex":
        ckpt = load_checkpoint(out, device, dtype)
        return f"{params(ckpt.lm)} LM parameters, {ckpt.model_type}"
    if kind == "tts":
        ckpt = load_tts_checkpoint(out, device, dtype)
        store = VoiceStore.open(out / "voices", ckpt.config.voice_suffix, ckpt.config.speaker.dim, out / VOICE_MAP)
        store.read_all()
        return (f"{params(ckpt.lm)} LM parameters, n_q {ckpt.config.lm.n_q}, "
                f"{len(store.names())} voice names")
    if kind == "stt":
        ckpt = load_stt_checkpoint(out, device, dtype)
        return f"{params(ckpt.lm)} LM parameters, n_q {ckpt.lm_config.n_q}"
    from parley.models.image_pipeline import load_image_pipeline

    stepper = load_image_pipeline(str(out), device, dtype)
    return f"{stepper.family}, default {stepper.default_size} px"


def params(module: torch.nn.Module) -> str:
    return f"{sum(p.numel() for p in module.parameters()) / 1e6:,.1f} M"


def size_gb(directory: Path) -> float:
    """Bytes of the files as written (a sparse file counts its full length)."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="each kind is written to DIR/<kind>")
    p.add_argument("--shapes", choices=("real", "tiny"), default="real")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of: " + ", ".join(KINDS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where weights are drawn (cuda: fast at real shapes); meta: sparse zero weights")
    p.add_argument("--mimi-from", type=Path, default=None,
                   help="a duplex checkpoint whose Mimi the TTS and STT use (default: DIR/duplex if there)")
    p.add_argument("--check", action="store_true", help="then load each one with Parley's loader on --device")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--kinds: one or more of {', '.join(KINDS)}")
    if args.device == "meta" and (args.shapes == "tiny" or "image" in kinds):
        p.error("--device meta writes real-shape layouts of duplex, tts and stt (diffusers saves real tensors)")
    for kind in sorted(kinds, key=KINDS.index):  # the duplex first: the others read its Mimi
        out = args.dir / kind
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        mimi_dir = args.mimi_from or (args.dir / "duplex" if (args.dir / "duplex").is_dir() else None)
        started = time.perf_counter()
        WRITERS[kind](out, args.shapes, args.device, mimi_dir if kind != "duplex" else None)
        sparse = " (sparse: zeros not stored)" if args.device == "meta" else ""
        print(f"{kind}: {out} {size_gb(out):.2f} GB{sparse}, written in {time.perf_counter() - started:.1f} s",
              flush=True)
    for kind in kinds if args.check else ():
        started = time.perf_counter()
        print(f"{kind}: loaded on {args.device}: {check(kind, args.dir / kind, args.device)} "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
    print("serve with: " + " ".join(f"--serve-arg={a}" for a in serve_args(args.dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
