"""GPT-Live's delegation policy (live/policy.py), its turn watcher and delegation ids
(live/delegation.py), and the settings judge (live/config.py), without sockets."""

from __future__ import annotations

import numpy as np
import pytest

from parley.realtime.cli import build_parser, reliability_settings
from parley.realtime.live.config import check_update, parse_start
from parley.realtime.live.delegation import Delegations, TurnWatcher
from parley.realtime.live.policy import DelegationPolicy, PolicyError, parse_policy
from parley.realtime.realtime_api.settings import ClientError, ModelCaps

SR = 24_000
MOSHI, PERSONAPLEX = ModelCaps(prompts=False, models=("m",)), ModelCaps(prompts=True, models=("m",))


def test_policies_parse_and_bad_ones_name_the_flag():
    assert parse_policy("every_turn") == DelegationPolicy("every_turn")
    assert parse_policy("never") == DelegationPolicy("never")
    assert parse_policy("pattern:weather|book") == DelegationPolicy("pattern", "weather|book")
    for bad in ("sometimes", "never:x", "pattern:", "pattern:(unclosed"):
        with pytest.raises(PolicyError, match="--live-delegation"):
            parse_policy(bad)


def test_the_serve_flag_reaches_the_config_and_refuses_a_bad_policy():
    args = build_parser().parse_args(["serve", "--live-delegation", "pattern:help"])
    assert reliability_settings(args)["live_delegation"] == DelegationPolicy("pattern", "help")
    assert reliability_settings(build_parser().parse_args(["serve"]))["live_delegation"] == DelegationPolicy()
    with pytest.raises(ValueError, match="every_turn, never or pattern"):
        reliability_settings(build_parser().parse_args(["serve", "--live-delegation", "always"]))


def speech(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)


def quiet(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * SR), np.float32)


def test_every_turn_delegates_once_per_turn_after_the_quiet():
    watcher = TurnWatcher(DelegationPolicy(), semantic=False)
    assert watcher.audio(speech(0.8)) == []
    assert watcher.audio(quiet(0.4)) == []  # 400 ms of quiet: the turn goes on
    assert len(watcher.audio(quiet(0.2))) == 1  # 500 ms: it ended
    assert watcher.audio(quiet(2.0)) == []  # quiet is no new turn
    odd = np.concatenate([speech(0.5), quiet(0.6), speech(0.5), quiet(0.6)])
    assert len(watcher.audio(odd[:1000])) + len(watcher.audio(odd[1000:])) == 2  # chunk edges do not matter


def test_never_and_pattern_decide_on_the_turns_transcript():
    assert TurnWatcher(DelegationPolicy("never"), semantic=False).audio(np.concatenate([speech(1), quiet(1)])) == []
    watcher = TurnWatcher(parse_policy("pattern:weather"), semantic=True)
    watcher.audio(speech(1.0))
    watcher.heard(" what is the WEATHER", float("nan"))
    watcher.heard(" today", 0.9)  # the end-of-turn head: the turn ends after 160 ms of quiet
    assert watcher.audio(quiet(0.24)) == ["what is the WEATHER today"]
    watcher.audio(speech(1.0))
    watcher.heard(" tell me a joke", 0.9)
    assert watcher.audio(quiet(0.24)) == []


def test_a_semantic_turn_waits_for_the_head_or_the_timeout():
    watcher = TurnWatcher(DelegationPolicy(), semantic=True)
    watcher.audio(speech(1.0))
    watcher.heard(" hm", 0.1)
    assert watcher.audio(quiet(3.9)) == []  # the head says not finished; eagerness medium waits 4 s
    assert len(watcher.audio(quiet(0.2))) == 1


def test_appends_name_a_delegation_of_this_session_or_none():
    book = Delegations()
    first = book.create()
    assert book.check(first) == first and book.check(None) is None
    for bad in ("dlg_other", 3):
        with pytest.raises(ClientError) as err:
            book.check(bad)
        assert err.value.param == "delegation_id"


def refused_params(raw, caps=MOSHI) -> list[str]:
    config, errors = parse_start(raw, caps)
    assert config is None
    return sorted(e.param for e in errors)


def test_start_refuses_each_field_the_model_cannot_honour_by_name():
    assert refused_params({"model": "m", "instructions": "be kind", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], "store": True,
        "delegation": {"type": "responses", "responses": {"model": "x"}}, "triggers": [{"x": 1}],
        "audio": {"format": {"type": "audio/pcm", "rate": 44100}}, "client": {}, "colour": "blue"}) == sorted([
            "session.instructions", "session.input", "session.store", "session.delegation.type",
            "session.triggers", "session.audio.format.rate", "session.client", "session.colour"])
    assert refused_params({"model": "m", "audio": {"output": {"voice": "NATF0"}}}) == ["session.audio.output.voice"]
    assert refused_params({"instructions": ""}) == ["session.model"]
    _, [unserved] = parse_start({"model": "gpt-live-1"}, MOSHI)  # any name was a label
    assert (unserved.code, unserved.param) == ("model_not_found", "session.model") and "served as 'm'" in str(unserved)
    assert refused_params({"model": "m", "delegation": {"type": "decisions", "decisions": {}}}) == \
        ["session.delegation.type"]
    # an unknown kind is refused by its name too, not by the field that came with it
    _, [unknown] = parse_start({"model": "m", "delegation": {"type": "planner", "planner": {"depth": 2}}}, MOSHI)
    assert unknown.param == "session.delegation.type" and "'planner'" in str(unknown)
    assert refused_params({"model": "m", "delegation": {"type": "client", "acknowledgement_delay_ms": 400}}) == \
        ["session.delegation.acknowledgement_delay_ms"]
    assert refused_params({"model": "m", "audio": {"format": {"type": "audio/pcmu", "rate": 16000}}}) == \
        ["session.audio.format.rate"]


def test_personaplex_takes_instructions_voice_and_prior_messages_into_its_persona():
    config, errors = parse_start({"model": "m", "instructions": "You are kind.", "audio": {
        "output": {"voice": {"id": "NATF0"}}, "format": {"type": "audio/pcm", "rate": 16000}}, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi there."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]}]}, PERSONAPLEX)
    assert errors == [] and config.voice_prompt == "NATF0" and config.format.rate == 16000
    assert config.persona("default") == "You are kind.\nUser: Hi there.\nAssistant: Hello!"
    assert config.persona("default", ("Be brief.",)) == "You are kind.\nUser: Hi there.\nAssistant: Hello!\nBe brief."
    blank, _ = parse_start({"model": "m", "audio": {"output": {"voice": "marin"}}}, PERSONAPLEX)
    assert blank.voice_prompt is None and blank.persona("the server's") == "the server's"
    assert blank.resource("the server's")["instructions"] == "the server's"  # resolved, as OpenAI shows it
    resource = config.resource()
    assert resource["audio"] == {"format": {"type": "audio/pcm", "rate": 16000}, "output": {"voice": {"id": "NATF0"}}}


def test_update_keeps_the_delegation_mode_and_takes_sparse_responses_settings():
    client_session, _ = parse_start({"model": "m"}, MOSHI)
    assert check_update({"delegation": {"type": "client"}, "triggers": []}, client_session) == ([], client_session)
    errors, config = check_update({"delegation": {"type": "responses", "responses": {}}, "instructions": "x",
                                   "bogus": 1}, client_session)
    assert [e.param for e in errors] == ["session.delegation.type", "session.instructions", "session.bogus"]
    assert config is client_session
    responses = {"type": "responses", "responses": {"model": "qwen", "tools": [{"type": "function", "name": "f"}]}}
    backed, _ = parse_start({"model": "m", "delegation": responses}, MOSHI, backend=True)
    assert [e.param for e in check_update({"delegation": {"type": "client"}}, backed, backend=True)[0]] == \
        ["session.delegation.type"]
    # pipecat's and LiveKit's tools update: only the tools, the model kept
    errors, updated = check_update({"delegation": {"type": "responses", "responses": {
        "tools": [{"type": "function", "name": "g"}], "tool_choice": "required"}}}, backed, backend=True)
    assert errors == [] and updated.responses.model == "qwen" and updated.responses.tool_choice == "required"
    assert [t["function"]["name"] for t in updated.responses.tools] == ["g"]
    assert updated.resource()["delegation"]["responses"]["tools"] == [{"type": "function", "name": "g"}]
    errors, same = check_update({"delegation": {"type": "responses", "responses": {"tools": [{"type": "mcp"}]}}},
                                backed, backend=True)
    assert [e.param for e in errors] == ["session.delegation.responses.tools[0].type"] and same is backed


def test_responses_delegation_takes_function_tools_for_a_backend_and_refuses_the_rest_by_name():
    responses = {"model": "qwen", "instructions": "Be brief.", "tool_choice": {"type": "function", "name": "f"},
                 "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}],
                 "max_output_tokens": 64, "parallel_tool_calls": False}
    config, errors = parse_start({"model": "m", "delegation": {"type": "responses", "responses": responses}},
                                 MOSHI, backend=True)
    assert errors == [] and config.resource()["delegation"] == {"type": "responses", "responses": responses}
    body = config.responses.request([{"role": "user", "content": "hi"}])
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "description": "d",
                                                               "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}} and body["max_tokens"] == 64
    assert body["parallel_tool_calls"] is False and body["stream"] is True and body["model"] == "qwen"

    def refused(responses):
        config, errors = parse_start({"model": "m", "delegation": {"type": "responses", "responses": responses}},
                                     MOSHI, backend=True)
        assert config is None
        return [e.param for e in errors]

    assert refused({"model": "q", "tools": [{"type": "web_search"}]}) == ["session.delegation.responses.tools[0].type"]
    assert refused({"model": "q", "reasoning": {"effort": "low"}}) == ["session.delegation.responses.reasoning"]
    assert refused({"model": "q", "tool_choice": {"type": "shell"}}) == ["session.delegation.responses.tool_choice"]
    assert refused({"model": "q", "colour": 1}) == ["session.delegation.responses.colour"]
    assert refused({"tools": []}) == ["session.delegation.responses.model"]
    assert refused(None) == ["session.delegation.responses"]
