"""The model's output audio on both OpenAI doors, one 80 ms frame at a time: on a WebRTC call it is
played on the call's track (whose queue the lag limit bounds); over a socket it is an event, and a
client that reads too slowly loses its oldest audio (counted) rather than fall behind by more than
the lag limit; its text still goes out.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from parley.engine import FrameOut

from .edge_sessions import EdgeSession
from .event_reader import Event


class FrameSender:
    """One connection's output audio: played, sent, or dropped, and counted."""

    def __init__(self, edge: EdgeSession, protocol: str, send: Callable[[Event], Awaitable[int]]) -> None:
        self.edge = edge
        self.protocol = protocol  # the metrics label
        self._send = send

    @property
    def on_track(self) -> bool:
        """A WebRTC call: the audio is played on its track, not sent as events."""
        return self.edge.transport.media is not None

    def lagging(self, frame: FrameOut) -> bool:
        """Over a socket, whether this frame's audio is dropped: it would reach the client more than
        the lag limit late (counted by the edge). Never on a track (bounded there)."""
        return not self.on_track and self.edge.drop_if_lagging(frame.produced_at)

    async def send(self, audio: Event) -> None:
        """An audio event over the socket, its size told to the lag meter."""
        self.edge.lag.sent(await self._send(audio))

    def play(self, frame: FrameOut) -> None:
        """The frame onto the call's track."""
        self.edge.play(frame.pcm)

    def count(self, frame: FrameOut) -> None:
        """One frame out (sent, or queued on the track), and its delay since the tick produced it."""
        self.edge.manager.metrics.frames_out.labels(self.protocol).inc()
        self.edge.observe_frame_sent(frame.produced_at)
