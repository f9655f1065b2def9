"""A WebRTC worker process: the aiortc peers (webrtc/peer.py) of the calls pinned to it, on an
event loop of its own, so Opus, SRTP, DTLS and SCTP never run on the server's loop, its engine
thread or under its GIL.

Started by `parley.realtime.webrtc.pool.WebRTCPool` as `python -m parley.realtime.webrtc.worker FD`,
where FD is its end of a Unix socketpair carrying webrtc/wire.py's frames. It imports aiortc, PyAV,
soxr and numpy, never torch. It exits when the socket reaches EOF (the server closed it or died:
the kernel closes its fds), hanging up every call first, so it never outlives its server.

Bounded: audio for a server that stopped reading is dropped past SOFT_OUTBOX_BYTES (counted);
a call whose events would push the queue past HARD_OUTBOX_BYTES ends (`overflowed`).

`Worker` holds the calls whatever carries its frames: an edge worker runs one in its own process,
over an in-process link (webrtc/local.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys

import numpy as np

from . import wire
from .peer import Peer
from ..server.log_format import configure_logging
from .wire import Link, OfferError

log = logging.getLogger("parley.webrtc.worker")  # (in a worker process)

BACKLOG_REPORT_S = 0.04  # how often changed channel backlogs are reported (half a tick)


class WorkerCall:
    """One call in this worker: its peer, and the frames it sends to the server (a CallSink)."""

    def __init__(self, worker: "Worker", call_id: int, ice_servers: list[dict], max_lag_s: float) -> None:
        self.worker = worker
        self.id = call_id
        self.peer = Peer(self, ice_servers, max_lag_s)
        self.reported_backlog = 0
        self.dropped_in = 0  # audio chunks dropped here since the last report
        self.reported_silent = 0  # the track's silent packets already reported
        self.answering: asyncio.Task | None = None  # answering its offer (Worker.offer)

    def ready(self) -> None:
        self.worker.send(wire.READY, self.id)

    def audio(self, pcm: np.ndarray) -> None:
        if self.worker.link.queued() > wire.SOFT_OUTBOX_BYTES:
            self.dropped_in += 1
            return
        self.worker.send(wire.AUDIO, self.id, np.ascontiguousarray(pcm, np.float32).tobytes())

    def message(self, message: str | bytes) -> None:
        if self.worker.link.queued() + len(message) > wire.HARD_OUTBOX_BYTES:
            self.peer.end(overflowed=True)
            return
        text = isinstance(message, str)
        self.worker.send(wire.TEXT if text else wire.BYTES, self.id, message.encode() if text else message)

    def ended(self, overflowed: bool) -> None:
        self.worker.send(wire.ENDED, self.id, bytes([overflowed]))
        self.worker.forget(self)

    def play(self, payload: bytes) -> None:
        dropped = self.peer.outgoing.play(np.frombuffer(payload, np.float32))
        if dropped:
            self.worker.send(wire.DROPPED_OP, self.id, wire.DROPPED.pack(0, dropped, 0))

    def report(self) -> None:
        """Changed backlog, dropped input and silent packets, for the server's lag bound and counters."""
        backlog = self.peer.backlog()
        if backlog != self.reported_backlog:
            self.reported_backlog = backlog
            self.worker.send(wire.BACKLOG_OP, self.id, wire.BACKLOG.pack(backlog))
        silent = self.peer.outgoing.silent_packets - self.reported_silent
        if self.dropped_in or silent:
            self.worker.send(wire.DROPPED_OP, self.id, wire.DROPPED.pack(self.dropped_in, 0, silent))
            self.dropped_in = 0
            self.reported_silent += silent


class Worker:
    """The calls of this process, by the server's call id; their frames go out on `link` (the
    socket's end: a wire.FrameProtocol calling `on_frame` and `on_lost`, unless one is given)."""

    def __init__(self, link: Link | None = None) -> None:
        self.calls: dict[int, WorkerCall] = {}
        self.closing: set[asyncio.Task] = set()
        self.link = link if link is not None else wire.FrameProtocol(self.on_frame, self.on_lost)

    def send(self, op: int, call: int, payload: bytes = b"") -> None:
        self.link.send(op, call, payload)

    def on_frame(self, op: int, call_id: int, payload: bytes) -> None:
        call = self.calls.get(call_id)
        if op == wire.OFFER:
            if call is None:
                request = json.loads(payload)
                call = WorkerCall(self, call_id, request.get("ice_servers", []), float(request["max_lag_s"]))
                self.calls[call_id] = call  # now: a CLOSE that comes while it answers ends it
                call.answering = self._spawn(self.offer(call, request["sdp"]))
        elif call is None:
            return  # an ended call's late audio or events
        elif op == wire.PLAY:
            call.play(payload)
        elif op in (wire.SEND_TEXT, wire.SEND_BYTES):
            call.peer.send(payload.decode() if op == wire.SEND_TEXT else payload)
        elif op == wire.CLOSE:
            call.peer.end()  # forgets it; the peer closes below

    async def offer(self, call: WorkerCall, sdp: str) -> None:
        try:
            answer = await call.peer.answer(sdp)
        except OfferError as exc:
            if not call.peer.ended:
                self.send(wire.REFUSED, call.id, str(exc).encode())
                self.calls.pop(call.id, None)
            await call.peer.close()
            return
        except Exception:  # aiortc failed under this call: it ends alone (the server's answer is a 503)
            if not call.peer.ended:
                log.exception("webrtc call %d: answering its offer failed", call.id)
            await call.peer.close()  # ENDED: the server settles the answer as unavailable
            return
        if call.peer.ended:  # closed by the server while answering
            return
        self.send(wire.ANSWER, call.id, answer.encode())

    def forget(self, call: WorkerCall) -> None:
        if self.calls.get(call.id) is call:
            del self.calls[call.id]
        if call.answering is not None and call.answering is not asyncio.current_task():
            call.answering.cancel()  # ended while its peer still answers (a stuck one would hold on)
        self._spawn(call.peer.close())

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.closing.add(task)
        task.add_done_callback(self.closing.discard)
        return task

    def on_lost(self, why: str) -> None:
        for call in list(self.calls.values()):
            call.peer.end()

    async def report_backlogs(self) -> None:
        while True:
            await asyncio.sleep(BACKLOG_REPORT_S)
            for call in list(self.calls.values()):
                call.report()


async def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    worker = Worker()
    await asyncio.get_running_loop().create_connection(lambda: worker.link, sock=sock)
    worker.send(wire.HELLO, 0)
    reporter = asyncio.create_task(worker.report_backlogs())
    await worker.link.lost  # EOF: the server closed the socket or exited
    reporter.cancel()
    worker.on_lost("")
    if worker.closing:
        await asyncio.wait(set(worker.closing), timeout=3.0)


def main(argv: list[str]) -> int:
    """argv: the socket's fd, then the server's log format (`--log-format`; text if absent)."""
    # Ctrl-C reaches the whole process group: the server shuts its workers down itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging("warning", argv[1] if len(argv) > 1 else "text")
    asyncio.run(serve(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
