"""Imports at the two ends of a server's life.

The `parley` command's help and version load no model stack: torch, diffusers and transformers
took 7-9 s before argparse ran. Each command's handler imports what it needs when it runs; the
defaults --help shows come from torch-free modules (engine/config.py, realtime/sessions/limits.py, ...).

After the server starts, serving a request imports no module. An import holds the GIL while it
runs (tens of ms), and the engine thread waits for it: on the H200 the first /v1/audio/speech
request made a duplex frame 20-50 ms late (anyio's backend, loaded on Starlette's first request),
and the first mp3 response imported PyAV. realtime/server/app.py `load_lazy_modules` imports them at
start; this test serves one request of every kind to the demo server (every modality) in a
process of its own and fails naming any module a request imported."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import time
import wave
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
import soundfile as sf

from parley.models.synthetic import write_tiny_stt_checkpoint
from server_harness import chat_session, free_port, tone

SERVER = Path(__file__).with_name("lazy_import_server.py")
HEAVY = ("torch", "diffusers", "transformers", "triton")
# Runs `parley ARGV...` in a fresh interpreter, then prints which of HEAVY it imported.
CLI = ("import json, sys\nfrom parley.realtime.cli import main\n"
       "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
       f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["serve", "--help"], ["offline", "--help"],
                                  ["tts", "--help"], ["transcribe", "--help"], ["launch", "--help"]],
                         ids=" ".join)
def test_help_and_version_import_no_model_stack(argv):
    done = subprocess.run([sys.executable, "-c", CLI, *argv], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip(), done.stderr  # the help or version text was printed
    assert json.loads(done.stderr.splitlines()[-1]) == []


def test_a_server_without_an_image_model_never_loads_diffusers():
    """diffusers and transformers (seconds of start-up, hundreds of MB) load with an image model
    only: importing the server module (what every `parley serve` does) leaves them out."""
    code = ("import sys\nfrom parley.realtime import server\n"
            "print(sorted(m for m in ('diffusers', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


# Loaded only where used: Triton (and torch._dynamo, which imports it) by the fused CUDA path,
# aiortc by the WebRTC worker processes, pyloudnorm (with scipy.signal) by an audio voice file.
START_LAZY = ("triton", "torch._dynamo", "aiortc", "pyloudnorm", "scipy.signal")


def imported_by(code: str, env: dict | None = None) -> list[str]:
    """Which of START_LAZY a fresh interpreter has imported after running `code`."""
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(m for m in {START_LAZY!r} if m in sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cpu_server_starts_without_triton_aiortc_or_pyloudnorm(tiny_personaplex_dir, tmp_path):
    """Importing the server module and building a CPU server's app (duplex model, paired STT; no
    image model, whose diffusers imports torch._dynamo itself) import none of them: ~0.1 s of
    Triton, ~1.4 s more of torch._dynamo (drawn in by init on the meta device) and ~0.9 s of
    pyloudnorm's scipy.signal (docs/benchmarks.md)."""
    stt = tmp_path / "stt"
    write_tiny_stt_checkpoint(stt, mimi_from=tiny_personaplex_dir)
    assert imported_by("import parley.realtime.server.serve") == []
    config = f"ServeConfig(model={str(tiny_personaplex_dir)!r}, stt_model={str(stt)!r}, device='cpu', max_sessions=1)"
    assert imported_by(f"from parley.realtime.server.serve import ServeConfig, build_app\nbuild_app({config})") == []
    # The demo (every modality; .pt voices, WebRTC in worker processes): its image model's diffusers
    # imports torch._dynamo, and with it Triton, itself; the other two stay out.
    demo = "from parley.realtime.server.serve import ServeConfig, build_app\nbuild_app(ServeConfig(model=None, device='cpu'))"
    assert set(imported_by(demo)) <= {"torch._dynamo", "triton"}


def test_each_is_imported_where_it_is_needed(tmp_path):
    """The fused path imports Triton (a CUDA tensor, or a CPU one under Triton's interpreter), the
    WebRTC worker aiortc, and reading an audio voice file pyloudnorm."""
    fused = "import torch\nfrom parley.models import kernels\nassert kernels.available(torch.zeros(1))"
    assert "triton" in imported_by(fused, {"TRITON_INTERPRET": "1"})
    assert "triton" not in imported_by(fused.replace("assert ", "assert not "))  # no CUDA, no interpreter
    assert "aiortc" in imported_by("import parley.realtime.webrtc.worker")
    wav = tmp_path / "voice.wav"
    sf.write(wav, 0.3 * np.sin(np.arange(24_000) * 0.05), 24_000)
    assert "pyloudnorm" in imported_by(f"from parley.models.voices import voice_audio\nvoice_audio({str(wav)!r})")


def test_serve_help_shows_the_engines_defaults():
    """The defaults --help prints are the engine's own values (one definition, read torch-free)."""
    from parley.engine import SamplingOptions
    from parley.engine.image_queue import DEFAULT_STALL_TIMEOUT_S
    from parley.realtime.cli import build_parser
    from parley.realtime.sessions.limits import EdgeLimits

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    sampling, limits = SamplingOptions(), EdgeLimits()
    assert f"else {sampling.text_temperature})" in text and f"else {sampling.audio_top_k})" in text
    assert f"(default: {DEFAULT_STALL_TIMEOUT_S})" in text
    assert f"(default: {limits.max_messages_per_s})" in text


def wav_bytes(pcm: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes((pcm * 30000).astype(np.int16).tobytes())
    return buf.getvalue()


async def realtime_turn(base: str) -> None:
    from websockets.asyncio.client import connect

    async with connect(f"ws://{base}/v1/realtime", open_timeout=10) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "instructions": "Hi."}}))
        audio = base64.b64encode((tone(300, 0.5) * 30000).astype(np.int16).tobytes()).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        types = set()
        while "response.output_audio.delta" not in types and "response.audio.delta" not in types:
            types.add(json.loads(await asyncio.wait_for(ws.recv(), 10))["type"])


@pytest.fixture(scope="module")
def demo_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "READY":
                break
        else:
            pytest.fail(f"the demo server exited with {proc.wait()} before serving")

        def imported_since() -> list[str]:
            proc.stdin.write("report\n")
            proc.stdin.flush()
            line = next(line for line in proc.stdout if line.startswith("NEW "))
            return json.loads(line[4:])

        deadline = time.monotonic() + 120
        while httpx.get(f"http://127.0.0.1:{port}/readyz").status_code != 200:  # warmed up: started
            assert time.monotonic() < deadline, "the demo server did not become ready"
            time.sleep(0.1)
        imported_since()  # what the start imported
        yield f"127.0.0.1:{port}", imported_since
    finally:
        proc.kill()
        proc.wait(10)


def test_no_request_imports_a_module(demo_server):
    base, imported_since = demo_server
    imported: dict[str, list[str]] = {}
    with httpx.Client(base_url=f"http://{base}", timeout=60) as c:
        def check(name: str, response: httpx.Response) -> None:
            assert response.status_code == 200, (name, response.text[:300])
            imported[name] = imported_since()

        for path in ("/", "/readyz", "/api/info", "/metrics", "/v1/audio/voices", "/v1/models"):
            check(f"GET {path}", c.get(path))
        speech = {"model": "tts-1", "input": "Hello there.", "voice": "alloy"}
        for fmt in ("pcm", "wav", "mp3", "opus", "flac", "aac"):
            check(f"speech {fmt}", c.post("/v1/audio/speech", json={**speech, "response_format": fmt}))
        check("speech sse", c.post("/v1/audio/speech", json={**speech, "stream_format": "sse"}))
        upload = {"file": ("a.wav", wav_bytes(tone(440, 1.0)), "audio/wav")}
        check("transcription", c.post("/v1/audio/transcriptions", files=upload, data={"model": "whisper-1"}))
        check("transcription stream", c.post("/v1/audio/transcriptions", files=upload,
                                             data={"model": "whisper-1", "stream": "true"}))
        image = {"prompt": "a cat", "size": "16x16", "num_inference_steps": 1}
        for fmt in ("png", "jpeg", "webp"):
            check(f"image {fmt}", c.post("/v1/images/generations", json={**image, "output_format": fmt}))
        check("image stream", c.post("/v1/images/generations", json={**image, "stream": True, "partial_images": 1}))
    result = asyncio.run(chat_session(base, tone(300, 1.0), query="transcript=1"))
    assert result.audio_messages > 0
    imported["/api/chat"] = imported_since()
    asyncio.run(realtime_turn(base))
    imported["/v1/realtime"] = imported_since()
    assert {name: mods for name, mods in imported.items() if mods} == {}
