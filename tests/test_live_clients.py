"""GPT-Live clients other than the openai SDK, unmodified, against a Parley test server (tiny
models) with Responses delegation to an in-process OpenAI-compatible backend
(test_live_responses.backend_app): LiveKit Agents' GPTLiveModel (livekit-plugins-openai 1.8.9,
driven without a room, as tests/test_demo_model.py drives the PersonaPlex plugin) and pipecat's
OpenAILiveLLMService. Each connects by base URL, sends audio and gets audio back, gets the
transcripts, and answers the backend's function call through its own tool machinery; each also
answers a client delegation with commentary (pipecat from its BackendLLMWorker)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from parley.realtime.live.policy import DelegateBackend
from server_harness import serve
from test_live_responses import SPOKEN, backend_app
from test_live_server import SR, checkpoints, live_app, speech_then_quiet  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_livekit_gpt_live_model_unmodified_with_responses_delegation_and_a_tool(checkpoints):
    pytest.importorskip("livekit.plugins.openai", reason="tests/run.sh installs livekit-plugins-openai")
    import aiohttp
    from livekit import rtc
    from livekit.agents import llm
    from livekit.plugins.openai.realtime.gpt_live_model import GPTLiveModel

    @llm.function_tool
    async def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    requests: list[dict] = []

    async def scenario(base):
        errors, calls, said, heard, received = [], [], [], [], []
        async with aiohttp.ClientSession() as http:
            model = GPTLiveModel(api_key="sk-test", base_url=f"http://{base}/v1", http_session=http,
                                 responses_options={"model": "qwen"})
            session = model.session()
            session.on("error", errors.append)
            session.on("function_call", calls.append)
            session.on("transcript_delta", lambda ev: said.append(ev.text))
            session.on("input_audio_transcription_completed", lambda ev: heard.append(ev.transcript))

            async def drain():
                async for frame in session.audio_stream:
                    received.append(np.frombuffer(frame.frame.data, np.int16))
            reader = asyncio.create_task(drain())
            await session._update_session(tools=[get_weather])  # what AgentSession does first

            async def push(pcm: np.ndarray) -> None:
                pcm16 = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
                for start in range(0, pcm16.size, 480):  # 20 ms frames, paced in real time
                    session.push_audio(rtc.AudioFrame(pcm16[start:start + 480].tobytes(), SR, 1, 480))
                    await asyncio.sleep(0.02)

            await push(speech_then_quiet(1.2, 4.8))
            for _ in range(20):  # the backend's call arrives; the framework would run the tool
                if calls:
                    break
                await push(np.zeros(SR // 2, np.float32))
            assert calls, [str(e.error) for e in errors]
            call = calls[0]
            await session._append_items([llm.FunctionCallOutput(call_id=call.call_id, name=call.name,
                                                                output='{"sky": "sunny"}', is_error=False)])
            for _ in range(20):  # the continued run's reply is spoken into the model's text stream
                if SPOKEN in "".join(said):
                    break
                await push(np.zeros(SR // 2, np.float32))
            await session.aclose()
            reader.cancel()
        return errors, calls, "".join(said), heard, received

    with serve(backend_app(requests)) as backend:
        app = live_app(checkpoints, live_delegate=DelegateBackend(f"http://{backend}/v1"))
        with serve(app) as base:
            errors, calls, said, heard, received = asyncio.run(scenario(base))
    assert not errors, [str(e.error) for e in errors]
    assert (calls[0].name, calls[0].arguments) == ("get_weather", '{"city": "Paris"}')
    # its session.start carried the agent's tool to the backend; the output went back, then the reply
    assert requests[0]["tools"][0]["function"]["name"] == "get_weather" and requests[0]["model"] == "qwen"
    assert requests[1]["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}
    assert SPOKEN in said and heard  # the model's text stream, and the paired STT's words
    audio = np.concatenate(received) if received else np.zeros(0, np.int16)
    assert audio.size >= 4 * SR  # every 80 ms frame of the session comes back


def test_pipecat_openai_live_service_unmodified_with_responses_delegation_and_a_tool(checkpoints):
    pytest.importorskip("pipecat.services.openai.live.llm", reason="tests/run.sh installs pipecat-ai --no-deps")
    from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
    from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
    from pipecat.frames.frames import (EndFrame, InputAudioRawFrame, LLMContextFrame, OutputAudioRawFrame,
                                       TranscriptionFrame, TTSTextFrame)
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.live.llm import OpenAILiveLLMService
    from pipecat.services.openai.responses.llm import OpenAIResponsesLLMService
    from pipecat.workers.runner import WorkerRunner

    class Sink(FrameProcessor):
        def __init__(self) -> None:
            super().__init__()
            self.audio, self.said, self.heard = [], [], []

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, OutputAudioRawFrame):
                self.audio.append(np.frombuffer(frame.audio, np.int16))
            elif isinstance(frame, TTSTextFrame):
                self.said.append(frame.text)
            elif isinstance(frame, TranscriptionFrame):
                self.heard.append(frame.text)
            await self.push_frame(frame, direction)

    requests: list[dict] = []
    calls: list = []

    async def scenario(base):
        service = OpenAILiveLLMService(api_key="sk-test", base_url=f"ws://{base}/v1/live/sessions",
                                       delegation=OpenAILiveLLMService.ResponsesDelegation(
                                           settings=OpenAIResponsesLLMService.Settings(model="qwen")))

        async def get_weather(params) -> None:
            calls.append(params.arguments)
            await params.result_callback({"sky": "sunny"})
        service.register_function("get_weather", get_weather)
        sink = Sink()
        task = PipelineWorker(Pipeline([service, sink]), enable_rtvi=False)
        tools = ToolsSchema(standard_tools=[FunctionSchema(
            name="get_weather", description="The weather in a city.",
            properties={"city": {"type": "string"}}, required=["city"])])
        await task.queue_frame(LLMContextFrame(LLMContext(messages=[], tools=tools)))

        async def feed() -> None:
            pcm = speech_then_quiet(1.2, 4.8)
            pcm = np.concatenate([pcm, np.zeros(10 * SR, np.float32)])
            pcm16 = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
            for start in range(0, pcm16.size, 480):  # 20 ms frames, paced in real time
                await task.queue_frame(InputAudioRawFrame(pcm16[start:start + 480].tobytes(), SR, 1))
                await asyncio.sleep(0.02)
                # Done once the tool ran and its answer was spoken, and not before the 6 s of speech
                # and quiet went out: how soon the answer came must not decide how much audio returns.
                if start >= 6 * SR and calls and SPOKEN in "".join(sink.said):
                    break
            await task.queue_frame(EndFrame())

        feeder = asyncio.create_task(feed())
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(task)
        await runner.run()
        await feeder
        return sink

    with serve(backend_app(requests)) as backend:
        app = live_app(checkpoints, live_delegate=DelegateBackend(f"http://{backend}/v1"))
        with serve(app) as base:
            sink = asyncio.run(scenario(base))
    assert calls == [{"city": "Paris"}]
    assert requests[0]["tools"][0]["function"]["name"] == "get_weather" and requests[0]["model"] == "qwen"
    assert requests[1]["messages"][-1]["role"] == "tool" and "sunny" in requests[1]["messages"][-1]["content"]
    assert SPOKEN in "".join(sink.said)
    audio = np.concatenate(sink.audio) if sink.audio else np.zeros(0, np.int16)
    assert audio.size >= 4 * SR


def test_livekit_gpt_live_model_answers_a_client_delegation_with_commentary(checkpoints):
    """LiveKit's client delegation: its delegation_created event, answered with append_commentary,
    which the model says into its text stream."""
    pytest.importorskip("livekit.plugins.openai", reason="tests/run.sh installs livekit-plugins-openai")
    import aiohttp
    from livekit import rtc
    from livekit.plugins.openai.realtime.gpt_live_model import GPTLiveModel

    async def scenario(base):
        errors, said, delegations = [], [], []
        async with aiohttp.ClientSession() as http:
            session = GPTLiveModel(api_key="sk-test", base_url=f"http://{base}/v1", http_session=http,
                                   delegation="client").session()
            session.on("error", errors.append)
            session.on("transcript_delta", lambda ev: said.append(ev.text))

            def answer(delegation) -> None:
                delegations.append(delegation.id)
                session.append_commentary("hello world", delegation_id=delegation.id)
            session.on("delegation_created", answer)
            await session._update_session(tools=[])

            async def push(pcm: np.ndarray) -> None:
                pcm16 = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
                for start in range(0, pcm16.size, 480):
                    session.push_audio(rtc.AudioFrame(pcm16[start:start + 480].tobytes(), SR, 1, 480))
                    await asyncio.sleep(0.02)

            await push(speech_then_quiet(1.2, 4.8))
            for _ in range(20):
                if "hello world" in "".join(said):
                    break
                await push(np.zeros(SR // 2, np.float32))
            await session.aclose()
        return errors, "".join(said), delegations

    with serve(live_app(checkpoints)) as base:
        errors, said, delegations = asyncio.run(scenario(base))
    assert not errors, [str(e.error) for e in errors]
    assert delegations and "hello world" in said


def test_pipecat_openai_live_service_answers_a_client_delegation_from_its_backend_worker(checkpoints):
    """pipecat's client delegation: its BackendLLMWorker (an OpenAILLMService on the in-process
    chat backend) gets the delegated request and its marked reply goes back as commentary, which
    the model says into its text stream."""
    pytest.importorskip("pipecat.services.openai.live.llm", reason="tests/run.sh installs pipecat-ai --no-deps")
    from pipecat.frames.frames import EndFrame, InputAudioRawFrame, LLMContextFrame, TTSTextFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.live.llm import OpenAILiveLLMService
    from pipecat.services.openai.llm import OpenAILLMService
    from pipecat.workers.llm.backend_llm_worker import BackendLLMWorker
    from pipecat.workers.runner import WorkerRunner

    said: list[str] = []

    class Sink(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSTextFrame):
                said.append(frame.text)
            await self.push_frame(frame, direction)

    requests: list[dict] = []

    async def scenario(base, backend):
        worker = BackendLLMWorker(llm=OpenAILLMService(api_key="sk-backend", base_url=f"http://{backend}/v1",
                                                       settings=OpenAILLMService.Settings(model="qwen")))
        service = OpenAILiveLLMService(api_key="sk-test", base_url=f"ws://{base}/v1/live/sessions",
                                       delegation=OpenAILiveLLMService.ClientDelegation(backend=worker))
        task = PipelineWorker(Pipeline([service, Sink()]), enable_rtvi=False)
        await task.queue_frame(LLMContextFrame(LLMContext(messages=[])))

        async def feed() -> None:
            pcm = np.concatenate([speech_then_quiet(1.2, 4.8), np.zeros(10 * SR, np.float32)])
            pcm16 = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
            for start in range(0, pcm16.size, 480):
                await task.queue_frame(InputAudioRawFrame(pcm16[start:start + 480].tobytes(), SR, 1))
                await asyncio.sleep(0.02)
                if "hello world" in "".join(said):
                    break
            await task.queue_frame(EndFrame())

        feeder = asyncio.create_task(feed())
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(task)
        await runner.run()
        await feeder

    with serve(backend_app(requests, words=">> hello world.")) as backend:
        with serve(live_app(checkpoints)) as base:
            asyncio.run(scenario(base, backend))
    assert requests and requests[0]["model"] == "qwen"  # the delegated request reached its backend
    assert "hello world" in "".join(said)
