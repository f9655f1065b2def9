"""`/v1/audio/speech` HTTP clients for benchmarks/tts_load.py, and the process they run in.

By default tts_load.py runs them here as their own process (`ClientProcess`), so the server's
process holds only the server's work: every byte a client reads is Python work that would
otherwise compete for the GIL with the engine thread (real clients are remote). The protocol,
one JSON object a line: the child prints `{"ready": true}` once its client is built, waits for
a line on stdin (the go: sent as the parent's measuring window opens, after the child's start-up), runs the
requests, prints `{"received": [...]}` (bytes per client so far) twice per `--progress` seconds
if asked, and ends with `{"outcomes": [...]}`: per request its timings or its failure (`outcome`).
Timings are taken here, from this process's own send to its first and last body byte; nothing
crosses processes inside a timed interval.

    python benchmarks/tts_clients.py --url http://127.0.0.1:PORT --voices v0 --streams 2   # then type a line
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the pinned openai SDK ships on

SCRIPT = Path(__file__).resolve()
MAX_LINE_BYTES = 1 << 24  # the outcomes line: ~300 bytes a failed request (asyncio's default is 64 KiB)
EXIT_GRACE_S = 30.0  # past the last request's own deadline, before the parent gives up on the child


async def one_request(client: httpx.AsyncClient, url: str, voice: str, text: str,
                      delay_s: float = 0.0, received: list[int] | None = None,
                      index: int = 0) -> tuple[float, float, float]:
    """(ttfb_s, audio_s, total_s), the request sent after `delay_s`; `received[index]` follows the
    bytes so far (for --progress)"""
    await asyncio.sleep(delay_s)
    start = time.perf_counter()
    first = None
    size = 0
    async with client.stream("POST", f"{url}/v1/audio/speech",
                             json={"input": text, "voice": voice, "response_format": "pcm"}) as r:  # the served model
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}")
        async for chunk in r.aiter_bytes():
            if first is None and chunk:
                first = time.perf_counter() - start
            size += len(chunk)
            if received is not None:
                received[index] = size
    return first or float("nan"), size / 2 / 24000, time.perf_counter() - start


async def gather_requests(request, streams: int, stagger_s: float, timeout_s: float) -> list[dict]:
    """`request(i)` for i < streams, the i-th started `i * stagger_s` in (its own sleep) and given
    `timeout_s` after that; each one's `outcome`."""
    raw = await asyncio.gather(*[asyncio.wait_for(request(i), i * stagger_s + timeout_s) for i in range(streams)],
                               return_exceptions=True)
    return [outcome(r, timeout_s) for r in raw]


def outcome(result: tuple[float, float, float] | BaseException, timeout_s: float) -> dict:
    """A request's timings (seconds) or its failure (exception type and message), as JSON can carry it."""
    if isinstance(result, BaseException):
        return {"error": type(result).__name__, "message": str(result) or f"over {timeout_s:g} s"}
    return dict(zip(("ttfb_s", "audio_s", "total_s"), result))


def failure_summary(outcomes: list[dict]) -> str | None:
    """The line tts_load prints for failed requests (N of M, and each kind once), or None when none did."""
    failed = [o for o in outcomes if "error" in o]
    if not failed:
        return None
    kinds = sorted({f"{o['error']}: {o['message']}"[:160] for o in failed})
    return f"{len(failed)} of {len(outcomes)} requests failed: " + "; ".join(kinds)


class ClientProcess:
    """The clients as a child process (this file run as a script), driven from the server's loop."""

    def __init__(self, proc: asyncio.subprocess.Process, streams: int, deadline_s: float) -> None:
        self._proc = proc
        self._streams = streams
        self._deadline_s = deadline_s

    @classmethod
    async def start(cls, url: str, voices: list[str], text: str, streams: int, stagger_s: float,
                    timeout_s: float, progress_s: float) -> "ClientProcess":
        """Start the child and wait until its HTTP client is built (its start-up stays out of the
        parent's measuring window)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), "--url", url, "--voices", ",".join(voices), "--text", text,
            "--streams", str(streams), "--stagger", repr(stagger_s), "--request-timeout", repr(timeout_s),
            "--progress", repr(progress_s), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=MAX_LINE_BYTES)
        self = cls(proc, streams, (streams - 1) * stagger_s + timeout_s + EXIT_GRACE_S)
        try:
            message = await asyncio.wait_for(self._message(), 120)
        except BaseException:
            await self.close()
            raise
        if message != {"ready": True}:
            await self.close()
            raise RuntimeError(f"the HTTP client process did not start: {message}")
        return self

    async def run(self, received: list[int]) -> list[dict]:
        """Send the go and wait for every request's outcome; `received` follows the child's progress
        lines. A child that dies or hangs fails every request, saying so."""
        try:
            async with asyncio.timeout(self._deadline_s):
                with contextlib.suppress(ConnectionError):  # a child already gone: its end of stdout says so
                    self._proc.stdin.write(b"go\n")
                    await self._proc.stdin.drain()
                while (message := await self._message()) is not None:
                    if "received" in message:
                        received[:] = message["received"]
                    elif "outcomes" in message:
                        await self._proc.wait()
                        return message["outcomes"]
                failure = {"error": "ClientProcessExited", "message": f"exit status {await self._proc.wait()}, "
                           "no outcomes (its stderr is above)"}
        except TimeoutError:
            failure = {"error": "ClientProcessHung", "message": f"no outcomes after {self._deadline_s:g} s"}
        finally:
            await self.close()
        return [failure] * self._streams

    async def close(self) -> None:
        """Stop the child if it still runs (a cancelled case, an engine that failed)."""
        if self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()

    async def _message(self) -> dict | None:
        line = await self._proc.stdout.readline()
        return json.loads(line) if line else None


def say(message: dict) -> None:
    print(json.dumps(message), flush=True)


async def report_received(received: list[int], every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        say({"received": received})


async def serve_parent(args) -> None:
    voices = args.voices.split(",")
    received = [0] * args.streams
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        say({"ready": True})
        if not await asyncio.to_thread(sys.stdin.readline):
            return  # the parent went away before the go
        # twice per --progress period: the parent's report, on its own clock, is at most half a period stale
        reporter = asyncio.create_task(report_received(received, args.progress / 2)) if args.progress else None

        def request(i: int):
            return one_request(client, args.url, voices[i % len(voices)], args.text, i * args.stagger, received, i)

        outcomes = await gather_requests(request, args.streams, args.stagger, args.request_timeout)
        if reporter is not None:
            reporter.cancel()
    say({"outcomes": outcomes})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8998")
    parser.add_argument("--voices", required=True,
                        help="comma-separated voice names, request i takes i mod their count")
    parser.add_argument("--text", default="Hello.")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--stagger", type=float, default=0.0, help="seconds between the requests' starts")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--progress", type=float, default=0.0,
                        help="print bytes received twice every this many seconds")
    args = parser.parse_args()
    if args.streams < 1 or args.request_timeout <= 0 or args.stagger < 0 or args.progress < 0:
        parser.error("--streams must be at least 1, --request-timeout positive, --stagger and --progress not negative")
    asyncio.run(serve_parent(args))


if __name__ == "__main__":
    main()
