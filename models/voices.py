"""PersonaPlex voice prompts: the files, and what a session's voice is made of.

A voice is given either as audio (`.wav`, `.flac`, `.ogg`: resampled to 24 kHz mono,
loudness-normalised to -24 LUFS, then Mimi-encoded into agent codes) or as a `.pt` of
precomputed LM input embeddings plus the token ring left after them (PersonaPlex's own
voices). This module reads and writes those files, lists and resolves voice names in a
checkpoint's voices directory, and unpacks `voices.tgz`. Turning a voice into prompt
frames is `persona_prompt.py`'s job.
"""

from __future__ import annotations

import math
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .audio_io import read_wav
from .config import FRAME_SAMPLES, SAMPLE_RATE

VOICE_TARGET_LUFS = -24.0
SINE_HZ = 440.0
SINE_AMPLITUDE = 0.5

VOICE_PT_SUFFIX = ".pt"
VOICE_AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")
VOICE_SUFFIXES = (VOICE_PT_SUFFIX, *VOICE_AUDIO_SUFFIXES)  # every kind `load_voice` reads

MimiEncode = Callable[[torch.Tensor], torch.Tensor]


class PersonaError(ValueError):
    """A voice or persona that cannot be used; the message names the file or field and why."""


# --------------------------------------------------------------------------- audio helpers


def sine_frame(sample_rate: int = SAMPLE_RATE, frame: int = FRAME_SAMPLES) -> torch.Tensor:
    """One frame of PersonaPlex's user-side "sine": 440 Hz, amplitude 0.5, phase 0, float32.

    Built like PersonaPlex's `create_sinewave(frame / sample_rate, sample_rate)`: the sine is
    evaluated in float64 on an evenly spaced grid without endpoint, cast to float32, then
    scaled. (PersonaPlex builds this waveform but feeds the LM the fixed `SINE_TOKENS`.)
    """
    if sample_rate <= 0 or frame <= 0:
        raise ValueError(f"sample_rate and frame must be positive, got {sample_rate}, {frame}")
    duration = frame / sample_rate
    n = int(sample_rate * duration)
    t = np.linspace(0.0, duration, n, endpoint=False)
    wave = np.float32(SINE_AMPLITUDE) * np.sin(2.0 * np.pi * SINE_HZ * t).astype(np.float32)
    return torch.from_numpy(wave.astype(np.float32))


def integrated_loudness(pcm: torch.Tensor, sample_rate: int = SAMPLE_RATE) -> float:
    """ITU-R BS.1770-4 integrated loudness (LUFS) of mono audio, via pyloudnorm's meter.

    Raises `ValueError` when the audio is shorter than one 400 ms gating block.
    """
    # Imported here (slow, with scipy.signal): only an audio voice needs it. Voices are read when
    # the backend is built (engine/voice_library.py), never on the engine thread while it ticks.
    import pyloudnorm

    data = pcm.detach().to("cpu", torch.float64).reshape(-1).numpy()
    return float(pyloudnorm.Meter(sample_rate).integrated_loudness(data))


def normalize_loudness(pcm: torch.Tensor, sample_rate: int = SAMPLE_RATE,
                       target_lufs: float = VOICE_TARGET_LUFS, *, name: str = "audio") -> torch.Tensor:
    """Scale mono audio to `target_lufs` integrated loudness (one gain, no clipping: as PersonaPlex)."""
    try:
        loudness = integrated_loudness(pcm, sample_rate)
    except PersonaError:
        raise
    except ValueError as err:
        raise PersonaError(f"{name}: cannot measure loudness ({err}); a voice prompt needs at least 0.4 s of audio") from err
    if not math.isfinite(loudness):
        raise PersonaError(f"{name}: the audio is silent (loudness {loudness} LUFS); it cannot be a voice prompt")
    gain = 10.0 ** ((target_lufs - loudness) / 20.0)
    return (pcm.to(torch.float64) * gain).to(torch.float32)


def voice_audio(path: str | Path, target_lufs: float = VOICE_TARGET_LUFS) -> torch.Tensor:
    """A voice prompt's audio as PersonaPlex prepares it: 24 kHz mono float32, at `target_lufs`.

    Resampled with soxr (`audio_io.read_wav`; channels averaged), then loudness-normalised.
    """
    pcm = read_wav(path, SAMPLE_RATE)
    return normalize_loudness(pcm, SAMPLE_RATE, target_lufs, name=f"voice file {path}")


def split_frames(pcm: torch.Tensor, frame: int = FRAME_SAMPLES) -> torch.Tensor:
    """`[T]` samples -> `[ceil(T / frame), frame]`, the last frame zero-padded."""
    pcm = pcm.reshape(-1)
    n = max(1, -(-pcm.numel() // frame))
    padded = torch.zeros(n * frame, dtype=pcm.dtype, device=pcm.device)
    padded[: pcm.numel()] = pcm
    return padded.view(n, frame)


# --------------------------------------------------------------------------- voice prompts


@dataclass(frozen=True)
class VoicePrompt:
    """A voice prompt, either as agent Mimi codes or as PersonaPlex's precomputed `.pt` state.

    - `codes` `[N, n_agent]`: one frame of agent codes per voice frame (from a `.wav`).
    - `embeddings` `[N - 1, dim]` + `cache` `[num_codebooks, max_delay + 3]` (from a `.pt`):
      the LM inputs of ring columns `0 .. N-2`, and PersonaPlex's token ring after the
      N-th voice frame (column c of the ring is absolute column `c mod width`).
    """

    source: str
    codes: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    cache: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return "codes" if self.codes is not None else "embeddings"

    @property
    def num_frames(self) -> int:
        """Voice frames N (one LM step each in the reference)."""
        if self.codes is not None:
            return int(self.codes.shape[0])
        assert self.embeddings is not None
        return int(self.embeddings.shape[0]) + 1


def _pt_layout() -> str:
    return "{'embeddings': float [T, 1, 1, dim], 'cache': int64 [1, num_codebooks, max_delay + 3]}"


def load_voice_pt(path: str | Path) -> VoicePrompt:
    """Load a PersonaPlex voice `.pt` ({'embeddings': [T, 1, 1, dim], 'cache': [1, K, W]}).

    Embeddings come back as `[T, dim]` in their stored dtype, the cache as int64 `[K, W]`.
    Every problem raises `PersonaError` naming the file and the key or shape at fault.
    """
    path = Path(path)
    if not path.is_file():
        raise PersonaError(f"voice file {path} does not exist")
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and unpickler errors have no common base
        raise PersonaError(f"voice file {path} is not a PyTorch voice file ({type(err).__name__}: {err})") from err
    if not isinstance(state, dict):
        raise PersonaError(f"voice file {path} holds a {type(state).__name__}, expected a dict {_pt_layout()}")
    for key in ("embeddings", "cache"):
        if key not in state:
            raise PersonaError(f"voice file {path} has no {key!r} entry (keys: {sorted(map(str, state))}); "
                               f"expected {_pt_layout()}")
        if not isinstance(state[key], torch.Tensor):
            raise PersonaError(f"voice file {path}: {key!r} is a {type(state[key]).__name__}, not a tensor")

    emb = state["embeddings"]
    if not emb.is_floating_point():
        raise PersonaError(f"voice file {path}: 'embeddings' has dtype {emb.dtype}, expected a float tensor")
    shape = tuple(emb.shape)
    if emb.dim() == 4 and shape[1:3] == (1, 1):
        emb = emb[:, 0, 0]
    elif emb.dim() == 3 and shape[1] == 1:
        emb = emb[:, 0]
    elif emb.dim() != 2:
        raise PersonaError(f"voice file {path}: 'embeddings' has shape {list(shape)}, expected [T, 1, 1, dim]")
    if emb.shape[0] < 1 or emb.shape[1] < 1:
        raise PersonaError(f"voice file {path}: 'embeddings' has shape {list(shape)}, expected T >= 1 frames")

    cache = state["cache"]
    cshape = tuple(cache.shape)
    if cache.is_floating_point() or cache.is_complex() or cache.dtype == torch.bool:
        raise PersonaError(f"voice file {path}: 'cache' has dtype {cache.dtype}, expected int64 tokens")
    if cache.dim() == 3 and cshape[0] == 1:
        cache = cache[0]
    elif cache.dim() != 2:
        raise PersonaError(f"voice file {path}: 'cache' has shape {list(cshape)}, expected [1, num_codebooks, max_delay + 3]")
    if cache.shape[0] < 3 or cache.shape[1] < 2:
        raise PersonaError(f"voice file {path}: 'cache' has shape {list(cshape)}, expected [1, num_codebooks, max_delay + 3]")
    return VoicePrompt(source=str(path), embeddings=emb.contiguous(), cache=cache.to(torch.long).contiguous())


def save_voice_pt(path: str | Path, voice: VoicePrompt) -> None:
    """Write a voice in PersonaPlex's `.pt` layout (embeddings `[T, 1, 1, dim]`, cache `[1, K, W]`)."""
    if voice.embeddings is None or voice.cache is None:
        raise PersonaError(f"voice {voice.source} has no embeddings/cache to save; build them with voice_to_pt")
    emb = voice.embeddings.detach().to("cpu")
    torch.save({
        "embeddings": emb.reshape(emb.shape[0], 1, 1, emb.shape[-1]).contiguous(),
        "cache": voice.cache.detach().to("cpu", torch.long).unsqueeze(0).contiguous(),
    }, str(path))


def voice_from_wav(path: str | Path, mimi_encode: MimiEncode) -> VoicePrompt:
    """Encode an audio voice prompt: 24 kHz mono, -24 LUFS, 1920-sample frames (last zero-padded).

    `mimi_encode(frames [N, 1920] float32) -> codes [N, n_agent]` must run the frames in order
    through a freshly reset streaming Mimi encoder (PersonaPlex resets Mimi before the prompt).
    """
    frames = split_frames(voice_audio(path))
    codes = torch.as_tensor(mimi_encode(frames))
    if codes.dim() != 2 or codes.shape[0] != frames.shape[0]:
        raise PersonaError(f"voice file {path}: mimi_encode returned shape {list(codes.shape)} for "
                           f"{frames.shape[0]} frames, expected [{frames.shape[0]}, n_codebooks]")
    return VoicePrompt(source=str(path), codes=codes.to("cpu", torch.long))


def load_voice(path: str | Path, mimi_encode: MimiEncode | None = None) -> VoicePrompt:
    """A `.pt` voice via `load_voice_pt`, anything else as audio via `voice_from_wav`."""
    path = Path(path)
    if path.suffix == VOICE_PT_SUFFIX:
        return load_voice_pt(path)
    if mimi_encode is None:
        raise PersonaError(f"voice file {path} is audio and needs a Mimi encoder")
    return voice_from_wav(path, mimi_encode)


def list_voices(voices_dir: str | Path) -> list[str]:
    """File names of the voice prompts in a directory (`.pt` and audio), sorted."""
    root = Path(voices_dir)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_file() and p.suffix in VOICE_SUFFIXES)


def voice_candidates(name: str) -> list[str]:
    """The file names a client-supplied voice name may mean, in order: `NATF0.pt` as is, `NATF0`
    -> `NATF0.pt`, then audio. Names with directory parts raise `PersonaError` (PersonaPlex
    rejects them too)."""
    if not name or name != Path(name).name or name in (".", ".."):
        raise PersonaError(f"invalid voice name {name!r}: expected a file name such as 'NATF0' or 'NATF0.pt'")
    if Path(name).suffix in VOICE_SUFFIXES:
        return [name]
    return [f"{name}{s}" for s in VOICE_SUFFIXES] + [name]


def voice_not_found(name: str, available: list[str], note: str = "") -> PersonaError:
    shown = ", ".join(Path(v).stem if v.endswith(VOICE_PT_SUFFIX) else v for v in available) or "none"
    return PersonaError(f"voice {name!r} not found{note}; available voices: {shown}")


def resolve_voice(voices_dir: str | Path, name: str) -> Path:
    """The voice file for a client-supplied name (see `voice_candidates`); a missing voice
    raises `PersonaError` listing what the directory holds."""
    root = Path(voices_dir)
    for cand in voice_candidates(name):
        if (root / cand).is_file():
            return root / cand
    raise voice_not_found(name, list_voices(root))


def unpack_voices(archive: str | Path, dest: str | Path | None = None) -> Path:
    """Unpack `voices.tgz` next to itself (or into `dest`) once; return its `voices/` directory.

    Members that would land outside the destination are refused.
    """
    archive = Path(archive)
    dest = Path(dest) if dest is not None else archive.parent
    voices = dest / "voices"
    if voices.is_dir():
        return voices
    try:
        with tarfile.open(archive, "r:gz") as tar:
            root = dest.resolve()
            for member in tar.getmembers():
                target = (root / member.name).resolve()
                if target != root and root not in target.parents:
                    raise PersonaError(f"{archive}: member {member.name!r} would be written outside {dest}")
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as err:
        raise PersonaError(f"{archive} could not be unpacked: {err}") from err
    if not voices.is_dir():
        raise PersonaError(f"{archive} holds no 'voices/' directory")
    return voices

