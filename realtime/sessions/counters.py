"""One connection's counters: what /metrics shows of it, labelled by its protocol.

Rules this module keeps:
1. Counting only: nothing here sends, closes or decides; a refusal's close is the outbox's
   (sessions/outbox.py), its log line and count are here.
2. The per-message children (bytes in and out, frames out) are looked up once per connection:
   a `labels()` lookup per frame would cost as much as the frame's own bookkeeping.
3. Delays are measured on time.monotonic(), the clock FrameOut.produced_at and SttPartial.input_at
   are taken on (engine/session.py, engine/stt_pool.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..http.metrics import EdgeMetrics


class Counters:
    """The counters of one protocol's connections (rule 2: one per connection, or per refusal)."""

    def __init__(self, metrics: "EdgeMetrics", protocol: str) -> None:
        self._metrics = metrics
        self.protocol = protocol
        self._bytes_in = metrics.bytes_in.labels(protocol)
        self._bytes_out = metrics.bytes_out.labels(protocol)
        self._frames_out = metrics.frames_out.labels(protocol)

    def bytes_in(self, n: int) -> None:
        self._bytes_in.inc(n)

    def bytes_out(self, n: int) -> None:
        self._bytes_out.inc(n)

    def protocol_error(self) -> None:
        """A client message or setting this protocol refused."""
        self._metrics.protocol_errors.labels(self.protocol).inc()

    def refused(self) -> None:
        """An admission the engine refused: every slot taken."""
        self._metrics.refused.labels(self.protocol).inc()

    def rate_limited(self) -> None:
        self._metrics.rate_limited.labels(self.protocol).inc()

    def lag_dropped(self, frames: int = 1) -> None:
        """Output audio dropped because the client was behind by more than the lag limit."""
        self._metrics.lag_dropped.labels(self.protocol).inc(frames)

    def codec_failure(self) -> None:
        self._metrics.codec_failures.labels(self.protocol).inc()

    def refusal(self, scope: dict, reason: str, message: str) -> None:
        """A refusal, logged and counted once (sessions/refusals.py); `reason`: a refusals.REASONS code."""
        self._metrics.refusals.record(scope, reason, message)

    def frame_handled(self, seconds: float) -> None:
        """Time the edge took over one output frame (encode and send)."""
        self._metrics.frame_send_delay.observe(seconds)

    def frame_sent(self, produced_at: float) -> None:
        """One output frame out, and its end-to-end delay: from the end of the engine tick that
        produced it (FrameOut.produced_at) to its bytes having been written."""
        self._frames_out.inc()
        self._metrics.frame_delay.observe(max(0.0, time.monotonic() - produced_at))

    def transcript_sent(self, path: str, input_at: float | None) -> None:
        """Delay of one transcript delta just written, from the arrival of the input frame its STT
        step read (SttPartial.input_at). `path`: "paired" or "standalone"."""
        if input_at is not None:
            self._metrics.transcript_delay.labels(path).observe(max(0.0, time.monotonic() - input_at))
