"""The process: `parley serve` exits 0 on SIGTERM / SIGINT with no traceback (also after a
refused oversized handshake), and exits 1 after a fatal engine error so a supervisor restarts it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from parley.realtime.server import run_app, uvicorn_config
from server_harness import chat_session, delay_app, free_port, tone

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"parley serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy in {timeout} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)


def _oversized_handshake(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"GET /api/chat?text_prompt={'p' * 9000} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                  "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                  "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return data


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_exits_0_without_traceback_after_an_oversized_handshake(tmp_path_factory, sig):
    cache = tmp_path_factory.getbasetemp() / "parley-cache"  # the demo model, written once for both
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    port = free_port()
    env = {**os.environ, "PARLEY_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "parley.realtime.cli", "serve", "--port", str(port), "--max-sessions", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, port, log)
            answers = [_oversized_handshake(port) for _ in range(3)]
            proc.send_signal(sig)
            code = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert all(a.startswith(b"HTTP/1.1 414 ") for a in answers)
    assert code == 0, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "Application shutdown complete" in text


def test_a_fatal_engine_error_makes_the_server_exit_1():
    app, _ = delay_app(2, fail_at_step=5)
    port = free_port()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(run_app(app, uvicorn_config(app, "127.0.0.1", port,
                                                                                       log_level="warning"))))
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        res = asyncio.run(chat_session(f"127.0.0.1:{port}", tone(300, 1.0), tail_seconds=0.5))
        thread.join(30)
    finally:
        if thread.is_alive():
            app.state.sessions.engine.shutdown()
            thread.join(15)
    assert res.close_code == 1011 and "engine failure" in res.close_reason
    assert "simulated" not in res.close_reason  # no exception text to clients: a request id instead
    assert result == [1]
