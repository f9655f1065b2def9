"""API keys on every door (three ways to present one), the Origin check, and keys kept out of logs."""

from __future__ import annotations

import asyncio
import logging
import ssl
import subprocess
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from battery import get_json
from parley.realtime.server.security import RedactKeys, key_matches, parse_origins
from parley.realtime.sessions.session import ServerDefaults
from server_harness import delay_app, serve

pytestmark = pytest.mark.timeout(60)
KEY = "s3cret-key"


async def _ws_status(url: str, **kwargs) -> int | str:
    """101 (and the accepted subprotocol) or the refusal's HTTP status."""
    try:
        async with connect(url, open_timeout=10, **kwargs) as ws:
            await asyncio.wait_for(ws.recv(), 10)
            return f"101 {ws.subprotocol}"
    except InvalidStatus as exc:
        return exc.response.status_code


def test_the_key_guards_every_door_but_the_page_and_health_probes(caplog):
    app, _ = delay_app(2, defaults=ServerDefaults(api_key=KEY))
    caplog.set_level(logging.INFO)
    bearer = {"Authorization": f"Bearer {KEY}"}

    async def sockets(base):
        out = {}
        for path in ("/api/chat", "/v1/realtime"):
            out[path, "none"] = await _ws_status(f"ws://{base}{path}")
            out[path, "wrong"] = await _ws_status(f"ws://{base}{path}",
                                                  additional_headers={"Authorization": "Bearer no"})
            out[path, "bearer"] = await _ws_status(f"ws://{base}{path}", additional_headers=bearer)
            out[path, "query"] = await _ws_status(f"ws://{base}{path}?api_key={KEY}")
            out[path, "subprotocol"] = await _ws_status(f"ws://{base}{path}",
                                                        subprotocols=[f"openai-insecure-api-key.{KEY}"])
        return out

    with serve(app) as base:
        http = {path: get_json(base, path)[0] for path in
                ("/", "/app.js", "/health", "/ready", "/metrics", "/api/info", "/api/voices", "/no/such/door")}
        probes = {path: get_json(base, path)[0] for path in ("/livez", "/readyz", "/load")}
        with_key = {path: get_json(base, path, bearer)[0] for path in ("/api/info", "/api/voices")}
        by_query = get_json(base, f"/api/info?api_key={KEY}")[0]
        ws = asyncio.run(sockets(base))
    assert http == {"/": 200, "/app.js": 200, "/health": 200, "/ready": 200, "/metrics": 200,
                    "/api/info": 401, "/api/voices": 401, "/no/such/door": 401}  # default-deny
    assert with_key == {"/api/info": 200, "/api/voices": 200} and by_query == 200
    assert 401 not in probes.values(), probes  # load balancer probes carry no key
    for path in ("/api/chat", "/v1/realtime"):
        assert ws[path, "none"] == 401 and ws[path, "wrong"] == 401
        assert ws[path, "bearer"].startswith("101") and ws[path, "query"].startswith("101")
        # A browser that offered only the key subprotocol needs one back, or it fails the handshake.
        assert ws[path, "subprotocol"] == f"101 openai-insecure-api-key.{KEY}"
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert refusals and all(r.levelno < logging.ERROR for r in refusals)
    server_lines = [r.getMessage() for r in caplog.records if r.name.startswith(("parley", "uvicorn"))]
    assert not any(KEY in line for line in server_lines)


def test_metrics_can_be_protected_too():
    app, _ = delay_app(1, defaults=ServerDefaults(api_key=(KEY, "other"), protect_metrics=True))
    with serve(app) as base:
        assert get_json(base, "/metrics")[0] == 401
        assert get_json(base, "/metrics", {"Authorization": "Bearer other"})[0] == 200  # a second key: rotation
        assert get_json(base, "/health")[0] == 200


@pytest.mark.parametrize("allowed, origin, expected", [
    (None, None, 101),  # non-browser clients send no Origin: not checked
    (None, "SAME", 101),  # the built-in page
    (None, "http://evil.example", 403),
    (("https://app.example",), "https://app.example", 101),
    (("https://app.example",), "SAME", 403),
    (("*",), "http://anything.example", 101),
])
def test_origins(allowed, origin, expected):
    app, _ = delay_app(1, defaults=ServerDefaults(allowed_origins=allowed))
    with serve(app) as base:
        headers = {} if origin is None else {"Origin": f"http://{base}" if origin == "SAME" else origin}
        status = asyncio.run(_ws_status(f"ws://{base}/api/chat", additional_headers=headers))
    assert (int(str(status)[:3])) == expected, status


def test_keys_are_redacted_from_log_lines_and_compared_whole():
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", f"/api/chat?api_key={KEY}&text_prompt=hi", "1.1", 101), None)
    RedactKeys().filter(record)
    assert KEY not in record.getMessage() and "api_key=***&text_prompt=hi" in record.getMessage()
    assert key_matches(KEY, (KEY,)) and key_matches(KEY, ("a", KEY))
    assert not key_matches(KEY[:-1], (KEY,)) and not key_matches(None, (KEY,)) and not key_matches("", (KEY,))
    assert parse_origins("https://a.example, http://b.example:8080") == ("https://a.example", "http://b.example:8080")
    assert parse_origins("") is None and parse_origins("*") == ("*",)
    with pytest.raises(ValueError, match="not an origin"):
        parse_origins("a.example/path")


def test_tls_serves_wss_and_https(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    context = ssl.create_default_context(cafile=str(cert))
    context.check_hostname = False
    app, _ = delay_app(1)
    with serve(app, ssl_certfile=str(cert), ssl_keyfile=str(key)) as base:
        status = asyncio.run(_ws_status(f"wss://{base}/api/chat", ssl=context))
        with urllib.request.urlopen(f"https://{base}/health", context=context, timeout=5) as r:
            health = r.status
    assert str(status).startswith("101") and health == 200
