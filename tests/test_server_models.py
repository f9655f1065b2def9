"""The server on real model paths (tiny checkpoints, CPU): the app `parley serve` builds,
and the `parley serve` command itself (a subprocess, stopped with SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from realtime.server import ServeConfig, build_app
from engine import SessionOptions
from server_harness import chat_session, free_port, serve, tone

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


def test_moshi_checkpoint_refuses_a_default_persona(tiny_moshi_dir):
    from realtime.server import ServeError
    with pytest.raises(ServeError, match="persona"):
        build_app(ServeConfig(model=str(tiny_moshi_dir), defaults=SessionOptions(persona="x")))


def _wait_healthy(proc, port: int, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"parley serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"parley serve not healthy in {timeout} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)


def test_parley_serve_demo_model_then_sigterm(tmp_path):
    """No --model: the demo checkpoint is written to $PARLEY_CACHE, the log says it babbles,
    /api/info says so too, a session works, and SIGTERM stops the server cleanly."""
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PARLEY_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "realtime.cli", "serve", "--port", str(port), "--max-sessions", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, port, log)
            info = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/info", timeout=5).read())
            assert info["demo"] is True and "babbles" in info["notice"]
            res = asyncio.run(chat_session(f"127.0.0.1:{port}", tone(300, 0.5), tail_seconds=0.2))
            assert res.handshake_at is not None and res.audio_messages > 0
            proc.send_signal(signal.SIGTERM)
            # uvicorn drains, runs the lifespan exit, then re-raises the signal (exit -15)
            assert proc.wait(20) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert "babbles" in text and "--model" in text
    assert "Application shutdown complete" in text
    assert (tmp_path / "cache" / "demo" / "model.safetensors").is_file()


def test_parley_serve_help_explains_flags():
    out = subprocess.run([sys.executable, "-m", "realtime.cli", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60).stdout
    for flag in ("--model", "--host", "--port", "--max-sessions", "--device", "--dtype", "--persona", "--voice",
                 "--text-temperature", "--audio-topk", "--api-key", "--log-level"):
        assert flag in out, flag
