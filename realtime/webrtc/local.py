"""An edge worker's WebRTC calls (server/edge_worker.py): each call's aiortc peer on this process's
own event loop, beside the call's connection; no worker process, no socket between them.

One of the two peer hosts (webrtc/transport.py `PeerHost`; the other, webrtc/pool.py's worker
processes, is the one-process server's, whose loop shares the engine thread's GIL). Both sides of
a call are the ones a worker process runs: the connection's `WebRTCCall` and webrtc/worker.py's
`Worker` with its peers, speaking webrtc/wire.py's frames. Only the link differs:

1. A frame reaches the other side on the loop's next turn, never inside its sender's call (as a
   socket hands it over), in the order sent.
2. Nothing waits between processes (`queued()` is 0): the outbox bounds of the socket never fire
   here. The call's bounds remain: its event and audio queues (transport.py), the track's lag bound.
3. A call whose peer fails, or does not answer in time, ends alone: there is no process to restart.
4. `aclose()` (the server's shutdown, after its calls hung up) hangs up what is left and waits for
   the peers to close, at most CLOSE_TIMEOUT_S.

Imports aiortc (through worker.py): only an edge worker imports this module.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable

from . import wire
from .transport import WebRTCCall
from .worker import Worker

log = logging.getLogger("parley.webrtc")

CLOSE_TIMEOUT_S = 3.0  # at shutdown, the peers get this long to close (as a worker process does at EOF)


class LoopLink:
    """One end of the in-process link: each frame to `deliver(op, call, payload)` on the loop's next turn."""

    def __init__(self, deliver: Callable[[int, int, bytes], None]) -> None:
        self._deliver = deliver
        self._loop = asyncio.get_running_loop()

    def send(self, op: int, call: int, payload: bytes = b"") -> None:
        self._loop.call_soon(self._deliver, op, call, payload)

    def queued(self) -> int:
        return 0  # both ends run on this loop: nothing is held between them (rule 2)


class LocalLane:
    """What every call here is pinned to: the link to this process's Worker."""

    def __init__(self, link: LoopLink) -> None:
        self.link = link


class LocalPeers:
    """The peer host of an edge worker: its calls' peers on its own loop (module docstring)."""

    def __init__(self, on_silent: Callable[[int], None] | None = None) -> None:
        self.on_silent = on_silent  # (packets): the calls' tracks sent silence, no model audio ready
        self._ids = itertools.count(1)
        self._calls: dict[int, WebRTCCall] = {}
        self._worker: Worker | None = None  # made by the first call: its link needs the running loop
        self._lane: LocalLane | None = None
        self._reporter: asyncio.Task | None = None

    async def pin(self, call: WebRTCCall) -> LocalLane:
        if self._worker is None or self._lane is None:
            self._worker = Worker(LoopLink(self._on_frame))
            self._lane = LocalLane(LoopLink(self._worker.on_frame))
            self._reporter = asyncio.create_task(self._worker.report_backlogs(), name="webrtc-backlogs")
        call.id = next(self._ids) & 0xFFFFFFFF
        self._calls[call.id] = call
        return self._lane

    def _on_frame(self, op: int, call_id: int, payload: bytes) -> None:
        call = self._calls.get(call_id)
        if call is not None:  # else: a call the connection already let go of
            call.deliver(op, payload)

    def unpin(self, call: WebRTCCall) -> None:
        if self._calls.get(call.id) is call:
            del self._calls[call.id]

    def stuck(self, call: WebRTCCall, what: str) -> None:
        """The call's peer `what`: this call ends, and only it (rule 3)."""
        log.warning("webrtc call %d: its peer %s; the call ended", call.id, what)
        call.lost(f"the call's peer {what}")
        if self._lane is not None:
            self._lane.link.send(wire.CLOSE, call.id)  # its peer hangs up and closes

    def count_silent(self, packets: int) -> None:
        if self.on_silent is not None:
            self.on_silent(packets)

    def peers(self) -> int:
        """Peers running here now (each until it has closed)."""
        return len(self._worker.calls) if self._worker is not None else 0

    async def aclose(self) -> None:
        """Hang up what is left and wait for the peers to close, bounded (rule 4)."""
        if self._worker is None:
            return
        if self._reporter is not None:
            self._reporter.cancel()
        for call in list(self._calls.values()):
            call.lost("the server is shutting down")
        self._worker.on_lost("")  # every peer ends; the worker closes each
        if self._worker.closing:
            await asyncio.wait(set(self._worker.closing), timeout=CLOSE_TIMEOUT_S)
