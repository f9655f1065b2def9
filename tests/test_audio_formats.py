"""G.711 telephony audio for /v1/realtime: bit-exact against the ITU reference tables (Python's
audioop, where it still exists) and a real 8 kHz mu-law round trip through the resamplers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from parley.realtime.media.audio_formats import AudioFormat, FormatError, InputDecoder, OutputEncoder, g711_decode, g711_encode


@pytest.mark.parametrize("kind", ["pcmu", "pcma"])
def test_g711_matches_audioop(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")  # removed in Python 3.13
    every = np.arange(-32768, 32768, dtype=np.int16)
    encode, decode = {"pcmu": (audioop.lin2ulaw, audioop.ulaw2lin), "pcma": (audioop.lin2alaw, audioop.alaw2lin)}[kind]
    assert g711_encode(every, kind) == encode(every.tobytes(), 2)
    codes = bytes(range(256))
    assert np.array_equal(g711_decode(codes, kind), np.frombuffer(decode(codes, 2), "<i2"))


def test_g711_properties_without_audioop():
    every = np.arange(-32768, 32768, dtype=np.int16)
    for kind in ("pcmu", "pcma"):
        codes = np.frombuffer(g711_encode(every, kind), np.uint8)
        assert len(set(codes.tolist())) >= 255  # (mu-law's two zeros)
        back = g711_decode(codes.tobytes(), kind).astype(np.int64)
        assert np.all(np.diff(back) >= 0)  # monotonic
        wide = every.astype(np.int64)
        assert np.max(np.abs(back - wide) / np.maximum(np.abs(wide), 256)) < 0.07  # ~ 6 % quantisation


@pytest.mark.parametrize("kind", ["pcmu", "pcma"])
def test_8khz_round_trip_keeps_a_tone(kind):
    fmt = AudioFormat(kind)
    sr_model = 24000
    t = np.arange(1920 * 13) / sr_model  # 13 frames (1.04 s) at 24 kHz
    tone = (0.4 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    encoder, decoder = OutputEncoder(fmt), InputDecoder(fmt)
    chunks = [encoder.encode(tone[i:i + 1920]) for i in range(0, tone.size, 1920)]
    assert all(len(c) == 640 for c in chunks)  # 80 ms at 8 kHz, one byte a sample, every frame
    wire = b"".join(chunks)
    back = np.concatenate([decoder.decode(wire[i:i + 160]) for i in range(0, len(wire), 160)])
    assert 0 <= tone.size - back.size < 2400  # the streaming resamplers hold back < 100 ms
    mid = back[4000:18000]
    spectrum = np.abs(np.fft.rfft(mid * np.hanning(mid.size)))
    peak_hz = np.argmax(spectrum) * sr_model / mid.size
    assert abs(peak_hz - 440) < 5
    assert 0.35 < np.sqrt(2 * np.mean(mid ** 2)) < 0.45  # amplitude kept through 8 kHz G.711


def test_format_names():
    assert AudioFormat.parse("g711_ulaw") == AudioFormat.parse({"type": "audio/pcmu"}) == AudioFormat("pcmu")
    assert AudioFormat.parse({"type": "audio/pcm", "rate": 24000}).to_beta() == "pcm16"
    for bad in ("opus", {"type": "audio/pcm", "rate": 16000}, {"type": "audio/pcmu", "rate": 16000}, 3):
        with pytest.raises(FormatError):
            AudioFormat.parse(bad)


def test_an_append_names_what_is_wrong_with_its_audio():
    """Bad base64 and a payload the format cannot hold are two errors, each saying which (a
    FormatError is a ValueError: it was reported as bad base64)."""
    import base64

    from parley.realtime.calls.input_audio import appended_audio
    from parley.realtime.realtime_api.settings import ClientError

    decode = InputDecoder(AudioFormat("pcm16")).decode
    event = {"type": "input_audio_buffer.append"}
    with pytest.raises(ClientError, match="not valid base64"):
        appended_audio({**event, "audio": "not base64!"}, decode)
    with pytest.raises(ClientError, match="whole number of 2-byte samples"):
        appended_audio({**event, "audio": base64.b64encode(b"abc").decode()}, decode)
    pcm = appended_audio({**event, "audio": base64.b64encode(b"\x00\x40" * 4).decode()}, decode)
    assert pcm.shape == (4,) and np.allclose(pcm, 0.5)
