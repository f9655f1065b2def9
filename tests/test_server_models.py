"""The server on real model paths (tiny checkpoints, CPU): the app `parley serve` builds,
and the `parley serve` command itself (a subprocess, stopped with SIGTERM)."""

from __future__ import annotations

import asyncio
import difflib
import importlib.metadata
import io
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import soundfile
import torch

from parley.engine import SessionOptions
from parley.engine.backend import ModelBackend
from parley.models.checkpoint import load_checkpoint
from parley.models.persona_prompt import SILENCE_FRAMES
from parley.models.synthetic import ECHO_FIRST_FRAME, echo_text_token, echo_words
from parley.models.voices import unpack_voices
from parley.realtime.server.serve import ServeConfig, build_app
from server_harness import FRAME, SR, chat_session, free_port, serve, tone, wait_healthy

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[1]


def test_tiny_moshi_chat_handshake_audio_and_text(tiny_moshi_dir):
    app = build_app(ServeConfig(model=str(tiny_moshi_dir), max_sessions=2))
    with serve(app) as base:
        res = asyncio.run(chat_session(base, tone(300, 1.6), tail_seconds=1.0))
    assert res.handshake_at is not None
    # ~32 frames in real time; a loaded 2-core box may skip ticks, so ask for a fraction
    assert res.audio_messages >= 8
    assert res.pcm.size >= 6 * 1920
    assert "".join(res.text), "the tiny model's text pieces arrive as 0x02 messages"


def test_tiny_personaplex_persona_and_voice(tiny_personaplex_dir):
    app = build_app(ServeConfig(model=str(tiny_personaplex_dir), max_sessions=1))
    with serve(app) as base:
        voices = json.loads(urllib.request.urlopen(f"http://{base}/api/voices", timeout=5).read())
        assert voices["voices"] == ["NATF0.pt", "NATM0.pt"]
        res = asyncio.run(chat_session(base, tone(300, 0.8), query="text_prompt=Hi&voice_prompt=NATM0.pt"))
        # (the tiny model's context is 40 frames: voice + silences + persona must fit)
        assert res.handshake_at is not None and res.audio_messages >= 5
        bad = asyncio.run(chat_session(base, None, query="voice_prompt=NOPE.pt"))
        assert bad.handshake_at is None and bad.close_code == 1008


def test_api_voices_lists_every_voice_the_backend_loads(tiny_personaplex_dir, copy_checkpoint):
    # Audio voices load when typed; the page's list must offer them too (not only the .pt files).
    src = copy_checkpoint(tiny_personaplex_dir)
    voices_dir = unpack_voices(src / "voices.tgz")
    for name, fmt in (("Aria.wav", "WAV"), ("bo.flac", "FLAC"), ("cy.ogg", "OGG")):
        soundfile.write(voices_dir / name, tone(220, 1.0, sr=16_000), 16_000, format=fmt)
    (voices_dir / "README.txt").write_text("not a voice")
    expected = ["Aria.wav", "NATF0.pt", "NATM0.pt", "bo.flac", "cy.ogg"]

    app = build_app(ServeConfig(model=str(src), max_sessions=1))
    with serve(app) as base:
        listed = json.loads(urllib.request.urlopen(f"http://{base}/api/voices", timeout=5).read())
    assert listed["voices"] == expected
    backend = ModelBackend.load(src, 1, seed=0)
    for name in expected:  # every listed name is one a session can open with
        job = backend.start_prefill(0, SessionOptions(voice=name))
        assert job.frames_left > 2 * SILENCE_FRAMES, name


def test_moshi_checkpoint_refuses_a_default_persona(tiny_moshi_dir):
    from parley.realtime.server.serve import ServeError
    with pytest.raises(ServeError, match="persona"):
        build_app(ServeConfig(model=str(tiny_moshi_dir), defaults=SessionOptions(persona="x")))


def test_parley_serve_demo_model_then_sigterm(tmp_path):
    """No --model: the demo checkpoint is written to $PARLEY_CACHE, the log says it babbles,
    /api/info says so too, a session works, and SIGTERM stops the server cleanly."""
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PARLEY_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "parley.realtime.cli", "serve", "--port", str(port), "--max-sessions", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(proc, port, log)
            info = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/info", timeout=5).read())
            assert info["demo"] is True and "babbles" in info["notice"]
            res = asyncio.run(chat_session(f"127.0.0.1:{port}", tone(300, 0.5), tail_seconds=0.2))
            assert res.handshake_at is not None and res.audio_messages > 0
            # the demo includes a tiny STT: transcription works out of the box, and says it is nonsense
            assert info["transcription"] is True and "nonsense" in info["transcription_notice"]
            wav = io.BytesIO()
            soundfile.write(wav, tone(300, 0.5), 24_000, format="WAV")
            stt = openai.OpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=60)
            assert isinstance(stt.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav.getvalue())).text, str)
            proc.send_signal(signal.SIGTERM)
            # uvicorn drains, runs the lifespan exit, then re-raises the signal (exit -15)
            assert proc.wait(20) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert "babbles" in text and "--model" in text and "transcribes nonsense" in text
    assert "Application shutdown complete" in text
    assert (tmp_path / "cache" / "demo-personaplex" / "model.safetensors").is_file()


def test_parley_serve_help_explains_flags():
    out = subprocess.run([sys.executable, "-m", "parley.realtime.cli", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60).stdout
    for flag in ("--model", "--host", "--port", "--max-sessions", "--device", "--dtype", "--persona", "--voice",
                 "--text-temperature", "--audio-topk", "--api-key", "--log-level", "--image-model", "--image-queue",
                 "--image-stall-timeout"):
        assert flag in out, flag


def test_parley_version_prints_the_installed_package_version():
    # The console script pip installed, so the entry point and the package metadata are what is tested.
    script = Path(sys.executable).with_name("parley")
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    installed = importlib.metadata.version("parley")
    assert out.returncode == 0 and out.stdout.strip() == f"parley {installed}"
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert installed == declared, "reinstall: the metadata is older than pyproject.toml"


# ---- /api/chat on the echo checkpoint: exact expectations, computed independently ----------

GREEDY = "text_temperature=0&audio_temperature=0"  # the Moshi web client's sampling parameters
MAX_LEAD = 4  # leading underrun frames searched (ticks between the row going live and the first audio)


def _signal(i: int, seconds: float = 2.4) -> np.ndarray:
    """Session i's input: a chirp of its own range, a tone and a little noise of its own seed."""
    t = np.arange(int(seconds * SR)) / SR
    rng = np.random.default_rng(100 + i)
    f0 = 120 + 90 * i
    x = (0.25 * np.sin(2 * np.pi * f0 * t * (1 + (0.6 + 0.2 * i) * t)) + 0.15 * np.sin(2 * np.pi * (900 + 370 * i) * t)
         * (0.5 + 0.5 * np.sin(2 * np.pi * (1 + i) * t)) + (0.02 + 0.01 * i) * rng.standard_normal(t.size))
    return x.astype(np.float32)


def _server_input(sent_ogg: list[bytes]) -> np.ndarray:
    """The PCM the server decoded: the client's own Ogg pages through a fresh sphn reader."""
    import sphn
    reader = sphn.OpusStreamReader(SR)
    chunks = [np.asarray(reader.append_bytes(page), np.float32).reshape(-1) for page in sent_ogg]
    return np.concatenate([c for c in chunks if c.size])


def _model_input(pcm: np.ndarray, lead: int) -> torch.Tensor:
    """What the engine fed the row: `lead` underrun frames of silence, then the input cut into
    whole 1920-sample frames (a trailing partial frame never reaches the model)."""
    frames = pcm.size // FRAME
    return torch.from_numpy(np.concatenate([np.zeros(lead * FRAME, np.float32), pcm[:frames * FRAME]]))


@torch.no_grad()
def _user_codes(mimi, pcm: torch.Tensor) -> torch.Tensor:
    return mimi.encode(pcm[None])[0].T  # [F, 8], a fresh streaming encoder as a new session's


@torch.no_grad()
def _echo_pcm(mimi, user: torch.Tensor) -> np.ndarray:
    """The agent audio of output frames 1..F-1: frame 1 is code 0, frame f >= 2 the user's f - 1."""
    agent = torch.cat([torch.zeros(1, user.shape[1], dtype=torch.long), user[ECHO_FIRST_FRAME - 1:-1]])
    return mimi.decode(agent.T[None])[0].reshape(-1).numpy()  # a fresh decoder


def _opus_round_trip(pcm: np.ndarray) -> np.ndarray:
    """What a client hears of `pcm` sent as the server sends it: a fresh writer fed 1920-sample
    frames, a fresh reader."""
    import sphn
    writer, reader = sphn.OpusStreamWriter(SR), sphn.OpusStreamReader(SR)
    out = []
    for i in range(pcm.size // FRAME):
        page = writer.append_pcm(np.ascontiguousarray(pcm[i * FRAME:(i + 1) * FRAME]))
        if page:
            out.append(np.asarray(reader.append_bytes(bytes(page)), np.float32).reshape(-1))
    return np.concatenate([o for o in out if o.size])


def _ncc(expected: np.ndarray, received: np.ndarray, max_lag: int) -> tuple[float, int]:
    """Best normalised cross-correlation of `received` against `expected` delayed by 0..max_lag
    samples (every lag)."""
    best, best_lag = -1.0, 0
    for lag in range(max_lag + 1):
        n = min(expected.size, received.size - lag)
        if n <= FRAME:
            break
        a, b = expected[:n], received[lag:lag + n]
        c = float(a @ b) / (float(np.linalg.norm(a) * np.linalg.norm(b)) or 1.0)
        if c > best:
            best, best_lag = c, lag
    return best, best_lag


def _text_match(received: list[str], pieces: list[str]) -> tuple[float, int]:
    """Best share of frames whose received text piece is the expected one, over leading-underrun
    shifts: received[lead + m] is frame lead + m + 1, the echo of user frame m."""
    best = (0.0, 0)
    for lead in range(MAX_LEAD + 1):
        pairs = [(received[lead + m], pieces[m]) for m in range(1, len(pieces)) if lead + m < len(received)]
        if pairs:
            best = max(best, (sum(a == b for a, b in pairs) / len(pairs), lead))
    return best


def _text_match_with_underruns(received: list[str], pieces: list[str]) -> float:
    """Share of the echo's pieces (frames 1..) found in the received text in order, allowing
    underrun frames anywhere: many sessions on a loaded box get late input mid-stream too, and
    each late frame shifts the rest of the stream by one (a single leading shift is `_text_match`)."""
    expected = pieces[1:]
    matcher = difflib.SequenceMatcher(None, received, expected, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks()) / len(expected)


def _expected_pieces(ckpt, user: torch.Tensor) -> list[str]:
    tokens = echo_text_token(user[:, 0], echo_words(ckpt.tokenizer)).tolist()
    return [ckpt.tokenizer.piece(t) for t in tokens]


def test_echo_chat_text_and_audio_match_the_echo_of_the_users_codes(echo_dir):
    """/api/chat over a real server on the echo checkpoint with a sphn client: the handshake comes
    after prefill, the text is the echo's word for each of the user's frames, and the audio is
    the Mimi decode of the user's own codes one frame later, heard through Opus."""
    app = build_app(ServeConfig(model=str(echo_dir), max_sessions=1))
    engine = app.state.sessions.engine
    sent = _signal(0)
    with serve(app) as base:
        res = asyncio.run(chat_session(base, sent, query=GREEDY, tail_seconds=0.8))
    assert res.handshake_at is not None
    assert engine.counters()["prefill_seconds"]["count"] == 1  # prefilled before the handshake
    ckpt = load_checkpoint(echo_dir, dtype=torch.float32)
    pcm = _server_input(res.sent_ogg)
    frames = pcm.size // FRAME
    assert frames >= 25

    # Text: one 0x02 piece per frame, the echo's word for the user's semantic code one frame back.
    assert len(res.text) >= frames
    share0, lead = _text_match(res.text, _expected_pieces(ckpt, _user_codes(ckpt.mimi, _model_input(pcm, 0))))
    user = _user_codes(ckpt.mimi, _model_input(pcm, lead))  # the codes of exactly what the row was fed
    share, _ = _text_match(res.text[lead:], _expected_pieces(ckpt, user[lead:]))
    assert share >= 0.95, (share, share0, lead)

    # Audio: the echo of the user's codes, decoded by a fresh Mimi, after the Opus round trip.
    expected = _echo_pcm(ckpt.mimi, user)
    raw, _ = _ncc(expected, res.pcm, 4 * FRAME)
    corr, lag = _ncc(_opus_round_trip(expected), res.pcm, 4 * FRAME)
    print(f"echo /api/chat: leading underrun frames {lead}, text match {share:.3f}, "
          f"NCC vs Opus(expected) {corr:.4f} at lag {lag}, NCC vs raw expected {raw:.4f}")
    assert corr > 0.9, (corr, lag, raw, lead)


def test_eight_concurrent_echo_sessions_each_hear_their_own_codes(echo_dir):
    """8 sessions with different signals at once: each one's text follows its own codes (and not
    its neighbours')."""
    app = build_app(ServeConfig(model=str(echo_dir), max_sessions=8))
    sents = [_signal(i, 2.0) for i in range(8)]
    with serve(app) as base:
        async def all_sessions():
            # each session reads until the echo of every frame it sent came back (+ the tail)
            return await asyncio.gather(*(chat_session(base, s, query=GREEDY, tail_seconds=0.6,
                                                       until_text=s.size // FRAME + 1) for s in sents))
        results = asyncio.run(all_sessions())
    ckpt = load_checkpoint(echo_dir, dtype=torch.float32)
    expected = [_expected_pieces(ckpt, _user_codes(ckpt.mimi, _model_input(_server_input(r.sent_ogg), 0)))
                for r in results]
    shares = []
    for i, res in enumerate(results):
        # about 30 audio messages when no tick is skipped; a loaded 2-core CI box skips some
        assert res.handshake_at is not None and res.audio_messages >= 10, (i, res.audio_messages)
        own = _text_match_with_underruns(res.text, expected[i])
        others = max(_text_match_with_underruns(res.text, expected[j]) for j in range(8) if j != i)
        shares.append((round(own, 3), round(others, 3)))
        assert own >= 0.9 and others < own - 0.3, (i, own, others)
    print("8 echo sessions: (own, best other) text match:", shares)
