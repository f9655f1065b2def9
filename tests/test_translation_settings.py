"""realtime/translation/settings.py: `session.update` judged field by field, without a server: each
refused field is named by its path and keeps its value, the rest of the update applies."""

from __future__ import annotations

import pytest

from parley.realtime.realtime_api.settings import ClientError
from parley.realtime.translation.settings import TranslationCaps, TranslationConfig, apply_update

CONFIG = TranslationConfig(id="sess_1", model="hibiki-zero", language="en")
WITH_STT = TranslationCaps(languages=("en",), transcription_models=("gpt-4o-transcribe", "whisper-1"))
NO_STT = TranslationCaps(languages=("en",))


def refused(session, caps=WITH_STT, config=CONFIG):
    new, errors = apply_update(session, config, caps)
    return new, {e.param: e.code for e in errors}


def test_the_output_language_is_honoured_only_when_the_model_speaks_it():
    assert refused({"audio": {"output": {"language": "EN"}}}) == (CONFIG, {})
    assert refused({"audio": {"output": {"language": None}}}) == (CONFIG, {})
    assert refused({"audio": {"output": {"language": "fr"}}}) == (
        CONFIG, {"session.audio.output.language": "unsupported_parameter"})
    assert refused({"audio": {"output": {"language": 3}}})[1] == {"session.audio.output.language": "invalid_type"}


def test_source_transcription_needs_the_paired_stt_and_one_of_its_names():
    on, errors = refused({"audio": {"input": {"transcription": {"model": "whisper-1"}}}})
    assert on.transcription == "whisper-1" and not errors
    default, _ = refused({"audio": {"input": {"transcription": {}}}})
    assert default.transcription == "gpt-4o-transcribe"
    assert refused({"audio": {"input": {"transcription": None}}}, config=on) == (CONFIG, {})
    assert refused({"audio": {"input": {"transcription": {"model": "x"}}}}, config=on) == (
        on, {"session.audio.input.transcription.model": "model_not_found"})
    assert refused({"audio": {"input": {"transcription": {"model": "whisper-1"}}}}, NO_STT) == (
        CONFIG, {"session.audio.input.transcription": "unsupported_parameter"})
    assert refused({"audio": {"input": {"transcription": {"model": "whisper-1", "language": "fr"}}}})[1] == {
        "session.audio.input.transcription.language": "unknown_parameter"}


def test_each_refused_field_is_named_and_the_rest_applies():
    new, errors = refused({"audio": {"input": {"noise_reduction": {"type": "far_field"},
                                               "transcription": {"model": "whisper-1"}},
                                     "output": {"language": "de", "voice": "alloy"}},
                           "type": "translation", "model": "gpt-realtime-translate", "instructions": "x"})
    assert new.transcription == "whisper-1" and new.language == "en"
    assert errors == {"session.audio.input.noise_reduction": "unsupported_parameter",
                      "session.audio.output.language": "unsupported_parameter",
                      "session.audio.output.voice": "unknown_parameter",
                      "session.model": "unsupported_parameter", "session.instructions": "unknown_parameter"}
    assert refused({"audio": {"input": {"noise_reduction": None}}, "model": "hibiki-zero"}) == (CONFIG, {})
    on, errors = refused({"audio": {"format": {}, "input": {"transcription": {"model": "whisper-1"}}}})
    assert on.transcription == "whisper-1" and errors == {"session.audio.format": "unknown_parameter"}
    assert refused({"audio": {"input": "on"}})[1] == {"session.audio.input": "invalid_type"}
    assert refused({"audio": []})[1] == {"session.audio": "invalid_type"}


def test_a_session_that_is_not_an_object_refuses_the_event():
    with pytest.raises(ClientError) as exc:
        apply_update(["audio"], CONFIG, WITH_STT)
    assert exc.value.param == "session"


def test_the_resource_is_the_sdks_translation_session():
    from openai.types.realtime import RealtimeTranslationSession
    resource = TranslationConfig(id="sess_1", model="m", language="en", transcription="whisper-1").resource()
    parsed = RealtimeTranslationSession.model_validate(resource)
    assert parsed.model_dump(exclude_none=True) == {k: v for k, v in resource.items()} | {
        "audio": {"input": {"transcription": {"model": "whisper-1"}}, "output": {"language": "en"}}}
