"""/api/chat query parameters: seeds reach the session's sampling, features the sampler lacks are
refused unless neutral, and a voice or persona a model cannot take closes 1008 on every model."""

from __future__ import annotations

import asyncio

import pytest

from parley.engine import OptionsError, SamplingOptions, SessionOptions
from parley.realtime.chat.protocol import options_from_query
from parley.realtime.sessions.session import ServerDefaults
from server_harness import delay_app, serve


def test_seeds():
    base = SessionOptions(sampling=SamplingOptions(text_temperature=0.6))
    opts = options_from_query({"seed": "42"}, base)
    assert (opts.sampling.text_seed, opts.sampling.audio_seed, opts.sampling.text_temperature) == (42, 42, 0.6)
    opts = options_from_query({"seed": "42", "audio_seed": "9223372036854775807"}, base)
    assert (opts.sampling.text_seed, opts.sampling.audio_seed) == (42, 2 ** 63 - 1)  # exact, not via float
    assert options_from_query({}, base).sampling.text_seed is None
    for bad in ({"seed": "-1"}, {"text_seed": "1.5"}, {"audio_seed": "x"}, {"seed": str(2 ** 64)}):
        with pytest.raises(OptionsError, match="seed"):
            options_from_query(bad, base)


def test_neutral_only_params():
    base = SessionOptions()
    # what the Moshi web client sends by default is accepted
    options_from_query({"pad_mult": "0", "repetition_penalty": "1.0", "repetition_penalty_context": "64"}, base)
    for param, value in (("pad_mult", "1.5"), ("repetition_penalty", "1.2")):
        with pytest.raises(OptionsError, match=param):
            options_from_query({param: value}, base)


@pytest.mark.timeout(60)
def test_a_moshi_model_closes_1008_for_a_voice_or_persona():
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    app, _ = delay_app(1, defaults=ServerDefaults(prompts=False))

    async def attempt(base, query):
        async with connect(f"ws://{base}/api/chat?{query}") as ws:
            try:
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            except ConnectionClosed:
                return ws.close_code, ws.close_reason

    async def scenario(base):
        return [await attempt(base, q) for q in ("voice_prompt=NATF2.pt", "text_prompt=Be+Ada", "pad_mult=2")]

    with serve(app) as base:
        results = asyncio.run(scenario(base))
    assert [code for code, _ in results] == [1008, 1008, 1008]
    assert "voice 'NATF2.pt' is not available" in results[0][1]
    assert "persona" in results[1][1] and "pad_mult" in results[2][1]
