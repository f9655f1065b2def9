"""Parley's engine: session slots, the lockstep tick, and the streaming output queue.

See docs/engine.md. The network edge uses only the names exported here.
"""

from .backend import BackendOutput, FrameBackend, HostOutput, RowFailure, SessionRejected
from .clock import TickClock
from .config import EngineConfig, OptionsError, SamplingOptions, SessionOptions
from .engine import Engine, EngineClosed
from .input_buffer import InputError
from .session import FrameOut, Session
from .slots import EngineFull
from .stream import OutputStream, Status, Terminal

__all__ = [
    "BackendOutput", "Engine", "EngineClosed", "EngineConfig", "EngineFull", "FrameBackend",
    "FrameOut", "HostOutput", "InputError", "OptionsError", "OutputStream", "RowFailure",
    "SamplingOptions", "Session", "SessionOptions", "SessionRejected", "Status", "Terminal",
    "TickClock",
]
