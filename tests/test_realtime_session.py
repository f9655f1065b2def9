"""`/v1/realtime` settings judged without sockets: every session field is honoured or refused
with an error naming it, numbers are checked by type and range, and good fields still apply."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from parley.realtime.media.audio_formats import AudioFormat
from parley.realtime.realtime_api.events import Dialect, SessionConfig
from parley.realtime.realtime_api.settings import (
    ClientError, ModelCaps, apply_session_update, parse_item, parse_response_options, parse_turn_detection,
)

SERVED = ("m", "gpt-realtime")  # the duplex model's served names: its checkpoint's, an operator's alias
PERSONAPLEX, MOSHI = ModelCaps(prompts=True, models=SERVED), ModelCaps(prompts=False, models=SERVED)
STT_SERVED = ("stt-ckpt", "whisper-1")  # the STT model's served names: its checkpoint's, an alias
WITH_STT = ModelCaps(prompts=True, transcribe=True, models=SERVED, transcription_models=STT_SERVED)


def config() -> SessionConfig:
    return SessionConfig(id="sess_1", model="m")


def update(session, caps=PERSONAPLEX, base=None):
    return apply_session_update(session, base or config(), caps)


@pytest.mark.parametrize("value", ["abc", "500ms", 1.5, True, [500]])
def test_silence_duration_must_be_a_whole_number(value):
    cfg, errors = update({"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": value}}},
                          "instructions": "kept"})
    assert [e.param for e in errors] == ["session.audio.input.turn_detection.silence_duration_ms"]
    assert errors[0].code == "invalid_type"
    assert cfg.instructions == "kept"  # the good field still applies
    assert cfg.turn_detection.silence_duration_ms == 500  # the detector keeps its previous setting


@pytest.mark.parametrize("field,value,code", [
    ("threshold", 0, "invalid_value"), ("threshold", 1.5, "invalid_value"), ("threshold", "0.5", "invalid_type"),
    ("prefix_padding_ms", -1, "invalid_value"), ("prefix_padding_ms", 10 ** 9, "invalid_value"),
    ("silence_duration_ms", float("nan"), "invalid_type"), ("create_response", "yes", "invalid_type"),
    ("interrupt_response", 1, "invalid_type"), ("idle_timeout_ms", 5000, "unsupported_parameter"),
    ("eagerness", "high", "unknown_parameter"),  # a semantic_vad field on server_vad
])
def test_turn_detection_fields_by_type_and_range(field, value, code):
    with pytest.raises(ClientError) as err:
        parse_turn_detection("session.turn_detection", {"type": "server_vad", field: value}, PERSONAPLEX)
    assert err.value.param.endswith(f".{field}") and err.value.code == code


def test_turn_detection_good_values_and_semantic_eagerness():
    td = parse_turn_detection("p", {"type": "server_vad", "threshold": 0.8, "silence_duration_ms": 300.0,
                                    "create_response": False}, PERSONAPLEX)
    assert (td.threshold, td.silence_duration_ms, td.create_response) == (0.8, 300, False)
    assert isinstance(td.silence_duration_ms, int)
    assert parse_turn_detection("p", {"type": "semantic_vad", "eagerness": "high"}, WITH_STT).eagerness == "high"
    assert parse_turn_detection("p", None, PERSONAPLEX) is None


def test_transcription_and_semantic_vad_need_a_paired_stt():
    for caps, refused in ((PERSONAPLEX, ["session.audio.input.transcription",
                                         "session.audio.input.turn_detection.type"]), (WITH_STT, [])):
        cfg, errors = update({"audio": {"input": {"transcription": {"model": "whisper-1"},
                                                  "turn_detection": {"type": "semantic_vad"}}}}, caps=caps)
        assert [e.param for e in errors] == refused
        assert cfg.needs_stt == (not refused)
    with pytest.raises(ClientError) as err:
        parse_turn_detection("p", {"type": "semantic_vad", "eagerness": "eager"}, WITH_STT)
    assert err.value.param == "p.eagerness"


REFUSED = [
    ({"tools": [{"type": "function", "name": "f"}]}, "session.tools"),
    ({"tool_choice": "required"}, "session.tool_choice"),
    ({"audio": {"input": {"transcription": {"model": "whisper-1"}}}}, "session.audio.input.transcription"),
    ({"input_audio_transcription": {"model": "whisper-1"}}, "session.input_audio_transcription"),
    ({"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, "session.audio.input.noise_reduction"),
    ({"audio": {"output": {"speed": 1.2}}}, "session.audio.output.speed"),
    ({"speed": "fast"}, "session.speed"),
    ({"prompt": {"id": "pmpt_1"}}, "session.prompt"),
    ({"include": ["item.input_audio_transcription.logprobs"]}, "session.include"),
    ({"truncation": "disabled"}, "session.truncation"),
    ({"type": "transcription"}, "session.type"),
    ({"temperature": 1e39}, "session.temperature"),
    ({"temperature": "hot"}, "session.temperature"),
    ({"max_output_tokens": 0}, "session.max_output_tokens"),
    ({"max_response_output_tokens": "lots"}, "session.max_response_output_tokens"),
    ({"output_modalities": ["video"]}, "session.output_modalities"),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.input.format"),
    ({"input_audio_format": "opus"}, "session.input_audio_format"),
    ({"no_such_field": 1}, "session.no_such_field"),
    ({"audio": {"sideways": {}}}, "session.audio.sideways"),
    ({"tracing": {"workflow_name": 3}}, "session.tracing.workflow_name"),
]


@pytest.mark.parametrize("session,param", REFUSED)
def test_refused_fields_name_their_param_and_change_nothing(session, param):
    before = config()
    after, errors = update(session, base=before)
    assert [e.param for e in errors] == [param], [str(e) for e in errors]
    assert after.to_dict(Dialect.GA) == before.to_dict(Dialect.GA)


def test_a_model_not_served_is_model_not_found_and_the_other_fields_apply():
    """session.model was taken as a label whatever it named."""
    cfg, errors = update({"model": "gpt-4o-realtime-preview", "instructions": "Be Ada."})
    assert [(e.code, e.param) for e in errors] == [("model_not_found", "session.model")]
    assert "served as 'm', 'gpt-realtime'" in str(errors[0]) and "GET /v1/models" in str(errors[0])
    assert cfg.model == "m" and cfg.instructions == "Be Ada."
    assert [e.code for e in update({"model": 7})[1]] == ["invalid_type"]
    assert update({"model": "gpt-realtime"})[0].model == "gpt-realtime"  # an alias is honoured as the label


def test_honoured_fields_show_in_the_effective_config():
    cfg, errors = update({"type": "realtime", "model": "gpt-realtime", "instructions": "Be Ada.",
                          "output_modalities": ["text"], "tools": [], "tool_choice": "auto", "tracing": "auto",
                          "max_output_tokens": 7, "include": None, "truncation": "auto",
                          "audio": {"input": {"format": {"type": "audio/pcmu"}, "transcription": None,
                                              "turn_detection": None},
                                    "output": {"format": {"type": "audio/pcma"}, "voice": "NATF2.pt", "speed": 1.0}}})
    assert errors == []
    ga = cfg.to_dict(Dialect.GA)
    assert ga["instructions"] == "Be Ada." and ga["output_modalities"] == ["text"] and ga["max_output_tokens"] == 7
    assert ga["audio"]["input"]["format"] == {"type": "audio/pcmu"} and ga["audio"]["input"]["turn_detection"] is None
    assert ga["audio"]["output"] == {"format": {"type": "audio/pcma"}, "voice": "NATF2.pt", "speed": 1.0}
    assert ga["tracing"] == "auto" and ga["model"] == "gpt-realtime"
    beta, errors = update({"input_audio_format": "g711_ulaw", "output_audio_format": "g711_alaw",
                           "modalities": ["text", "audio"], "temperature": 0.6, "max_response_output_tokens": "inf"})
    assert errors == []
    b = beta.to_dict(Dialect.BETA)
    assert (b["input_audio_format"], b["output_audio_format"], b["temperature"]) == ("g711_ulaw", "g711_alaw", 0.6)


def test_moshi_refuses_a_persona_and_voice_prompt_but_takes_openai_voice_names():
    cfg, errors = update({"instructions": "You are Ada.", "voice": "NATF2.pt"}, caps=MOSHI)
    assert sorted(e.param for e in errors) == ["session.instructions", "session.voice"]
    cfg, errors = update({"instructions": "", "voice": "alloy"}, caps=MOSHI)
    assert errors == [] and cfg.voice == "alloy"


def test_session_must_be_an_object():
    with pytest.raises(ClientError) as err:
        update("nope")
    assert err.value.param == "session"


def test_response_options():
    cfg = config()
    opts = parse_response_options({"output_modalities": ["text"], "max_output_tokens": 5, "metadata": {"k": "v"},
                                   "conversation": "none", "tools": [], "instructions": ""}, cfg, PERSONAPLEX)
    assert (opts.audio, opts.max_output_tokens, opts.metadata, opts.in_conversation) == (False, 5, {"k": "v"}, False)
    assert parse_response_options(None, cfg, PERSONAPLEX).audio is True
    for raw, param in [({"instructions": "other"}, "response.instructions"),
                       ({"voice": "NATM1.pt"}, "response.voice"),
                       ({"conversation": "conv_1"}, "response.conversation"),
                       ({"input": [{"type": "item_reference", "id": "x"}]}, "response.input"),
                       ({"metadata": {"k": 1}}, "response.metadata.k"),
                       ({"max_output_tokens": -3}, "response.max_output_tokens"),
                       ({"tools": [{"type": "function"}]}, "response.tools"),
                       ({"audio": {"output": {"format": {"type": "audio/pcmu"}}}}, "response.audio.output.format"),
                       ({"bogus": 1}, "response.bogus")]:
        with pytest.raises(ClientError) as err:
            parse_response_options(raw, cfg, PERSONAPLEX)
        assert err.value.param == param, raw


def test_items_only_user_audio_reaches_the_model():
    pcm = (np.sin(np.arange(2400) / 5) * 8000).astype("<i2")
    parsed = parse_item({"type": "message", "role": "user",
                         "content": [{"type": "input_audio", "audio": base64.b64encode(pcm.tobytes()).decode()}]},
                        AudioFormat())
    assert parsed.item["content"] == [{"type": "input_audio", "transcript": None}]
    np.testing.assert_allclose(parsed.audio, pcm / 32768.0, atol=1e-6)
    for raw, param in [({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                        "item.content[0].type"),
                       ({"type": "message", "role": "system", "content": []}, "item.role"),
                       ({"type": "function_call_output", "call_id": "c", "output": "{}"}, "item.type"),
                       ({"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "@@"}]},
                        "item.content[0].audio")]:
        with pytest.raises(ClientError) as err:
            parse_item(raw, AudioFormat())
        assert err.value.param == param, raw


TRANSCRIBING = ModelCaps(prompts=False, transcribe=True, transcribe_sessions=True, transcription_models=STT_SERVED)


def transcription_config() -> SessionConfig:
    return SessionConfig(id="sess_1", model="m", type="transcription")


def test_transcription_session_fields():
    """GA transcription sessions take audio.input and include; conversation fields, output audio and
    response flags are refused by name; the good fields still apply."""
    cfg, errors = apply_session_update(
        {"type": "transcription", "instructions": "x", "include": [],
         "audio": {"input": {"format": {"type": "audio/pcmu"}, "transcription": {"model": "whisper-1"},
                             "turn_detection": {"type": "semantic_vad", "create_response": True}},
                   "output": {"voice": "alloy"}}}, transcription_config(), TRANSCRIBING)
    assert [e.param for e in errors] == ["session.instructions", "session.audio.input.turn_detection.create_response",
                                         "session.audio.output.voice"]
    ga = cfg.to_dict(Dialect.GA)
    assert ga["type"] == "transcription" and ga["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert ga["audio"]["input"]["transcription"] == {"model": "whisper-1"} and "output" not in ga["audio"]
    _, errors = apply_session_update({"type": "realtime"}, transcription_config(), TRANSCRIBING)
    assert [e.param for e in errors] == ["session.type"]


def test_beta_transcription_session_fields():
    cfg, errors = apply_session_update(
        {"input_audio_format": "g711_ulaw", "input_audio_transcription": {"model": "whisper-1"},
         "turn_detection": {"type": "server_vad", "silence_duration_ms": 300, "interrupt_response": False},
         "modalities": ["audio"], "client_secret": {"expires_at": {"seconds": 10}}, "voice": "alloy"},
        transcription_config(), TRANSCRIBING, beta_transcription=True)
    assert [e.param for e in errors] == ["session.modalities", "session.client_secret", "session.voice"]
    beta = cfg.to_dict(Dialect.BETA)
    assert beta["object"] == "realtime.transcription_session" and beta["input_audio_format"] == "g711_ulaw"
    assert beta["turn_detection"]["silence_duration_ms"] == 300 and not beta["turn_detection"]["create_response"]


def test_session_type_transcription_in_a_conversation_says_how():
    _, errors = update({"type": "transcription"}, caps=TRANSCRIBING)
    assert "intent=transcription" in str(errors[0])
    _, errors = update({"type": "transcription"})
    assert "--stt-model" in str(errors[0])


@pytest.mark.parametrize("caps,base", [(WITH_STT, config), (TRANSCRIBING, transcription_config)],
                         ids=["conversation", "transcription session"])
def test_transcription_model_must_be_a_served_stt_name(caps, base):
    """The STT model transcribes, so audio.input.transcription.model names one of its served names,
    as `model` does on every door: another is model_not_found and changes nothing; left out, the
    first is filled in (the one in effect)."""
    kind = {"type": base().type}
    for name in STT_SERVED:
        cfg, errors = update({**kind, "audio": {"input": {"transcription": {"model": name, "language": "en"}}}},
                             caps=caps, base=base())
        assert not errors and cfg.transcription == {"model": name, "language": "en"}
    cfg, errors = update({**kind, "audio": {"input": {"transcription": {}}}}, caps=caps, base=base())
    assert not errors and cfg.transcription == {"model": "stt-ckpt"}
    before = update({**kind, "audio": {"input": {"transcription": {"model": "whisper-1"}}}}, caps=caps,
                    base=base())[0]
    for bad, code in (("gpt-4o-transcribe", "model_not_found"), ("m", "model_not_found"), (7, "invalid_type")):
        cfg, errors = update({**kind, "audio": {"input": {"transcription": {"model": bad}}}}, caps=caps, base=before)
        assert [(e.param, e.code) for e in errors] == [("session.audio.input.transcription.model", code)]
        assert cfg.transcription == {"model": "whisper-1"}  # unchanged
    assert "'stt-ckpt', 'whisper-1'" in str(update({**kind, "audio": {"input": {"transcription": {
        "model": "x"}}}}, caps=caps, base=base())[1][0])


def test_beta_input_audio_transcription_model_must_be_a_served_stt_name():
    _, errors = update({"input_audio_transcription": {"model": "gpt-4o-mini-transcribe"}}, caps=WITH_STT)
    assert [(e.param, e.code) for e in errors] == [("session.input_audio_transcription.model", "model_not_found")]
    cfg, errors = apply_session_update({"input_audio_transcription": {"model": "stt-ckpt"}}, transcription_config(),
                                       TRANSCRIBING, beta_transcription=True)
    assert not errors and cfg.transcription == {"model": "stt-ckpt"}
