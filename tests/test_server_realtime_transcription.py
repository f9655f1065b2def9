"""/v1/realtime input transcription and semantic_vad on the paired STT row, and transcription-only
sessions on a standalone row (tiny random models), validated strictly by the openai SDK's GA and
beta event models (and openai-agents / pipecat when installed)."""

from __future__ import annotations

import numpy as np
import pytest

from parley.models.synthetic import write_tiny_stt_checkpoint
from parley.realtime.server.serve import ServeConfig, build_app
from server_harness import OPENAI_ALIASES, assert_transcript_delays, delay_app, serve, tone
from test_server_realtime import Recorder, beta_validators, check_all, client, ga_validators, run, stream


@pytest.fixture(scope="module")
def stt_app_factory(tmp_path_factory):
    def make(tiny_moshi_dir):
        stt_dir = tmp_path_factory.mktemp("stt") / "stt"
        if not stt_dir.exists():
            write_tiny_stt_checkpoint(stt_dir, mimi_from=tiny_moshi_dir)
        return build_app(ServeConfig(model=str(tiny_moshi_dir), stt_model=str(stt_dir), max_sessions=1,
                                     stt_slots=1, served_model_names={**OPENAI_ALIASES, "stt": ("gpt-4o-transcribe", "whisper-1")}))
    return make


def speech_then_quiet() -> np.ndarray:
    # 2.4 s of quiet: past semantic_vad's 2 s timeout at high eagerness, so the turn ends whatever
    # the tiny random end-of-turn head says (it may end earlier on the head).
    return np.concatenate([tone(300, 1.2), np.zeros(int(2.4 * 24_000), np.float32)])


async def speak_until_transcribed(conn, rec) -> list[dict]:
    """Speak, wait for the item's transcript, hang up: every event the session sent."""
    await stream(conn, speech_then_quiet())
    await rec.wait_type("conversation.item.input_audio_transcription.completed", timeout=15)
    await conn.close()
    await rec.task
    return rec.events


def assert_turn_ended_in_time(events: list[dict]) -> None:
    # high eagerness: the turn ends on the end-of-turn head or at the latest after 2 s of quiet
    stopped = [e for e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    assert stopped and stopped[0]["audio_end_ms"] <= 1200 + 2000 + 160


def deltas_of(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]


def assert_transcript_of_item(events: list[dict]) -> None:
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    completed = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert committed and completed and completed[0]["item_id"] == committed[0]["item_id"]
    item = completed[0]["item_id"]
    deltas = [e["delta"] for e in events[:events.index(completed[0])]
              if e["type"] == "conversation.item.input_audio_transcription.delta" and e["item_id"] == item]
    assert deltas, "no transcription deltas before the item completed"
    assert completed[0]["transcript"] == "".join(deltas).strip()
    assert completed[0]["usage"]["type"] == "duration" and completed[0]["usage"]["seconds"] > 0


def test_ga_input_transcription_deltas_and_completed(tiny_moshi_dir, stt_app_factory):
    async def scenario(base):
        async with client(base).realtime.connect(model="gpt-realtime") as conn:
            rec = Recorder(conn)
            await rec.wait_type("session.created")
            # A name the STT model is not served as: model_not_found, with the event's id; nothing changes.
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "transcription": {"model": "gpt-4o-mini-transcribe"}}}}, event_id="evt_unserved")
            refused = await rec.wait_type("error")
            assert (refused["error"]["event_id"], refused["error"]["code"], refused["error"]["param"]) == (
                "evt_unserved", "model_not_found", "session.audio.input.transcription.model")
            assert "'gpt-4o-transcribe', 'whisper-1'" in refused["error"]["message"]
            assert (await rec.wait_type("session.updated"))["session"]["audio"]["input"]["transcription"] is None
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "transcription": {"model": "gpt-4o-transcribe"}, "turn_detection": {"type": "server_vad"}}}})
            updated = await rec.wait(lambda e: e["type"] == "session.updated"
                                     and e["session"]["audio"]["input"]["transcription"] is not None)
            assert updated["session"]["audio"]["input"]["transcription"] == {"model": "gpt-4o-transcribe"}
            return await speak_until_transcribed(conn, rec)

    with serve(stt_app_factory(tiny_moshi_dir)) as base:
        events = run(scenario(base))
        assert_transcript_delays(base, "paired", len(deltas_of(events)), model_delay=0.16)
    assert_transcript_of_item(events)
    check_all(events, ga_validators())


def test_beta_input_audio_transcription_and_semantic_vad(tiny_moshi_dir, stt_app_factory):
    async def scenario(base):
        async with client(base).beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
            rec = Recorder(conn)
            await rec.wait_type("session.created")
            await conn.session.update(session={"input_audio_transcription": {"model": "whisper-1"},
                                               "turn_detection": {"type": "semantic_vad", "eagerness": "high"}})
            updated = await rec.wait_type("session.updated")
            assert updated["session"]["turn_detection"]["type"] == "semantic_vad"
            return await speak_until_transcribed(conn, rec)

    with serve(stt_app_factory(tiny_moshi_dir)) as base:
        events = run(scenario(base))
    assert_turn_ended_in_time(events)
    assert_transcript_of_item(events)
    check_all(events, beta_validators())


def test_without_stt_model_the_settings_get_an_error_naming_them():
    app, _ = delay_app(1)

    async def scenario(base):
        async with client(base).realtime.connect(model="gpt-realtime") as conn:
            rec = Recorder(conn)
            await rec.wait_type("session.created")
            await conn.session.update(session={"type": "realtime", "instructions": "still here", "audio": {
                "input": {"transcription": {"model": "x"}, "turn_detection": {"type": "semantic_vad"}}}})
            updated = await rec.wait_type("session.updated")
            await conn.close()
            await rec.task
            return rec.of("error"), updated, rec.events

    with serve(app) as base:
        errors, updated, events = run(scenario(base))
    assert [e["error"]["param"] for e in errors] == ["session.audio.input.transcription",
                                                     "session.audio.input.turn_detection.type"]
    assert all("--stt-model" in e["error"]["message"] for e in errors)
    # those two were not applied, the rest of the update was
    assert updated["session"]["audio"]["input"]["transcription"] is None
    assert updated["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert updated["session"]["instructions"] == "still here"
    check_all(events, ga_validators())


# ---- transcription-only sessions (?intent=transcription, a standalone STT row) -------------------


def no_responses(events: list[dict]) -> None:
    assert not [e for e in events if e["type"].startswith("response.")], "a transcription session never speaks"


def test_ga_transcription_session(tiny_moshi_dir, stt_app_factory):
    async def scenario(base):
        # A realtime conversation cannot turn into a transcription session: it says how to open one.
        async with client(base).realtime.connect(model="gpt-realtime") as conn:
            rec = Recorder(conn)
            await rec.wait_type("session.created")
            await conn.session.update(session={"type": "transcription"})
            refused = await rec.wait_type("error")
            assert refused["error"]["param"] == "session.type" and "intent=transcription" in refused["error"]["message"]
            await conn.close()
            await rec.task
        async with client(base).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            rec = Recorder(conn)
            created = await rec.wait_type("session.created")
            assert created["session"]["type"] == "transcription"
            # Its one STT row (stt_slots=1) is taken: a second session is refused, not queued.
            async with client(base).realtime.connect(extra_query={"intent": "transcription"}) as other:
                busy = Recorder(other)
                assert (await busy.wait_type("error"))["error"]["code"] == "session_limit_reached"
                await busy.task
            await conn.session.update(session={"type": "transcription", "audio": {"input": {
                "transcription": {"model": "gpt-4o-transcribe"}, "turn_detection": {"type": "server_vad"}}}})
            updated = await rec.wait_type("session.updated")
            assert updated["session"]["audio"]["input"]["transcription"] == {"model": "gpt-4o-transcribe"}
            assert updated["session"]["audio"]["input"]["turn_detection"]["create_response"] is False
            await conn.response.create()
            assert (await rec.wait_type("error"))["error"]["param"] == "type"
            return await speak_until_transcribed(conn, rec)

    with serve(stt_app_factory(tiny_moshi_dir)) as base:
        events = run(scenario(base))
        assert_transcript_delays(base, "standalone", len(deltas_of(events)), model_delay=0.16)
    assert_transcript_of_item(events)
    no_responses(events)
    # pipecat's parser models conversation sessions only (its session.type is 'realtime')
    check_all(events, [v for v in ga_validators() if v[0] != "pipecat"])


def test_beta_transcription_session_with_semantic_vad(tiny_moshi_dir, stt_app_factory):
    from openai.types.beta.realtime.transcription_session import TranscriptionSession

    async def scenario(base):
        # the beta SDK needs a model: a transcription session's is one of the STT's names
        async with client(base).beta.realtime.connect(model="gpt-4o-transcribe",
                                                      extra_query={"intent": "transcription"}) as conn:
            rec = Recorder(conn)
            created = await rec.wait_type("transcription_session.created")
            await conn.transcription_session.update(session={
                "input_audio_transcription": {"model": "whisper-1"}, "include": [],
                "turn_detection": {"type": "semantic_vad", "eagerness": "high", "create_response": True}})
            refused = await rec.wait_type("error")
            assert refused["error"]["param"] == "session.turn_detection.create_response"
            updated = await rec.wait_type("transcription_session.updated")
            assert updated["session"]["turn_detection"]["type"] == "server_vad"  # the refused field changed nothing
            await conn.transcription_session.update(session={
                "turn_detection": {"type": "semantic_vad", "eagerness": "high"}})
            updated = await rec.wait(lambda e: e["type"] == "transcription_session.updated"
                                     and e["session"]["turn_detection"]["type"] == "semantic_vad")
            assert updated["session"]["turn_detection"]["type"] == "semantic_vad"
            assert updated["session"]["input_audio_transcription"] == {"model": "whisper-1"}
            return created, await speak_until_transcribed(conn, rec)

    with serve(stt_app_factory(tiny_moshi_dir)) as base:
        created, events = run(scenario(base))
    assert_turn_ended_in_time(events)
    # The beta SDK has no model for transcription_session.created: check its session object.
    TranscriptionSession.model_validate(created["session"])
    assert_transcript_of_item(events)
    no_responses(events)
    check_all([e for e in events if e["type"] != "transcription_session.created"], beta_validators())


def test_transcription_sessions_without_stt_model_name_the_parameter():
    app, _ = delay_app(1)

    async def scenario(base):
        async with client(base).realtime.connect(model="gpt-realtime", extra_query={"intent": "transcription"}) as conn:
            rec = Recorder(conn)
            created = await rec.wait_type("session.created")
            intent = await rec.wait_type("error")
            await conn.session.update(session={"type": "transcription"})
            await rec.wait(lambda e: len(rec.of("error")) >= 2)
            await conn.send({"type": "transcription_session.update", "session": {}})
            await rec.wait(lambda e: len(rec.of("error")) >= 3)
            await conn.session.update(session={"type": "realtime", "instructions": ""})
            await rec.wait_type("session.updated")  # the session went on
            await conn.close()
            await rec.task
            return created, intent, rec.of("error"), rec.events

    with serve(app) as base:
        created, intent, errors, events = run(scenario(base))
    assert created["session"]["type"] == "realtime"
    assert [e["error"]["param"] for e in errors] == ["intent", "session.type", "type"]
    assert all("--stt-model" in e["error"]["message"] for e in errors)
    check_all(events, ga_validators())
