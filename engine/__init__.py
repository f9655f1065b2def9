"""Parley's engine: session slots, the lockstep tick, and the streaming output queue.

See docs/engine.md. The network edge uses only the names exported here (tests/test_layering.py
fails on any other): the engine and its options, the duplex backends it is built around, and each
kind of request (speech, transcription, images) with its options, events and errors.

The names load lazily (PEP 562): `from parley.engine import SamplingOptions` imports only the
torch-free options module, so `parley --help` can show their defaults without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the submodule that defines it ("module:attr" where the public name is not the module's)
_EXPORTS = {
    # the engine, its options and the duplex backends
    "BackendOutput": "backend", "FrameBackend": "backend", "HostOutput": "backend", "ModelBackend": "backend",
    "RowFailure": "backend", "SessionRejected": "backend", "default_dtype": "backend", "kv_layout": "backend",
    "NO_DUPLEX_REASON": "no_duplex", "NoDuplexBackend": "no_duplex",
    "TickClock": "clock",
    "DEFAULT_STALL_TIMEOUT_S": "config", "EngineConfig": "config", "OptionsError": "config",
    "SamplingOptions": "config", "SessionOptions": "config", "TICK_SECONDS": "config",
    "Engine": "engine", "EngineClosed": "engine",
    "FULL_COLLECTIONS": "gc_pauses", "SLACK_COLLECTIONS": "gc_pauses", "freeze_loaded_objects": "gc_pauses",
    "InputError": "input_buffer",
    "KV_ATTENTION": "kv_blocks:ATTENTION", "KV_POLICIES": "kv_blocks:POLICIES", "KvBlockPool": "kv_blocks",
    "KvSettings": "kv_blocks",
    "TickTrace": "tick_trace", "TICK_TRACE_TICKS": "tick_trace:DEFAULT_MAX_TICKS",  # parley serve --tick-trace
    "TICK_PHASES": "metrics",  # the tick's phases, each timed: /metrics' parley_engine_tick_<phase>_seconds
    "FrameOut": "session", "Session": "session",
    "EngineFull": "slots",
    "OutputStream": "stream", "Status": "stream", "Terminal": "stream",
    "CostModel": "slack", "SlackSource": "slack",  # slack sources: warm_up(costs) seeds the cost model
    "run_offline": "offline",
    # translation (Hibiki): Session.end_input's default tail, in frames
    "TRANSLATION_TAIL_FRAMES": "translation:TAIL_FRAMES",
    # speech: a request's words, options and voice in, audio frames and word times out
    "TtsAudio": "tts_pool", "TtsJob": "tts_pool", "TtsPool": "tts_pool", "TtsPoolFull": "tts_pool",
    "TtsRequest": "tts_pool", "TtsWord": "tts_pool", "text_entries": "tts_pool",
    "synthesize": "tts_offline",
    "SpeechFrontEnd": "speech", "SpeechInputError": "speech", "UnknownVoice": "speech",
    # transcription: standalone rows (requests) and the duplex sessions' paired rows
    "SttBusy": "stt_pool", "SttFailed": "stt_pool", "SttInputError": "stt_pool", "SttPartial": "stt_pool",
    "SttPool": "stt_pool", "SttRequest": "stt_pool", "collect_transcript": "stt_pool",
    "WordEnded": "stt_pool", "WordHeard": "stt_pool",  # a word as moshi-server's ASR reports it (models/stt_text.py)
    "PairedTranscription": "stt_paired",
    # images
    "IMAGE_STALLED": "image_queue:STALLED", "ImagePartial": "image_queue", "ImageQueue": "image_queue",
    "ImageQueueFull": "image_queue", "ImageRefused": "image_queue", "ImageRequest": "image_queue",
    "ImageResult": "image_queue", "ImageSpec": "image_queue", "MAX_PARTIAL_IMAGES": "image_queue",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .backend import (BackendOutput, FrameBackend, HostOutput, ModelBackend, RowFailure, SessionRejected,
                          default_dtype, kv_layout)
    from .clock import TickClock
    from .config import (DEFAULT_STALL_TIMEOUT_S, TICK_SECONDS, EngineConfig, OptionsError, SamplingOptions,
                         SessionOptions)
    from .engine import Engine, EngineClosed
    from .tick_trace import DEFAULT_MAX_TICKS as TICK_TRACE_TICKS, TickTrace
    from .gc_pauses import FULL_COLLECTIONS, SLACK_COLLECTIONS, freeze_loaded_objects
    from .image_queue import MAX_PARTIAL_IMAGES, ImagePartial, ImageQueue, ImageQueueFull, ImageRefused
    from .image_queue import STALLED as IMAGE_STALLED
    from .image_queue import ImageRequest, ImageResult, ImageSpec
    from .input_buffer import InputError
    from .kv_blocks import ATTENTION as KV_ATTENTION
    from .kv_blocks import POLICIES as KV_POLICIES
    from .kv_blocks import KvBlockPool, KvSettings
    from .metrics import TICK_PHASES
    from .no_duplex import NO_DUPLEX_REASON, NoDuplexBackend
    from .offline import run_offline
    from .session import FrameOut, Session
    from .slack import CostModel, SlackSource
    from .slots import EngineFull
    from .speech import SpeechFrontEnd, SpeechInputError, UnknownVoice
    from .stream import OutputStream, Status, Terminal
    from .stt_paired import PairedTranscription
    from .stt_pool import (SttBusy, SttFailed, SttInputError, SttPartial, SttPool, SttRequest, WordEnded, WordHeard,
                           collect_transcript)
    from .translation import TAIL_FRAMES as TRANSLATION_TAIL_FRAMES
    from .tts_offline import synthesize
    from .tts_pool import TtsAudio, TtsJob, TtsPool, TtsPoolFull, TtsRequest, TtsWord, text_entries


def __getattr__(name: str):
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attr = where.partition(":")
    value = getattr(importlib.import_module(f".{module}", __name__), attr or name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
