"""The official openai Node SDK (the version tests/node/package.json pins) against the demo server
over TLS: tests/node/openai_sdk.mjs opens a /v1/realtime session (the SDK only ever dials wss:),
asks for speech, a transcription and an image, and this test checks what it got against the same
server asked from Python.

Needs node (>= 22, or >= 20.10 with --experimental-websocket), the SDK installed in tests/node
(`npm ci`, which tests/run.sh runs) and the openssl command for a self-signed certificate; it
skips, saying which is missing, otherwise."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import re
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx2 as httpx  # what the pinned openai SDK ships on
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from parley.engine import Engine
from parley.realtime.server import services
from parley.realtime.server.serve import ServeConfig, build_app
from server_harness import serve

NODE_DIR = Path(__file__).resolve().parent / "node"
FRAME_BYTES = 1920 * 2  # one 80 ms PCM16 frame at 24 kHz
# The demo server with a longer tick: an image step measured on a crowded 2-core CPU can take more
# than an 80 ms tick's slack, and the image request would be refused (size_too_large).
TICK = 0.25

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


def node_command() -> list[str]:
    """node, with --experimental-websocket where it has no global WebSocket (Node 20)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the openai Node SDK test needs Node 22 (or 20.10+)")
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        pytest.skip("the pinned openai Node SDK is not installed: run `npm ci` in tests/node (tests/run.sh does)")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    major, minor = (int(x) for x in re.match(r"v(\d+)\.(\d+)", version).groups())
    if major >= 22:
        return [node]
    if (major, minor) >= (20, 10):
        return [node, "--experimental-websocket"]
    pytest.skip(f"node {version}: the openai 7 SDK needs Node 22, or 20.10+ with --experimental-websocket")


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1, and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: no certificate for the TLS server")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_openai_node_sdk_over_tls(tmp_path, monkeypatch):
    command = node_command()
    cert, key = self_signed_certificate(tmp_path)
    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path / "cache"))  # the demo checkpoints
    pinned = json.loads((NODE_DIR / "package.json").read_text())["dependencies"]["openai"]
    monkeypatch.setattr(services, "Engine",
                        lambda backend, config, **kw: Engine(backend, dataclasses.replace(config, tick_seconds=TICK), **kw))
    app = build_app(ServeConfig(model=None, codec_workers=0, torch_threads=1, tts_slots=1, stt_slots=1))
    with serve(app, ssl_certfile=str(cert), ssl_keyfile=str(key)) as base:
        port = base.rsplit(":", 1)[1]
        run = subprocess.run([*command, "openai_sdk.mjs", f"https://localhost:{port}/v1", str(tmp_path)],
                             cwd=NODE_DIR, capture_output=True, text=True, timeout=90,
                             env={**os.environ, "NODE_EXTRA_CA_CERTS": str(cert)})
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
        # The same server, asked from Python, for what Node's requests should have got.
        with httpx.Client(base_url=f"https://localhost:{port}/v1", verify=ssl.create_default_context(cafile=cert),
                          timeout=60) as c:
            wav = (tmp_path / "speech.wav").read_bytes()
            text = c.post("/audio/transcriptions", data={"model": "whisper-1"},
                          files={"file": ("speech.wav", wav, "audio/wav")}).json()["text"]
            image = c.post("/images/generations", json={"prompt": "a lighthouse", "size": "auto", "quality": "low",
                                                        "seed": 1234}).json()["data"][0]["b64_json"]
    assert out["sdk"] == pinned
    realtime = out["realtime"]
    assert realtime["url"] == f"wss://localhost:{port}/v1/realtime?model=parley"  # the SDK made it wss:
    assert realtime["session_created"] and realtime["audio_deltas"] >= 5
    assert realtime["audio_bytes"] == realtime["audio_deltas"] * FRAME_BYTES  # one 80 ms frame a delta
    pcm, rate = sf.read(io.BytesIO(wav), dtype="float32")
    assert out["speech_bytes"] == len(wav) and rate == 24000 and pcm.size >= 1920 and np.abs(pcm).max() > 0
    # The demo's STT is greedy, so the same audio gives the same (babbled) text.
    assert out["transcription"] and out["transcription"] == text
    # The same seed, size and steps, each request alone in its batch on the same device: bit for bit.
    assert out["images"] == 1
    node_png = Image.open(tmp_path / "image.png")
    assert node_png.format == "PNG"
    np.testing.assert_array_equal(np.asarray(node_png), np.asarray(Image.open(io.BytesIO(base64.b64decode(image)))))
