"""GPT-Live's Responses delegation: Parley itself asks an OpenAI-compatible backend
(`parley serve --delegate-url`, e.g. a `vllm serve` of an instruction model) to do the work.

At each delegation moment (the same policy as client delegation: live/policy.py) the session's
transcripts go to the backend's /chat/completions (streamed) with the session's function tools:
the chat API is what vLLM, llama.cpp and most other servers implement with tool calls. What
comes back is forwarded to the client as Responses events wrapped in `response.event` (with the
delegation id), as OpenAI's GPT-Live does: `response.created`, `response.output_text.delta`,
`response.output_item.done` (the reply's message, and each function call with call_id, name,
arguments), then `response.completed` or `response.failed`. The reply's text is spoken as
commentary sentence by sentence as it streams. Parley runs no tool itself: every function call
is the client's, answered with `response.item.create` (function_call_output) and continued with
`response.create`.

Each backend call runs as a task off the event path, bounded by RUN_TIMEOUT_S; one run at a
time per session, in order. The chat API needs every function call answered before the
conversation goes on, so a user turn delegated while a call awaits its output (and a message item
sent then) joins the run the client's `response.create` starts. A failed or unreachable backend gets the session a short spoken fallback
(FALLBACK) and an `error` event; the voice session goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from . import events as ev
from .policy import DelegateBackend
from ..realtime_api.events import new_id
from ..realtime_api.settings import ClientError

log = logging.getLogger("parley.live")

RUN_TIMEOUT_S = 60.0  # one backend call, first byte to last
FALLBACK = "Sorry, I could not get that done."
SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")  # commentary is spoken a sentence at a time
MAX_MESSAGES = 200  # conversation messages kept for the backend (the oldest are dropped first)
TOOL_CHOICES = ("auto", "none", "required")
# ResponsesDelegationConfig fields Parley passes on; the others are refused by name.
SETTINGS = ("model", "instructions", "tools", "tool_choice", "max_output_tokens", "parallel_tool_calls")
REFUSED_SETTINGS = {
    "reasoning": "reasoning settings are OpenAI's (an OpenAI-compatible backend has its own); leave it out",
    "service_tier": "service tiers are OpenAI's; leave it out",
    "text": "text verbosity is OpenAI's; leave it out",
}


@dataclass(frozen=True)
class ResponsesSettings:
    """A session's `delegation.responses`, as the backend's chat request takes it."""

    model: str
    instructions: str | None = None
    tools: tuple[dict, ...] = ()  # chat-completions function tools
    tool_choice: Any = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool | None = None
    sent: dict = field(default_factory=dict)  # as the client sent it (the session resource shows it)

    def request(self, messages: list[dict]) -> dict:
        body: dict = {"model": self.model, "messages": messages, "stream": True}
        if self.tools:
            body["tools"] = list(self.tools)
        optional = {"tool_choice": self.tool_choice, "max_tokens": self.max_output_tokens,
                    "parallel_tool_calls": self.parallel_tool_calls}
        body.update({k: v for k, v in optional.items() if v is not None})
        return body


def _wrong(param: str, expected: str, value: Any) -> ClientError:
    return ClientError(f"{param} must be {expected}, got {value!r:.60}", "invalid_value", param)


def _tool(param: str, tool: Any) -> dict:
    if not isinstance(tool, dict):
        raise _wrong(param, "a tool object", tool)
    if tool.get("type") != "function":
        raise ClientError(f"{param}: {tool.get('type')!r:.40} tools are OpenAI's hosted tools; Parley's backend "
                          "takes function tools (type function), which the client answers", "unsupported_parameter",
                          f"{param}.type")
    for key in tool:
        if key not in ("type", "name", "description", "parameters", "strict"):
            raise ClientError(f"unknown field {param}.{key!s:.40}", "unknown_parameter", f"{param}.{key!s:.40}")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise _wrong(f"{param}.name", "a function name", tool.get("name"))
    if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
        raise _wrong(f"{param}.parameters", "a JSON Schema object", tool["parameters"])
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(param: str, value: Any) -> Any:
    if value is None or value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str) \
            and set(value) == {"type", "name"}:
        return {"type": "function", "function": {"name": value["name"]}}
    raise ClientError(f"{param}: Parley's backend takes auto, none, required or {{type: function, name}}, "
                      f"not {value!r:.60}", "unsupported_parameter", param)


def parse_settings(param: str, value: Any) -> ResponsesSettings:
    """`delegation.responses` -> settings; ClientError naming the field otherwise."""
    if not isinstance(value, dict):
        raise ClientError(f"{param} is required for responses delegation: an object with at least 'model'",
                          "missing_required_parameter", param)
    for key in value:
        if key in REFUSED_SETTINGS and value[key] is not None:
            raise ClientError(f"{param}.{key}: {REFUSED_SETTINGS[key]}", "unsupported_parameter", f"{param}.{key}")
        if key not in SETTINGS and key not in REFUSED_SETTINGS:
            raise ClientError(f"unknown field {param}.{key!s:.40}", "unknown_parameter", f"{param}.{key!s:.40}")
    if not isinstance(value.get("model"), str) or not value["model"]:
        raise _wrong(f"{param}.model", "the backend's model name", value.get("model"))
    if value.get("instructions") is not None and not isinstance(value["instructions"], str):
        raise _wrong(f"{param}.instructions", "a string", value["instructions"])
    tools = value.get("tools") or []
    if not isinstance(tools, list):
        raise _wrong(f"{param}.tools", "a list of tools", tools)
    limit = value.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise _wrong(f"{param}.max_output_tokens", "a positive integer", limit)
    parallel = value.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _wrong(f"{param}.parallel_tool_calls", "a boolean", parallel)
    return ResponsesSettings(model=value["model"], instructions=value.get("instructions"),
                             tools=tuple(_tool(f"{param}.tools[{i}]", t) for i, t in enumerate(tools)),
                             tool_choice=_tool_choice(f"{param}.tool_choice", value.get("tool_choice")),
                             max_output_tokens=limit, parallel_tool_calls=parallel, sent=dict(value))


def _text_of(item: dict, param: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _wrong(f"{param}.content", "text or a list of text parts", content)


class ResponsesDelegate:
    """One session's Responses delegations: the conversation the backend sees, its runs, the open calls.

    `send` writes one event to the client; `speak` forces text as commentary (raises on failure)."""

    def __init__(self, settings: ResponsesSettings, backend: DelegateBackend,
                 send: Callable[[dict], Awaitable[Any]], speak: Callable[[str], Awaitable[Any]]) -> None:
        from openai import AsyncOpenAI  # only sessions that delegate to a backend need the client

        self.settings = settings
        self.client = AsyncOpenAI(base_url=backend.url, api_key=backend.api_key or "none", max_retries=0,
                                  timeout=RUN_TIMEOUT_S)
        self._send, self._speak = send, speak
        self.messages: list[dict] = []  # the conversation the backend has seen, in order
        self.pending: list[dict] = []  # turns and message items that join the next run
        self.open_calls: dict[str, dict] = {}  # call_id -> its function call item, until answered
        self.delegation_id: str | None = None  # the delegation the latest run belongs to
        self.task: asyncio.Task | None = None  # the latest run (each waits for the one before)
        self._tasks: set[asyncio.Task] = set()

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def _keep(self, message: dict) -> None:
        self.messages.append(message)
        del self.messages[:-MAX_MESSAGES]
        while self.messages and self.messages[0]["role"] == "tool":  # an output whose call was dropped
            del self.messages[0]

    def delegate(self, delegation_id: str, response_id: str, heard: str, said: str) -> None:
        """A delegation moment: what the model said and the user's turn join the conversation, and a
        run starts (after the one in flight, if any)."""
        if said.strip():
            self.pending.append({"role": "assistant", "content": said.strip()})
        self.pending.append({"role": "user", "content": heard or "(the user spoke; no transcript)"})
        self._start(delegation_id, response_id)

    def item(self, item: Any) -> None:
        """`response.item.create`: a function_call_output for an open call, or a message."""
        if not isinstance(item, dict):
            raise ClientError("response.item.create needs 'item': an input item", "missing_required_parameter", "item")
        kind = item.get("type", "message")
        if kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in self.open_calls:
                raise ClientError(f"item.call_id {call_id!r:.60} is not an open function call of this session",
                                  "invalid_value", "item.call_id")
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output) if output is not None else ""
            self.open_calls.pop(call_id)
            self._keep({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "message" and item.get("role") in ("user", "assistant", "developer", "system"):
            role = "system" if item["role"] == "developer" else item["role"]
            self.pending.append({"role": role, "content": _text_of(item, "item")})
        else:
            raise ClientError(f"item.type {kind!r:.40}: Parley's backend takes function_call_output and message "
                              "items", "unsupported_parameter", "item.type")

    def create(self) -> None:
        """`response.create`: continue once every function call is answered."""
        if self.running:
            raise ClientError("a delegated response is in progress; send response.create after its "
                              "response.completed", "response_in_progress", "type")
        if self.open_calls:
            raise ClientError(f"answer the open function calls first ({', '.join(self.open_calls)}) with "
                              "response.item.create", "function_call_outputs_required", "type")
        self._start(self.delegation_id, new_id("resp"))

    async def aclose(self) -> None:
        """The session ended: its runs are cancelled, the backend's connections closed."""
        for task in list(self._tasks):
            task.cancel()
        await self.client.close()

    def _start(self, delegation_id: str | None, response_id: str) -> None:
        previous = self.task
        self.task = asyncio.create_task(self._run(previous, delegation_id, response_id))
        self._tasks.add(self.task)
        self.task.add_done_callback(self._tasks.discard)

    # ---- one run ----

    async def _event(self, delegation_id: str | None, inner: dict) -> None:
        await self._send({"type": "response.event", "event_id": new_id("event"), "delegation_id": delegation_id,
                          "event": inner})

    def _response(self, response_id: str, status: str, **extra: Any) -> dict:
        """A lifecycle snapshot: like OpenAI's, without input, instructions, tools or output."""
        return {"id": response_id, "object": "response", "status": status, "model": self.settings.model,
                "output": [], **extra}

    async def _run(self, previous: asyncio.Task | None, delegation_id: str | None, response_id: str) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait([previous])
        if self.open_calls:  # the pending turns wait for the calls' outputs; response.create runs them
            return
        for message in self.pending:
            self._keep(message)
        self.pending.clear()
        self.delegation_id = delegation_id
        await self._event(delegation_id, {"type": "response.created",
                                          "response": self._response(response_id, "in_progress")})
        try:
            async with asyncio.timeout(RUN_TIMEOUT_S):
                text, calls = await self._stream(delegation_id, response_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # unreachable, an HTTP error, a bad stream, the timeout
            reason = str(exc) or type(exc).__name__
            log.warning("delegation %s: the backend failed: %s", delegation_id, reason)
            await self._event(delegation_id, {"type": "response.failed", "response": self._response(
                response_id, "failed", error={"code": "server_error", "message": reason})})
            await self._send(ev.error(f"the delegation backend failed: {reason}", "delegation_failed",
                                      kind="server_error"))
            await self._say(FALLBACK)
            return
        message: dict = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        self._keep(message)
        for index, call in enumerate(calls, start=1 if text else 0):
            self.open_calls[call["call_id"]] = call
            await self._event(delegation_id, {"type": "response.output_item.done", "output_index": index,
                                              "item": call})
        await self._event(delegation_id, {"type": "response.completed",
                                          "response": self._response(response_id, "completed")})

    async def _stream(self, delegation_id: str | None, response_id: str) -> tuple[str, list[dict]]:
        """One streamed chat call: its text (spoken a sentence at a time) and its function calls."""
        messages = ([{"role": "system", "content": self.settings.instructions}] if self.settings.instructions
                    else []) + self.messages
        stream = await self.client.chat.completions.create(**self.settings.request(messages))
        text, unsaid, calls = "", "", {}
        message_id = new_id("msg")
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if delta.content:
                text += delta.content
                unsaid += delta.content
                await self._event(delegation_id, {"type": "response.output_text.delta", "item_id": message_id,
                                                  "output_index": 0, "content_index": 0, "delta": delta.content})
                *sentences, unsaid = SENTENCE_END.split(unsaid)
                for sentence in sentences:
                    await self._say(sentence)
            for call in delta.tool_calls or ():
                slot = calls.setdefault(call.index, {"type": "function_call", "id": new_id("fc"),
                                                     "call_id": "", "name": "", "arguments": "",
                                                     "status": "completed"})
                slot["call_id"] = call.id or slot["call_id"]
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
        await self._say(unsaid)
        if text:
            await self._event(delegation_id, {"type": "response.output_item.done", "output_index": 0, "item": {
                "type": "message", "id": message_id, "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}})
        for slot in calls.values():
            slot["call_id"] = slot["call_id"] or new_id("call")
        return text, [calls[i] for i in sorted(calls)]

    async def _say(self, text: str) -> None:
        """Commentary: a sentence that cannot be placed is logged, not fatal to the run."""
        if not text.strip():
            return
        try:
            await self._speak(text.strip())
        except Exception as exc:  # the model cannot force it (too long, no tokens): the client has the text
            log.warning("delegation %s: commentary not placed: %s", self.delegation_id, exc)
