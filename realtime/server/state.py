"""The app's state, typed: what the handlers read, in one frozen record, reached by one accessor.

Rules this module keeps:
1. `create_app` (server/app.py) builds one `AppState` and sets it as the app's `state`; nothing else
   writes it, and no field is rebound after (the record is frozen; `calls` is a set the WebRTC doors
   add their calls' tasks to).
2. A handler reads it through `app_state(request)` (a Request, a WebSocket, or the app), which fails
   loudly on an app that create_app did not build, rather than an AttributeError deep in a door.
3. Doors reach the engine through `client` (realtime/engine_client.py), never through the engine.
4. This module imports no room at run time (only for type checking), so any room may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

    from starlette.applications import Starlette
    from starlette.requests import HTTPConnection

    from ..calls.sideband import LiveCalls
    from ..engine_client import EngineClient
    from ..translation.model import Translator
    from ..http.speech import SpeechService
    from ..sessions.refusals import Refusals
    from ..sessions.session import SessionManager
    from ..webrtc.transport import PeerHost
    from .doors import Door
    from .drain import Drainer
    from .served_models import ServedModels
    from .services import ServerInfo


@dataclass(frozen=True, eq=False)
class AppState:
    """Everything a handler of this app reads (rule 1); None: that modality is not served."""

    client: "EngineClient"  # the one way to the engine (realtime/engine_client.py)
    sessions: "SessionManager"  # admission, live connections, per-connection parts (sessions/session.py)
    models: "ServedModels"  # what `model` may name on each door (server/served_models.py)
    refusals: "Refusals"  # the HTTP doors' own refusals (a full pool or queue), logged and counted
    info: "ServerInfo"  # what the page and /api/info show about the loaded model
    doors: tuple["Door", ...]  # the doors this app serves (server/doors.py)
    drainer: "Drainer"  # POST /admin/drain and SIGTERM (server/drain.py)
    codec: Any  # the Opus codec runner (media/opus.py): in-process or worker processes
    webrtc: "PeerHost"  # where the WebRTC calls' peers run: worker processes, or this one (webrtc/transport.py)
    speech: "SpeechService | None" = None  # /v1/audio/speech (http/speech.py)
    stt_model: str | None = None  # the standalone transcription model's name; None: no STT served
    calls: "set[asyncio.Task]" = field(default_factory=set)  # the WebRTC calls' tasks, held until each ends
    live_calls: "LiveCalls | None" = None  # the calls a sideband may attach to, by id (calls/sideband.py)
    translator: "Translator | None" = None  # the served Hibiki (translation/model.py); None: the duplex model stands in


def app_state(where: "HTTPConnection | Starlette") -> AppState:
    """The app's state, from a request, a WebSocket or the app itself (rule 2)."""
    app = getattr(where, "app", where)
    state = app.state
    if not isinstance(state, AppState):
        raise TypeError("this app was not built by server/app.py's create_app: its state is not an AppState")
    return state
