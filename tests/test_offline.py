"""`parley offline`: a WAV through one session, checked exactly against the echo checkpoint."""

from __future__ import annotations

import json

import numpy as np
import soundfile as sf
import torch

from parley.models.audio_io import read_wav
from parley.models.checkpoint import load_checkpoint
from parley.models.config import FRAME_SAMPLES
from parley.models.synthetic import ECHO_FIRST_FRAME, echo_text_token, echo_words
from parley.realtime.cli import main


def _chirp_wav(path, sample_rate=16_000, seconds=2.0, channels=2):
    t = np.arange(int(sample_rate * seconds)) / sample_rate
    x = 0.3 * np.sin(2 * np.pi * 200 * t * (1 + 2 * t)) + 0.05 * np.random.default_rng(0).standard_normal(t.size)
    sf.write(path, np.stack([x] * channels, axis=1).astype(np.float32), sample_rate)


def _run_offline(model, wav_in, wav_out, text_out) -> None:
    assert main(["offline", "--model", str(model), "--input-wav", str(wav_in), "--output-wav", str(wav_out),
                 "--output-text", str(text_out), "--greedy"]) == 0


def _assert_echo_reply(ckpt, wav_in, wav_out, text_out) -> np.ndarray:
    """The echo checkpoint's known answer: the agent's audio is the Mimi decode of the user's own
    codes shifted by one frame (ECHO_DELAY_FRAMES), and the text is the echo's words. Returns
    the written audio."""
    pcm = read_wav(wav_in)
    with torch.no_grad():
        user = ckpt.mimi.encode(pcm[None])[0].T  # [F, 8]: a fresh encoder, as the session's
        # Frame 1 (the first valid one) reads initial tokens only: code 0 in every codebook.
        agent = torch.cat([torch.zeros(1, 8, dtype=torch.long), user[ECHO_FIRST_FRAME - 1:-1]])
        expected = ckpt.mimi.decode(agent.T[None])[0]  # a fresh decoder, from frame 1 on

    out, rate = sf.read(wav_out, dtype="float32")
    assert rate == 24_000 and out.shape == (pcm.numel(),)  # aligned with the input, as heard live
    assert np.all(out[:FRAME_SAMPLES] == 0)  # step 0 has no frame yet
    n = out.size - FRAME_SAMPLES
    np.testing.assert_allclose(out[FRAME_SAMPLES:], expected[:n].numpy(), atol=1e-4)  # 16-bit WAV

    pieces = json.loads(text_out.read_text())["pieces"]
    words = echo_words(ckpt.tokenizer)
    expected_tokens = echo_text_token(user[ECHO_FIRST_FRAME - 1:-1, 0], words).tolist()
    got = {p["frame"]: p["token"] for p in pieces}
    assert [got[f] for f in range(ECHO_FIRST_FRAME, user.shape[0])] == expected_tokens
    return out


def test_offline_echo_reproduces_the_users_codes_one_frame_later(echo_dir, tmp_path):
    """Any rate and channel count in (here 16 kHz stereo); the echo's known reply out."""
    wav_in, wav_out, text_out = tmp_path / "in.wav", tmp_path / "out.wav", tmp_path / "out.json"
    _chirp_wav(wav_in)
    _run_offline(echo_dir, wav_in, wav_out, text_out)
    _assert_echo_reply(load_checkpoint(echo_dir, dtype=torch.float32), wav_in, wav_out, text_out)


def test_offline_is_deterministic_with_greedy(echo_dir, tmp_path):
    """Two greedy runs write the same bytes, and both are the echo's known reply (so a run
    that is repeatable but wrong, or right only once, fails)."""
    wav_in = tmp_path / "in.wav"
    _chirp_wav(wav_in, sample_rate=48_000, seconds=1.0, channels=1)
    ckpt = load_checkpoint(echo_dir, dtype=torch.float32)
    runs = []
    for i in range(2):
        wav_out, text_out = tmp_path / f"out{i}.wav", tmp_path / f"out{i}.json"
        _run_offline(echo_dir, wav_in, wav_out, text_out)
        _assert_echo_reply(ckpt, wav_in, wav_out, text_out)
        runs.append((wav_out.read_bytes(), text_out.read_text()))
    assert runs[0] == runs[1]


def test_offline_bad_input_gives_one_clear_line(echo_dir, tmp_path, capsys):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF not really a wav")
    rc = main(["offline", "--model", str(echo_dir), "--input-wav", str(bad), "--output-wav",
               str(tmp_path / "o.wav")])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.wav" in err and "Traceback" not in err
    good = tmp_path / "good.wav"
    _chirp_wav(good, seconds=0.2)
    rc = main(["offline", "--model", str(tmp_path / "nowhere"), "--input-wav", str(good), "--output-wav",
               str(tmp_path / "o.wav")])
    err = capsys.readouterr().err
    assert rc == 2 and "nowhere" in err
