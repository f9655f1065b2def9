"""Parley's engine: session slots, the lockstep tick, and the streaming output queue.

See docs/engine.md. The network edge uses only the names exported here.

The names load lazily (PEP 562): `from parley.engine import SamplingOptions` imports only the
torch-free options module, so `parley --help` can show their defaults without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the submodule that defines it
_EXPORTS = {
    "BackendOutput": "backend", "FrameBackend": "backend", "HostOutput": "backend", "RowFailure": "backend",
    "SessionRejected": "backend",
    "TickClock": "clock",
    "EngineConfig": "config", "OptionsError": "config", "SamplingOptions": "config", "SessionOptions": "config",
    "Engine": "engine", "EngineClosed": "engine",
    "InputError": "input_buffer",
    "FrameOut": "session", "Session": "session",
    "EngineFull": "slots",
    "OutputStream": "stream", "Status": "stream", "Terminal": "stream",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .backend import BackendOutput, FrameBackend, HostOutput, RowFailure, SessionRejected
    from .clock import TickClock
    from .config import EngineConfig, OptionsError, SamplingOptions, SessionOptions
    from .engine import Engine, EngineClosed
    from .input_buffer import InputError
    from .session import FrameOut, Session
    from .slots import EngineFull
    from .stream import OutputStream, Status, Terminal


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
