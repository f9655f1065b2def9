"""Mimi in bf16 and float16 against the reference's own numbers: what `--mimi-dtype bfloat16` /
`float16` (auto's choice on CUDA) change in the codes and the audio, beside what the reference
itself changes when it runs as users run it.

    python benchmarks/mimi_quality.py                          # CUDA, full-size Mimi
    python benchmarks/mimi_quality.py --device cpu --tiny      # the CPU smoke run

Weights: the reference's Mimi with random weights (`synthetic.randomize_mimi_state_`), and
Parley's loaded from it (the same tensors). Codebooks are then fitted to the encoder's own
latents: each level's centroids are that level's residuals, drawn from a calibration signal,
as a trained codebook's centroids lie among the data they quantize. Gaussian centroids lie far
apart from the latents instead, which hides near-ties (every variant then picks the same codes).
Signals are speech-like (a gliding pitch with its harmonics under a moving formant, in 3 Hz
syllables, plus noise), one draw for calibration and another for the test.

The baseline is the reference in exact float32 (TF32 off for cuDNN's convolutions and for
matmuls). Against it, per variant: the share of codes equal to the baseline's (the semantic level,
and every level), from streaming encodes of the test signal, and the SNR of streaming decodes of
the baseline's codes against the baseline's audio. Variants (CUDA):
- `reference (PyTorch defaults)`: the reference as it runs on a GPU unless told otherwise;
  PyTorch lets cuDNN's convolutions round their inputs to TF32 by default;
- `parley float32, TF32 off` / `parley float32`: Parley's default Mimi, exact and as it runs;
- `parley bfloat16` / `parley float16`: `--mimi-dtype bfloat16` / `float16` (convs and
  transformers in that dtype, quantizer in fp32).
On the CPU there is no TF32: the two float32 rows are one.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys

import torch

from parley.models.checkpoint import mimi_config_dict
from parley.models.config import FRAME_SAMPLES, MimiConfig, tiny_mimi_config
from parley.models.mimi import Mimi
from parley.models.synthetic import fit_codebooks_, randomize_mimi_state_

SAMPLE_RATE = 24_000


def speech_like(batch: int, frames: int, seed: int) -> torch.Tensor:
    """[batch, frames * 1920]: per row a pitch of 90-250 Hz gliding +-20 % with its first 30
    harmonics, a formant moving over 300-2500 Hz, 3 Hz syllables, and noise 30 dB down."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(frames * FRAME_SAMPLES, dtype=torch.float64) / SAMPLE_RATE
    base = 90 + 160 * torch.rand(batch, 1, generator=g, dtype=torch.float64)
    rate, phase = 0.3 + torch.rand(batch, 1, generator=g, dtype=torch.float64), 2 * math.pi * torch.rand(batch, 1, generator=g, dtype=torch.float64)
    f0 = base * (1 + 0.2 * torch.sin(2 * math.pi * rate * t + phase))
    cycles = torch.cumsum(f0, dim=1) / SAMPLE_RATE
    formant = 1400 + 1100 * torch.sin(2 * math.pi * 0.7 * t + 2 * phase)
    voice = torch.zeros(batch, t.numel(), dtype=torch.float64)
    for k in range(1, 31):
        voice += torch.exp(-((k * f0 - formant) / 400) ** 2) / k * torch.sin(2 * math.pi * k * cycles)
    syllables = 0.5 * (1 + torch.sin(2 * math.pi * 3 * t + phase))
    pcm = voice * syllables
    pcm = 0.3 * pcm / pcm.abs().amax(dim=1, keepdim=True)
    pcm += 0.3 * 10 ** (-30 / 20) * torch.randn(pcm.shape, generator=g, dtype=torch.float64)
    return pcm.float()


AS_RUN = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)  # the process's (PyTorch's defaults)
EXACT = (False, False)


@contextlib.contextmanager
def tf32(cudnn_and_matmul: tuple[bool, bool]):
    """cuDNN's and cuBLAS's TF32 switches for the block, restored after."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn_and_matmul
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def parley_stream(mimi: Mimi, pcm: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Streaming encode of pcm [B, F * 1920] and decode of codes [B, K, F] -> codes, audio [B, F, 1920]."""
    return mimi.encode(pcm), mimi.decode(codes).view(codes.shape[0], -1, FRAME_SAMPLES)


@torch.no_grad()
def reference_encode(ref, pcm: torch.Tensor) -> torch.Tensor:
    """The reference's streaming encode, frame by frame: codes [B, K, F]."""
    frames = pcm.shape[1] // FRAME_SAMPLES
    with ref.streaming(pcm.shape[0]):
        return torch.cat([ref.encode(pcm[:, None, f * FRAME_SAMPLES:(f + 1) * FRAME_SAMPLES])
                          for f in range(frames)], dim=-1)


@torch.no_grad()
def reference_decode(ref, codes: torch.Tensor) -> torch.Tensor:
    """The reference's streaming decode, frame by frame: audio [B, F, 1920]."""
    with ref.streaming(codes.shape[0]):
        return torch.stack([ref.decode(codes[:, :, f:f + 1])[:, 0] for f in range(codes.shape[-1])], dim=1)


def snr_db(audio: torch.Tensor, want: torch.Tensor) -> str:
    noise = (audio.double() - want.double()).pow(2).sum().item()
    return "exact" if noise == 0 else f"{10 * math.log10(want.double().pow(2).sum().item() / noise):.1f} dB"


def build(cfg: MimiConfig, device: str, calibration: torch.Tensor, seed: int):
    """The reference and Parley's Mimi on the same random weights and fitted codebooks."""
    from moshi.models import loaders
    ref = loaders.get_mimi(None, mimi_config_dict(cfg), num_codebooks=cfg.num_codebooks)
    state = ref.state_dict()
    randomize_mimi_state_(state, seed)
    ours = Mimi(cfg)
    ours.load_state_dict(state, strict=True)  # our loader takes the reference's in-memory names
    ours.to(device).eval()
    fit_codebooks_(ours, calibration.to(device), seed)
    books = {k: v.cpu() for k, v in ours.state_dict().items() if "._codebook." in k}
    missing, unexpected = ref.load_state_dict({**state, **books}, strict=False)
    assert not unexpected and all("_codebook._embedding" in k for k in missing), (missing, unexpected)
    return ref.to(device).eval(), ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny test Mimi, not the published shapes")
    parser.add_argument("--batch", type=int, default=8, help="test rows")
    parser.add_argument("--frames", type=int, default=50, help="test frames a row (80 ms each)")
    parser.add_argument("--calibration-frames", type=int, default=80, help="frames a calibration row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if min(args.batch, args.frames, args.calibration_frames) < 1:
        sys.exit("--batch, --frames and --calibration-frames must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("mimi_quality needs a CUDA GPU (or --device cpu)")
    try:
        import moshi  # noqa: F401  (the test oracle: the reference package)
    except ImportError:
        sys.exit("mimi_quality compares against the reference moshi package; install it (pip install moshi==0.2.13)")
    cfg = tiny_mimi_config() if args.tiny else MimiConfig()
    rows = math.ceil(cfg.quantizer.bins / args.calibration_frames)  # a latent frame per 80 ms frame
    calibration = speech_like(rows, args.calibration_frames, args.seed + 1)
    with tf32(EXACT):
        ref, ours = build(cfg, args.device, calibration, args.seed)
    pcm = speech_like(args.batch, args.frames, args.seed + 2).to(args.device)
    cuda = args.device == "cuda"
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}  torch {torch.__version__}  "
          f"{'tiny' if args.tiny else 'published-shape'} Mimi, random weights, codebooks fitted on "
          f"{rows} x {args.calibration_frames} calibration frames; test {args.batch} x {args.frames} frames")
    with tf32(EXACT):
        base_codes = reference_encode(ref, pcm)
        base_audio = reference_decode(ref, base_codes)
    bf16 = copy.deepcopy(ours).compute_in(torch.bfloat16)
    variants = [("parley float32, TF32 off", lambda: parley_stream(ours, pcm, base_codes), EXACT)]
    if cuda:  # (no TF32 on the CPU: these two rows would repeat the first)
        variants.insert(0, ("reference (PyTorch defaults)",
                            lambda: (reference_encode(ref, pcm), reference_decode(ref, base_codes)), AS_RUN))
        variants.append(("parley float32", lambda: parley_stream(ours, pcm, base_codes), AS_RUN))
    variants.append(("parley bfloat16", lambda: parley_stream(bf16, pcm, base_codes), AS_RUN))
    fp16 = copy.deepcopy(ours).compute_in(torch.float16)
    variants.append(("parley float16", lambda: parley_stream(fp16, pcm, base_codes), AS_RUN))
    print("\n| variant | semantic codes equal | all codes equal | decode SNR vs exact reference |")
    print("|---|---:|---:|---:|")
    for name, run, switches in variants:
        with tf32(switches):
            codes, audio = run()
        same = codes == base_codes
        print(f"| {name} | {same[:, 0].float().mean().item():.2%} | {same.float().mean().item():.2%} | "
              f"{snr_db(audio, base_audio)} |", flush=True)


if __name__ == "__main__":
    main()
