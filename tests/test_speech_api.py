"""POST /v1/audio/speech and GET /v1/audio/voices on a real server: the tiny DSM TTS in the
engine's slack beside the fabricated duplex backend. Greedy sampling makes every request for the
same text and voice give the same frames, so the engine's own frames (synthesised offline first)
are the oracle for every response format."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import time

import av
import httpx2 as httpx  # what the pinned openai SDK ships on
import numpy as np
import openai
import pytest
import soundfile as sf
import soxr
import sphn
import torch

from parley.engine import Engine, EngineConfig
from delay_backend import DelayBackend
from parley.engine.tts_offline import synthesize
from parley.models.synthetic import TINY_TTS_VOICES
from parley.realtime.server.app import ServerInfo, create_app
from parley.realtime.server.served_models import ServedModels
from parley.realtime.server.services import Services
from parley.realtime.server.demo_model import OPENAI_VOICE_NAMES
from parley.realtime.media.speech_formats import to_int16
from parley.realtime.server.speech_setup import load_speech_service
from server_harness import serve

TEXT = "Hello there, how are you?"
GREEDY = {"text_temperature": 0.0, "audio_temperature": 0.0}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tts_dir(tiny_tts_dir, tmp_path_factory):
    """The tiny TTS, and a voice map giving it OpenAI's 13 names (beside it, not inside it)."""
    voice_map = tmp_path_factory.mktemp("voice_map") / "voice_map.json"
    voice_map.write_text(json.dumps({name: TINY_TTS_VOICES[i % 3] for i, name in enumerate(OPENAI_VOICE_NAMES)}))
    return tiny_tts_dir, voice_map


def make_service(tts_dir, slots):
    directory, voice_map = tts_dir
    service = load_speech_service(directory, slots=slots, voices=directory / "voices",
                                  voice_map=voice_map, device="cpu", dtype=torch.float32)
    service.front_end.sampling = dict(GREEDY)
    return service


@pytest.fixture(scope="module")
def server(tts_dir):
    service = make_service(tts_dir, slots=2)
    request, _ = service.front_end.request(TEXT, "alloy", 1.0)
    oracle = synthesize(service.pool, request)  # before the engine thread owns the pool
    assert oracle.terminal.status.value == "completed" and oracle.pcm.size > 0
    # Long ticks: a tiny TTS step on a shared CPU can take most of an 80 ms tick.
    engine = Engine(DelayBackend(2), EngineConfig(tick_seconds=0.5))
    engine.add_slack_source(service.pool)
    # served as an operator's --served-model-name tts=tts-1,gpt-4o-mini-tts would: the SDK's usual names
    models = ServedModels.build({"duplex": "delay", "tts": service.model}, {"tts": ("tts-1", "gpt-4o-mini-tts")})
    app = create_app(Services(engine, info=ServerInfo(model="delay"), codec_workers=0, speech=service,
                              models=models))
    with serve(app) as url:
        yield f"http://{url}", oracle, service


def post(url, **body):
    body = {"model": "tts-1", "input": TEXT, "voice": "alloy", **body}
    return httpx.post(f"{url}/v1/audio/speech", json=body, timeout=60)


def aligned(want: np.ndarray, got: np.ndarray, max_lag: int = 3000) -> tuple[float, int]:
    """Best normalised correlation of `got` against `want` delayed by 0..max_lag samples
    (codecs prime their decoders: mp3 1105, aac 1024, opus 156 samples at 24 kHz)."""
    best = (-1.0, 0)
    for lag in range(max_lag):
        n = min(want.size, got.size - lag)
        if n < 1920:
            break
        x, y = want[:n], got[lag:lag + n]
        best = max(best, (float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-9)), lag))
    return best


def envelope(pcm: np.ndarray, hop: int = 480) -> np.ndarray:
    n = pcm.size // hop
    return np.sqrt((pcm[:n * hop].reshape(n, hop) ** 2).mean(axis=1))


def test_lossless_formats_equal_the_engine_frames(server):
    url, oracle, _ = server
    want = to_int16(oracle.pcm)
    r = post(url, response_format="pcm")
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
    np.testing.assert_array_equal(np.frombuffer(r.content, "<i2"), want)
    r = post(url, response_format="wav")
    assert r.content[:4] == b"RIFF" and r.content[4:8] == b"\xff\xff\xff\xff"  # one streaming header
    assert r.content[40:44] == b"\xff\xff\xff\xff"
    np.testing.assert_array_equal(np.frombuffer(r.content[44:], "<i2"), want)
    pcm, sr = sf.read(io.BytesIO(r.content), dtype="int16")  # libsndfile takes the unknown sizes
    assert sr == 24000
    np.testing.assert_array_equal(pcm, want)


def test_flac_is_one_complete_file_soundfile_and_pyav_read(server):
    """FLAC is buffered, so its STREAMINFO holds the total sample count and the MD5 of the
    samples (streamed, the total was 0, "unknown", and soundfile failed with "array is too big")."""
    url, oracle, _ = server
    want = to_int16(oracle.pcm)
    r = post(url, response_format="flac")
    assert r.status_code == 200 and r.headers["content-type"] == "audio/flac"
    flac = r.content
    # "fLaC", a 4-byte block header, then STREAMINFO: 10 bytes of block/frame sizes, 64 bits of
    # rate (20) / channels - 1 (3) / bits - 1 (5) / total samples (36), then the MD5.
    fields = int.from_bytes(flac[18:26], "big")
    assert (fields >> 44, fields >> 41 & 7, fields >> 36 & 31) == (24000, 0, 15)
    assert fields & (2**36 - 1) == want.size
    assert flac[26:42] == hashlib.md5(want.tobytes()).digest()
    pcm, sr = sf.read(io.BytesIO(flac), dtype="int16")
    assert sr == 24000
    np.testing.assert_array_equal(pcm, want)
    np.testing.assert_array_equal(av_decode(flac, "s16"), want)
    # SSE: the same whole file, in one delta
    r = post(url, response_format="flac", stream_format="sse")
    events = [json.loads(block[len("data: "):]) for block in r.text.split("\n\n") if block]
    assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.done"]
    assert base64.b64decode(events[0]["audio"]) == flac


def av_decode(data: bytes, fmt: str = "flt") -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.audio[0].rate == 24000
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    out = np.concatenate(frames)
    return out if fmt != "s16" else out.astype(np.int16)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
def test_lossy_formats_decode_to_the_engine_frames(server, fmt):
    url, oracle, _ = server
    r = post(url, response_format=fmt)
    assert r.status_code == 200
    assert r.headers["content-type"] == {"mp3": "audio/mpeg", "opus": "audio/opus", "aac": "audio/aac"}[fmt]
    if fmt == "opus":
        pcm, sr = sphn.read_opus_bytes(r.content)  # decodes at 48 kHz
        pcm = soxr.resample(np.asarray(pcm, dtype=np.float32).reshape(-1), sr, 24000)
    elif fmt == "mp3":
        pcm, sr = sf.read(io.BytesIO(r.content), dtype="float32")
        assert sr == 24000
    else:
        pcm = av_decode(r.content)
    want = oracle.pcm
    correlation, lag = aligned(want, pcm.astype(np.float32))
    assert abs(pcm.size - lag - want.size) < 2000  # all of it, plus encoder priming / padding only
    got = pcm[lag:lag + want.size]
    want = want[:got.size]
    # The tiny model's audio is noise-like (centroid ~6 kHz): mp3 and aac at 64 kb/s keep the waveform,
    # Opus (a speech codec at sphn's bit rate) keeps the loudness contour, not the phase of the noise.
    assert np.corrcoef(envelope(want), envelope(got))[0, 1] > 0.9
    assert correlation > (0.4 if fmt == "opus" else 0.85)


def test_sse_events_then_one_done(server):
    url, oracle, _ = server
    r = post(url, response_format="pcm", stream_format="sse")
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(block[len("data: "):]) for block in r.text.split("\n\n") if block]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    np.testing.assert_array_equal(np.frombuffer(audio, "<i2"), to_int16(oracle.pcm))
    usage = events[-1]["usage"]
    assert all(isinstance(usage[k], int) for k in ("input_tokens", "output_tokens", "total_tokens"))
    assert usage["output_tokens"] == (oracle.pcm.size // 1920) * 4 and usage["input_tokens"] > 5
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_openai_sdk_round_trip(server):
    url, oracle, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)
    whole = client.audio.speech.create(model="gpt-4o-mini-tts", voice="alloy", input=TEXT,
                                       response_format="pcm", instructions="cheerful (ignored)")
    np.testing.assert_array_equal(np.frombuffer(whole.content, "<i2"), to_int16(oracle.pcm))
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=TEXT,
                                                            response_format="wav") as response:
        streamed = b"".join(response.iter_bytes())
    np.testing.assert_array_equal(np.frombuffer(streamed[44:], "<i2"), to_int16(oracle.pcm))


def test_tts_counters_reach_metrics(server):
    url, _, _ = server
    text = httpx.get(f"{url}/metrics").text
    assert "parley_engine_tts_completed_total" in text and "parley_engine_tts_slots 2.0" in text


def test_voices_list_and_every_openai_name_speaks(server):
    url, _, _ = server
    names = [v["id"] for v in httpx.get(f"{url}/v1/audio/voices").json()["data"]]
    assert set(OPENAI_VOICE_NAMES) | set(TINY_TTS_VOICES) == set(names)
    r = post(url, voice={"id": "tiny/bravo"}, response_format="pcm", input="Hi.")
    assert r.status_code == 200 and len(r.content) > 0
    for name in ("cedar", "marin"):
        assert post(url, voice=name, response_format="pcm", input="Hi.").status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"input": "x" * 4097}, "input"),
    ({"voice": "nobody"}, "voice"),
    ({"response_format": "ogg"}, "response_format"),
    ({"speed": 3.0}, "speed"),
    ({"stream_format": "chunks"}, "stream_format"),
    ({"temperature": 0.5}, "temperature"),
])
def test_bad_requests_get_openai_errors(server, body, param):
    url, _, _ = server
    r = post(url, **body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_the_front_ends_refusals_keep_the_doors_words(server):
    """The engine's SpeechFrontEnd raises them (engine/speech.py); the door words them."""
    url, _, _ = server
    error = post(url, voice="nobody").json()["error"]
    assert error["message"].startswith("unknown voice 'nobody'; GET /v1/audio/voices lists them (e.g. alloy, ")
    assert (error["param"], error["code"]) == ("voice", "invalid_voice")
    r = post(url, input='<break time="1s"/>')
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "input holds no words to speak", "type": "invalid_request_error",
                                 "param": "input", "code": None}


def test_full_pool_is_429_and_a_disconnect_frees_the_row(server):
    url, _, service = server
    pool = service.pool
    long_text = " ".join(["hello there my friend"] * 30)
    with httpx.Client(timeout=60) as c1, httpx.Client(timeout=60) as c2:
        streams = [c.stream("POST", f"{url}/v1/audio/speech",
                            json={"model": "tts-1", "input": long_text, "voice": "ash", "response_format": "pcm"})
                   for c in (c1, c2)]
        responses = [s.__enter__() for s in streams]
        readers = [r.iter_bytes() for r in responses]  # kept: a dropped reader closes its response
        for r, reader in zip(responses, readers):
            assert r.status_code == 200
            next(reader)  # audio is flowing: both rows are live
        full = post(url)
        assert full.status_code == 429, pool.slack_counters()
        assert full.headers.get("retry-after") == "1"
        assert full.json()["error"]["type"] == "rate_limit_error"
        cancelled_before = pool.cancelled
        for s in streams:
            s.__exit__(None, None, None)  # hang up mid-stream
    deadline = time.monotonic() + 20
    while pool.live and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.live == 0 and pool.cancelled == cancelled_before + 2, pool.slack_counters()
    assert post(url, response_format="pcm", input="Hi.").status_code == 200  # the rows serve again


def test_speed_changes_the_speech_rate(tts_dir):
    """Slower speech pads more between words (the bonus raises PAD's logit); a model that already
    asks for every word as early as the forced padding allows cannot go faster."""
    service = make_service(tts_dir, slots=1)
    frames = {}
    for speed in (0.5, 1.0, 2.0):
        request, _ = service.front_end.request(TEXT + " The quick brown fox.", "alloy", speed)
        frames[speed] = synthesize(service.pool, request).pcm.size // 1920
    assert frames[0.5] > frames[1.0] >= frames[2.0]


def test_the_dataclass_request_is_greedy_here(tts_dir):
    service = make_service(tts_dir, slots=1)
    request, tokens = service.front_end.request(TEXT, "alloy", 1.0)
    assert dataclasses.asdict(request)["text_temperature"] == 0.0
    assert tokens == sum(len(e.tokens) for e in request.entries)
