"""Talk to a Parley server from a WAV file: stream it in real time, save the reply.

    python examples/duplex_client.py question.wav                       # /api/chat (Moshi protocol)
    python examples/duplex_client.py question.wav --persona "You are Ada." --voice NATF2.pt
    python examples/duplex_client.py question.wav --realtime            # /v1/realtime (OpenAI API)
    python examples/duplex_client.py question.wav --live --commentary "Let me check."  # GPT-Live
    python examples/duplex_client.py speech.wav --translate --language en  # /v1/realtime/translations

The input may be any rate and channel count (it is mixed to mono and resampled to 24 kHz).
It is streamed paced in real time, followed by `--tail` seconds of silence so the agent can
answer; the agent's audio goes to `--out` (WAV, 24 kHz; default reply.wav) and its text to
`--text-out` (default reply.txt).

/api/chat: Ogg-Opus both ways (sphn), text as 0x02 messages; everything the agent says is
kept, including its silences, so the reply lines up in time with the input.
/v1/realtime: base64 PCM16 events; only the audio inside responses is sent by the server,
so the reply WAV holds the agent's speech back to back.
/v1/live/sessions (GPT-Live): base64 PCM16 events both ways, every 80 ms frame kept (like
/api/chat); the text is the model's output transcript. It delegates to this client (client
delegation): with `--commentary TEXT` each session.delegation.created is answered with that
text as commentary, which the model says from its next pause.
/v1/realtime/translations (--translate): base64 PCM16 events both ways, every 80 ms frame kept;
the text is the translation's transcript. After the file (no silence tail unless --tail asks)
`session.close` flushes: the server translates what it still owes, then sends session.closed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import re
import time
import urllib.parse
import urllib.request

import numpy as np
import soundfile
import soxr
import sphn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

SAMPLE_RATE = 24_000
FRAME = 1920  # 80 ms at 24 kHz


def load_wav(path: str) -> np.ndarray:
    data, rate = soundfile.read(path, dtype="float32", always_2d=True)
    mono = data.mean(axis=1)
    if rate != SAMPLE_RATE:
        mono = soxr.resample(mono, rate, SAMPLE_RATE, quality="HQ")
    return np.ascontiguousarray(mono, dtype=np.float32)


def frames_of(pcm: np.ndarray, tail_seconds: float) -> list[np.ndarray]:
    pcm = np.concatenate([pcm, np.zeros(int(tail_seconds * SAMPLE_RATE), np.float32)])
    pcm = np.pad(pcm, (0, -pcm.size % FRAME))
    return [pcm[i:i + FRAME] for i in range(0, pcm.size, FRAME)]


def to_pcm16_b64(frame: np.ndarray) -> str:
    """A float32 frame as the OpenAI doors take audio: base64 of little-endian PCM16."""
    return base64.b64encode((np.clip(frame, -1, 1) * 32767).astype("<i2").tobytes()).decode()


def from_pcm16_b64(delta: str) -> np.ndarray:
    """An OpenAI audio delta (base64 PCM16) as float32."""
    return np.frombuffer(base64.b64decode(delta), "<i2").astype(np.float32) / 32768.0


async def paced(frames: list[np.ndarray]):
    """Yield frames on an 80 ms grid (no drift: each is due at start + i * 80 ms)."""
    start = time.monotonic()
    for i, frame in enumerate(frames):
        delay = start + i * FRAME / SAMPLE_RATE - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        yield frame


async def chat(args: argparse.Namespace, frames: list[np.ndarray]) -> tuple[np.ndarray, str]:
    params = {"text_prompt": args.persona or ""}
    if args.voice:
        params["voice_prompt"] = args.voice
    url = f"{args.url.rstrip('/')}/api/chat?{urllib.parse.urlencode(params)}"
    reader, writer = sphn.OpusStreamReader(SAMPLE_RATE), sphn.OpusStreamWriter(SAMPLE_RATE)
    audio: list[np.ndarray] = []
    text: list[str] = []
    async with connect(url, max_size=None, compression=None) as ws:
        first = await asyncio.wait_for(ws.recv(), 120)  # the server prefills before its handshake
        if not isinstance(first, bytes) or first[:1] != b"\x00":
            raise SystemExit(f"expected the 0x00 handshake, got {first[:16]!r}")

        async def receive() -> None:
            try:
                async for msg in ws:
                    if isinstance(msg, bytes) and msg[:1] == b"\x01":
                        pcm = np.asarray(reader.append_bytes(msg[1:]), np.float32).reshape(-1)
                        if pcm.size:
                            audio.append(pcm)
                    elif isinstance(msg, bytes) and msg[:1] == b"\x02":
                        piece = msg[1:].decode(errors="replace")
                        text.append(piece)
                        print(piece, end="", flush=True)
            except ConnectionClosed:
                pass

        receiver = asyncio.create_task(receive())
        async for frame in paced(frames):
            await ws.send(b"\x01" + bytes(writer.append_pcm(frame)))
        await asyncio.sleep(0.5)
        await ws.close()
        await receiver
        if ws.close_code not in (None, 1000, 1005):
            print(f"\nserver closed: {ws.close_code} {ws.close_reason}", file=sys.stderr)
    return (np.concatenate(audio) if audio else np.zeros(0, np.float32)), "".join(text)


async def realtime(args: argparse.Namespace, frames: list[np.ndarray]) -> tuple[np.ndarray, str]:
    query = f"?{urllib.parse.urlencode({'model': args.model})}" if args.model else ""  # none: the served one
    url = f"{args.url.rstrip('/')}/v1/realtime{query}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    audio: list[np.ndarray] = []
    text: list[str] = []
    async with connect(url, additional_headers=headers, max_size=None, compression=None) as ws:
        created = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if created.get("type") != "session.created":
            raise SystemExit(f"expected session.created, got {created}")
        session: dict = {"type": "realtime"}
        if args.persona:
            session["instructions"] = args.persona
        if args.voice:
            session["audio"] = {"output": {"voice": args.voice}}
        if len(session) > 1:
            await ws.send(json.dumps({"type": "session.update", "session": session}))

        async def receive() -> None:
            try:
                async for raw in ws:
                    event = json.loads(raw)
                    kind = event.get("type", "")
                    if kind in ("response.output_audio.delta", "response.audio.delta"):
                        audio.append(from_pcm16_b64(event["delta"]))
                    elif kind in ("response.output_audio_transcript.delta", "response.audio_transcript.delta"):
                        text.append(event["delta"])
                        print(event["delta"], end="", flush=True)
                    elif kind == "response.done":
                        text.append("\n")
                        print(flush=True)
                    elif kind == "error":
                        print(f"\nserver error: {event['error']}", file=sys.stderr)
            except ConnectionClosed:
                pass

        receiver = asyncio.create_task(receive())
        async for frame in paced(frames):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": to_pcm16_b64(frame)}))
        await asyncio.sleep(0.5)
        await ws.close()
        await receiver
    return (np.concatenate(audio) if audio else np.zeros(0, np.float32)), "".join(text)


def served_duplex_model(args: argparse.Namespace) -> str:
    """The server's speech-to-speech model name, from GET /v1/models (another name is refused)."""
    base = re.sub(r"^ws", "http", args.url.rstrip("/"))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with urllib.request.urlopen(urllib.request.Request(f"{base}/v1/models", headers=headers), timeout=30) as r:
        names = [m["id"] for m in json.load(r)["data"] if m.get("modality") == "duplex"]
    if not names:
        raise SystemExit("the server serves no speech-to-speech model (GET /v1/models)")
    return names[0]


async def live(args: argparse.Namespace, frames: list[np.ndarray]) -> tuple[np.ndarray, str]:
    url = f"{args.url.rstrip('/')}/v1/live/sessions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or served_duplex_model(args)  # session.start needs one
    session: dict = {"model": model, "audio": {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE}}}
    if args.persona:
        session["instructions"] = args.persona
    if args.voice:
        session["audio"]["output"] = {"voice": args.voice}
    audio: list[np.ndarray] = []
    text: list[str] = []
    async with connect(url, additional_headers=headers, max_size=None, compression=None) as ws:
        await ws.send(json.dumps({"type": "session.start", "session": session}))
        while (started := json.loads(await asyncio.wait_for(ws.recv(), 120)))["type"] != "session.started":
            if started["type"] == "error":  # a refused setting: the error names it
                raise SystemExit(f"session.start refused: {started['error']['message']}")

        async def receive() -> None:
            try:
                async for raw in ws:
                    event = json.loads(raw)
                    kind = event.get("type", "")
                    if kind == "session.output_audio.delta":
                        audio.append(from_pcm16_b64(event["delta"]))
                    elif kind == "session.output_transcript.delta":
                        text.append(event["delta"])
                        print(event["delta"], end="", flush=True)
                    elif kind == "session.delegation.created" and args.commentary:
                        await ws.send(json.dumps({"type": "session.commentary.append", "content": args.commentary,
                                                  "delegation_id": event["delegation"]["id"]}))
                    elif kind == "error":
                        print(f"\nserver error: {event['error']}", file=sys.stderr)
                    elif kind == "session.closed":
                        return
            except ConnectionClosed:
                pass

        receiver = asyncio.create_task(receive())
        async for frame in paced(frames):
            await ws.send(json.dumps({"type": "session.input_audio.append", "audio": to_pcm16_b64(frame)}))
        await ws.send(json.dumps({"type": "session.close"}))
        await asyncio.wait_for(receiver, 30)
    return (np.concatenate(audio) if audio else np.zeros(0, np.float32)), "".join(text)


async def translate(args: argparse.Namespace, frames: list[np.ndarray]) -> tuple[np.ndarray, str]:
    query = f"?{urllib.parse.urlencode({'model': args.model})}" if args.model else ""  # none: the served one
    url = f"{args.url.rstrip('/')}/v1/realtime/translations{query}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    audio: list[np.ndarray] = []
    text: list[str] = []
    async with connect(url, additional_headers=headers, max_size=None, compression=None) as ws:
        created = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if created.get("type") != "session.created":
            raise SystemExit(f"expected session.created, got {created}")
        if args.language:
            await ws.send(json.dumps({"type": "session.update",
                                      "session": {"audio": {"output": {"language": args.language}}}}))

        async def receive() -> None:
            try:
                async for raw in ws:
                    event = json.loads(raw)
                    kind = event.get("type", "")
                    if kind == "session.output_audio.delta":
                        audio.append(from_pcm16_b64(event["delta"]))
                    elif kind == "session.output_transcript.delta":
                        text.append(event["delta"])
                        print(event["delta"], end="", flush=True)
                    elif kind == "error":  # a refused --language names audio.output.language
                        print(f"\nserver error: {event['error']}", file=sys.stderr)
                    elif kind == "session.closed":
                        return
            except ConnectionClosed:
                pass

        receiver = asyncio.create_task(receive())
        async for frame in paced(frames):
            await ws.send(json.dumps({"type": "session.input_audio_buffer.append",
                                      "audio": to_pcm16_b64(frame)}))
        await ws.send(json.dumps({"type": "session.close"}))  # the server flushes what it owes, then closes
        await asyncio.wait_for(receiver, 60)
    return (np.concatenate(audio) if audio else np.zeros(0, np.float32)), "".join(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wav", help="input audio file (WAV/FLAC/OGG, any rate)")
    p.add_argument("--url", default="ws://127.0.0.1:8998",
                   help="server base URL: ws://, wss://, or http(s):// (mapped to ws(s)://); default %(default)s")
    p.add_argument("--out", default="reply.wav", help="where to write the agent's audio (default %(default)s)")
    p.add_argument("--text-out", default="reply.txt", help="where to write the agent's text (default %(default)s)")
    p.add_argument("--persona", default="", help="persona / system prompt (PersonaPlex)")
    p.add_argument("--voice", default=None, help="voice prompt name, e.g. NATF2.pt (PersonaPlex)")
    p.add_argument("--tail", type=float, default=None,
                   help="seconds of silence streamed after the input (default 3.0; 0 with --translate)")
    p.add_argument("--realtime", action="store_true", help="use /v1/realtime (OpenAI Realtime API) instead")
    p.add_argument("--live", action="store_true", help="use /v1/live/sessions (OpenAI GPT-Live) instead")
    p.add_argument("--translate", action="store_true",
                   help="use /v1/realtime/translations (OpenAI Realtime translation) instead")
    p.add_argument("--language", default=None,
                   help="--translate: the output language, e.g. en (default: the model's own)")
    p.add_argument("--commentary", default=None,
                   help="--live: answer each delegation with this text as commentary (the model says it)")
    p.add_argument("--model", default=None,
                   help="model name sent to /v1/realtime, /v1/live/sessions or /v1/realtime/translations: "
                        "one the server serves (default: its speech-to-speech model, from GET /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="bearer key for the /v1 doors, if the server requires one")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.realtime + args.live + args.translate > 1:
        parser.error("--realtime, --live and --translate are three protocols: give one")
    if args.language and not args.translate:
        parser.error("--language is the translation's output language: it needs --translate")
    if args.commentary and not args.live:
        parser.error("--commentary answers GPT-Live delegations: it needs --live")
    # Browsers' http(s) addresses work too: the WebSocket scheme is the same address's ws(s).
    args.url = re.sub(r"^http(s?)://", r"ws\1://", args.url)

    tail = args.tail if args.tail is not None else 0.0 if args.translate else 3.0
    frames = frames_of(load_wav(args.wav), tail)
    protocol = realtime if args.realtime else live if args.live else translate if args.translate else chat
    audio, text = asyncio.run(protocol(args, frames))
    soundfile.write(args.out, np.clip(audio, -1, 1), SAMPLE_RATE, subtype="PCM_16")
    with open(args.text_out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"\nwrote {args.out} ({audio.size / SAMPLE_RATE:.1f} s) and {args.text_out} ({len(text)} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
