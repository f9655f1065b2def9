"""Paired transcription: an STT row beside each duplex row, fed from the frame's own Mimi encode.

    paired = PairedTranscription(stt_checkpoint, max_sessions)   # backend built with
    engine.set_paired_transcription(paired)                      #   encode_codebooks >= STT n_q
    stream = engine.enable_transcription(session)                # OutputStream[SttPartial]

Every tick, right after the duplex frame and before its host copy, `step` runs one batched STT
step on the codes the frame already encoded (`BackendOutput.user_codes`: the backend encodes the
STT's extra codebooks in the same encode; the first n_user codebooks, the LM's, do not change).
It reads only device tensors the frame wrote and has its own random generator, so the duplex
output is bit-identical with and without it. Row r of the STT state is duplex row r.
`publish` (after the frame's host copy) turns each transcribed row's text token into an
`SttPartial` every frame (text may be empty: the end-of-turn probability is news on its own).
On CUDA the STT step is one CUDA graph per row bucket (the backend's buckets), captured at
construction with no row running and replayed right after the frame's graph: it copies the
frame's code buffer into its own and registers its generator, so the duplex stream never moves.
Transcript streams are realtime: a full one drops its oldest partial, like the duplex stream.
No silence prefix is fed (the session is live); word times count from when transcription began.
"""

from __future__ import annotations

import asyncio
import threading
from functools import partial

import torch

from parley.models.checkpoint import SttCheckpoint
from parley.models.config import FRAME_RATE
from parley.models.row_views import leading_rows
from parley.models.stt import SttGen
from parley.models.stt_text import TextDelta, TranscriptDecoder, Word

from .backend import BackendOutput, bucket_sizes
from .cuda_graph import CUDAGraphRunner
from .scheduler import TickPlan
from .stream import OutputStream, Status, Terminal
from .stt_pool import SttPartial

TRANSCRIPT_EVENTS = 256  # partials buffered per session (about 20 s of frames)


class _Row:
    def __init__(self, request_id: str, stream: OutputStream, decoder: TranscriptDecoder) -> None:
        self.request_id, self.stream, self.decoder = request_id, stream, decoder
        self.step = 0


class PairedTranscription:
    def __init__(self, checkpoint: SttCheckpoint, max_sessions: int, *, cuda_graphs: bool = True) -> None:
        self.checkpoint = checkpoint
        self.n_q = checkpoint.lm_config.n_q
        self.gen = SttGen(checkpoint.lm)
        self.max_sessions = max_sessions
        self._state = self.gen.init_state(max_sessions)
        device = self._state.offsets.device
        self._pinned = device.type == "cuda"
        self._mask_host = torch.zeros(max_sessions, dtype=torch.bool, pin_memory=self._pinned)
        # Per row count n (every bucket the backend may run): the step over the lowest n rows.
        self._steps = {n: partial(self._device_step, leading_rows(self._state, n)) for n in bucket_sizes(max_sessions)}
        self._graphs: dict[int, CUDAGraphRunner] = {}
        if cuda_graphs and device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()  # one bucket runs per tick: the graphs share memory
            for n in sorted(self._steps, reverse=True):
                idle = torch.zeros(n, dtype=torch.bool, device=device)
                codes = torch.zeros(n, self.n_q, dtype=torch.long, device=device)
                self._graphs[n] = CUDAGraphRunner(self._steps[n], (codes, idle), pool=pool,
                                                  generators=(self.gen.generator,))
        self._rows: list[_Row | None] = [None] * max_sessions
        self._pending: list[tuple[int, _Row | None]] = []  # (row, new state) from the loop thread
        self._lock = threading.Lock()
        self._out: torch.Tensor | None = None  # this tick's [B, 3] device outputs
        self._mask: list[bool] = [False] * max_sessions
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

    def step(self, plan: TickPlan, out: BackendOutput) -> None:
        self._apply_pending()
        run = [r is not None and plan.request_ids[i] == r.request_id and bool(plan.live_mask[i])
               for i, r in enumerate(self._rows)]
        self._mask = run
        self._out = None
        if not any(run) or out.user_codes is None:
            return
        if out.user_codes.shape[1] < self.n_q:
            raise RuntimeError(f"the frame encodes {out.user_codes.shape[1]} codebooks; the STT reads {self.n_q} "
                               f"(build the backend with encode_codebooks >= {self.n_q})")
        # A row bucket: the frame ran only its lowest n rows (every live one); step those alone.
        n = out.user_codes.shape[0]
        self._mask_host[:n].copy_(torch.tensor(run[:n]))
        mask = self._mask_host[:n].to(out.user_codes.device, non_blocking=True)
        codes = out.user_codes[:, :self.n_q].long()
        step = self._graphs.get(n) or self._steps.get(n)
        if step is None:  # a backend without buckets runs max_sessions rows: always a key
            raise RuntimeError(f"the frame ran {n} rows; paired transcription has {self.max_sessions}")
        (self._out,) = step(codes, mask)
        self.steps += 1
        self.rows_stepped += sum(run)

    @torch.no_grad()
    def _device_step(self, state, codes: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.gen.step(state, codes, mask).packed(),)

    @property
    def graphed(self) -> bool:
        """Whether the steps replay CUDA graphs (CUDA, cuda_graphs on)."""
        return bool(self._graphs)

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()

    def counters(self) -> dict:
        """For /metrics (engine.counters)."""
        return {"stt_paired_live": sum(row is not None for row in self._rows), "stt_paired_slots": self.max_sessions,
                "stt_paired_steps": self.steps, "stt_paired_rows_stepped": self.rows_stepped,
                "stt_paired_dropped": self.dropped}

    def publish(self) -> None:
        """After the frame's host copy: one partial per transcribed row."""
        if self._out is None:
            return
        host = self._out.cpu().numpy()
        for i, run in enumerate(self._mask):
            row = self._rows[i]
            if not run or row is None:
                continue
            step = row.step
            row.step += 1
            events = row.decoder.feed(int(host[i, 0]), step) if host[i, 1] > 0.5 else []
            kept = row.stream.push(SttPartial("".join(e.text for e in events if isinstance(e, TextDelta)),
                                              tuple(e for e in events if isinstance(e, Word)),
                                              float(host[i, 2]), row.step / FRAME_RATE))
            self.dropped += not kept

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


class _Disable:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
