"""The process: `parley serve` exits 0 on SIGTERM / SIGINT with no traceback (also after a
refused oversized handshake), and exits 1 after a fatal engine error so a supervisor restarts it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from attacks import oversized_handshake
from parley.realtime.server.serve import run_app, uvicorn_config
from server_harness import chat_session, delay_app, free_port, tone, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


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
            wait_healthy(proc, port, log)
            answers = [oversized_handshake("127.0.0.1", port) for _ in range(3)]
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
