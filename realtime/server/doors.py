"""The server's doors: every path it can serve, what each is, what serves it, and what makes it served.

The table is each modality's doors (server/modalities.py) and the server's own. One table, read
by everything that names the doors, so they cannot disagree: server/app.py mounts its routes from
it (a door whose service is not loaded is not mounted), the startup banner
lists the routes server/app.py mounted, `parley serve --help` describes the table, the answer for an
unmounted /v1 door names the flag that serves it (http/not_found.py), and the refusal counter takes
its bounded `door` label from it (sessions/refusals.py). Torch-free: `--help` imports it.
"""

from __future__ import annotations

import re

from .modalities import MODALITIES, WS, Door  # noqa: F401 (WS, Door: what the app and the tests name)

# What mounts a door that needs a service: (what it is, the flag that loads it), by modality key.
NEEDS = {
    "page": ("the web page", "the web/ folder"),
    **{m.key: (m.noun, m.loaded_by) for m in MODALITIES},
}

# The server's own doors: what it serves whatever is loaded.
SERVER_DOORS = (
    Door("/v1/models", "GET", "OpenAI models: every served model name, with its modality",
         "http.models:models_endpoint"),
    Door("/v1/models/{model:path}", "GET", "one served model, or 404 model_not_found", "http.models:model_endpoint"),
    Door("/api/voices", "GET", "the model's voice prompts, for the page", "server.app:api_voices"),
    Door("/api/info", "GET", "the model, and what this server serves, for the page", "server.app:api_info"),
    Door("/livez", "GET", "liveness probe (alias /health)", "sessions.capacity:livez"),
    Door("/readyz", "GET", "readiness probe: 503 when full, draining or unhealthy (alias /ready)",
         "sessions.capacity:readyz"),
    Door("/health", "GET", "alias of /livez", "sessions.capacity:livez"),
    Door("/ready", "GET", "alias of /readyz", "sessions.capacity:readyz"),
    Door("/load", "GET", "slots, live sessions and tick times, for a load balancer", "sessions.capacity:load"),
    Door("/metrics", "GET", "Prometheus metrics", "http.metrics:metrics"),
    Door("/admin/drain", "POST", "stop admitting, let live sessions finish, exit", "server.drain:drain_endpoint"),
)
PAGE = Door("/", "GET", "the browser voice-chat page and its files", "", "page")  # a Mount of web/, not an endpoint

# Every modality's doors in the registry's order, then the server's; the page last: it takes every other path.
DOORS = (*(door for modality in MODALITIES for door in modality.doors), *SERVER_DOORS, PAGE)
BY_PATH = {door.path: door for door in DOORS}
WEBRTC_PATHS = frozenset({"/v1/realtime/calls", "/v1/live/sessions"})  # POST: a WebRTC call starts a session


def mounted(available: dict[str, bool]) -> list[Door]:
    """The doors served when `available` says which services are loaded (modality keys, and "page")."""
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
