"""`/v1/realtime` response and voice-activity bookkeeping without sockets: frames in, events out."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from parley.models.config import FRAME_SAMPLES
from parley.realtime.sessions.limits import ConversationBudget, EdgeLimits
from parley.realtime.realtime_api.events import Dialect, Events, SessionConfig
from parley.realtime.realtime_api.settings import ClientError, ResponseOptions
from parley.realtime.realtime_api.turns import END_QUIET_FRAMES, Turns

LOUD = (0.3 * np.sin(np.arange(FRAME_SAMPLES) * 0.1)).astype(np.float32)
QUIET = np.zeros(FRAME_SAMPLES, np.float32)


def turns(**config) -> Turns:
    return Turns(Events(Dialect.GA), SessionConfig(id="sess_1", model="m", **config),
                 ConversationBudget(EdgeLimits().max_conversation_bytes))


def types(events) -> list[str]:
    return [e["type"] for e in events]


def test_the_models_speech_makes_one_response_that_ends_after_quiet():
    t = turns()
    assert t.output_frame(QUIET, "") == []  # quiet between responses: nothing sent
    first = t.output_frame(LOUD, "hi")
    assert types(first) == ["response.created", "response.output_item.added", "conversation.item.added",
                            "response.content_part.added", "response.output_audio.delta",
                            "response.output_audio_transcript.delta"]
    tail = []
    for _ in range(END_QUIET_FRAMES):
        tail += t.output_frame(QUIET, "")
    done = tail[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "completed"
    assert done["response"]["usage"]["output_token_details"] == {"text_tokens": 1, "audio_tokens": 1 + END_QUIET_FRAMES}
    assert t.response is None


def test_text_only_max_tokens_and_out_of_band_responses():
    t = turns()
    events = t.start_response(ResponseOptions(audio=False, max_output_tokens=2, metadata={"k": "v"},
                                              in_conversation=False))
    assert "conversation.item.added" not in types(events)
    out = t.output_frame(LOUD, "a") + t.output_frame(LOUD, "b") + t.output_frame(LOUD, "c")
    assert "response.output_audio.delta" not in types(out)  # text only: audio muted
    assert [e["delta"] for e in out if e["type"] == "response.output_text.delta"] == ["a", "b"]
    done = out[-1]["response"]
    assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens"
    assert done["metadata"] == {"k": "v"} and done["conversation_id"] is None and done["max_output_tokens"] == 2
    assert "conversation.item.done" not in types(out) and not t.items
    # the rest of the cut-off utterance stays muted until the agent is quiet
    assert t.output_frame(LOUD, "d") == []


def test_create_response_false_sends_only_requested_responses():
    t = turns()
    t.set_config(dataclasses.replace(t.config, turn_detection=dataclasses.replace(t.config.turn_detection,
                                                                                    create_response=False)))
    assert t.output_frame(LOUD, "x") == []
    t.start_response(ResponseOptions())
    assert "response.output_audio.delta" in types(t.output_frame(LOUD, "x"))
    with pytest.raises(ClientError) as err:
        t.start_response(ResponseOptions())
    assert err.value.code == "conversation_already_has_active_response"


def test_user_speech_interrupts_the_response_and_commits_at_its_end():
    t = turns()
    t.output_frame(LOUD, "talking")
    _, events = t.heard(np.tile(LOUD, 3))
    assert types(events)[0] == "input_audio_buffer.speech_started"
    done = [e for e in events if e["type"] == "response.done"][0]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    _, events = t.heard(np.zeros(FRAME_SAMPLES * 7, np.float32))  # 560 ms > 500 ms of silence
    assert types(events) == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
                             "conversation.item.added", "conversation.item.done"]
    with pytest.raises(ClientError) as err:
        t.commit()
    assert err.value.code == "input_audio_buffer_commit_empty"


def test_cancel_delete_and_item_lookup():
    t = turns()
    with pytest.raises(ClientError):
        t.cancel()
    t.start_response(ResponseOptions())
    item_id = t.last_item_id
    assert t.cancel()[-1]["response"]["status"] == "cancelled"
    assert t.item(item_id)["status"] == "incomplete"
    assert types(t.delete(item_id)) == ["conversation.item.deleted"]
    assert t.last_item_id is None
    with pytest.raises(ClientError) as err:
        t.item(item_id)
    assert err.value.param == "item_id"


def test_an_item_over_the_conversation_budget_is_refused_and_deleting_makes_room():
    t = Turns(Events(Dialect.GA), SessionConfig(id="sess_1", model="m"), ConversationBudget(400))
    item = {"id": "item_a", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 200}]}
    t.add_item(item, None)
    with pytest.raises(ClientError) as refused:
        t.add_item({**item, "id": "item_b"}, None)
    assert refused.value.code == "conversation_too_large" and "item_b" not in t.items
    t.delete("item_a")
    assert t.budget.used == 0
    t.add_item({**item, "id": "item_b"}, None)
    assert list(t.items) == ["item_b"]
