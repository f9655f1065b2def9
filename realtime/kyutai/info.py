"""moshi-server's info routes: `GET /api/build_info` and `GET /api/modules_info`.

- `/api/build_info`: what server this is, as JSON (Unmute's health check reads only the 200;
  moshi-server's fields describe its Rust build, so Parley names its own package and version).
- `/api/modules_info`: one entry per Kyutai door served, moshi-server's fields as it writes them
  (every value a string): `type` (`batched_asr` for the STT door, `py` for the TTS door, the module
  kinds whose paths these are in Kyutai's configs), `path`, `lm` (the model's name), `used_slots`
  and `total_slots` (the pool's rows taken or promised to a waiting request, and its rows in all;
  the rows are shared with the OpenAI doors on the same pool).
Both need no key, as on moshi-server (server/security.py's public paths).
"""

from __future__ import annotations

import platform
from importlib import metadata

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine_client import PoolSlots
from ..server.state import app_state

ASR_PATH = "/api/asr-streaming"
TTS_PATH = "/api/tts_streaming"


def _version() -> str:
    try:
        return metadata.version("parley")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


# Read once at import: a request that first reads package metadata would import modules while the
# engine ticks (server/app.py's load_lazy_modules says why that is avoided).
BUILD_INFO = {"server": "parley", "version": _version(), "python_version": platform.python_version()}


async def build_info(request: Request) -> Response:
    return JSONResponse(BUILD_INFO)


async def modules_info(request: Request) -> Response:
    state = app_state(request)
    modules = []
    if state.stt_model is not None:
        modules.append(_module("batched_asr", ASR_PATH, state.stt_model, state.client.stt_slots()))
    if state.speech is not None:
        modules.append(_module("py", TTS_PATH, state.speech.model, state.client.speech_slots()))
    return JSONResponse(modules)


def _module(kind: str, path: str, model: str, slots: PoolSlots) -> dict[str, str]:
    return {"type": kind, "path": path, "lm": model, "used_slots": str(slots.used), "total_slots": str(slots.total)}
