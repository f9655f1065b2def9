"""The server's doors: every path it can serve, what each is, and what makes it served.

One table, read by everything that names the doors, so they cannot disagree: server/app.py mounts
its routes from it (a door whose service is not loaded is not mounted), the startup banner
lists the routes server/app.py mounted, `parley serve --help` describes the table, the answer for an
unmounted /v1 door names the flag that serves it (http/not_found.py), and the refusal counter takes
its bounded `door` label from it (sessions/refusals.py). Standard library only: `--help` imports it
without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WS = "WS"  # a door's method when it is a WebSocket


@dataclass(frozen=True)
class Door:
    path: str
    method: str  # WS, GET or POST
    what: str
    needs: str | None = None  # the service it serves (a NEEDS key); None: always mounted


# What mounts a door that needs a service: (what it is, the flag that loads it).
NEEDS = {
    "page": ("the web page", "the web/ folder"),
    "tts": ("text-to-speech model", "--tts-model; the demo includes a tiny one"),
    "stt": ("speech-to-text model", "--stt-model; the demo includes a tiny one"),
    "images": ("image model", "--image-model; the demo includes a tiny one"),
}

DOORS = (
    Door("/api/chat", WS, "Moshi / PersonaPlex binary protocol"),
    Door("/v1/realtime", WS, "OpenAI Realtime API (a conversation, ?intent=transcription, or a sideband "
         "joining a WebRTC call: ?call_id=)"),
    Door("/v1/live/sessions", WS, "OpenAI GPT-Live: full duplex, with client delegation"),
    Door("/v1/live/sessions/{session_id}/attach", WS, "GPT-Live sideband: a server joins a WebRTC call's "
         "session (its events out, control events in)"),
    Door("/v1/realtime/translations", WS, "OpenAI Realtime translation: speech in, translated speech and text out"),
    Door("/v1/realtime/calls", "POST", "OpenAI Realtime over WebRTC: an SDP offer in, the answer out"),
    Door("/v1/live/sessions", "POST", "OpenAI GPT-Live over WebRTC: session and SDP offer in, id and answer out"),
    Door("/v1/realtime/calls/{call_id}/{action}", "POST", "a Realtime WebRTC call's hangup (accept, reject, refer: "
         "SIP only, refused)"),
    Door("/v1/audio/speech", "POST", "OpenAI speech: text to speech", "tts"),
    Door("/v1/audio/voices", "GET", "the text-to-speech voices", "tts"),
    Door("/v1/audio/transcriptions", "POST", "OpenAI transcription", "stt"),
    Door("/v1/images/generations", "POST", "OpenAI images", "images"),
    Door("/v1/models", "GET", "OpenAI models: every served model name, with its modality"),
    Door("/v1/models/{model:path}", "GET", "one served model, or 404 model_not_found"),
    Door("/api/asr-streaming", WS, "Kyutai moshi-server speech-to-text (msgpack; Unmute, LiveKit's Kyutai plugin)",
         "stt"),
    Door("/api/tts_streaming", WS, "Kyutai moshi-server text-to-speech (msgpack; Unmute)", "tts"),
    Door("/api/build_info", "GET", "Kyutai moshi-server's build info (Unmute's health check)"),
    Door("/api/modules_info", "GET", "Kyutai moshi-server's modules: used and total slots of each Kyutai door"),
    Door("/api/voices", "GET", "the model's voice prompts, for the page"),
    Door("/api/info", "GET", "the model, and what this server serves, for the page"),
    Door("/livez", "GET", "liveness probe (alias /health)"),
    Door("/readyz", "GET", "readiness probe: 503 when full, draining or unhealthy (alias /ready)"),
    Door("/health", "GET", "alias of /livez"),
    Door("/ready", "GET", "alias of /readyz"),
    Door("/load", "GET", "slots, live sessions and tick times, for a load balancer"),
    Door("/metrics", "GET", "Prometheus metrics"),
    Door("/admin/drain", "POST", "stop admitting, let live sessions finish, exit"),
    Door("/", "GET", "the browser voice-chat page and its files", "page"),  # last: it takes every other path
)
BY_PATH = {door.path: door for door in DOORS}
WEBRTC_PATHS = frozenset({"/v1/realtime/calls", "/v1/live/sessions"})  # POST: a WebRTC call starts a session


def mounted(available: dict[str, bool]) -> list[Door]:
    """The doors served when `available` says which services are loaded (NEEDS keys)."""
    return [door for door in DOORS if door.needs is None or available[door.needs]]


# Doors with parameters ({session_id}; {model:path} takes slashes), as patterns of their paths.
PATTERNS = tuple((re.compile(re.sub(r"\{\w+:path\}", ".+", re.sub(r"\{\w+\}", "[^/]+", door.path)) + "$"), door.path)
                 for door in DOORS if "{" in door.path)


def label(path: str) -> str:
    """A metrics label for a request path: the door's path (a parameter's door's, as written in
    the table), or `other` (bounded cardinality)."""
    door = BY_PATH.get(path)
    if door is not None:
        return door.path
    return next((name for pattern, name in PATTERNS if pattern.match(path)), "other")


def help_summary() -> str:
    """The API doors in one line (`parley --help`)."""
    return ", ".join(door.path for door in DOORS if door.path.startswith(("/api/chat", "/v1/")))


def help_table() -> str:
    """Every door, with what serves it (`parley serve --help`)."""
    lines = []
    for door in DOORS:
        needs = f" [{NEEDS[door.needs][1]}]" if door.needs else ""
        lines.append(f"  {door.method:<4} {door.path:<25} {door.what}{needs}")
    return "\n".join(lines)
