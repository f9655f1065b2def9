"""PersonaPlex prompting: persona text, sine frame, voice files, and the prefill plan."""

from __future__ import annotations

import io
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from parley.models.config import FRAME_SAMPLES, SAMPLE_RATE, TEXT_PAD, UNGENERATED_TOKEN, tiny_lm_config
from parley.models.persona_prompt import (
    SILENCE_FRAMES,
    SILENCE_TOKENS,
    SINE_TOKENS,
    PromptPlan,
    build_prompt_frames,
    delay_frames,
    persona_tokens,
    voice_to_pt,
    wrap_persona,
)
from parley.models.tokenizer import TextTokenizer, train_tiny_tokenizer
from parley.models.voices import (
    PersonaError,
    VoicePrompt,
    integrated_loudness,
    list_voices,
    load_voice_pt,
    resolve_voice,
    save_voice_pt,
    sine_frame,
    unpack_voices,
    voice_audio,
    voice_from_wav,
)

CFG = tiny_lm_config()  # Moshi structure: 8 agent + 8 user codebooks, delays [0, 0,1.., 0,1..]
K = CFG.num_codebooks
NA = CFG.n_agent


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    path = train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok.model", vocab_size=CFG.text_card)
    return TextTokenizer(path)


def fake_embed(columns: torch.Tensor) -> torch.Tensor:
    """Stands in for LMGen.embed_frames: a fixed random table per stream, summed."""
    gen = torch.Generator().manual_seed(0)
    text = torch.randn(CFG.text_card + 1, CFG.dim, generator=gen)
    audio = torch.randn(CFG.n_q, CFG.card + 1, CFG.dim, generator=gen)
    out = text[columns[:, 0]]
    for k in range(CFG.n_q):
        out = out + audio[k, columns[:, 1 + k]]
    return out


def codes_voice(n: int, seed: int = 1) -> VoicePrompt:
    gen = torch.Generator().manual_seed(seed)
    return VoicePrompt(source="test-voice", codes=torch.randint(0, CFG.card, (n, NA), generator=gen))


# --------------------------------------------------------------------------- persona text


@pytest.mark.parametrize("text, wrapped", [
    ("You enjoy a good conversation.", "<system> You enjoy a good conversation. <system>"),
    ("  padded\n", "<system> padded <system>"),
    ("<system> already wrapped <system>", "<system> already wrapped <system>"),
    ("  <system> wrapped, spaced <system> ", "<system> wrapped, spaced <system>"),
    ("<system> only the start", "<system> <system> only the start <system>"),
    ("", "<system>  <system>"),
], ids=["plain", "stripped", "wrapped", "wrapped-stripped", "half-wrapped", "empty"])
def test_wrap_persona_matches_personaplex(text, wrapped):
    assert wrap_persona(text) == wrapped


def test_persona_tokens_encode_the_wrapped_text(tokenizer):
    text = "You are a friendly and helpful teacher."
    assert persona_tokens(tokenizer, text) == tokenizer.encode("<system> You are a friendly and helpful teacher. <system>")


def test_empty_persona_has_no_tokens(tokenizer):
    assert persona_tokens(tokenizer, "") == []


# --------------------------------------------------------------------------- sine frame


def test_sine_frame_is_440hz_half_amplitude_float32():
    wave = sine_frame()
    assert wave.shape == (FRAME_SAMPLES,) and wave.dtype == torch.float32
    n = np.arange(FRAME_SAMPLES)
    expected = 0.5 * np.sin(2 * np.pi * 440.0 * n / SAMPLE_RATE)
    np.testing.assert_allclose(wave.numpy(), expected, atol=1e-6)
    assert wave[0] == 0.0
    assert abs(float(wave.abs().max()) - 0.5) < 1e-3
    # 440 Hz over 80 ms: 35.2 cycles -> 71 sign changes.
    signs = np.sign(wave.numpy()[1:])
    assert int(np.count_nonzero(np.diff(signs))) == 70


def test_sine_frame_equals_the_reference_grid():
    duration = FRAME_SAMPLES / SAMPLE_RATE
    t = np.linspace(0.0, duration, int(SAMPLE_RATE * duration), endpoint=False)
    ref = 0.5 * np.sin(2 * np.pi * 440.0 * t).astype(np.float32)
    assert np.array_equal(sine_frame().numpy(), ref)


# --------------------------------------------------------------------------- .pt voices


def test_voice_pt_round_trip_keeps_the_published_layout(tmp_path):
    emb = torch.randn(5, CFG.dim).to(torch.bfloat16)
    cache = torch.randint(0, CFG.card, (K, CFG.max_delay + 3))
    path = tmp_path / "NATF0.pt"
    save_voice_pt(path, VoicePrompt(source="x", embeddings=emb, cache=cache))

    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"embeddings", "cache"}
    assert raw["embeddings"].shape == (5, 1, 1, CFG.dim) and raw["embeddings"].dtype == torch.bfloat16
    assert raw["cache"].shape == (1, K, 4) and raw["cache"].dtype == torch.long

    voice = load_voice_pt(path)
    assert voice.kind == "embeddings" and voice.num_frames == 6
    assert torch.equal(voice.embeddings, emb) and torch.equal(voice.cache, cache)


def test_voice_pt_missing_key_names_file_and_key(tmp_path):
    path = tmp_path / "broken.pt"
    torch.save({"embeddings": torch.zeros(3, 1, 1, 8)}, path)
    with pytest.raises(PersonaError, match=r"broken\.pt has no 'cache' entry"):
        load_voice_pt(path)


def test_voice_pt_wrong_shape_names_file_key_and_shape(tmp_path):
    path = tmp_path / "shape.pt"
    torch.save({"embeddings": torch.zeros(2, 3, 4, 5), "cache": torch.zeros(1, K, 4, dtype=torch.long)}, path)
    with pytest.raises(PersonaError, match=r"shape\.pt: 'embeddings' has shape \[2, 3, 4, 5\]"):
        load_voice_pt(path)
    torch.save({"embeddings": torch.zeros(2, 1, 1, 8), "cache": torch.zeros(2, K, 4, dtype=torch.long)}, path)
    with pytest.raises(PersonaError, match=r"'cache' has shape \[2, 17, 4\]"):
        load_voice_pt(path)
    torch.save({"embeddings": torch.zeros(2, 1, 1, 8), "cache": torch.zeros(1, K, 4)}, path)
    with pytest.raises(PersonaError, match=r"'cache' has dtype torch.float32"):
        load_voice_pt(path)


def test_voice_pt_that_is_not_a_torch_file(tmp_path):
    path = tmp_path / "text.pt"
    path.write_bytes(b"this is not a pickle")
    with pytest.raises(PersonaError, match=r"text\.pt is not a PyTorch voice file"):
        load_voice_pt(path)
    with pytest.raises(PersonaError, match=r"nothing\.pt does not exist"):
        load_voice_pt(tmp_path / "nothing.pt")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    with pytest.raises(PersonaError, match=r"holds a Tensor, expected a dict"):
        load_voice_pt(tmp_path / "tensor.pt")


def test_voice_pt_that_does_not_fit_the_lm(tmp_path):
    path = tmp_path / "other.pt"
    save_voice_pt(path, VoicePrompt(source="x", embeddings=torch.zeros(4, CFG.dim + 1),
                                    cache=torch.zeros(K, 4, dtype=torch.long)))
    with pytest.raises(PersonaError, match=r"other\.pt: embeddings have shape \[4, 65\], this LM needs \[frames, 64\]"):
        build_prompt_frames(CFG, load_voice_pt(path))


# --------------------------------------------------------------------------- .wav voices


def _write_stereo_16k(path: Path, seconds: float, scale: float) -> None:
    sr = 16_000
    t = np.arange(int(sr * seconds)) / sr
    rng = np.random.default_rng(0)
    left = scale * (np.sin(2 * np.pi * 220 * t) + 0.3 * rng.standard_normal(t.size))
    right = scale * (np.sin(2 * np.pi * 330 * t) + 0.3 * rng.standard_normal(t.size))
    soundfile.write(str(path), np.stack([left, right], axis=1).astype(np.float32), sr, subtype="FLOAT")


def test_wav_voice_is_resampled_mono_at_minus_24_lufs(tmp_path):
    path = tmp_path / "voice.wav"
    _write_stereo_16k(path, 2.5, 0.02)  # quiet: needs a big gain
    seen: list[torch.Tensor] = []

    def mimi_encode(frames: torch.Tensor) -> torch.Tensor:
        seen.append(frames)
        return torch.arange(frames.shape[0] * NA).view(frames.shape[0], NA) % CFG.card

    voice = voice_from_wav(path, mimi_encode)
    samples = int(2.5 * SAMPLE_RATE)  # 60000 at 24 kHz
    n = math.ceil(samples / FRAME_SAMPLES)  # 32 frames, the last zero-padded
    assert voice.kind == "codes" and voice.codes.shape == (n, NA)
    frames = seen[0]
    assert frames.shape == (n, FRAME_SAMPLES) and frames.dtype == torch.float32
    pcm = frames.reshape(-1)
    assert torch.all(pcm[samples:] == 0)
    assert abs(integrated_loudness(pcm[:samples], SAMPLE_RATE) - (-24.0)) < 0.5
    assert torch.equal(voice_audio(path), pcm[:samples])


def test_silent_or_short_wav_voice_is_refused(tmp_path):
    silent = tmp_path / "silent.wav"
    soundfile.write(str(silent), np.zeros(24_000, dtype=np.float32), 24_000)
    with pytest.raises(PersonaError, match=r"silent\.wav: the audio is silent"):
        voice_audio(silent)
    short = tmp_path / "short.wav"
    soundfile.write(str(short), 0.1 * np.ones(2_400, dtype=np.float32), 24_000)
    with pytest.raises(PersonaError, match=r"short\.wav: cannot measure loudness"):
        voice_audio(short)


# --------------------------------------------------------------------------- the prompt plan


def test_prompt_plan_orders_voice_silence_persona_silence():
    voice = codes_voice(10)
    persona = [5, 6, 7, 8, 9, 10, 11]
    plan = build_prompt_frames(CFG, voice, persona)

    assert [(p.name, p.start, p.length) for p in plan.phases] == [
        ("voice", 0, 10), ("silence", 10, 6), ("persona", 16, 7), ("silence", 23, 6)]
    assert plan.num_frames == 29 and plan.embeddings is None
    frames = plan.frames
    assert frames.shape == (29, K)
    assert frames[:, 0].tolist() == [TEXT_PAD] * 16 + persona + [TEXT_PAD] * 6
    assert torch.equal(frames[:10, 1:1 + NA], voice.codes)
    assert frames[10:, 1:1 + NA].tolist() == [list(SILENCE_TOKENS)] * 19
    assert frames[:, 1 + NA:].tolist() == [list(SINE_TOKENS)] * 29


def test_prompt_columns_apply_the_delays():
    plan = build_prompt_frames(CFG, codes_voice(4), [5, 6])
    frames, cols = plan.frames, plan.columns
    delays = torch.tensor(CFG.delays)
    assert cols.shape == (plan.num_frames, K)
    assert cols[0].tolist() == [CFG.text_card] + [CFG.card] * CFG.n_q  # all initial tokens
    assert torch.equal(cols[1, delays == 1], torch.full((int((delays == 1).sum()),), CFG.card))
    assert torch.equal(cols[1, delays == 0], frames[1, delays == 0])
    for j in range(2, plan.num_frames):
        assert torch.equal(cols[j, delays == 0], frames[j, delays == 0])
        assert torch.equal(cols[j, delays == 1], frames[j - 1, delays == 1])
    # The spill: the last frame's delayed codebooks, waiting in column F.
    assert plan.spill.shape == (1, K)
    assert torch.equal(plan.spill[0, delays == 1], frames[-1, delays == 1])
    assert torch.all(plan.spill[0, delays == 0] == UNGENERATED_TOKEN)


def test_handoff_step_and_ring():
    plan = build_prompt_frames(CFG, codes_voice(3), [])
    f = plan.num_frames  # 3 + 6 + 6, no persona phase
    assert [p.name for p in plan.phases] == ["voice", "silence", "silence"] and f == 15
    assert plan.first_step_user.tolist() == list(SINE_TOKENS)
    assert plan.first_step_force_text == UNGENERATED_TOKEN
    assert plan.first_step_force_audio.tolist() == [UNGENERATED_TOKEN] + list(SILENCE_TOKENS[1:])
    ring = plan.ring(3)
    assert torch.equal(ring[:, (f - 1) % 3], plan.columns[-1])
    assert torch.equal(ring[:, f % 3], plan.spill[0])
    assert torch.all(ring[:, (f + 1) % 3] == UNGENERATED_TOKEN)


def test_pt_voice_plan_equals_the_wav_voice_plan(tmp_path):
    """A .pt made from codes replays to the same transformer inputs as the codes themselves."""
    voice = codes_voice(9)
    persona = [12, 13, 14]
    path = tmp_path / "VOICE.pt"
    save_voice_pt(path, voice_to_pt(voice, fake_embed, CFG))
    from_codes = build_prompt_frames(CFG, voice, persona)
    from_pt = build_prompt_frames(CFG, load_voice_pt(path), persona)

    assert from_pt.phases == from_codes.phases
    assert from_pt.num_embedded == 8 and from_pt.embeddings.shape == (8, CFG.dim)
    torch.testing.assert_close(from_pt.embeddings, fake_embed(from_codes.columns[:8]))
    assert torch.equal(from_pt.columns, from_codes.columns[8:])
    assert torch.equal(from_pt.spill, from_codes.spill)
    assert torch.equal(from_pt.frames[9:], from_codes.frames[9:])
    assert torch.all(from_pt.frames[:9] == UNGENERATED_TOKEN)
    assert torch.equal(from_pt.ring(3), from_codes.ring(3))


def test_pt_voice_alone_still_hands_off():
    voice = codes_voice(5)
    alone = build_prompt_frames(CFG, voice_to_pt(voice, fake_embed, CFG), silence_frames=0)
    assert [p.name for p in alone.phases] == ["voice"] and alone.columns.shape == (1, K)
    assert alone.first_step_user.tolist() == list(SINE_TOKENS)
    assert alone.first_step_force_audio[1:].tolist() == voice.codes[-1, 1:].tolist()


def test_prompt_without_voice_starts_with_silence():
    plan = build_prompt_frames(CFG, None, [7])
    assert [(p.name, p.length) for p in plan.phases] == [("silence", SILENCE_FRAMES), ("persona", 1),
                                                          ("silence", SILENCE_FRAMES)]


def test_prompt_plan_refuses_bad_inputs():
    with pytest.raises(PersonaError, match=r"persona token 200 is outside the text vocabulary"):
        build_prompt_frames(CFG, codes_voice(2), [200])
    bad = VoicePrompt(source="seven.wav", codes=torch.zeros(4, 7, dtype=torch.long))
    with pytest.raises(PersonaError, match=r"seven\.wav: codes have shape \[4, 7\], expected \[frames, 8\]"):
        build_prompt_frames(CFG, bad)


def test_delay_frames_carries_pending_columns():
    frames = torch.arange(6 * K).view(6, K)
    whole, spill = delay_frames(frames, CFG)
    head, pending = delay_frames(frames[:2], CFG)
    window = torch.cat([pending, torch.full((1, K), UNGENERATED_TOKEN)])
    tail, spill2 = delay_frames(frames[2:], CFG, start=2, pending=window)
    assert torch.equal(torch.cat([head, tail]), whole) and torch.equal(spill, spill2)


# --------------------------------------------------------------------------- voice files on disk


def test_resolve_voice_accepts_names_with_or_without_suffix(tmp_path):
    for name in ("NATF0.pt", "NATM1.pt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "custom.wav").write_bytes(b"")
    assert resolve_voice(tmp_path, "NATF0") == tmp_path / "NATF0.pt"
    assert resolve_voice(tmp_path, "NATF0.pt") == tmp_path / "NATF0.pt"
    assert resolve_voice(tmp_path, "custom") == tmp_path / "custom.wav"
    with pytest.raises(PersonaError, match=r"voice 'VARF9' not found in .*; available voices: NATF0, NATM1, custom\.wav"):
        resolve_voice(tmp_path, "VARF9")
    with pytest.raises(PersonaError, match=r"invalid voice name '\.\./NATF0\.pt'"):
        resolve_voice(tmp_path, "../NATF0.pt")


def test_list_voices_lists_every_kind_load_voice_reads(tmp_path):
    for name in ("NATF0.pt", "b.wav", "c.flac", "d.ogg", "notes.txt", "e.WAV.bak"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "sub.pt").mkdir()  # a directory is not a voice
    assert list_voices(tmp_path) == ["NATF0.pt", "b.wav", "c.flac", "d.ogg"]
    assert list_voices(tmp_path / "missing") == []


def _tgz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_unpack_voices_once_and_refuse_escapes(tmp_path):
    archive = tmp_path / "voices.tgz"
    archive.write_bytes(_tgz({"voices/NATF0.pt": b"a", "voices/NATM0.pt": b"b"}))
    voices = unpack_voices(archive)
    assert voices == tmp_path / "voices" and sorted(p.name for p in voices.iterdir()) == ["NATF0.pt", "NATM0.pt"]
    assert unpack_voices(archive) == voices

    evil = tmp_path / "evil" / "voices.tgz"
    evil.parent.mkdir()
    evil.write_bytes(_tgz({"../outside.pt": b"x"}))
    with pytest.raises(PersonaError, match=r"would be written outside"):
        unpack_voices(evil)
    assert not (tmp_path / "outside.pt").exists()


# --------------------------------------------------------------------------- with the real LMGen


def _stepped(gen, plan: PromptPlan, live: torch.Tensor):
    """Reference timeline: every prompt frame as one forced LMGen.step, then the live frames."""
    frames, f, one = plan.frames, plan.num_frames, torch.ones(1, dtype=torch.bool)
    state = gen.init_state(1)
    for s in range(f):
        nxt = frames[s + 1] if s + 1 < f else torch.full((K,), UNGENERATED_TOKEN)
        audio = torch.cat([nxt[1:2], frames[s, 2:1 + NA]])  # column s+1: semantic of s+1, acoustic of s
        out = gen.step(state, frames[s:s + 1, 1 + NA:], one, force_text=nxt[:1], force_audio=audio[None])
    return state, out, [gen.step(state, live[i:i + 1], one) for i in range(live.shape[0])]


def _prefilled(gen, plan: PromptPlan, live: torch.Tensor):
    """Parley's timeline: one batched prefill, the handoff step, then the live frames."""
    one = torch.ones(1, dtype=torch.bool)
    state = gen.init_state(1)
    x = gen.embed_frames(plan.prefill_columns)
    if plan.embeddings is not None:
        x = torch.cat([plan.embeddings.to(x.dtype), x])
    assert x.shape[0] == plan.num_frames - 1
    gen.prefill(state, 0, x, ring_tokens=plan.ring_tokens)
    out = gen.step(state, plan.first_step_user[None], one, force_text=torch.tensor([plan.first_step_force_text]),
                   force_audio=plan.first_step_force_audio[None])
    return state, out, [gen.step(state, live[i:i + 1], one) for i in range(live.shape[0])]


@pytest.fixture(scope="module")
def greedy_gen():
    from parley.models.lm import LMModel
    from parley.models.lm_gen import LMGen

    model = LMModel(CFG).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    return LMGen(model, text_temp=0.0, audio_temp=0.0)


@pytest.mark.parametrize("as_pt", [False, True], ids=["wav-codes", "pt"])
def test_prefill_plan_equals_stepping_every_frame(greedy_gen, as_pt):
    gen = greedy_gen
    voice = codes_voice(3)
    voice_in = voice_to_pt(voice, gen.embed_frames, CFG) if as_pt else voice
    reference = build_prompt_frames(CFG, voice, [21, 22], silence_frames=2)
    plan = build_prompt_frames(CFG, voice_in, [21, 22], silence_frames=2)
    live = torch.randint(0, CFG.card, (3, CFG.n_user), generator=torch.Generator().manual_seed(5))

    s_state, s_handoff, s_live = _stepped(gen, reference, live)
    p_state, p_handoff, p_live = _prefilled(gen, plan, live)
    assert p_handoff.text.tolist() == [TEXT_PAD] and p_handoff.audio[0].tolist() == list(SILENCE_TOKENS)
    assert torch.equal(s_handoff.audio, p_handoff.audio)
    for layer in range(len(s_state.transformer.keys)):
        torch.testing.assert_close(p_state.transformer.keys[layer], s_state.transformer.keys[layer])
    for a, b in zip(s_live, p_live):
        assert torch.equal(a.text, b.text) and torch.equal(a.audio, b.audio)
