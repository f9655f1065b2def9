"""OpenAI's WebRTC doors: `POST /v1/realtime/calls` (Realtime) and `POST /v1/live/sessions` (GPT-Live).

Each call is the WebSocket door's session over another transport (webrtc/transport.py): the same
connection class (RealtimeConnection, LiveConnection), events, admission, key, Origin, limits,
metrics and drain. Only the start differs:

1. The request is judged before any media: the key and the Origin (server/security.py, as for an
   upgrade), the body (the SDP offer; the session settings, judged as `session.update` /
   `session.start` would be), then admission (a full or draining server: 503 with Retry-After).
   Each refusal is an OpenAI-shaped HTTP error, `{"error": {message, type, param, code}}`.
2. The call is answered: Realtime `201 application/sdp` with `Location: /v1/realtime/calls/{id}`;
   GPT-Live `200 {"session": {"id"}, "transport": {"type": "webrtc", "sdp"}}`.
3. The session then runs on its own task, not the request's: once the peer's `oai-events` channel
   opens (at most CONNECT_TIMEOUT_S), the engine session opens (the prefill) and the events flow
   as on the WebSocket (`session.created` / `session.started` first). A peer that never connects
   frees its reserved slot at the timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..live import events as ev
from ..sessions.capacity import RETRY_AFTER_S, Reservation
from ..live.config import parse_start
from ..live.attach import attached_live_call
from ..live.session import PROTOCOL as LIVE_PROTOCOL, LiveConnection
from ..calls.sideband import AttachedCall
from ..server.security import offered_key
from ..http.models import model_not_found
from ..http.not_found import openai_error
from ..realtime_api.events import Dialect, new_id
from ..realtime_api.attach import attached_realtime_call
from ..realtime_api.connection import PROTOCOL as REALTIME_PROTOCOL, RealtimeConnection
from ..realtime_api.settings import ClientError
from ..server.served_models import ModelNotFound
from ..sessions.session import EdgeSession, SessionManager
from .transport import CONNECT_TIMEOUT_S, CallUnavailable, OfferError, WebRTCCall
from ..server.state import app_state

if TYPE_CHECKING:
    from ..calls.call_relay import CallRelay

log = logging.getLogger("parley.webrtc")

MAX_BODY_BYTES = 256 * 1024  # an SDP offer is a few kB; the session settings a few more
DENIALS = {  # admission's reasons (sessions/capacity.py) -> the error code a WebRTC client gets with its 503
    "full": "session_limit_reached", "memory": "session_limit_reached", "draining": "server_shutting_down",
    "unhealthy": "server_unavailable",
}


class Refused(Exception):
    """A call refused before any media; `response` is its OpenAI-shaped HTTP error."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def bad_request(exc: ClientError | OfferError, param: str | None = None) -> Refused:
    if isinstance(exc, OfferError):
        return Refused(openai_error(400, str(exc), param=param, code="invalid_offer"))
    return Refused(openai_error(_status(exc), str(exc), param=exc.param, code=exc.code))


def _status(exc: ClientError) -> int:
    """A setting naming a model this server does not serve is OpenAI's 404, as on every HTTP door."""
    return 404 if exc.code == "model_not_found" else 400


def _check_model(request: Request) -> None:
    """`?model=`, if given, must be a served duplex name (server/served_models.py): else 404 model_not_found."""
    models = app_state(request).models
    asked = request.query_params.get("model")
    if asked is not None and "duplex" in models.names:
        try:
            models.resolve("duplex", asked)
        except ModelNotFound as exc:
            raise Refused(model_not_found(exc)) from None


# ---- POST /v1/realtime/calls ----

async def realtime_calls(request: Request) -> Response:
    """The Realtime WebRTC door: the body is the SDP offer (`application/sdp`), or multipart with
    `sdp` and an optional `session` (JSON, as the SDK's `client.realtime.calls.create` sends)."""
    manager: SessionManager = app_state(request).sessions
    try:
        _check_model(request)
        request, placed = await _placed(request)
        if placed is not None:
            return placed
        offer, session = await _realtime_body(request)

        def connect(edge: EdgeSession) -> RealtimeConnection:
            connection = RealtimeConnection(edge, Dialect.GA, request.query_params.get("model")
                                            or manager.defaults.model_name,
                                            served=app_state(request).models.of("duplex"))
            refused = connection.configure(session) if session is not None else []
            if refused:
                raise Refused(_joined(refused))
            return connection

        edge, call, connection, answer, held = await _answer(request, REALTIME_PROTOCOL, offer, connect)
    except Refused as exc:
        return _refusal(manager, REALTIME_PROTOCOL, exc)
    except OfferError as exc:
        return _refusal(manager, REALTIME_PROTOCOL, bad_request(exc, "sdp"))
    call_id = new_id("rtc")
    edge.notice = lambda reason: connection.send(connection.events.error(reason, "server_shutting_down",
                                                                         kind="server_error"))
    _start(request, edge, call, connection.run, call_task_name(call_id),
           attached_realtime_call(call_id, connection, offered_key(request.scope)), held)
    return Response(answer, status_code=201, media_type="application/sdp",
                    headers={"Location": f"/v1/realtime/calls/{call_id}"})


def call_task_name(call_id: str) -> str:
    return f"realtime call {call_id}"


async def call_action(request: Request) -> Response:
    """`POST /v1/realtime/calls/{call_id}/hangup` ends that call: its session and peer connection
    close as when the peer leaves (on an edge worker not holding it: relayed, calls/call_relay.py).
    `accept`, `reject` and `refer` act on SIP calls, which this server does not take: refused by name."""
    call_id, action = request.path_params["call_id"], request.path_params["action"]
    if action in ("accept", "reject", "refer"):
        return openai_error(400, f"{action} acts on an incoming SIP call; this server takes WebRTC calls only "
                                 "(POST /v1/realtime/calls)", code="unsupported_call_action")
    if action != "hangup":
        return openai_error(404, f"no call action {action!r:.40}: hangup is served", code="not_found")
    name = call_task_name(call_id)
    task = next((t for t in app_state(request).calls if t.get_name() == name), None)
    if task is None:
        relay = _relay(request)  # an edge worker's: another worker may hold it
        if relay is not None and not relay.relayed(request):
            answer = await relay.post(request)
            if answer is not None:
                return answer
        return openai_error(404, f"no call {call_id!r:.60} is live on this server", param="call_id",
                            code="call_not_found")
    log.info("%s: hung up by the client", name)
    task.cancel()  # _run_call's finally closes the session and the peer connection
    return Response(status_code=200)


async def _realtime_body(request: Request) -> tuple[str, Any]:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        try:
            form = await request.form(max_files=2, max_fields=8, max_part_size=MAX_BODY_BYTES)
        except Exception as exc:  # starlette's parser: a malformed or oversized form
            raise Refused(openai_error(400, f"the multipart body cannot be read: {exc}"[:200],
                                       code="invalid_request")) from None
        offer = await _text(form.get("sdp"))
        if offer is None:
            raise Refused(openai_error(400, "the multipart body needs an 'sdp' part: the SDP offer", param="sdp",
                                       code="missing_required_parameter"))
        raw = await _text(form.get("session"))
        if raw is None:
            return offer, None
        try:
            return offer, json.loads(raw)
        except json.JSONDecodeError as exc:
            raise Refused(openai_error(400, f"session is not JSON: {exc}", param="session",
                                       code="invalid_json")) from None
    if kind in ("application/sdp", "text/plain", ""):
        return (await _body(request)).decode(errors="replace"), None
    raise Refused(openai_error(415, f"send the SDP offer as application/sdp or multipart/form-data, not {kind:.60}",
                               code="unsupported_media_type"))


async def _text(part: Any) -> str | None:
    if part is None:
        return None
    if isinstance(part, str):
        return part
    return (await part.read()).decode(errors="replace")  # an UploadFile: a part sent with a filename


# ---- POST /v1/live/sessions ----

async def live_calls(request: Request) -> Response:
    """GPT-Live's WebRTC door: `{"session": {...}, "transport": {"type": "webrtc", "sdp"}}` (the SDK's
    `client.live.create`); the request starts the session, no `session.start` follows."""
    manager: SessionManager = app_state(request).sessions
    defaults = manager.defaults
    try:
        request, placed = await _placed(request)
        if placed is not None:
            return placed
        body = await _json_body(request)
        offer = _live_offer(body.get("transport"))
        session = body.get("session")
        if isinstance(session, dict) and isinstance(session.get("audio"), dict) and "format" in session["audio"]:
            raise Refused(openai_error(400, "session.audio.format: a WebRTC call negotiates its audio format on the "
                                       "media transport (Opus); leave it out", param="session.audio.format",
                                       code="unsupported_parameter"))

        def connect(edge: EdgeSession) -> tuple[LiveConnection, Any]:
            connection = LiveConnection(edge, served=app_state(request).models.of("duplex"))
            config, refused = parse_start(session, connection.caps, backend=defaults.live_delegate is not None)
            if config is None:
                raise Refused(_joined(refused))
            return connection, config

        edge, call, (connection, config), answer, held = await _answer(request, LIVE_PROTOCOL, offer, connect)
    except Refused as exc:
        return _refusal(manager, LIVE_PROTOCOL, exc)
    except OfferError as exc:
        return _refusal(manager, LIVE_PROTOCOL, bad_request(exc, "transport.sdp"))
    edge.notice = lambda reason: connection.send(ev.error(reason, "server_shutting_down", kind="server_error"))
    _start(request, edge, call, lambda: connection.run(start=config), f"live session {config.id}",
           attached_live_call(config.id, connection, offered_key(request.scope)), held)
    return JSONResponse({"session": {"id": config.id}, "transport": {"type": "webrtc", "sdp": answer}})


def _live_offer(transport: Any) -> str:
    if not isinstance(transport, dict):
        raise Refused(openai_error(400, "transport is required: {\"type\": \"webrtc\", \"sdp\": \"<offer>\"}",
                                   param="transport", code="missing_required_parameter"))
    if transport.get("type") != "webrtc":
        raise Refused(openai_error(400, f"transport.type must be 'webrtc' here (got {transport.get('type')!r:.40}); "
                                   "WebSocket clients connect to /v1/live/sessions with an upgrade",
                                   param="transport.type", code="invalid_value"))
    unknown = sorted(set(transport) - {"type", "sdp"})
    if unknown:
        raise Refused(openai_error(400, f"unknown field transport.{unknown[0]:.40}",
                                   param=f"transport.{unknown[0]:.40}", code="unknown_parameter"))
    sdp = transport.get("sdp")
    if not isinstance(sdp, str):
        raise Refused(openai_error(400, "transport.sdp is required: the SDP offer", param="transport.sdp",
                                   code="missing_required_parameter"))
    return sdp


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await _body(request))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Refused(openai_error(400, f"the body is not JSON: {exc}", code="invalid_json")) from None
    if not isinstance(body, dict):
        raise Refused(openai_error(400, "the body must be a JSON object with session and transport",
                                   code="invalid_json"))
    return body


# ---- shared: admission, the refusal, the call's task ----

async def _body(request: Request) -> bytes:
    data = b""
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise Refused(openai_error(413, f"the body is over {MAX_BODY_BYTES} bytes", code="request_too_large"))
    return data


def _admit(request: Request, protocol: str) -> tuple[EdgeSession, WebRTCCall]:
    """Reserve a slot (no await since the check: as atomic as an upgrade's, sessions/capacity.py) and attach
    a call to it; Refused with 503 + Retry-After when the server cannot take a session now."""
    manager: SessionManager = app_state(request).sessions
    admission = manager.admission
    load = admission.load()
    reason = admission.refusal(load)
    if reason is not None:
        admission.rejected.labels(reason).inc()
        message = {"full": f"all {load.slots_total} session slots are in use; try again later",
                   "draining": "this server is draining (shutting down); call again to reach another one",
                   }.get(reason, f"this server cannot take a session now ({reason})")
        admission.refusals.record(request.scope, reason, message)
        raise Refused(openai_error(503, message, code=DENIALS.get(reason, reason),
                                   headers={"Retry-After": str(RETRY_AFTER_S)}))
    reservation = Reservation(admission)  # no await since load(): atomic on the event loop
    call = WebRTCCall(request.scope, app_state(request).webrtc, manager.defaults.ice_servers,
                      manager.defaults.limits.max_lag_s)  # its peer runs where the app's PeerHost puts it
    return manager.attach(call, protocol, reservation), call


async def _placed(request: Request) -> tuple[Request, Response | None]:
    """On an edge worker holding more calls than another: the offer relayed there and its answer
    (calls/call_relay.py rule 5). Otherwise None, with a request whose body still reads."""
    relay = _relay(request)
    target = None if relay is None or relay.relayed(request) else relay.lighter()
    if relay is None or target is None:
        return request, None
    body = await _body(request)
    answer = await relay.place(request, body, target)
    if answer is not None:
        return request, answer
    sent = [False]

    async def replay() -> dict:  # the body read above, once more for this worker's own answer
        if sent[0]:
            return await request.receive()
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}
    return Request(request.scope, replay), None


def _relay(request: Request) -> CallRelay | None:
    calls = app_state(request).live_calls
    return calls.relay if calls is not None else None  # an edge worker's: the other workers and their calls


async def _answer(request: Request, protocol: str, offer: str, connect: Callable[[EdgeSession], Any]):
    """Admit the call, open its connection (`connect(edge)`: the door's connection, its settings
    judged; Refused to refuse them) and answer the offer; any failure hangs up what was reserved.
    (edge, call, what connect returned, the SDP answer, the function that stops counting the call
    on this worker: calls/call_relay.py rule 5). No peer for the call: 503."""
    relay = _relay(request)
    held = relay.hold_call() if relay is not None else _nothing
    try:
        edge, call = _admit(request, protocol)
    except BaseException:
        held()
        raise
    try:
        connected = connect(edge)
        return edge, call, connected, await call.answer(offer), held
    except CallUnavailable as exc:
        held()
        await _hang_up(edge, call)
        raise Refused(openai_error(503, f"this server cannot take a WebRTC call now: {exc}"[:300],
                                   code="server_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})) from None
    except BaseException:
        held()
        await _hang_up(edge, call)
        raise


def _nothing() -> None:
    pass


def _joined(refused: list[ClientError]) -> Response:
    """One error for the refused settings: the first names its param and status (400, or 404 for
    an unserved model), the message lists them all."""
    first = refused[0]
    message = "; ".join(str(exc) for exc in refused)
    return openai_error(_status(first), message[:1000], param=first.param, code=first.code)


def _refusal(manager: SessionManager, protocol: str, exc: Refused) -> Response:
    if exc.response.status_code < 500:
        manager.counters(protocol).protocol_error()
    return exc.response


async def _hang_up(edge: EdgeSession, call: WebRTCCall) -> None:
    edge.close()
    await call.close()


def _start(request: Request, edge: EdgeSession, call: WebRTCCall, run: Callable[[], Awaitable[None]],
           name: str, attachable: AttachedCall, held: Callable[[], None]) -> None:
    """Run the call's session on a task of its own (held by the app until it ends, and counted on this
    worker till then: `held`); sidebands may attach to it by id meanwhile (calls/sideband.py), and are
    ended with it."""
    calls: set[asyncio.Task] = app_state(request).calls
    registry = app_state(request).live_calls
    registry.hold(attachable)
    task = asyncio.get_running_loop().create_task(_run_call(edge, call, run, name), name=name)
    calls.add(task)
    task.add_done_callback(calls.discard)
    task.add_done_callback(lambda _: registry.release(attachable))
    task.add_done_callback(lambda _: held())


async def _run_call(edge: EdgeSession, call: WebRTCCall, run: Callable[[], Awaitable[None]], name: str) -> None:
    try:
        if not await call.wait_ready(CONNECT_TIMEOUT_S):
            log.info("%s (%d): the peer did not connect", name, edge.number)
            return
        await run()
        if call.overflowed:
            edge.counters.rate_limited()
            edge.counters.refusal(call.scope, "rate_limit", "events arrived faster than the session "
                                                 "reads them, or one was over the size limit")
    except Exception:
        log.exception("%s (%d) failed", name, edge.number)
    finally:
        log.info("%s (%d): ended", name, edge.number)
        await _hang_up(edge, call)
