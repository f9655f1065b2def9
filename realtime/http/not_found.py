"""Answers for what no door serves, in the shape its client reads.

- A WebSocket upgrade to a path without a WebSocket door: HTTP 404 before the upgrade (the
  framework's default closes it unaccepted, which reaches the client as 403).
- Under /v1/ every error is OpenAI-shaped JSON, `{"error": {"message", "type", "param",
  "code"}}`, which the openai SDKs parse (a plain-text `Not Found` they cannot): an unknown
  path is 404 `Invalid URL (GET /v1/models)`; a door this server was started without is 404
  naming the flag that serves it (server/doors.py); a wrong method is 405 with `Allow`.
- Elsewhere: Starlette's plain text.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.routing import compile_path
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from ..server import doors
from ..sessions.capacity import deny_upgrade
from ..server.state import app_state

OPENAI_PREFIX = "/v1/"


def openai_error(status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class UnknownWebSocket:
    """ASGI middleware: a WebSocket upgrade to a path that is not a mounted WebSocket door
    gets 404 before the upgrade."""

    def __init__(self, app: ASGIApp, *, paths: frozenset[str]) -> None:
        self.app = app
        self.paths = paths
        # a door with parameters ({session_id}) is a pattern
        self.patterns = [compile_path(path)[0] for path in paths if "{" in path]

    def served(self, path: str) -> bool:
        return path in self.paths or any(pattern.match(path) for pattern in self.patterns)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket" or self.served(scope["path"]):
            await self.app(scope, receive, send)
            return
        text = f"no WebSocket door at {scope['path'][:100]}; the WebSocket doors are {', '.join(sorted(self.paths))}"
        await deny_upgrade(WebSocket(scope, receive, send), PlainTextResponse(text, status_code=404),
                           "no WebSocket door at this path")


async def http_error(request: Request, exc: HTTPException) -> Response:
    """The app's handler for the router's (and the page's) 404 and 405."""
    path = request.url.path
    if not path.startswith(OPENAI_PREFIX):
        if exc.status_code in (204, 304):
            return Response(status_code=exc.status_code, headers=exc.headers)
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    served = {door.path: door for door in app_state(request).doors}
    door = served.get(path)
    if door is None:
        known = doors.BY_PATH.get(path)
        if known is not None and known.needs is not None:
            what, flag = doors.NEEDS[known.needs]
            return openai_error(404, f"this server has no {what}: {known.method} {path} needs {flag}.",
                                param="model", code="model_not_found")
        listed = ", ".join(p for p in served if p.startswith(OPENAI_PREFIX))
        return openai_error(404, f"Invalid URL ({request.method} {path}); this server serves {listed}.",
                            code="unknown_url")
    if exc.status_code in (404, 405):
        return openai_error(405, f"{path} takes {door.method}, not {request.method}.", code="method_not_allowed",
                            headers=exc.headers if exc.status_code == 405 else None)
    return openai_error(exc.status_code, exc.detail, headers=exc.headers)
