"""Paired transcription: an STT row beside each duplex row, fed from the frame's own Mimi encode.

    paired = PairedTranscription(stt_checkpoint, max_sessions, in_frame=True)
    backend = ModelBackend(checkpoint, max_sessions, side_work=paired.frame_work)
    engine.set_paired_transcription(paired)
    stream = engine.enable_transcription(session)                # OutputStream[SttPartial]

Row r of the STT state is duplex row r. Two ways to run the STT step, same results:
- in the frame (`in_frame=True`; the server switches to it once its GPU test passes,
  `PAIRED_IN_FRAME` in realtime/server/serve.py): the backend calls `frame_work` with the
  frame's Mimi latent right after the encode; it quantizes the latent to the STT's codebooks (the
  first ones are the LM's, unchanged: residual quantization is sequential) and steps the STT. On
  CUDA this runs on a stream of its own inside the frame's graph, overlapping the duplex LM and
  decode, so the frame's critical path is the plain frame's (docs/benchmarks.md has the figures).
- after the frame (the default, and what the server runs today): `step` reads the codes the frame encoded (the backend built with
  `encode_codebooks >= n_q`) and runs one batched step, on CUDA one graph per row bucket.
Either way the STT reads only what the frame computed and has its own random generator
(registered with the graphs), so the duplex output is bit-identical with and without it.
`prepare` (before the frame) applies enable/disable and sets which rows run; `publish` (after the
frame's host copy) turns each transcribed row's text token into an `SttPartial` every frame (text
may be empty: the end-of-turn probability is news on its own), stamped with when the row's input
frame arrived (TickPlan.arrivals) so the edge can measure transcript delay.
Transcript streams are realtime: a full one drops its oldest partial, like the duplex stream.
No silence prefix is fed (the session is live); word times count from when transcription began.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from parley.models.checkpoint import SttCheckpoint
from parley.models.config import FRAME_RATE
from parley.models.stt import SttGen
from parley.models.stt_text import TextDelta, TranscriptDecoder, Word

from .backend import BackendOutput
from .bucketed_step import BucketedStep, bucket_sizes
from .scheduler import TickPlan
from .stream import OutputStream, Status, Terminal
from .stt_pool import SttPartial

TRANSCRIPT_EVENTS = 256  # partials buffered per session (about 20 s of frames)


class _Row:
    def __init__(self, request_id: str, stream: OutputStream, decoder: TranscriptDecoder) -> None:
        self.request_id, self.stream, self.decoder = request_id, stream, decoder
        self.step = 0


class PairedTranscription:
    def __init__(self, checkpoint: SttCheckpoint, max_sessions: int, *, cuda_graphs: bool = True,
                 in_frame: bool = False) -> None:
        self.checkpoint = checkpoint
        self.n_q = checkpoint.lm_config.n_q
        self.gen = SttGen(checkpoint.lm)
        self.max_sessions = max_sessions
        self.in_frame = in_frame
        self._state = self.gen.init_state(max_sessions)
        device = self._state.offsets.device
        self._mask_dev = torch.zeros(max_sessions, dtype=torch.bool, device=device)  # read by frame_work
        # Per row count n (every bucket the backend may run): the step over the lowest n rows.
        self._steps = BucketedStep(self._device_step, (self._state,), bucket_sizes(max_sessions))
        self.frame_work = _FrameWork(self) if in_frame else None  # the backend's FrameSideWork
        if cuda_graphs and device.type == "cuda" and not in_frame:
            self._steps.capture(lambda n: (torch.zeros(n, self.n_q, dtype=torch.long, device=device),
                                           torch.zeros(n, dtype=torch.bool, device=device)),
                                generators=(self.gen.generator,))
        self._rows: list[_Row | None] = [None] * max_sessions
        self._pending: list[tuple[int, _Row | None]] = []  # (row, new state) from the loop thread
        self._lock = threading.Lock()
        self._out: torch.Tensor | None = None  # this tick's [B, 3] device outputs
        self._mask: list[bool] = [False] * max_sessions
        self._arrivals: list[float | None] = [None] * max_sessions  # this tick's input frames' (TickPlan)
        self.steps = 0  # ticks that stepped at least one STT row
        self.rows_stepped = 0  # row-steps (one per transcribed session per tick)
        self.dropped = 0  # partials dropped from full transcript streams (a slow client)

    # ---- event loop ----

    def enable(self, row: int, request_id: str, loop: asyncio.AbstractEventLoop) -> OutputStream[SttPartial]:
        stream: OutputStream[SttPartial] = OutputStream(f"{request_id}.transcript", loop, TRANSCRIPT_EVENTS)
        decoder = TranscriptDecoder(self.checkpoint.tokenizer, self.gen.text_delay)
        with self._lock:
            self._pending.append((row, _Row(request_id, stream, decoder)))
        return stream

    def disable(self, row: int, request_id: str) -> None:
        """Stop transcribing (the stream ends completed at the next tick)."""
        with self._lock:
            self._pending.append((row, _Disable(request_id)))

    # ---- engine thread ----

    def prepare(self, plan: TickPlan) -> None:
        """Before the frame: apply enables / disables and set which rows this tick transcribes."""
        self._apply_pending()
        self._mask = [r is not None and plan.request_ids[i] == r.request_id and bool(plan.live_mask[i])
                      for i, r in enumerate(self._rows)]
        self._out = None
        self._arrivals = plan.arrivals
        self._mask_dev.copy_(torch.tensor(self._mask))  # staged from pageable memory: safe to reuse at once

    def step(self, plan: TickPlan, out: BackendOutput) -> None:
        """After the frame, before its host copy: this tick's STT outputs (run here, or read from
        the frame when in_frame)."""
        run = self._mask
        if not any(run):
            return
        if self.in_frame:
            if out.side is None:
                raise RuntimeError("paired transcription in the frame needs the backend built with "
                                   "side_work=paired.frame_work")
            self._out = out.side
        else:
            if out.user_codes is None or out.user_codes.shape[1] < self.n_q:
                got = None if out.user_codes is None else out.user_codes.shape[1]
                raise RuntimeError(f"the frame encodes {got} codebooks; the STT reads {self.n_q} "
                                   f"(build the backend with encode_codebooks >= {self.n_q})")
            # A row bucket: the frame ran only its lowest n rows (every live one); step those alone.
            n = out.user_codes.shape[0]
            mask = self._mask_dev[:n]
            codes = out.user_codes[:, :self.n_q].long()
            if n not in self._steps.buckets:  # a backend without buckets runs max_sessions rows: always one
                raise RuntimeError(f"the frame ran {n} rows; paired transcription has {self.max_sessions}")
            (self._out,) = self._steps(n, codes, mask)
        self.steps += 1
        self.rows_stepped += sum(run)

    def _frame_step(self, latent: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """In the frame (FrameSideWork): quantize the frame's latent to the STT's codebooks, step."""
        codes = self.checkpoint.mimi.quantize(latent, self.n_q)
        (out,) = self._steps.eager(latent.shape[0])(codes, self._mask_dev[:latent.shape[0]] & live)
        return out

    @torch.no_grad()
    def _device_step(self, state, codes: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.gen.step(state, codes, mask).packed(),)

    @property
    def graphed(self) -> bool:
        """Whether the steps replay CUDA graphs (CUDA, cuda_graphs on)."""
        return self._steps.graphed

    def close(self) -> None:
        self._steps.close()

    def stop(self, terminal: Terminal) -> None:
        """The engine has stopped (engine.shutdown): every transcript stream ends with `terminal`,
        an enable not yet applied too; the disables its sessions queued would never be applied."""
        with self._lock:
            pending, self._pending = self._pending, []
        for _, new in pending:
            if isinstance(new, _Row):
                new.stream.finish(terminal)
        for i in range(self.max_sessions):
            self._end(i, terminal)

    def counters(self) -> dict:
        """For /metrics (engine.counters)."""
        return {"stt_paired_live": sum(row is not None for row in self._rows), "stt_paired_slots": self.max_sessions,
                "stt_paired_steps": self.steps, "stt_paired_rows_stepped": self.rows_stepped,
                "stt_paired_dropped": self.dropped,
                "stt_paired_model_delay_seconds": self.gen.text_delay / FRAME_RATE}

    def publish(self) -> None:
        """After the frame's host copy: one partial per transcribed row."""
        if self._out is None:
            return
        host = self._out.cpu().tolist()  # Python floats: no numpy scalar per field (64 rows a frame)
        for i, run in enumerate(self._mask):
            row = self._rows[i]
            if not run or row is None:
                continue
            token, valid, end_of_turn = host[i]
            step = row.step
            row.step += 1
            text, words = "", ()
            if valid > 0.5 and (events := row.decoder.feed(int(token), step)):
                text = "".join(e.text for e in events if isinstance(e, TextDelta))
                words = tuple(e for e in events if isinstance(e, Word))
            self.dropped += not row.stream.push(SttPartial(text, words, end_of_turn, row.step / FRAME_RATE,
                                                                    self._arrivals[i]))

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for i, new in pending:
            if isinstance(new, _Disable):
                if self._rows[i] is not None and self._rows[i].request_id == new.request_id:
                    self._end(i, Terminal(Status.COMPLETED))
                continue
            self._end(i, Terminal(Status.CANCELLED, "transcription restarted"))
            mask = torch.zeros(self.max_sessions, dtype=torch.bool, device=self._state.offsets.device)
            mask[i] = True
            self._state.reset(mask)
            self._rows[i] = new

    def _end(self, i: int, terminal: Terminal) -> None:
        row = self._rows[i]
        if row is None:
            return
        words = row.decoder.flush(max(row.step - 1, 0))
        if words:
            row.stream.push(SttPartial("", tuple(words), float("nan"), row.step / FRAME_RATE))
        row.stream.finish(terminal)
        self._rows[i] = None


class _FrameWork:
    """What the backend runs beside the LM (backend.FrameSideWork)."""

    def __init__(self, paired: PairedTranscription) -> None:
        self.generators = (paired.gen.generator,)
        self._step = paired._frame_step

    def __call__(self, latent: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return self._step(latent, live)


class _Disable:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
