"""Who may use the server: API keys and browser Origins, checked once, in front of every route.

- Keys (`--api-key` / `--api-key-file`): every door needs one except the page and its static
  files and the health probes (`PUBLIC_PATHS`); `/metrics` only with `--protect-metrics`.
  Default-deny: a route added later is covered without a change here. A key is accepted as
  `Authorization: Bearer <key>`, as the `api_key` query parameter, or as the WebSocket
  subprotocol `openai-insecure-api-key.<key>` (browsers cannot set headers on a WebSocket); and
  as Kyutai's moshi-server takes it (Unmute, LiveKit's Kyutai plugin), the `kyutai-api-key` header
  or the `auth_id` query parameter, on every door alike. moshi-server's `/api/build_info` (Unmute's
  health check) and `/api/modules_info` need none, as there.
  Keys are compared in constant time and never logged (`RedactKeys` scrubs uvicorn's lines).
- Origins (`--allowed-origins`): a browser request's Origin must be the server's own (default),
  one of the listed origins, or anything with `*`. Requests without an Origin (non-browser
  clients) are not origin-checked. This stops a page on another site from opening sessions
  on a user's local server (cross-site WebSocket hijacking). The HTTP doors that start sessions
  (WebRTC calls: `session_paths`) are origin-checked the same way: a cross-site form may POST
  an SDP offer without any preflight.

Refusals: 401 (key) or 403 (origin), as a plain HTTP response (OpenAI-shaped JSON under /v1/,
which the SDKs read), also for a WebSocket upgrade; each is logged at INFO without the key and
counted (sessions/refusals.py).
"""

from __future__ import annotations

import hmac
import logging
import re
from pathlib import Path
from typing import Iterable
from urllib.parse import parse_qsl

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from ..sessions.capacity import deny_upgrade
from ..sessions.refusals import Refusals

# probes: no key (moshi-server's info routes are probes too: Unmute checks /api/build_info without one)
PUBLIC_PATHS = frozenset({"/", "/livez", "/readyz", "/health", "/ready", "/load", "/api/build_info",
                          "/api/modules_info"})
METRICS_PATH = "/metrics"
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
KEY_QUERY_PARAM = "api_key"
KYUTAI_KEY_HEADER = "kyutai-api-key"  # moshi-server's header, and its query parameter below
KYUTAI_KEY_QUERY_PARAM = "auth_id"


def read_key_file(path: str | Path) -> tuple[str, ...]:
    """Keys from a file, one per line (several allow rotation); blank lines and # comments skipped."""
    lines = Path(path).read_text().splitlines()
    keys = tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys


def offered_key(scope: Scope) -> str | None:
    """The key a request carries, by header, query parameter or subprotocol (first found)."""
    headers = Headers(scope=scope)
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if KYUTAI_KEY_HEADER in headers:
        return headers[KYUTAI_KEY_HEADER]
    for name, value in parse_qsl(scope.get("query_string", b"").decode("latin-1")):
        if name in (KEY_QUERY_PARAM, KYUTAI_KEY_QUERY_PARAM):
            return value
    for proto in scope.get("subprotocols", []) or []:
        if proto.startswith(KEY_SUBPROTOCOL_PREFIX):
            return proto[len(KEY_SUBPROTOCOL_PREFIX):]
    return None


def key_matches(offered: str | None, keys: Iterable[str]) -> bool:
    """Constant-time comparison against every configured key (no early exit on a match)."""
    if offered is None:
        return False
    given = offered.encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key.encode())
    return ok


def choose_subprotocol(offered: list[str], preferred: str | None = None) -> str | None:
    """The subprotocol to accept: `preferred` if offered, else the first non-key one, else the
    key one itself (a browser fails the handshake when it offered some and none comes back)."""
    if preferred is not None and preferred in offered:
        return preferred
    plain = [p for p in offered if not p.startswith(KEY_SUBPROTOCOL_PREFIX)]
    return plain[0] if plain else (offered[0] if offered else None)


def _normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def origin_allowed(scope: Scope, allowed: tuple[str, ...] | None) -> bool:
    headers = Headers(scope=scope)
    origin = headers.get("origin")
    if origin is None:
        return True  # not a browser: nothing to hijack
    origin = _normalize_origin(origin)
    if allowed is None:  # same origin: the page this server serves
        scheme = {"ws": "http", "wss": "https"}.get(scope.get("scheme", "http"), scope.get("scheme", "http"))
        host = headers.get("host", "")
        return origin == _normalize_origin(f"{scheme}://{host}")
    return "*" in allowed or origin in {_normalize_origin(a) for a in allowed}


def parse_origins(text: str | None) -> tuple[str, ...] | None:
    """`--allowed-origins`: comma-separated; None or empty: same origin only."""
    if not text:
        return None
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin like https://example.com or *")
    return origins or None


class AccessMiddleware:
    """ASGI middleware in front of every route: origin check, then key check."""

    def __init__(self, app: ASGIApp, *, keys: tuple[str, ...], protect_metrics: bool,
                 allowed_origins: tuple[str, ...] | None, static_paths: Iterable[str] = (),
                 session_paths: Iterable[str] = (), refusals: Refusals) -> None:
        # session_paths: HTTP doors that start a session (WebRTC calls), origin-checked like WebSockets,
        # and the calls' actions below them (PATH/{call_id}/hangup)
        self.app = app
        self.session_paths = frozenset(session_paths)
        self.keys = keys
        self.protect_metrics = protect_metrics
        self.allowed_origins = allowed_origins
        self.public = PUBLIC_PATHS | frozenset(static_paths)
        self.refusals = refusals

    def needs_key(self, path: str) -> bool:
        if not self.keys or path in self.public:
            return False
        return path != METRICS_PATH or self.protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        # A WebRTC door, or a call's action under it (hangup): each starts or ends a session.
        on_session = (scope["type"] == "websocket" or path in self.session_paths
                      or path.rsplit("/", 2)[0] in self.session_paths)
        if on_session and not origin_allowed(scope, self.allowed_origins):
            await self._refuse(scope, receive, send, 403, "origin", "this Origin is not allowed; see "
                               "parley serve --allowed-origins")
            return
        if self.needs_key(path) and not key_matches(offered_key(scope), self.keys):
            await self._refuse(scope, receive, send, 401, "api_key", "invalid or missing API key: send "
                               "Authorization: Bearer <key>, ?api_key=<key>, the subprotocol "
                               "openai-insecure-api-key.<key>, or kyutai-api-key: <key> / ?auth_id=<key>")
            return
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, reason: str,
                      text: str) -> None:
        self.refusals.record(scope, reason, "wrong or missing API key" if reason == "api_key"
                             else "Origin not allowed")  # never the key itself
        response = PlainTextResponse(text, status_code=status)
        if scope["type"] == "http" and str(scope.get("path", "")).startswith("/v1/"):
            kind = "invalid_api_key" if reason == "api_key" else "origin_not_allowed"
            response = JSONResponse({"error": {"message": text, "type": "invalid_request_error", "param": None,
                                               "code": kind}}, status_code=status)
        if scope["type"] == "websocket":
            await deny_upgrade(WebSocket(scope, receive, send), response, f"refused: {reason}")
        else:
            await response(scope, receive, send)


_KEY_IN_TEXT = re.compile(r"(api_key=|auth_id=|openai-insecure-api-key\.)[^&\s\"']*", re.IGNORECASE)


class RedactKeys(logging.Filter):
    """Scrubs keys from log lines (uvicorn logs request paths with their query strings)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_KEY_IN_TEXT.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = _KEY_IN_TEXT.sub(r"\1***", record.msg)
        return True


def static_paths(web_dir: Path | None) -> tuple[str, ...]:
    """URL paths of the page's files (public even with a key: the page must load to ask for it)."""
    if web_dir is None or not web_dir.is_dir():
        return ()
    paths = []
    for file in web_dir.rglob("*"):
        if file.is_file():
            rel = file.relative_to(web_dir).as_posix()
            paths.append("/" + rel)
            if file.name == "index.html":
                parent = file.parent.relative_to(web_dir).as_posix()
                paths.append("/" if parent == "." else f"/{parent}/")
    return tuple(paths)
