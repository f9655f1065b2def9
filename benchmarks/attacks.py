"""Misbehaving clients against a real `parley serve`, with observer sessions measuring their own
cadence meanwhile: the figures in docs/reliability.md.

    python benchmarks/attacks.py --spawn tiny                 # starts `parley serve` itself (CPU)
    python benchmarks/attacks.py --url ws://127.0.0.1:8998    # against a running server

For each attack, `--observers` /api/chat clients (benchmarks/load.py's paced client) stream for
`--seconds` while one client misbehaves; printed per attack: what the attacker got (close code
and reason, or error events), the observers' audio messages per second and largest gap, the
engine's skipped ticks during the attack, and attack-specific figures (RSS, open fds, frames
dropped for lag). An observer at full cadence gets 12.5 messages/s.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import socket
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import FRAME, FRAME_S, SR, client, spawned_server  # noqa: E402


def metric(http: str, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def _drain_until_closed(ws, timeout: float) -> None:
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except (ConnectionClosed, asyncio.TimeoutError):
        pass


# ---- attacks: each returns a dict of figures ----

async def critical(url: str, http: str) -> dict:
    async with connect(f"{url}/api/chat?text_temperature=1e39", open_timeout=30) as ws:
        await _drain_until_closed(ws, 10)
        code, reason = ws.close_code, ws.close_reason
    await asyncio.sleep(1.0)
    health = urllib.request.urlopen(f"{http}/health", timeout=5).status
    return {"close": code, "reason": reason, "health_after": health}


async def flood(url: str, http: str, payload: bytes = b"\x06") -> dict:
    sent = 0
    start = time.monotonic()
    async with connect(f"{url}/api/chat", open_timeout=30, compression=None) as ws:
        await asyncio.wait_for(ws.recv(), 30)
        start = time.monotonic()
        try:
            while time.monotonic() - start < 10:
                await ws.send(payload)
                sent += 1
                if sent % 64 == 0:
                    await asyncio.sleep(0)
        except ConnectionClosed:
            pass
        await _drain_until_closed(ws, 5)
        return {"close": ws.close_code, "reason": ws.close_reason, "sent": sent,
                "closed_after_s": round(time.monotonic() - start, 2)}


async def _realtime(url: str, **kwargs):
    ws = await connect(f"{url}/v1/realtime", open_timeout=30, max_size=None, compression=None, **kwargs)
    assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "session.created"
    return ws


async def big_items(url: str, http: str, items: int = 64, size: int = 1 << 20) -> dict:
    rss0 = metric(http, "process_resident_memory_bytes")
    ws = await _realtime(url)
    accepted = refused = 0
    try:  # as fast as it can: the byte-rate limit may close it before the budget refuses items
        for i in range(items):
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * size}]}}))
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if event["type"] == "error":
                    refused += 1
                    break
                if event["type"] in ("conversation.item.created", "conversation.item.added"):
                    accepted += 1
                    break
    except ConnectionClosed:
        pass
    rss1 = metric(http, "process_resident_memory_bytes")
    await ws.close()
    close = (ws.close_code, ws.close_reason)
    await asyncio.sleep(2.0)
    rss2 = metric(http, "process_resident_memory_bytes")
    return {"accepted": accepted, "refused": refused, "close": close, "rss_during_mb": round((rss1 - rss0) / 2**20, 1),
            "rss_after_close_mb": round((rss2 - rss0) / 2**20, 1)}


async def deep_json(url: str, http: str, depth: int = 100_000) -> dict:
    ws = await _realtime(url)
    start = time.monotonic()
    await ws.send('{"type":"x","a":' + "[" * depth + "]" * depth + "}")
    event = json.loads(await asyncio.wait_for(ws.recv(), 30))
    took = time.monotonic() - start
    await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    after = json.loads(await asyncio.wait_for(ws.recv(), 30))["type"]
    await ws.close()
    return {"reply": f"{event['type']}/{event.get('error', {}).get('code')}", "reply_ms": round(took * 1000, 1),
            "next_event": after}


async def stalled_reader(url: str, http: str, stall: float = 8.0) -> dict:
    """A realtime client (small receive buffer) stops reading for `stall` s while its input keeps
    coming, then reads for 3 s: how many audio deltas it gets (live would be ~38), and how many
    frames the server dropped for lag (tests/reliability asserts on both)."""
    dropped0 = metric(http, "parley_lag_dropped_frames_total", '{protocol="openai"}')
    host, port = url.removeprefix("ws://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    sock.connect((host, int(port)))
    ws = await _realtime(url, max_queue=2, sock=sock)
    await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
    # Without turn detection the server answers only when asked: one response, open while the echo speaks.
    await ws.send(json.dumps({"type": "response.create"}))
    t = np.arange(int((stall + 6) * SR)) / SR
    audio = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)

    async def feed():
        for i in range(audio.size // FRAME):
            pcm16 = (audio[i * FRAME:(i + 1) * FRAME] * 32767).astype("<i2").tobytes()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode()}))
            await asyncio.sleep(FRAME_S)

    feeder = asyncio.create_task(feed())
    await asyncio.sleep(stall)
    resumed = time.monotonic()
    deltas = 0
    while (left := resumed + 3.0 - time.monotonic()) > 0:
        try:
            event = json.loads(await asyncio.wait_for(ws.recv(), left))
        except asyncio.TimeoutError:
            break
        deltas += event["type"] == "response.output_audio.delta"
    feeder.cancel()
    await ws.close()
    dropped = metric(http, "parley_lag_dropped_frames_total", '{protocol="openai"}') - dropped0
    return {"stall_s": stall, "audio_deltas_in_3s_after": deltas, "live_would_be": round(3.0 / FRAME_S),
            "frames_dropped": int(dropped)}


def oversized_handshake(host: str, port: int, length: int = 9000) -> bytes:
    """An upgrade request whose request line is over the 8 KiB limit; everything the server
    answers until it closes the connection (tests/reliability uses it too)."""
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"GET /api/chat?text_prompt={'p' * length} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                  "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                  "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return data


async def oversized_handshakes(url: str, http: str, n: int = 20) -> dict:
    fds0 = metric(http, "process_open_fds")
    host, port = url.removeprefix("ws://").split(":")
    answers = []
    for _ in range(n):
        answers.append(await asyncio.to_thread(oversized_handshake, host, int(port)))
    await asyncio.sleep(1.0)
    return {"answered_414": sum(a.startswith(b"HTTP/1.1 414") for a in answers), "of": n,
            "open_fds_delta": int(metric(http, "process_open_fds") - fds0)}


ATTACKS = {
    "none": None,
    "critical text_temperature=1e39": critical,
    "flood 0x06": flood,
    "flood empty 0x01": lambda url, http: flood(url, http, b"\x01"),
    "realtime 64 x 1 MiB items": big_items,
    "realtime 100k-deep JSON": deep_json,
    "realtime reader stalled 8 s": stalled_reader,
    "20 handshakes over 8 KiB": oversized_handshakes,
}


async def run_attack(url: str, http: str, name: str, observers: int, seconds: float) -> dict:
    skipped0 = metric(http, "parley_engine_skipped_ticks_total")
    gate = asyncio.Event()
    watchers = [asyncio.create_task(client(url, i, seconds, gate)) for i in range(observers)]
    await asyncio.sleep(1.0)  # observers connected and prefilled
    gate.set()
    await asyncio.sleep(0.5)
    attack = ATTACKS[name]
    result = await attack(url, http) if attack is not None else {}
    stats = await asyncio.gather(*watchers)
    rates, gaps = [], []
    for s in stats:
        arrivals = np.array(s.arrivals[2:])
        if arrivals.size > 1:
            rates.append((arrivals.size - 1) / (arrivals[-1] - arrivals[0]))
            gaps.append(float(np.diff(arrivals).max()))
    result.update({"observer_msgs_per_s_min": round(min(rates), 2) if rates else 0.0,
                   "observer_gap_max_ms": round(max(gaps) * 1000) if gaps else None,
                   "skipped_ticks": int(metric(http, "parley_engine_skipped_ticks_total") - skipped0)})
    return result


async def run_all(url: str, observers: int, seconds: float, only: list[str] | None) -> None:
    http = url.replace("ws://", "http://")
    for name in ATTACKS:
        if only and name not in only:
            continue
        result = await run_attack(url, http, name, observers, seconds)
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in result.items()), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server, ws://HOST:PORT")
    p.add_argument("--spawn", default=None, help="tiny | echo | checkpoint dir: run `parley serve` for the run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--observers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0, help="how long each observer streams per attack")
    p.add_argument("--only", nargs="*", default=None, help="attack names to run (default: all)")
    args = p.parse_args(argv)
    if (args.url is None) == (args.spawn is None):
        p.error("give --url or --spawn")
    if args.url:
        asyncio.run(run_all(args.url, args.observers, args.seconds, args.only))
        return 0
    with spawned_server(args.spawn, args.observers + 2, args.device, []) as url:
        asyncio.run(run_all(url, args.observers, args.seconds, args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
