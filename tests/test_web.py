"""The browser voice-chat page (web/) in real headless Chromium.

Chromium gets a fake microphone fed from a WAV written here. The page connects to
`/api/chat`, streams the microphone as Ogg-Opus, plays the agent's audio through its
jitter buffer (checked inside the page through `window.parleyStats`: decoded and played
frame counts, the analyser level), shows the agent's text, and shows "server full" when
the only slot is taken by another client.

Two servers:
- `test_page_with_stub_server`: a small in-test starlette server that decodes the page's
  Ogg-Opus with sphn (so the page's Ogg framing, CRC and Opus are checked by an
  independent decoder) and echoes it back, re-encoded by sphn, with some text.
- `test_page_with_parley_serve`: the real `parley serve` on the echo checkpoint.

Needs Debian's chromium (tests/web_setup.sh installs it) and the `playwright` Python
package, driving /usr/bin/chromium; it never downloads a browser.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.error
import urllib.request
import wave
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "web"
CHROMIUM = os.environ.get("PARLEY_CHROMIUM", "/usr/bin/chromium")
PERSONA = "You are Ada, a cheerful test persona."
CHROME_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
]


def _need_browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"Chromium not installed at {CHROMIUM}: run `bash tests/web_setup.sh` (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("Python package `playwright` missing: run `bash tests/web_setup.sh`")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_speechlike_wav(path: Path, seconds: float = 4.0, rate: int = 48000) -> None:
    """A voiced, syllable-modulated signal (pitch glide + harmonics + 4 Hz envelope)."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 150 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum((0.6 / k) * np.sin(k * phase) for k in range(1, 8))
    envelope = 0.35 + 0.65 * np.clip(np.sin(2 * np.pi * 4 * t), 0, None) ** 0.5
    x = 0.3 * voiced * envelope
    pcm = np.clip(x * 32767, -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


# --------------------------------------------------------------------------- stub server


class StubServer:
    """Minimal /api/chat peer: handshake after a short 'prefill', sphn echo, text, 1013 when full."""

    def __init__(self, max_sessions: int = 1, stall_at: int | None = None, stall_s: float = 0.6,
                 prefill_s: float = 0.3):
        import sphn
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Mount, Route, WebSocketRoute
        from starlette.staticfiles import StaticFiles
        from starlette.websockets import WebSocketDisconnect

        self.max_sessions = max_sessions
        self.active = 0
        self.params: list[dict] = []
        self.rx_samples = 0
        self.rx_sumsq = 0.0
        self.rx_pages = 0
        self.tx_frames = 0
        self.full_refusals = 0
        # Network-stall simulation: after `stall_at` frames, hold the output back for
        # `stall_s` and then send the backlog at once (the page must drop, not lag).
        self.stall_at = stall_at
        self.stall_s = stall_s

        async def voices(_request):
            return JSONResponse({"voices": ["NATF0.pt", "NATM1.pt"], "default": "NATF0.pt"})

        async def chat(ws):
            await ws.accept()
            if self.active >= self.max_sessions:
                self.full_refusals += 1
                await ws.close(code=1013, reason="server full")
                return
            self.active += 1
            try:
                self.params.append(dict(ws.query_params))
                await asyncio.sleep(prefill_s)  # "prefill"
                await ws.send_bytes(b"\x00")
                reader = sphn.OpusStreamReader(24000)
                writer = sphn.OpusStreamWriter(24000)
                pending = np.zeros(0, np.float32)
                backlog: list[bytes] = []
                stall_until = None
                while True:
                    msg = await ws.receive()
                    if msg["type"] == "websocket.disconnect":
                        break
                    data = msg.get("bytes")
                    if not data or data[0] != 1:
                        continue
                    self.rx_pages += 1
                    pcm = np.asarray(reader.append_bytes(data[1:]), np.float32).reshape(-1)
                    self.rx_samples += pcm.size
                    self.rx_sumsq += float(np.sum(pcm.astype(np.float64) ** 2))
                    pending = np.concatenate([pending, pcm])
                    while pending.size >= 1920:
                        frame, pending = pending[:1920], pending[1920:]
                        out = writer.append_pcm(frame)
                        self.tx_frames += 1
                        if out:
                            backlog.append(b"\x01" + out)
                        if self.tx_frames % 4 == 0:
                            backlog.append(b"\x02" + f" echo{self.tx_frames // 4}".encode())
                        if self.stall_at is not None and self.tx_frames == self.stall_at:
                            stall_until = time.monotonic() + self.stall_s
                        if stall_until is not None and time.monotonic() < stall_until:
                            continue
                        for m in backlog:
                            await ws.send_bytes(m)
                        backlog.clear()
            except WebSocketDisconnect:
                pass
            finally:
                self.active -= 1

        app = Starlette(routes=[
            Route("/api/voices", voices),
            WebSocketRoute("/api/chat", chat),
            Mount("/", app=StaticFiles(directory=str(WEB), html=True)),
        ])
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(5)

    @property
    def rx_rms(self) -> float:
        return math.sqrt(self.rx_sumsq / self.rx_samples) if self.rx_samples else 0.0


# --------------------------------------------------------------------------- real server


def _real_server_available() -> str | None:
    """None when `parley serve` on the echo checkpoint can be tried, else why not."""
    if not (ROOT / "realtime" / "server/app.py").exists():
        return "realtime/server/app.py does not exist yet"
    try:
        from parley.models.synthetic import write_echo_checkpoint  # noqa: F401
        import parley.realtime.cli  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the state of the tree
        return f"server pieces not importable: {e!r}"
    return None


@contextlib.contextmanager
def parley_serve(tmp_path: Path, model: Path | None, max_sessions: int = 1, extra: tuple[str, ...] = ()):
    """`parley serve` in a subprocess; model None serves the built-in demo model (cached in tmp)."""
    port = _free_port()
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")
    cmd = [sys.executable, "-c", "import sys; from parley.realtime.cli import main; sys.exit(main())",
           "serve", "--host", "127.0.0.1", "--port", str(port), "--max-sessions", str(max_sessions),
           "--device", "cpu"]
    if model is not None:
        cmd += ["--model", str(model)]
    cmd += list(extra)
    env = {**os.environ, "PARLEY_CACHE": str(tmp_path / "parley-cache")}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"parley serve exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"parley serve not healthy in 60 s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# --------------------------------------------------------------------------- the browser run


def _stats(page) -> dict:
    return page.evaluate("() => JSON.parse(JSON.stringify(window.parleyStats))")


def _wait_state(page, state: str, timeout_ms: int = 15000) -> None:
    try:
        page.wait_for_function("s => window.parleyStats && window.parleyStats.state === s", arg=state, timeout=timeout_ms)
    except Exception as e:
        raise AssertionError(f"page never reached state {state!r}: {_stats(page)}") from e


def run_page_scenario(base_url: str, tmp_path: Path, *, expect_voices: list[str] | None,
                      screenshot: str | None = "parley_web", expect_drop: bool = False,
                      expect_text: bool = True, check_full: bool = True) -> dict:
    """Connect, stream the fake microphone, check audio (and text) come back and play; then,
    with `check_full`, a second page meets "server full" until the first disconnects."""
    from playwright.sync_api import sync_playwright

    wav = tmp_path / "mic.wav"
    write_speechlike_wav(wav)
    result: dict = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            # launch() gives Chromium a fresh temporary profile (its own --user-data-dir).
            args=CHROME_FLAGS + [f"--use-file-for-fake-audio-capture={wav}"],
        )
        try:
            context = browser.new_context(viewport={"width": 900, "height": 1000})
            origin = "{0.scheme}://{0.netloc}".format(urllib.parse.urlsplit(base_url))
            context.grant_permissions(["microphone"], origin=origin)
            console: list[str] = []
            page = context.new_page()
            page.on("console", lambda m: console.append(f"A {m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"A pageerror: {e}"))
            page.goto(base_url)
            page.locator("#headphones").wait_for()
            if expect_voices:
                page.wait_for_function("n => window.parleyStats.voices.length >= n", arg=len(expect_voices), timeout=5000)
                assert _stats(page)["voices"] == expect_voices
                page.select_option("#voice", expect_voices[-1])
            else:
                page.wait_for_timeout(300)
            page.wait_for_load_state("networkidle")  # /api/info says whether a persona can be given
            if _stats(page)["prompts"]:
                page.fill("#persona", PERSONA)
            else:  # a Moshi checkpoint: the page sends neither persona nor voice
                assert page.locator("#persona").is_disabled() and page.locator("#voice").is_disabled()
            page.click("#connect")
            _wait_state(page, "live", 20000)
            assert page.locator("#status-text").inner_text() == "Live"
            try:
                page.wait_for_function(
                    """(needText) => { const s = window.parleyStats;
                               return s.encodedFrames >= 50 && s.decodedFrames >= 20 && s.playedFrames >= 10
                                      && s.outputLevelMax > 0.005 && s.inputLevelMax > 0.005
                                      && (!needText || s.text.length > 0); }""",
                    arg=expect_text, timeout=20000,
                )
            except Exception as e:
                raise AssertionError(f"audio/text did not flow: {_stats(page)}\n" + "\n".join(console[-30:])) from e
            if expect_drop:
                try:
                    page.wait_for_function("() => window.parleyStats.droppedMs > 0", timeout=10000)
                except Exception as e:
                    raise AssertionError(f"the jitter buffer never dropped after a stall: {_stats(page)}") from e
            page.wait_for_timeout(1000)  # let the meters and the readout settle for the picture
            stats_a = _stats(page)
            if expect_text:  # what the page shows is what arrived (read in one go: text keeps coming)
                # The agent's text is its pane's; the user's words (0x07, when the server
                # transcribes) are in their own pane beside it.
                shown, received, user_shown, user_received = page.evaluate(
                    "() => [document.getElementById('transcript').textContent, window.parleyStats.text,"
                    " document.getElementById('user-transcript').textContent, window.parleyStats.userText]")
                assert shown.strip() and shown == received
                assert user_shown == user_received
                result_user_text = user_shown
            name = screenshot or "page"
            shot = tmp_path / f"{name}.png"
            page.screenshot(path=str(shot), full_page=True)
            if screenshot:
                shutil.copy(shot, f"/tmp/{name}.png")
            result = {"a": stats_a, "console": console, "user_text": result_user_text if expect_text else "",
                      "user_pane": page.locator("#user-pane").is_visible(),
                      "modalities": page.evaluate("() => window.parleyDoors.modalities"),
                      "notice": page.locator("#server-notice").inner_text() if page.locator("#server-notice").is_visible() else ""}
            if not check_full:
                page.keyboard.press("Escape")
                _wait_state(page, "disconnected", 5000)
                return result

            # A second client while the only slot is held: "server full", by keyboard.
            page_b = context.new_page()
            page_b.on("console", lambda m: console.append(f"B {m.type}: {m.text}"))
            page_b.goto(base_url)
            page_b.focus("#connect")
            page_b.keyboard.press("Enter")
            _wait_state(page_b, "full", 15000)
            assert page_b.locator("#status-text").inner_text() == "Server full"
            assert "busy" in page_b.locator("#status-detail").inner_text()
            stats_b = _stats(page_b)
            shot_b = tmp_path / f"{name}_full.png"
            page_b.screenshot(path=str(shot_b), full_page=True)
            if screenshot:
                shutil.copy(shot_b, f"/tmp/{name}_full.png")

            # Esc disconnects the first page; the freed slot admits the second.
            page.bring_to_front()
            page.keyboard.press("Escape")
            _wait_state(page, "disconnected", 5000)
            page_b.bring_to_front()
            page_b.wait_for_timeout(300)
            page_b.click("#connect")
            _wait_state(page_b, "live", 20000)
            page_b.click("#connect")
            _wait_state(page_b, "disconnected", 5000)
            result["b_full"] = stats_b
        finally:
            browser.close()
    return result


def _check_live_stats(s: dict, text: bool = True, max_buffer_ms: float = 120) -> None:
    """max_buffer_ms: the jitter buffer's aim (120 ms) against a server that keeps time; the
    player's hard cap (200 ms) against a real server whose delivery may come in bursts."""
    assert s["state"] == "live"
    assert s["sampleRate"] > 0
    assert s["sentPages"] >= s["encodedFrames"] >= 50
    assert s["decodedFrames"] >= 20 and s["playedFrames"] >= 10
    assert s["outputLevelMax"] > 0.005, s
    if text:
        assert s["text"].strip()
    # The jitter buffer keeps the added delay low and does not let it grow.
    assert s["avgBufferedMs"] < max_buffer_ms, s
    assert s["latencyMs"] < max_buffer_ms + 100, s


@pytest.mark.parametrize("rate", ["model", "device"])
def test_page_with_stub_server(tmp_path, rate):
    """rate=model: the page's AudioContext runs at 24 kHz; rate=device: at the device rate
    (44.1 or 48 kHz), resampling both ways, as in browsers that refuse a 24 kHz context.
    The device run also has the server stall its output for 0.6 s and then send the backlog
    at once: the jitter buffer must drop audio and come back to a low delay."""
    _need_browser()
    stall = rate == "device"  # the second run also stalls the server's output once
    with StubServer(max_sessions=1, stall_at=20 if stall else None) as server:
        query = "?rate=device" if rate == "device" else ""
        res = run_page_scenario(server.url + query, tmp_path, expect_voices=["NATF0.pt", "NATM1.pt"],
                                screenshot="parley_web_stub" if rate == "model" else None, expect_drop=stall)
        params = server.params[0]
        assert params.get("text_prompt") == PERSONA
        assert params.get("voice_prompt") == "NATM1.pt"
        # sphn decoded the page's Ogg-Opus stream, and it carries the microphone signal.
        assert server.rx_samples > 24000, server.rx_samples
        assert server.rx_rms > 0.01, server.rx_rms
        assert server.full_refusals >= 1
    _check_live_stats(res["a"])
    assert (res["a"]["sampleRate"] == 24000) == (rate == "model"), res["a"]["sampleRate"]
    assert res["b_full"]["closeCode"] == 1013
    if stall:
        assert res["a"]["droppedMs"] > 0
    print(json.dumps({k: res["a"][k] for k in ("sampleRate", "decodedFrames", "playedFrames", "avgBufferedMs", "latencyMs",
                                               "marginMs", "underruns", "droppedMs", "rxRealtime", "outputLevelMax",
                                               "inputLevelMax")}))


def _need_server():
    why = _real_server_available()
    if why:
        pytest.skip(f"parley serve not available: {why}")


def test_page_with_parley_serve_echo(tmp_path):
    """`parley serve --model <echo checkpoint> --max-sessions 1`: the microphone comes back as the
    agent's voice through the whole real stack; a second page meets "server full"."""
    _need_browser()
    _need_server()
    from parley.models.synthetic import write_echo_checkpoint

    ckpt = write_echo_checkpoint(tmp_path / "echo_ckpt")
    with parley_serve(tmp_path, ckpt, max_sessions=1) as url:
        # The echo speaks a word per frame, derived from the microphone's codes.
        res = run_page_scenario(url + "?transport=websocket", tmp_path, expect_voices=None, screenshot="parley_web")
    _check_live_stats(res["a"], max_buffer_ms=200)
    # The real server refuses the upgrade with HTTP 503, which a browser reports as 1006; the page
    # then read /readyz (no free slot) to show "Server full".
    assert res["b_full"]["closeCode"] == 1006
    assert not res["user_pane"]  # no STT: the agent's text alone
    print(json.dumps({k: res["a"][k] for k in ("decodedFrames", "decodedMs", "playedFrames", "avgBufferedMs",
                                               "latencyMs", "underruns", "droppedMs", "rxRealtime", "outputLevelMax")}))


def test_page_behind_an_api_key_passes_it_on(tmp_path):
    """`parley serve --api-key`: /api/info refuses a keyless request, and the page opened as
    /?api_key=KEY loads its info and talks (the key rides on every fetch and the WebSocket)."""
    _need_browser()
    _need_server()
    from parley.models.synthetic import write_echo_checkpoint

    ckpt = write_echo_checkpoint(tmp_path / "echo_ckpt")
    with parley_serve(tmp_path, ckpt, max_sessions=1, extra=("--api-key", "sesame")) as url:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url + "api/info", timeout=5)
        assert refused.value.code == 401
        res = run_page_scenario(url + "?api_key=sesame&transport=websocket", tmp_path, expect_voices=None, screenshot=None,
                                check_full=False)
    _check_live_stats(res["a"], max_buffer_ms=200)
    assert res["modalities"] == ["duplex"]  # GET /v1/models, sent with the key as a bearer token


def test_page_with_parley_serve_demo(tmp_path):
    """Plain `parley serve` (the built-in demo model, a tiny PersonaPlex): the page lists its 18
    voices, takes a persona and the last voice, says it babbles, and the agent's text and voice arrive."""
    from parley.realtime.server.demo_model import PERSONAPLEX_VOICES
    _need_browser()
    _need_server()
    voices = sorted(f"{v}.pt" for v in PERSONAPLEX_VOICES)
    with parley_serve(tmp_path, None, max_sessions=1) as url:
        res = run_page_scenario(url + "?transport=websocket", tmp_path, expect_voices=voices,
                                screenshot="parley_web_demo", check_full=False)
    assert res["a"]["prompts"] is True  # the persona box was enabled and filled
    _check_live_stats(res["a"], max_buffer_ms=200)
    assert "babble" in res["notice"], res["notice"]
    assert res["user_text"].strip(), "the demo's tiny STT should show (nonsense) user words"
    assert res["user_pane"], "the user's words show beside the agent's"


# --------------------------------------------------------------------------- web/ogg.js unit check


def _py_crc(data: bytes) -> int:
    crc = 0
    for b in data:
        crc ^= b << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else (crc << 1)
            crc &= 0xFFFFFFFF
    return crc


def _py_page(segments: list[int], body: bytes, *, cont=False, bos=False, granule=0, serial=7, seq=0) -> bytes:
    header = bytearray(b"OggS" + bytes([0, (1 if cont else 0) | (2 if bos else 0)])
                       + granule.to_bytes(8, "little", signed=True) + serial.to_bytes(4, "little")
                       + seq.to_bytes(4, "little") + b"\0\0\0\0" + bytes([len(segments)]) + bytes(segments))
    page = header + body
    page[22:26] = _py_crc(bytes(page)).to_bytes(4, "little")
    return bytes(page)


def _py_parse_pages(data: bytes) -> list[dict]:
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos:pos + 4] == b"OggS"
        nseg = data[pos + 26]
        lacing = list(data[pos + 27:pos + 27 + nseg])
        total = 27 + nseg + sum(lacing)
        page = bytearray(data[pos:pos + total])
        crc = int.from_bytes(page[22:26], "little")
        page[22:26] = b"\0\0\0\0"
        assert _py_crc(bytes(page)) == crc, "bad CRC"
        body, packets, cur = bytes(page[27 + nseg:]), [], b""
        off = 0
        for lace in lacing:
            cur += body[off:off + lace]
            off += lace
            if lace < 255:
                packets.append(cur)
                cur = b""
        pages.append({"type": page[5], "granule": int.from_bytes(page[6:14], "little", signed=True),
                      "serial": int.from_bytes(page[14:18], "little"), "seq": int.from_bytes(page[18:22], "little"),
                      "packets": packets})
        pos += total
    return pages


def test_ogg_module_against_python(tmp_path):
    """web/ogg.js (run in Chromium) against an independent Python Ogg implementation."""
    _need_browser()
    from playwright.sync_api import sync_playwright

    sizes = [1, 254, 255, 256, 510, 1000]
    rng = np.random.default_rng(0)
    packets = [bytes([0xF8]) + rng.integers(0, 256, n - 1, dtype=np.uint8).tobytes() for n in sizes]
    # A stream for the reader: a packet spanning three pages, a garbage prefix, a page with a
    # broken CRC (dropped, with no effect on the next page), pages split at odd places.
    big = rng.integers(0, 256, 600, dtype=np.uint8).tobytes()
    small = [b"\x01" * 100, b"\x02" * 255, b"\x03" * 5]
    stream = b"junk!" + _py_page([100, 255, 0], small[0] + small[1], bos=True)
    stream += _py_page([255], big[:255], seq=1)
    stream += _py_page([255], big[255:510], cont=True, seq=2)
    stream += _py_page([90, 5], big[510:] + small[2], cont=True, seq=3)
    broken = bytearray(_py_page([3], b"bad", seq=4))
    broken[-1] ^= 0xFF
    stream += bytes(broken) + _py_page([4], b"good", seq=5)
    cuts = [0, 3, 40, 41, 300, 700, 1100, len(stream)]
    chunks = [list(stream[a:b]) for a, b in zip(cuts, cuts[1:])]

    with StubServer() as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_FLAGS)
        try:
            page = browser.new_page()
            page.goto(server.url)
            out = page.evaluate(
                """async ([packets, chunks]) => {
                    const m = await import('/ogg.js');
                    const w = new m.OggOpusWriter({ framesPerPage: 2, serial: 1234 });
                    const pages = w.headerPages(312);
                    for (const p of packets) { const pg = w.addPacket(new Uint8Array(p)); if (pg) pages.push(pg); }
                    const written = [];
                    for (const pg of pages) written.push(...pg);
                    const r = new m.OggReader();
                    const read = [];
                    for (const c of chunks) for (const pkt of r.push(new Uint8Array(c))) read.push(Array.from(pkt));
                    return { written, read, bad: r.badPages, durs: packets.map((p) => m.opusPacketSamples48k(new Uint8Array(p))) };
                }""",
                [[list(x) for x in packets], chunks],
            )
        finally:
            browser.close()

    pages = _py_parse_pages(bytes(out["written"]))
    assert [pg["seq"] for pg in pages] == list(range(len(pages)))
    assert len({pg["serial"] for pg in pages}) == 1 and pages[0]["serial"] == 1234
    assert pages[0]["type"] == 2 and all(pg["type"] == 0 for pg in pages[1:])  # BOS only on the first
    head, tags = pages[0]["packets"][0], pages[1]["packets"][0]
    assert head[:8] == b"OpusHead" and head[8] == 1 and head[9] == 1
    assert int.from_bytes(head[10:12], "little") == 312 and int.from_bytes(head[12:16], "little") == 24000
    assert tags[:8] == b"OpusTags"
    audio = [pkt for pg in pages[2:] for pkt in pg["packets"]]
    assert audio == packets
    assert [pg["granule"] for pg in pages[2:]] == [960 * 2, 960 * 4, 960 * 6]  # 0xF8: one 20 ms CELT frame
    assert out["durs"] == [960] * len(packets)
    assert [bytes(x) for x in out["read"]] == [small[0], small[1], big, small[2], b"good"]
    assert out["bad"] >= 1


# --------------------------------------------------------------------------- download recording


def test_page_recording_downloads_both_sides_as_heard(tmp_path):
    """After a call with the echo stub, "Download recording" saves a stereo WAV: the microphone
    left, the agent as played right, the echo lined up a round trip later."""
    _need_browser()
    import soundfile
    from playwright.sync_api import sync_playwright

    wav = tmp_path / "mic.wav"
    write_speechlike_wav(wav)
    with StubServer(max_sessions=1) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=CHROME_FLAGS + [f"--use-file-for-fake-audio-capture={wav}"])
        try:
            context = browser.new_context(accept_downloads=True)
            origin = "{0.scheme}://{0.netloc}".format(urllib.parse.urlsplit(server.url))
            context.grant_permissions(["microphone"], origin=origin)
            page = context.new_page()
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.goto(server.url)
            assert page.locator("#download").is_disabled()  # nothing recorded yet
            page.click("#connect")
            _wait_state(page, "live", 20000)
            try:
                page.wait_for_function("() => window.parleyStats.recordedMs > 2500"
                                       " && window.parleyStats.playedFrames > 20", timeout=20000)
            except Exception as e:
                raise AssertionError(f"nothing recorded: {_stats(page)}\n" + "\n".join(console[-20:])) from e
            page.keyboard.press("Escape")
            _wait_state(page, "disconnected", 5000)
            stats = _stats(page)
            with page.expect_download() as download:
                page.click("#download")  # still there after the call ended
            path = tmp_path / "recording.wav"
            download.value.save_as(path)
            assert download.value.suggested_filename.startswith("parley-")
        finally:
            browser.close()
    audio, rate = soundfile.read(path, dtype="float32")
    assert rate == stats["sampleRate"] and audio.ndim == 2 and audio.shape[1] == 2
    assert abs(audio.shape[0] / rate * 1000 - stats["recordedMs"]) < 50
    mic, agent = audio[:, 0], audio[:, 1]
    assert np.sqrt(np.mean(mic ** 2)) > 0.005 and np.sqrt(np.mean(agent ** 2)) > 0.005
    # the agent's channel is the microphone's echo, one round trip (< 0.6 s) later
    env = [np.convolve(np.abs(x), np.ones(rate // 100) / (rate // 100), mode="same")[::rate // 100] for x in (mic, agent)]
    env = [(e - e.mean()) / (e.std() or 1) for e in env]
    lags = range(0, 60)  # 10 ms steps
    corr = [float(np.mean(env[0][:len(env[0]) - lag] * env[1][lag:])) for lag in lags]
    best = int(np.argmax(corr))
    print("recording: %.2f s at %d Hz, echo lag %d ms, envelope correlation %.2f" % (
        audio.shape[0] / rate, rate, best * 10, corr[best]))
    assert corr[best] > 0.5, corr[best]


def test_page_over_webrtc_with_parley_serve_echo(tmp_path):
    """The page's default where the server offers WebRTC: GPT-Live's POST /v1/live/sessions with
    the SDP offer, the fake microphone on an Opus track with getUserMedia's echo cancellation
    applied, the echo of it back on the server's track (played by a media element, so the echo
    canceller knows it), the model's text from the data channel; no console errors; a second page
    meets "server full" (the call's 503) until the first hangs up."""
    _need_browser()
    _need_server()
    from playwright.sync_api import sync_playwright
    from parley.models.synthetic import write_echo_checkpoint

    ckpt = write_echo_checkpoint(tmp_path / "echo_ckpt")
    wav = tmp_path / "mic.wav"
    write_speechlike_wav(wav)
    with parley_serve(tmp_path, ckpt, max_sessions=1) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=CHROME_FLAGS + [f"--use-file-for-fake-audio-capture={wav}"])
        try:
            context = browser.new_context(viewport={"width": 900, "height": 1000})
            context.grant_permissions(["microphone"], origin=url.rstrip("/"))
            console: list[str] = []
            page = context.new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.goto(url)
            page.wait_for_load_state("networkidle")
            assert "cancels the agent's voice" in page.locator("#headphones").inner_text()
            page.click("#connect")
            _wait_state(page, "live", 30000)
            try:
                page.wait_for_function(
                    """() => { const s = window.parleyStats;
                               return s.rtcPacketsSent >= 50 && s.rtcPacketsReceived >= 50
                                      && s.outputLevelMax > 0.005 && s.inputLevelMax > 0.005 && s.text.length > 0; }""",
                    timeout=30000)
            except Exception as e:
                raise AssertionError(f"audio/text did not flow over WebRTC: {_stats(page)}\n" + "\n".join(console)) from e
            stats = _stats(page)
            assert stats["transport"] == "webrtc" and stats["echoCancellation"] is True, stats
            page.screenshot(path=str(tmp_path / "webrtc.png"), full_page=True)
            shutil.copy(tmp_path / "webrtc.png", "/tmp/parley_web_webrtc.png")
            page_b = context.new_page()
            page_b.on("console", lambda m: console.append(f"B {m.type}: {m.text}"))
            page_b.goto(url)
            page_b.wait_for_load_state("networkidle")
            page_b.click("#connect")
            _wait_state(page_b, "full", 15000)
            page.bring_to_front()
            page.keyboard.press("Escape")
            _wait_state(page, "disconnected", 5000)
            errors = [line for line in console if line.startswith(("error", "pageerror", "B error"))
                      and "503" not in line]  # the refused call's fetch logs its 503
            assert not errors, errors
        finally:
            browser.close()


# --------------------------------------------------------------------------- the other doors' sections

SCREENSHOTS_ENV = "PARLEY_WEB_SCREENSHOTS"  # e.g. docs/figures/web: where the sections' pictures go


def _screenshot_dir(tmp_path: Path) -> Path:
    """$PARLEY_WEB_SCREENSHOTS (relative to the repository) when set, else the test's tmp folder."""
    asked = os.environ.get(SCREENSHOTS_ENV)
    folder = (ROOT / asked) if asked else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _wait_door(page, name: str, timeout_ms: int = 120000) -> dict:
    """Waits for a section's request to end (window.parleyDoors[name].state done or error)."""
    try:
        page.wait_for_function("n => ['done', 'error'].includes(window.parleyDoors[n].state)", arg=name,
                               timeout=timeout_ms)
    except Exception as e:
        raise AssertionError(f"the {name} section never finished: "
                             f"{page.evaluate('() => window.parleyDoors')}") from e
    return page.evaluate("n => window.parleyDoors[n]", name)


def _blob_bytes(page, selector: str) -> bytes:
    """The bytes behind a media element's blob: address, as the page holds them."""
    data = page.evaluate("async (sel) => Array.from(new Uint8Array(await (await fetch("
                         "document.querySelector(sel).src)).arrayBuffer()))", selector)
    return bytes(data)


def _chat_section(page, shots: Path) -> None:
    """Over the page's default transport (WebRTC, GPT-Live's door), the demo's paired STT puts
    the user's words in their pane beside the agent's."""
    page.fill("#persona", PERSONA)
    page.click("#connect")
    _wait_state(page, "live", 30000)
    try:  # a line or so each, for the picture
        page.wait_for_function("() => window.parleyStats.text.trim().length > 40"
                               " && window.parleyStats.userText.trim().length > 20", timeout=30000)
    except Exception as e:
        raise AssertionError(f"no text from both sides: {_stats(page)}") from e
    stats = _stats(page)
    assert stats["transport"] == "webrtc", stats
    assert page.locator("#user-pane").is_visible()
    shown = page.evaluate("() => [document.getElementById('user-transcript').textContent, window.parleyStats.userText]")
    assert shown[0] == shown[1]
    page.locator("#chat").screenshot(path=str(shots / "chat.png"))
    page.keyboard.press("Escape")
    _wait_state(page, "disconnected", 5000)


def _speech_section(page, shots: Path, tmp_path: Path) -> Path:
    """POST /v1/audio/speech: the voice list is the door's; the WAV the page plays is real speech."""
    import soundfile
    from parley.realtime.server.demo_model import OPENAI_VOICE_NAMES

    voices = page.eval_on_selector_all("#speech-voice option", "os => os.map((o) => o.value)")
    assert set(OPENAI_VOICE_NAMES) <= set(voices), voices
    page.fill("#speech-input", "Hello from the page.")
    page.select_option("#speech-voice", "nova")
    page.click("#speech-go")
    done = _wait_door(page, "speech")
    assert done["state"] == "done", done
    page.wait_for_function("() => document.getElementById('speech-audio').duration > 0", timeout=10000)
    wav = tmp_path / "spoken.wav"
    wav.write_bytes(_blob_bytes(page, "#speech-audio"))
    audio, rate = soundfile.read(wav, dtype="float32")
    assert len(wav.read_bytes()) == done["bytes"]
    assert rate == 24000 and len(audio) / rate > 0.5 and np.sqrt(np.mean(audio ** 2)) > 0.001
    assert "of speech" in page.locator("#speech-status").inner_text()
    page.locator("#speech-section").screenshot(path=str(shots / "speech.png"))
    return wav


def _transcription_section(page, shots: Path, url: str, spoken: Path) -> None:
    """POST /v1/audio/transcriptions: an uploaded file gives what the openai SDK gets for it (the
    STT is greedy); a recording of the (fake) microphone is sent as a mono WAV and transcribed."""
    from openai import OpenAI

    page.set_input_files("#transcribe-file", str(spoken))
    page.click("#transcribe-go")
    done = _wait_door(page, "transcription")
    assert done["state"] == "done" and done["clipBytes"] == spoken.stat().st_size, done
    sdk = OpenAI(base_url=url + "v1", api_key="unused")
    with open(spoken, "rb") as f:
        expected = sdk.audio.transcriptions.create(model="whisper-1", file=f).text
    assert done["text"] == expected and expected.strip()
    assert page.locator("#transcribe-text").inner_text() == expected

    page.click("#transcribe-record")
    page.wait_for_function("() => window.parleyDoors.transcription.recordingMs >= 2000", timeout=15000)
    page.click("#transcribe-record")  # Stop
    page.wait_for_function("() => window.parleyDoors.transcription.recordedMs > 0", timeout=5000)
    recorded = page.evaluate("() => window.parleyDoors.transcription")
    clip = spoken.with_name("recorded.wav")
    clip.write_bytes(_blob_bytes(page, "#transcribe-audio"))
    with wave.open(str(clip)) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        assert abs(w.getnframes() / w.getframerate() * 1000 - recorded["recordedMs"]) < 25
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32768
    assert recorded["recordedMs"] >= 2000 and np.sqrt(np.mean(pcm ** 2)) > 0.01  # the fake microphone's signal
    page.click("#transcribe-go")  # its handler marks the request busy before it returns
    done = _wait_door(page, "transcription")
    assert done["state"] == "done" and done["text"].strip(), done
    page.locator("#transcribe-section").screenshot(path=str(shots / "transcription.png"))


def _image_section(page, shots: Path) -> None:
    """POST /v1/images/generations, streamed: a size the server refuses shows its message; the
    demo's native size streams previews, then the image."""
    page.fill("#image-size", "4096x4096")
    page.click("#image-go")
    refused = _wait_door(page, "image")
    assert refused["state"] == "error" and "size" in refused["message"], refused
    assert page.locator("#image-status").inner_text() == refused["message"]
    page.fill("#image-size", "auto")
    page.click("#image-go")
    done = _wait_door(page, "image")
    assert done["state"] == "done", done
    page.wait_for_function("() => window.parleyDoors.image.width > 0", timeout=5000)
    done = page.evaluate("() => window.parleyDoors.image")
    assert (done["width"], done["height"]) == (16, 16) and done["partials"] >= 1, done
    page.locator("#image-section").screenshot(path=str(shots / "image.png"))


def test_page_sections_with_parley_serve_demo(tmp_path):
    """Plain `parley serve` (the demo serves a duplex model with a paired STT, a TTS, an STT and an
    image model): the page shows the user's words beside the agent's, and a section for each other
    modality /v1/models lists, each driven through its door as a client would. One screenshot a
    section: to $PARLEY_WEB_SCREENSHOTS (docs/figures/web for docs/web.md) or the tmp folder."""
    _need_browser()
    _need_server()
    from playwright.sync_api import sync_playwright

    shots = _screenshot_dir(tmp_path)
    wav = tmp_path / "mic.wav"
    write_speechlike_wav(wav, seconds=10.0)
    with parley_serve(tmp_path, None, max_sessions=1) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=CHROME_FLAGS + [f"--use-file-for-fake-audio-capture={wav}"])
        try:
            context = browser.new_context(viewport={"width": 900, "height": 1000})
            context.grant_permissions(["microphone"], origin=url.rstrip("/"))
            console: list[str] = []
            page = context.new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.goto(url)
            page.wait_for_function("() => window.parleyDoors && window.parleyDoors.ready", timeout=10000)
            assert set(page.evaluate("() => window.parleyDoors.modalities")) == {"duplex", "tts", "stt", "image"}
            for section in ("#speech-section", "#transcribe-section", "#image-section"):
                assert page.locator(section).is_visible(), section
            _chat_section(page, shots)
            spoken = _speech_section(page, shots, tmp_path)
            _transcription_section(page, shots, url, spoken)
            _image_section(page, shots)
            errors = [line for line in console if line.startswith(("error", "pageerror")) and "400" not in line]
            assert not errors, errors  # the refused size's fetch logs its 400
        finally:
            browser.close()
    assert sorted(f.name for f in shots.glob("*.png")) == ["chat.png", "image.png", "speech.png", "transcription.png"]


def test_page_shows_no_sections_for_a_server_without_them(tmp_path):
    """`parley serve --model <echo checkpoint>` serves the duplex model alone: /v1/models lists
    no other modality, so no section shows, and the user's pane neither (no STT)."""
    _need_browser()
    _need_server()
    from playwright.sync_api import sync_playwright
    from parley.models.synthetic import write_echo_checkpoint

    ckpt = write_echo_checkpoint(tmp_path / "echo_ckpt")
    with parley_serve(tmp_path, ckpt, max_sessions=1) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_FLAGS)
        try:
            page = browser.new_page()
            page.goto(url)
            page.wait_for_function("() => window.parleyDoors && window.parleyDoors.ready", timeout=10000)
            page.wait_for_load_state("networkidle")
            assert page.evaluate("() => window.parleyDoors.modalities") == ["duplex"]
            for section in ("#speech-section", "#transcribe-section", "#image-section", "#user-pane"):
                assert page.locator(section).is_hidden(), section
        finally:
            browser.close()


def test_page_translation_section_with_parley_serve_demo_hibiki(tmp_path):
    """`parley serve --demo hibiki` (a tiny Hibiki-Zero): /v1/models lists a translation model and no
    conversational one, so the page hides the conversation and shows the translation section, which
    streams a file, then the (fake) microphone, through WS /v1/realtime/translations as the openai
    SDK would: 200 ms appends, session.close, the translated audio and its transcript back, and
    session.closed once the translation is complete."""
    _need_browser()
    _need_server()
    from playwright.sync_api import sync_playwright

    shots = _screenshot_dir(tmp_path)
    wav = tmp_path / "source.wav"
    write_speechlike_wav(wav, seconds=5.0)
    with parley_serve(tmp_path, None, max_sessions=1, extra=("--demo", "hibiki")) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=CHROME_FLAGS + [f"--use-file-for-fake-audio-capture={wav}"])
        try:
            context = browser.new_context(viewport={"width": 900, "height": 700})
            context.grant_permissions(["microphone"], origin=url.rstrip("/"))
            console: list[str] = []
            page = context.new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.goto(url)
            page.wait_for_function("() => window.parleyDoors && window.parleyDoors.ready", timeout=10000)
            assert "translation" in page.evaluate("() => window.parleyDoors.modalities")
            assert page.locator("#translate-section").is_visible() and page.locator("#chat").is_hidden()
            page.set_input_files("#translate-file", str(wav))
            page.click("#translate-go")
            done = _wait_door(page, "translation")
            assert done["state"] == "done" and done["closed"] and not done["errors"], done
            assert done["sentMs"] >= 4900 and done["audioMs"] >= done["sentMs"], done
            assert done["text"] and page.locator("#translate-text").inner_text() == done["text"].strip()
            assert page.locator("#translate-audio").is_visible()
            page.locator("#translate-section").screenshot(path=str(shots / "translation.png"))
            page.click("#translate-mic")
            page.wait_for_function("() => window.parleyDoors.translation.sentMs >= 2000", timeout=15000)
            page.click("#translate-mic")  # Stop: session.close, then the translation still owed
            done = _wait_door(page, "translation")
            assert done["state"] == "done" and done["closed"] and done["audioMs"] >= 2000, done
            errors = [line for line in console if line.startswith(("error", "pageerror"))]
            assert not errors, errors
        finally:
            browser.close()
