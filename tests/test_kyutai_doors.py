"""Kyutai moshi-server's doors on a real server, spoken to as Kyutai's own clients speak.

The message shapes are Unmute's (kyutai-labs/unmute `unmute/stt/speech_to_text.py`,
`unmute/tts/text_to_speech.py`): the same msgpack calls, fields and flows (Ready first, markers
followed by silence, the `Eos` flush). The STT is the tiny random checkpoint: its words are
nonsense, so the oracle is the model itself stepped directly over the same audio. The TTS is the
tiny DSM TTS, greedy: the engine's own frames synthesised offline are the oracle. LiveKit's Kyutai
STT plugin (`livekit-plugins-kyutai-lasuite`, unmodified) transcribes a WAV on the demo server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import logging
import re
import time
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
import soundfile
import torch
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from delay_backend import DelayBackend
from parley.engine import Engine, EngineConfig
from parley.engine.stt_pool import SttPool
from parley.engine.tts_offline import synthesize
from parley.models.checkpoint import load_stt_checkpoint
from parley.models.config import FRAME_SAMPLES
from parley.models.stt import SttGen
from parley.models.stt_text import TranscriptDecoder, WordEnded, WordHeard
from parley.models.synthetic import TINY_TTS_VOICES, write_tiny_stt_checkpoint
from parley.realtime.server.speech_setup import load_speech_service
from parley.realtime.server.app import ServerInfo, create_app
from parley.realtime.server.served_models import ServedModels
from parley.realtime.server.services import Services
from parley.realtime.sessions.session import ServerDefaults
from server_harness import serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "public_token"  # Unmute's HEADERS = {"kyutai-api-key": "public_token"}
HEADERS = {"kyutai-api-key": KEY}
GREEDY = {"text_temperature": 0.0, "audio_temperature": 0.0}
WORDS = "Hello there, how are you?".split()
LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.".split()
# The fields of Unmute's pydantic models (extra fields are ignored there; moshi-server's Step also
# carries buffered_pcm, which Unmute does not read).
UNMUTE_STT = {"Word": {"text", "start_time"}, "EndWord": {"stop_time"}, "Marker": {"id"},
              "Step": {"step_idx", "prs", "buffered_pcm"}, "Error": {"message"}, "Ready": set()}
UNMUTE_TTS = {"Text": {"text", "start_s", "stop_s"}, "Audio": {"pcm"}, "Error": {"message"}, "Ready": set()}


def noise(seconds: float, seed: int) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(seconds * 24_000))).astype(np.float32)


def unmute_stt_send(data: dict) -> bytes:
    """SpeechToText._send."""
    return msgpack.packb(data, use_bin_type=True, use_single_float=True)


def unmute_stt_audio(pcm: np.ndarray) -> bytes:
    """SpeechToText.send_audio."""
    return unmute_stt_send({"type": "Audio", "pcm": pcm.astype(np.float32).tolist()})


def read(message: bytes, shapes: dict) -> dict:
    """One message, as Unmute's TypeAdapter validates it: a known type and its fields."""
    data = msgpack.unpackb(message)
    assert set(data) - {"type"} == shapes[data["type"]], data
    return data


CLIP = noise(3.0, 5)


@torch.no_grad()
def close_words(stt) -> None:
    """The tiny random STT never samples PAD or end-of-padding, so it never closes a word before the
    flush that a stream never gets. Give it the habit: the text rows of the two ids it says most on
    CLIP are copied to PAD (3) and EPAD (0); on a tie greedy sampling picks the lower id, so it
    says those instead. (Its words stay nonsense; the model stepped directly stays the oracle.)"""
    _, _, tokens = direct_transcript(stt, np.concatenate([CLIP, np.zeros(24_000, np.float32)]), 10_000)
    ids, counts = np.unique([t for t in tokens if t > 3], return_counts=True)
    first, second = ids[np.argsort(counts)[-2:]]
    weight = stt.lm.text_linear.weight
    weight[3], weight[0] = weight[int(first)], weight[int(second)]


@pytest.fixture(scope="module")
def stt(tmp_path_factory):
    checkpoint = load_stt_checkpoint(write_tiny_stt_checkpoint(tmp_path_factory.mktemp("stt")), dtype=torch.float32)
    close_words(checkpoint)
    return checkpoint


def speech_service(tts_dir):
    service = load_speech_service(tts_dir, slots=1, voices=tts_dir / "voices", voice_map=None,
                                  device="cpu", dtype=torch.float32)
    service.front_end.sampling = dict(GREEDY)
    return service


@pytest.fixture(scope="module")
def tts_service(tiny_tts_dir):
    return speech_service(tiny_tts_dir)


def kyutai_app(stt_pool, speech, *, start_engine: bool = True):
    # Long ticks: a tiny TTS step on a shared CPU can take most of an 80 ms tick.
    engine = Engine(DelayBackend(2), EngineConfig(tick_seconds=0.5))
    for pool in (stt_pool, speech and speech.pool):
        if pool is not None:
            engine.add_slack_source(pool)
    models = ServedModels.build({"duplex": "delay", "stt": stt_pool and stt_pool.name,
                                 "tts": speech and speech.model}, {})
    return create_app(Services(engine, ServerDefaults(api_key=KEY), ServerInfo(model="delay"), codec_workers=0,
                               stt_pool=stt_pool, speech=speech, models=models, start_engine=start_engine))


@pytest.fixture(scope="module")
def server(stt, tts_service):
    """One STT row and one TTS row behind the key; the TTS oracle made before the engine owns the pool."""
    oracles = {}
    for words in (WORDS, LONG):
        request, _ = tts_service.front_end.request(" ".join(words), TINY_TTS_VOICES[0])
        request = dataclasses.replace(request, conditions={**request.conditions, "cfg": "1.5"})  # Unmute's cfg_alpha
        oracles[len(words)] = synthesize(tts_service.pool, request)
        assert oracles[len(words)].terminal.status.value == "completed" and oracles[len(words)].words
    with serve(kyutai_app(SttPool(stt, slots=1), tts_service)) as url:
        yield url, oracles[len(WORDS)], oracles[len(LONG)]


def get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, None


def wait_rows_free(url: str, timeout: float = 20.0) -> None:
    """A closed connection's row is freed at the pool's next offer: wait for it (modules_info)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(m["used_slots"] == "0" for m in get(f"http://{url}/api/modules_info")[1]):
            return
        time.sleep(0.05)
    raise AssertionError("the Kyutai doors' rows were not freed")


def direct_transcript(stt, pcm: np.ndarray, steps: int):
    """The first `steps` steps of one row stepped directly (the pool's silence prefix, then `pcm`):
    moshi-server's word events, and every step's extra heads after the prefix (and its text tokens)."""
    prefix = stt.settings.prefix_frames
    signal = np.concatenate([np.zeros(prefix * FRAME_SAMPLES, np.float32), pcm])
    codes = stt.mimi.encode(torch.from_numpy(signal)[None])[0].T
    gen = SttGen(stt.lm)
    state = gen.init_state(1)
    decoder = TranscriptDecoder(stt.tokenizer, gen.text_delay, prefix / 12.5)
    events, heads, tokens = [], [], []
    for step, frame in enumerate(codes[:steps]):
        out = gen.step(state, frame[None], torch.ones(1, dtype=torch.bool))
        heads.append(out.heads[0].tolist())
        if out.valid[0]:
            tokens.append(int(out.text[0]))
            events += [e for e in decoder.feed(tokens[-1], step) if isinstance(e, (WordHeard, WordEnded))]
    return events, heads[prefix:], tokens


def test_unmute_stt_flow_words_steps_and_marker_equal_the_model(server, stt):
    """Unmute's flow (stt_from_file_example.py): Ready; 80 ms Audio frames; Marker; silence
    until the Marker comes back. Words, their times and each Step's prs are the model's own."""
    url, *_ = server
    wait_rows_free(url)
    clip = CLIP
    silence = [np.zeros(FRAME_SAMPLES, np.float32)] * 25

    async def run():
        async with connect(f"ws://{url}/api/asr-streaming", additional_headers=HEADERS) as ws:
            assert read(await ws.recv(), UNMUTE_STT)["type"] == "Ready"
            for i in range(0, clip.size, FRAME_SAMPLES):
                await ws.send(unmute_stt_audio(clip[i:i + FRAME_SAMPLES]))
            await ws.send(unmute_stt_send({"type": "Marker", "id": 7}))
            for frame in silence:
                await ws.send(unmute_stt_audio(frame))
            got = []
            while (message := read(await asyncio.wait_for(ws.recv(), 60), UNMUTE_STT))["type"] != "Marker":
                got.append(message)
            return got, message

    got, marker = asyncio.run(run())
    assert marker["id"] == 7
    frames = -(-clip.size // FRAME_SAMPLES)  # the last, partial frame is completed by the silence after it
    due = frames + SttGen(stt.lm).text_delay  # the marker's audio, then the text delay
    steps = [m for m in got if m["type"] == "Step"]
    assert [m["step_idx"] for m in steps] == list(range(1, due + 1))
    assert all(m["buffered_pcm"] >= 0 for m in steps)
    silent = np.concatenate([clip, *silence])
    events, heads, _ = direct_transcript(stt, silent, stt.settings.prefix_frames + due)
    assert len(steps[0]["prs"]) == stt.lm.cfg.extra_heads_num_heads == 4  # Unmute reads prs[2]
    np.testing.assert_allclose([m["prs"] for m in steps], heads, atol=1e-6)
    want = [{"type": "Word", "text": e.text, "start_time": pytest.approx(e.start)} if isinstance(e, WordHeard)
            else {"type": "EndWord", "stop_time": pytest.approx(e.end)} for e in events]
    assert [m for m in got if m["type"] != "Step"] == want
    assert any(m["type"] == "Word" for m in got), "the tiny model heard no word: pick another clip"


def test_a_full_stt_pool_answers_as_moshi_server(server):
    """The one row taken: the next connection's first message is Error "no free channels" (Unmute
    raises MissingServiceAtCapacity on it), then the server closes."""
    url, *_ = server
    wait_rows_free(url)

    async def run():
        async with connect(f"ws://{url}/api/asr-streaming", additional_headers=HEADERS) as holder:
            assert read(await holder.recv(), UNMUTE_STT)["type"] == "Ready"
            async with connect(f"ws://{url}/api/asr-streaming", additional_headers=HEADERS) as second:
                first = read(await second.recv(), UNMUTE_STT)
                with pytest.raises(ConnectionClosed):
                    await second.recv()
                return first, second.close_code

    first, code = asyncio.run(run())
    assert first == {"type": "Error", "message": "no free channels"} and code == 1013


def test_bad_frames_get_an_error_on_their_own_connection(server):
    url, *_ = server
    wait_rows_free(url)

    async def run():
        async with connect(f"ws://{url}/api/asr-streaming", additional_headers=HEADERS) as ws:
            await ws.recv()  # Ready
            await ws.send("text frames are ignored, as moshi-server does")
            await ws.send(unmute_stt_send({"type": "Audio", "pcm": [float("nan")] * 8}))
            nan = read(await ws.recv(), UNMUTE_STT)
            await ws.send(b"\xc1 not msgpack")
            bad = read(await ws.recv(), UNMUTE_STT)
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            return nan, bad, ws.close_code

    nan, bad, code = asyncio.run(run())
    assert nan["type"] == "Error" and "NaN" in nan["message"]
    assert bad["type"] == "Error" and "msgpack" in bad["message"] and code == 1007


@pytest.mark.parametrize("how", ["header", "auth_id", "bearer"])
def test_the_key_is_taken_as_moshi_server_takes_it(server, how):
    url, *_ = server
    wait_rows_free(url)
    path, headers = "/api/asr-streaming", {}
    if how == "header":
        headers = HEADERS
    elif how == "auth_id":
        path += f"?auth_id={KEY}"
    else:
        headers = {"Authorization": f"Bearer {KEY}"}

    async def run():
        async with connect(f"ws://{url}{path}", additional_headers=headers) as ws:
            return msgpack.unpackb(await ws.recv())

    assert asyncio.run(run()) == {"type": "Ready"}


@pytest.mark.parametrize("path, headers, status", [
    ("/api/asr-streaming", {}, 401), ("/api/asr-streaming", {"kyutai-api-key": "wrong"}, 401),
    ("/api/tts_streaming?auth_id=wrong", {}, 401),
    ("/api/asr-streaming", {**HEADERS, "Origin": "https://elsewhere.example"}, 403)])
def test_a_wrong_key_or_origin_is_refused_before_the_upgrade(server, path, headers, status):
    """The one auth layer, as for every door: the key (moshi-server's header or query, or Parley's)
    and a browser's Origin."""
    url, *_ = server

    async def run():
        async with connect(f"ws://{url}{path}", additional_headers=headers):
            pass

    with pytest.raises(InvalidStatus) as refused:
        asyncio.run(run())
    assert refused.value.response.status_code == status


def test_build_info_and_modules_info_need_no_key(server):
    """Unmute's health check GETs /api/build_info without a key, as moshi-server serves it."""
    url, *_ = server
    wait_rows_free(url)
    status, info = get(f"http://{url}/api/build_info")
    assert status == 200 and info["server"] == "parley"
    status, modules = get(f"http://{url}/api/modules_info")
    assert status == 200
    assert [(m["type"], m["path"], m["used_slots"], m["total_slots"]) for m in modules] == [
        ("batched_asr", "/api/asr-streaming", "0", "1"), ("py", "/api/tts_streaming", "0", "1")]


def unmute_tts_query(voice: str, fmt: str = "PcmMessagePack") -> str:
    """TextToSpeech's TtsStreamingQuery(voice=..., cfg_alpha=1.5).to_url_params() (format defaults
    to PcmMessagePack there)."""
    return f"?format={fmt}&voice={voice}&cfg_alpha=1.5"


def test_unmute_tts_flow_speaks_the_engine_frames_then_closes(server):
    """TextToSpeech: Ready, Text messages word by word (msgpack of the pydantic model), Eos; then
    Audio and Text messages until the server closes (the Eos flush)."""
    url, oracle, _ = server
    wait_rows_free(url)

    async def run():
        uri = f"ws://{url}/api/tts_streaming{unmute_tts_query(TINY_TTS_VOICES[0])}"
        async with connect(uri, additional_headers=HEADERS) as ws:
            assert read(await ws.recv(), UNMUTE_TTS)["type"] == "Ready"
            for word in WORDS:
                await ws.send(msgpack.packb({"type": "Text", "text": word}))
            await ws.send(msgpack.packb({"type": "Eos"}))
            got = []
            with contextlib.suppress(ConnectionClosed):
                while True:
                    got.append(read(await asyncio.wait_for(ws.recv(), 60), UNMUTE_TTS))
            return got, ws.close_code

    got, code = asyncio.run(run())
    assert code == 1000
    pcm = np.concatenate([np.asarray(m["pcm"], np.float32) for m in got if m["type"] == "Audio"])
    np.testing.assert_array_equal(pcm, oracle.pcm)
    words = [(m["text"], m["start_s"], m["stop_s"]) for m in got if m["type"] == "Text"]
    assert words == [(w.text, pytest.approx(w.start_s), pytest.approx(w.stop_s)) for w in oracle.words]


def test_raw_pcm_with_plain_text_frames_and_the_zero_byte(server):
    """moshi-server's other forms: plain text frames in, b"\\0" as end of stream, raw float32 out."""
    url, oracle, _ = server
    wait_rows_free(url)

    async def run():
        async with connect(f"ws://{url}/api/tts_streaming{unmute_tts_query(TINY_TTS_VOICES[0], 'Pcm')}",
                           additional_headers=HEADERS) as ws:
            await ws.send(" ".join(WORDS[:2]))
            await ws.send(" ".join(WORDS[2:]))
            await ws.send(b"\0")
            chunks = []
            with contextlib.suppress(ConnectionClosed):
                while True:
                    chunks.append(await asyncio.wait_for(ws.recv(), 60))
            return chunks, ws.close_code

    chunks, code = asyncio.run(run())
    assert code == 1000 and all(isinstance(c, bytes) and len(c) == 4 * FRAME_SAMPLES for c in chunks)
    np.testing.assert_array_equal(np.frombuffer(b"".join(chunks), "<f4"), oracle.pcm)


@pytest.mark.parametrize("query, named", [("?format=Wav", "format"), ("?voice=nobody", "voice"),
                                          ("?cfg_alpha=1.7", "cfg_alpha"), ("?seed=3", "seed"),
                                          ("?max_seq_len=9", "max_seq_len"), ("?speed=2", "speed"),
                                          ("?language=fr", "language")])
def test_settings_a_door_cannot_serve_are_refused_by_name(server, query, named):
    url, *_ = server
    path = "/api/asr-streaming" if named == "language" else "/api/tts_streaming"

    async def run():
        async with connect(f"ws://{url}{path}{query}", additional_headers=HEADERS):
            pass

    with pytest.raises(InvalidStatus) as refused:
        asyncio.run(run())
    assert refused.value.response.status_code == 400 and named in refused.value.response.body.decode()


def test_a_full_tts_pool_answers_as_moshi_server(tiny_tts_dir):
    """A pool whose one row is promised (the engine never runs here, so it stays so): the next
    connection's first message is Error "no free channels", then the server closes. (A pool of
    its own: an engine's shutdown stops its pools for good.)"""
    tts_service = speech_service(tiny_tts_dir)
    with serve(kyutai_app(None, tts_service, start_engine=False)) as url:
        async def run():
            uri = f"ws://{url}/api/tts_streaming{unmute_tts_query(TINY_TTS_VOICES[0])}"
            async with connect(uri, additional_headers=HEADERS) as holder:
                await holder.recv()  # Ready
                await holder.send(msgpack.packb({"type": "Text", "text": "hello"}))
                await holder.send(msgpack.packb({"type": "Eos"}))
                for _ in range(100):  # the Eos reaches the pool
                    if tts_service.pool.free == 0:
                        break
                    await asyncio.sleep(0.05)
                async with connect(uri, additional_headers=HEADERS) as second:
                    first = read(await second.recv(), UNMUTE_TTS)
                    with pytest.raises(ConnectionClosed):
                        await second.recv()
                    return first, second.close_code

        first, code = asyncio.run(run())
    assert first == {"type": "Error", "message": "no free channels"} and code == 1013


def wav_file(pcm: np.ndarray) -> io.BytesIO:
    buf = io.BytesIO()
    soundfile.write(buf, pcm, 24_000, subtype="PCM_16", format="WAV")
    buf.seek(0)
    return buf


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    """The default demo server (tests/test_demo_model.py's), its cache in a temporary folder; its
    STT taught to close words (close_words: the demo's random one never would)."""
    from parley.realtime.server.serve import ServeConfig, build_services

    mp = pytest.MonkeyPatch()
    mp.setenv("PARLEY_CACHE", str(tmp_path_factory.mktemp("parley-cache")))
    try:
        services = build_services(ServeConfig(model=None, max_sessions=2, device="cpu", codec_workers=0))
        close_words(services.stt_pool.checkpoint)  # before the app hands the pool to the engine client
        with serve(create_app(services)) as url:
            yield url
    finally:
        mp.undo()


def live_sessions(base: str) -> float:
    text = urllib.request.urlopen(f"http://{base}/metrics", timeout=10).read().decode()
    found = re.search(r'^parley_live_sessions{protocol="kyutai_asr"} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_livekit_kyutai_plugin_unmodified_transcribes_a_wav_on_the_demo(demo_url, caplog):
    """LiveKit's Kyutai STT plugin, pointed at the demo: a WAV's words come back as final
    transcripts with their start times, and closing the stream ends the connection cleanly: no
    error on either side, the session and its row freed. (The plugin's close cancels its pending
    receive, which aiohttp books as 1006 and then drops the socket without a close frame; it does
    so against moshi-server too. The server must take that as an ordinary goodbye.)"""
    import aiohttp
    from lasuite.plugins.kyutai import STT  # tests/run.sh installs it
    from livekit import rtc
    from livekit.agents import stt as agents_stt

    pcm, rate = soundfile.read(wav_file(np.concatenate([CLIP, np.zeros(48_000, np.float32)])),
                               dtype="int16")
    assert rate == 24_000

    async def run():
        async with aiohttp.ClientSession() as session:
            plugin = STT(api_key="any", http_session=session, base_url=f"ws://{demo_url}/api/asr-streaming")
            stream = plugin.stream()
            for i in range(0, pcm.size, 480):  # 20 ms frames, as a room's track delivers them
                chunk = pcm[i:i + 480]
                stream.push_frame(rtc.AudioFrame(chunk.tobytes(), 24_000, 1, chunk.size))
                await asyncio.sleep(0)
            finals, arrived = [], [time.monotonic()]

            async def collect():
                async for event in stream:
                    if event.type == agents_stt.SpeechEventType.FINAL_TRANSCRIPT:
                        finals.append(event.alternatives[0])
                        arrived.append(time.monotonic())

            collector = asyncio.create_task(collect())
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:  # words until none came for a while (all audio read)
                await asyncio.sleep(0.5)
                if finals and time.monotonic() - arrived[-1] > 5:
                    break
            assert live_sessions(demo_url) == 1
            await stream.aclose()
            collector.cancel()
            return finals

    with caplog.at_level(logging.WARNING):
        finals = asyncio.run(run())
        wait_rows_free(demo_url)
    assert finals and all(f.text for f in finals)
    starts = [f.start_time for f in finals]
    assert starts == sorted(starts) and starts[-1] <= CLIP.size / 24_000 + 2
    assert live_sessions(demo_url) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_ogg_opus_audio_in_is_transcribed_step_by_step(server):
    """OggOpus{data}: Ogg pages of Opus (sphn's writer, as moshi-server's clients make them); each
    80 ms of decoded audio is one Step, and the marker comes back after it."""
    import sphn

    url, *_ = server
    wait_rows_free(url)
    writer = sphn.OpusStreamWriter(24_000)
    pages = [writer.append_pcm(f) for f in np.split(np.concatenate([CLIP[:24_000], np.zeros(24_000, np.float32)]), 25)]

    async def run():
        async with connect(f"ws://{url}/api/asr-streaming", additional_headers=HEADERS) as ws:
            await ws.recv()  # Ready
            for page in pages[:12]:  # 1 s of audio
                await ws.send(msgpack.packb({"type": "OggOpus", "data": bytes(page)}))
            await ws.send(msgpack.packb({"type": "Marker", "id": 1}))
            for page in pages[12:]:  # 1 s of silence: flushes the text delay
                await ws.send(msgpack.packb({"type": "OggOpus", "data": bytes(page)}))
            got = []
            while (message := read(await asyncio.wait_for(ws.recv(), 60), UNMUTE_STT))["type"] != "Marker":
                got.append(message)
            return got

    steps = [m["step_idx"] for m in asyncio.run(run()) if m["type"] == "Step"]
    assert steps == list(range(1, len(steps) + 1)) and 8 <= len(steps) <= 25


def test_tts_ogg_opus_message_pack_decodes_to_the_engine_frames(server):
    import sphn

    url, oracle, _ = server
    wait_rows_free(url)

    async def run():
        async with connect(f"ws://{url}/api/tts_streaming{unmute_tts_query(TINY_TTS_VOICES[0], 'OggOpusMessagePack')}",
                           additional_headers=HEADERS) as ws:
            assert read(await ws.recv(), UNMUTE_TTS)["type"] == "Ready"
            await ws.send(msgpack.packb({"type": "Text", "text": " ".join(WORDS)}))
            await ws.send(msgpack.packb({"type": "Eos"}))
            got = []
            with contextlib.suppress(ConnectionClosed):
                while True:
                    got.append(msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60)))
            return got

    got = asyncio.run(run())
    data = b"".join(m["data"] for m in got if m["type"] == "OggOpus")
    assert data[:4] == b"OggS" and {m["type"] for m in got} == {"OggOpus", "Text"}
    pcm, rate = sphn.read_opus_bytes(data)
    assert abs(pcm.shape[-1] / rate - oracle.pcm.size / 24_000) < 0.1


def test_a_voice_message_is_honoured_or_refused_by_its_shape(server, tts_service):
    """Voice{embeddings, shape} (Unmute's cloned voices): the voice set's own embeddings speak as
    that voice does; another shape is an Error naming Voice.shape."""
    url, oracle, _ = server
    wait_rows_free(url)
    voice = tts_service.front_end.voices.load(TINY_TTS_VOICES[0]).float()

    async def speak(embeddings: np.ndarray, shape: list[int]):
        uri = f"ws://{url}/api/tts_streaming{unmute_tts_query(TINY_TTS_VOICES[1])}"
        async with connect(uri, additional_headers=HEADERS) as ws:
            await ws.recv()  # Ready
            await ws.send(msgpack.packb({"type": "Voice", "embeddings": embeddings.tolist(), "shape": shape}))
            await ws.send(msgpack.packb({"type": "Text", "text": " ".join(WORDS)}))
            await ws.send(msgpack.packb({"type": "Eos"}))
            got = []
            with contextlib.suppress(ConnectionClosed):
                while True:
                    got.append(msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60)))
            return got, ws.close_code

    got, code = asyncio.run(speak(voice.reshape(-1).numpy(), list(voice.shape)))
    assert code == 1000
    np.testing.assert_array_equal(np.concatenate([m["pcm"] for m in got if m["type"] == "Audio"]).astype(np.float32),
                                  oracle.pcm)
    wait_rows_free(url)
    got, code = asyncio.run(speak(np.zeros(6, np.float32), [2, 3]))
    assert got[-1]["type"] == "Error" and "Voice.shape" in got[-1]["message"] and code == 1008


def test_a_drain_refuses_new_streams_and_says_goodbye_to_live_ones(stt):
    """As every door: once draining, an upgrade gets 503; a live stream gets moshi-server's Error
    with the reason, then close 1001 (going away)."""
    app = kyutai_app(SttPool(stt, slots=2), None)
    app.state.drainer.timeout_s = 0.5  # live sessions' grace before the goodbye
    with serve(app) as url:
        async def run():
            async with connect(f"ws://{url}/api/asr-streaming", additional_headers=HEADERS) as ws:
                assert msgpack.unpackb(await ws.recv()) == {"type": "Ready"}
                request = urllib.request.Request(f"http://{url}/admin/drain", method="POST",
                                                 headers={"Authorization": f"Bearer {KEY}"})
                await asyncio.to_thread(urllib.request.urlopen, request, timeout=10)
                with pytest.raises(InvalidStatus) as refused:
                    async with connect(f"ws://{url}/api/asr-streaming", additional_headers=HEADERS):
                        pass
                goodbye = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 10))
                with pytest.raises(ConnectionClosed):
                    await ws.recv()
                return refused.value.response.status_code, goodbye, ws.close_code

        status, goodbye, code = asyncio.run(run())
    assert status == 503 and goodbye["type"] == "Error" and "going away" in goodbye["message"] and code == 1001


def test_tts_speaks_while_the_text_streams_in(server):
    """Unmute streams its LLM's words: the first audio comes before the text's end (the row holds
    the DSM's lookahead and waits for more words), and the frames are the whole script's."""
    url, _, oracle = server
    wait_rows_free(url)

    async def run():
        uri = f"ws://{url}/api/tts_streaming{unmute_tts_query(TINY_TTS_VOICES[0])}"
        async with connect(uri, additional_headers=HEADERS) as ws:
            assert read(await ws.recv(), UNMUTE_TTS)["type"] == "Ready"
            for word in LONG[:-2]:
                await ws.send(msgpack.packb({"type": "Text", "text": word}))
            got = [read(await asyncio.wait_for(ws.recv(), 60), UNMUTE_TTS)]
            while got[-1]["type"] != "Audio":  # before the last words and Eos are sent
                got.append(read(await asyncio.wait_for(ws.recv(), 60), UNMUTE_TTS))
            for word in LONG[-2:]:
                await ws.send(msgpack.packb({"type": "Text", "text": word}))
            await ws.send(msgpack.packb({"type": "Eos"}))
            with contextlib.suppress(ConnectionClosed):
                while True:
                    got.append(read(await asyncio.wait_for(ws.recv(), 60), UNMUTE_TTS))
            return got, ws.close_code

    got, code = asyncio.run(run())
    assert code == 1000
    pcm = np.concatenate([np.asarray(m["pcm"], np.float32) for m in got if m["type"] == "Audio"])
    np.testing.assert_array_equal(pcm, oracle.pcm)
    assert [m["text"] for m in got if m["type"] == "Text"] == [w.text for w in oracle.words]
