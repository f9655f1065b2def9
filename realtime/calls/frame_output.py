"""The model's output audio on both OpenAI doors, one 80 ms frame at a time: on a WebRTC call it is
played on the call's track (whose queue the lag limit bounds); over a socket it is an event, and a
client that reads too slowly loses its oldest audio (counted) rather than fall behind by more than
the lag limit; its text still goes out.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from ..engine_client import FrameOut
from ..sessions.session import EdgeSession
from .event_reader import Event


class FrameSender:
    """One connection's output audio: played, sent, or dropped, and counted."""

    def __init__(self, edge: EdgeSession, send: Callable[[Event], Awaitable[int]]) -> None:
        self.edge = edge
        self._send = send

    @property
    def on_track(self) -> bool:
        """A WebRTC call: the audio is played on its track, not sent as events."""
        return self.edge.transport.media is not None

    def lagging(self, frame: FrameOut) -> bool:
        """Over a socket, whether this frame's audio is dropped: it would reach the client more than
        the lag limit late (counted by the edge). Never on a track (bounded there)."""
        return not self.on_track and self.edge.outbox.drop_if_lagging(frame.produced_at)

    async def send(self, audio: Event) -> None:
        """An audio event over the socket, its size told to the lag meter."""
        self.edge.outbox.lag.sent(await self._send(audio))

    def play(self, frame: FrameOut) -> None:
        """The frame onto the call's track."""
        self.edge.outbox.play(frame.pcm)

    def count(self, frame: FrameOut) -> None:
        """One frame out (sent, or queued on the track), and its delay since the tick produced it."""
        self.edge.counters.frame_sent(frame.produced_at)


class PlayingResponse:
    """On a WebRTC call, OpenAI's `output_audio_buffer.*` events (Realtime, WebRTC only): `started`
    before a response's first audio goes onto the track, `stopped` after its `response.done`
    (`cleared` when it was cancelled: an interruption or `output_audio_buffer.clear`). The track is
    paced in real time with at most a frame or so queued, so `stopped` is when its audio has left."""

    def __init__(self, make: Callable[[str, str], Event]) -> None:
        self._make = make  # (started | stopped | cleared, response id) -> the event
        self.response_id: str | None = None

    def before_audio(self, delta: Event) -> list[Event]:
        if delta["response_id"] == self.response_id:
            return []
        self.response_id = delta["response_id"]
        return [self._make("started", self.response_id)]

    def after(self, event: Event) -> list[Event]:
        if event["type"] != "response.done" or event["response"]["id"] != self.response_id:
            return []
        done, self.response_id = self.response_id, None
        return [self._make("cleared" if event["response"]["status"] == "cancelled" else "stopped", done)]
