"""GPT-Live Responses delegation (`parley serve --delegate-url`), driven by the unmodified openai SDK
against tiny models, with a small OpenAI-compatible backend in-process (a starlette app streaming
scripted /v1/chat/completions replies, as `vllm serve` does): a function call forwarded to the
client, answered and continued, the reply spoken as commentary; and a backend that is down."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from parley.realtime.cli import build_parser, reliability_settings
from parley.realtime.live.policy import DelegateBackend
from parley.realtime.live.responses import FALLBACK
from server_harness import free_port, serve
from test_live_server import (SR, checkpoints, close_live, live_app, output_deltas, pcm_frames, speak,  # noqa: F401 (fixture)
                              speech_then_quiet, start, validate)
from test_server_realtime import Recorder, client, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
SPOKEN = "It is sunny in Paris."


def chunk(delta: dict, finish: str | None = None) -> str:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "qwen",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


def backend_app(requests: list[dict], words: str | None = None) -> Starlette:
    """A chat-completions server: the first call asks for get_weather, the next ones answer in words
    (with `words`: every call answers with them)."""

    async def completions(request):
        body = await request.json()
        requests.append(body)
        if words is not None:
            parts = [chunk({"role": "assistant", "content": words}), chunk({}, "stop")]
        elif len(requests) == 1:
            parts = [chunk({"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                                  "function": {"name": "get_weather", "arguments": ""}}]}),
                     chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                     chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
                     chunk({}, "tool_calls")]
        else:
            parts = [chunk({"role": "assistant", "content": "It is sunny "}), chunk({"content": "in Paris. "}),
                     chunk({"content": "Enjoy"}), chunk({}, "stop")]

        async def stream():
            for part in parts:
                yield part
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


def inner(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == "response.event" and e["event"]["type"] == kind]


async def until_spoken(conn, rec, text: str) -> None:
    """Silence in until `text` is in the output transcript (the model pauses, then says it)."""
    for _ in range(10):
        if text in "".join(d["delta"] for d in output_deltas(rec.events)):
            return
        await speak(conn, pcm_frames(np.zeros(SR, np.float32)))


SESSION = {"model": "gpt-live-1", "delegation": {"type": "responses", "responses": {
    "model": "qwen", "instructions": "Answer briefly.", "tools": TOOLS}}}


def test_sdk_responses_delegation_forwards_a_function_call_and_speaks_the_backends_reply(checkpoints):
    requests: list[dict] = []

    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            started = await start(conn, rec, SESSION)
            assert started["type"] == "session.started", started
            speaker = asyncio.create_task(speak(conn, pcm_frames(speech_then_quiet(1.2, 4.8))))
            created = await rec.wait_type("session.delegation.created", timeout=20)
            done = await rec.wait(lambda e: e["type"] == "response.event"
                                  and e["event"]["type"] == "response.output_item.done", timeout=20)
            call = done["event"]["item"]
            await conn.response.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": '{"sky": "sunny"}'}, event_id="out-1")
            await conn.response.create(event_id="go-1")
            await rec.wait(lambda e: len(inner(rec.events, "response.completed")) == 2, timeout=20)
            await speaker
            await until_spoken(conn, rec, SPOKEN)
            await close_live(conn, rec)
            return rec.events, started, created

    with serve(backend_app(requests)) as backend:
        app = live_app(checkpoints, live_delegate=DelegateBackend(f"http://{backend}/v1", "sk-backend"))
        with serve(app) as base:
            events, started, created = run(scenario(base))
    validate(events)
    assert started["session"]["delegation"] == SESSION["delegation"]
    delegation = created["delegation"]
    assert delegation["target"] == "responses" and delegation["response_id"]
    wrapped = [e for e in events if e["type"] == "response.event"]
    assert {e["delegation_id"] for e in wrapped} == {delegation["id"]}
    assert [e["event"]["type"] for e in wrapped][:3] == ["response.created", "response.output_item.done",
                                                         "response.completed"]
    call = wrapped[1]["event"]["item"]
    assert (call["type"], call["call_id"], call["name"], json.loads(call["arguments"])) == \
        ("function_call", "call_1", "get_weather", {"city": "Paris"})
    assert not [e for e in events if e["type"] == "error"]
    # The backend got the instructions, the session's tools and the user's turn; then the answered call.
    first, second = requests
    assert first["model"] == "qwen" and first["stream"] is True
    assert first["messages"][0] == {"role": "system", "content": "Answer briefly."}
    assert first["messages"][-1]["role"] == "user"
    assert first["tools"] == [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    assert second["messages"][-2]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                   "arguments": '{"city": "Paris"}'}
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}
    # The reply streamed to the client as text deltas, and was spoken into the model's text stream.
    assert "".join(e["event"]["delta"] for e in inner(events, "response.output_text.delta")) == \
        "It is sunny in Paris. Enjoy"
    assert SPOKEN in "".join(d["delta"] for d in output_deltas(events))


def test_a_backend_that_is_down_gets_a_spoken_fallback_and_an_error_and_the_session_goes_on(checkpoints):
    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            await start(conn, rec, SESSION)
            speaker = asyncio.create_task(speak(conn, pcm_frames(speech_then_quiet(1.2, 4.8))))
            error = await rec.wait_type("error", timeout=30)
            await speaker
            await until_spoken(conn, rec, FALLBACK)
            # The session goes on: a function call output now names no open call, and is refused by name.
            await conn.response.item.create(item={"type": "function_call_output", "call_id": "call_x",
                                                  "output": "x"}, event_id="late-1")
            refused = await rec.wait(lambda e: e.get("client_event_id") == "late-1", timeout=10)
            audio_before = len(rec.of("session.output_audio.delta"))
            await speak(conn, pcm_frames(np.zeros(SR, np.float32)))
            await rec.wait(lambda e: len(rec.of("session.output_audio.delta")) > audio_before + 5, timeout=10)
            await close_live(conn, rec)
            return rec.events, error, refused

    down = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with serve(live_app(checkpoints, live_delegate=DelegateBackend(down))) as base:
        events, error, refused = run(scenario(base))
    validate(events)
    assert error["error"]["code"] == "delegation_failed" and error["error"]["type"] == "server_error"
    assert [e["event"]["response"]["status"] for e in inner(events, "response.failed")] == ["failed"]
    assert FALLBACK in "".join(d["delta"] for d in output_deltas(events))
    assert refused["type"] == "error" and refused["error"]["param"] == "item.call_id"


def test_without_a_backend_responses_delegation_is_refused_at_start(checkpoints):
    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            refused = await start(conn, rec, SESSION)
            await conn.response.create(event_id="go-1")
            create = await rec.wait(lambda e: e.get("client_event_id") == "go-1", timeout=10)
            return refused, create

    with serve(live_app(checkpoints)) as base:
        refused, create = run(scenario(base))
    assert refused["type"] == "error" and refused["error"]["param"] == "session.delegation.type"
    assert "--delegate-url" in refused["error"]["message"]
    assert create["error"]["code"] == "session_not_started"


def test_delegate_flags():
    def settings(*flags):
        return reliability_settings(build_parser().parse_args(["serve", *flags]))

    assert settings()["live_delegate"] is None
    assert settings("--delegate-url", "http://127.0.0.1:8000/v1")["live_delegate"] == \
        DelegateBackend("http://127.0.0.1:8000/v1")
    for flags, needle in ((["--delegate-url", "127.0.0.1:8000"], "http"),
                          (["--delegate-api-key-file", "k"], "give both")):
        with pytest.raises(ValueError, match=needle):
            settings(*flags)


def test_a_turn_delegated_while_a_call_is_open_joins_the_run_after_its_output():
    """The chat API needs a call's output right after the call: a user turn (or message item) that
    comes while the call is open waits for response.create, and goes to the backend after the output."""
    from parley.realtime.live.responses import ResponsesDelegate, parse_settings

    requests: list[dict] = []

    async def scenario(url):
        events, spoken = [], []

        async def send(event):
            events.append(event)

        async def say(text):
            spoken.append(text)

        delegate = ResponsesDelegate(parse_settings("responses", {"model": "qwen", "tools": TOOLS}),
                                     DelegateBackend(url), send, say)
        delegate.delegate("dlg_1", "resp_1", "what is the weather", "")
        await delegate.task
        assert list(delegate.open_calls) == ["call_1"]
        delegate.delegate("dlg_2", "resp_2", "and tomorrow", "hm")
        delegate.item({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "typed"}]})
        await delegate.task
        assert len(requests) == 1  # nothing ran while the call was open
        with pytest.raises(Exception, match="answer the open function calls first"):
            delegate.create()
        delegate.item({"type": "function_call_output", "call_id": "call_1", "output": "sunny"})
        delegate.create()
        await delegate.task
        return events, spoken

    with serve(backend_app(requests)) as backend:
        events, spoken = run(scenario(f"http://{backend}/v1"))
    assert [(m["role"], m.get("content")) for m in requests[1]["messages"]] == [
        ("user", "what is the weather"), ("assistant", None), ("tool", "sunny"), ("assistant", "hm"),
        ("user", "and tomorrow"), ("user", "typed")]
    assert spoken == ["It is sunny in Paris.", "Enjoy"]
    assert [e["event"]["type"] for e in events if e["type"] == "response.event"].count("response.completed") == 2


def test_a_backend_that_never_answers_is_bounded_by_the_run_timeout(monkeypatch):
    """The run is bounded (RUN_TIMEOUT_S, shortened here): a backend that accepts and never answers
    gets the session response.failed, a delegation_failed error and the spoken fallback."""
    from parley.realtime.live import responses as live_responses

    monkeypatch.setattr(live_responses, "RUN_TIMEOUT_S", 0.5)

    async def hang(request):  # until the client gives up
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)

    async def scenario(url):
        events, spoken = [], []

        async def send(event):
            events.append(event)

        async def say(text):
            spoken.append(text)

        delegate = live_responses.ResponsesDelegate(live_responses.parse_settings("responses", {"model": "q"}),
                                                    DelegateBackend(url), send, say)
        delegate.delegate("dlg_1", "resp_1", "hello", "")
        await asyncio.wait_for(delegate.task, 30)  # a failure here: the run was not bounded
        await delegate.aclose()
        return events, spoken

    with serve(Starlette(routes=[Route("/v1/chat/completions", hang, methods=["POST"])])) as backend:
        events, spoken = run(scenario(f"http://{backend}/v1"))
    assert [e["event"]["type"] for e in events if e["type"] == "response.event"] == ["response.created",
                                                                                     "response.failed"]
    assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["delegation_failed"]
    assert spoken == [FALLBACK]


def test_the_conversation_kept_drops_its_oldest_messages_never_leaving_an_output_without_its_call(monkeypatch):
    from parley.realtime.live import responses as live_responses

    monkeypatch.setattr(live_responses, "MAX_MESSAGES", 3)

    async def nothing(_):
        return None

    async def scenario():
        delegate = live_responses.ResponsesDelegate(live_responses.parse_settings("responses", {"model": "q"}),
                                                    DelegateBackend("http://127.0.0.1:9/v1"), nothing, nothing)
        for message in ({"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": []},
                        {"role": "tool", "tool_call_id": "c1", "content": "x"},
                        {"role": "tool", "tool_call_id": "c2", "content": "y"}, {"role": "user", "content": "b"}):
            delegate._keep(message)
        await delegate.aclose()
        return delegate.messages

    assert run(scenario()) == [{"role": "user", "content": "b"}]
