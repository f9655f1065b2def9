"""Standalone transcription as slack work: rows of a Kyutai STT model, several steps per tick.

    pool = SttPool(checkpoint, slots=N)          # models.checkpoint.SttCheckpoint
    pool.warm_up(engine.slack_costs)             # graphs captured and costed before engine.start()
    engine.add_slack_source(pool)                # Priority.TRANSCRIPTION (engine/slack.py rule 1)
    request = pool.submit(loop)                  # SttBusy when the queue is full
    request.feed(pcm_24k_float32); request.end_input()
    async for event in request.events: ...       # SttPartial ..., then one Terminal

Each work item is `n` batched steps of the rows that can advance (Mimi encode of one 80 ms frame
-> SttGen.step -> one host copy), with `n` sized to the slack left from the per-step cost
estimate (key `step_key(rows)`, seeded by `warm_up`). Live sessions' steps are realtime work,
uploads' steps throughput work (engine/slack.py rule 1: the realtime ones go first, the rest share
the slack left fairly with TTS and images; `offer`). Like the duplex frame, a step runs only
the lowest rows that hold every running row (a bucket: 1, 2, 4, ..., slots; rows are taken
lowest first), and on CUDA each bucket's step is one CUDA graph, captured by `warm_up`
(before it, and on CPU, steps run eagerly with the same code). A row advances when it has a whole frame of input
(or its input has ended: the last frame is zero-padded, then `stt_config`'s delay of silence
flushes the delayed text) and room in its output stream: transcripts are never dropped, a slow
client only stops its own row (back-pressure). Standalone rows get `stt_config`'s silence prefix,
as the reference's file transcription does; word times are relative to the request's audio.

Failure containment: a step that raises fails every request that was in it (they shared the
step) and nothing else; `submit` / `feed` validate input before it reaches the device.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np
import torch

from parley.models.checkpoint import SttCheckpoint
from parley.models.config import FRAME_RATE, FRAME_SAMPLES
from parley.models.stt import SttGen
from parley.models.stt_text import TextDelta, TranscriptDecoder, Word, WordEnded, WordHeard

from .bucketed_step import BucketedStep, bucket_sizes
from .host_rows import join_rows
from .row_pool import PoolStopped, RowPool
from .slack import CostModel, Priority, SlackSource, WorkItem, second_call_cost
from .slack_queue import host_copy
from .stream import OutputStream, Status, Terminal

def step_key(rows: int) -> tuple:
    """Cost key of one batched step over a bucket of `rows` rows (units = steps)."""
    return ("stt", "step", rows)


MAX_STEPS_PER_ITEM = 64  # one item's steps at most (manual mode runs items back to back)
OUTPUT_EVENTS = 256  # partials buffered per request before its row pauses
LIVE_BACKLOG_S = 30  # a live request's audio waiting to be stepped, at most (bounded memory)


class SttBusy(RuntimeError):
    """Every transcription row is taken and the waiting queue is full."""


class SttInputError(ValueError):
    """Audio a transcription request cannot take (wrong shape, not finite, after end_input)."""


@dataclass(frozen=True)
class SttPartial:
    """What one step added for a request: new text, finished words, the end-of-turn probability."""

    text: str
    words: tuple[Word, ...]
    end_of_turn: float  # P(the speaker has finished their turn) at `audio_s`; NaN without the head
    audio_s: float  # seconds of the request's audio the model has now read
    # When the newest input frame this step read reached the server (time.monotonic()); a frame the
    # server made up (silence prefix, flush, underrun) counts from when it was made. None: no step
    # (an end-of-stream flush). The edge measures transcript delay from it.
    input_at: float | None = None
    heads: tuple[float, ...] = ()  # every extra head's probability of its entry 0 (moshi-server's `prs`)
    heard: tuple[WordHeard | WordEnded, ...] = ()  # the words as moshi-server's ASR reports them (stt_text.py)


@dataclass
class SttRequest:
    request_id: str
    events: OutputStream
    max_input_s: float
    temperature: float = 0.0
    live: bool = False  # a live session: a partial every step (the end-of-turn probability is news)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _chunks: deque = field(default_factory=deque)  # float32 samples as bytes, fed from the loop
    _arrivals: deque = field(default_factory=deque)  # (queued samples at a chunk's end, its arrival time)
    _queued_samples: int = 0  # samples appended to _chunks, ever
    # Engine thread only: float32 bytes, sliced without numpy copies (engine/host_rows.py says why).
    _buffer: bytearray = field(default_factory=bytearray)
    _fed_samples: int = 0
    _taken_samples: int = 0  # fed samples the engine thread has stepped (a live request's backlog bound)
    _ended: bool = False
    cancelled: bool = False

    def feed(self, pcm: np.ndarray, received_at: float | None = None) -> None:
        """Append mono float PCM at 24 kHz (any length) that reached the server at `received_at`
        (time.monotonic(); default now)."""
        at = time.monotonic() if received_at is None else received_at
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if not np.isfinite(pcm).all():
            raise SttInputError("audio holds NaN or infinite samples.")
        with self._lock:
            if self._ended:
                raise SttInputError("audio was fed after the input ended.")
            if self.live and self._fed_samples + pcm.size - self._taken_samples > LIVE_BACKLOG_S * 24_000:
                raise SttInputError(f"more than {LIVE_BACKLOG_S} s of audio is waiting to be transcribed; "
                                    f"send audio at real-time pace (this chunk was dropped).")
            self._fed_samples += pcm.size
            if self._fed_samples > self.max_input_s * 24_000:
                raise SttInputError(f"audio is longer than the {self.max_input_s:.0f} s this server takes.")
            self._chunks.append(pcm.tobytes())
            self._queued_samples += pcm.size
            self._arrivals.append((self._queued_samples, at))

    @property
    def input_seconds(self) -> float:
        """How much audio has been fed (all of it once the input ended)."""
        with self._lock:
            return self._fed_samples / 24_000

    def end_input(self) -> None:
        with self._lock:
            self._ended = True

    def cancel(self) -> None:
        """The client went away: the row is freed at the next item, the stream ends cancelled."""
        self.cancelled = True

    @property
    def stream(self) -> OutputStream:
        """`events`, by the name row_pool.py's jobs share."""
        return self.events

    def _frames_ready(self) -> tuple[int, bool]:
        """Engine thread: (whole frames buffered, input ended)."""
        with self._lock:
            samples = (len(self._buffer) + sum(len(c) for c in self._chunks)) // 4
            return -(-samples // FRAME_SAMPLES) if self._ended else samples // FRAME_SAMPLES, self._ended

    def _take(self) -> tuple[bytes | None, bool, float | None]:
        """Engine thread: the next whole frame as float32 bytes, zero-padded at the input's end (None
        if not available yet), whether input ended, and when the frame's last sample arrived."""
        with self._lock:
            while self._chunks:
                self._buffer += self._chunks.popleft()
            ended = self._ended
            available = len(self._buffer) // 4
            if not (available >= FRAME_SAMPLES or (ended and available)):
                return None, ended, None
            n = min(FRAME_SAMPLES, available)
            end = self._taken_samples + n
            while self._arrivals[0][0] < end:  # chunks wholly before the frame's last sample
                self._arrivals.popleft()
            at = self._arrivals[0][1]  # the chunk holding that sample (kept: it may reach the next frame)
        frame = bytes(self._buffer[:4 * n]) + bytes(4 * (FRAME_SAMPLES - n))
        del self._buffer[:4 * n]
        self._taken_samples += n
        return frame, ended and not self._buffer, at


class SttFailed(RuntimeError):
    """A transcription ended without completing (its Terminal's reason)."""


async def collect_transcript(request: SttRequest) -> tuple[str, list[Word]]:
    """Await a request's end: (full text, timed words). SttFailed unless it completed."""
    text, words = "", []
    try:
        async for event in request.events:
            if isinstance(event, Terminal):
                if event.status is not Status.COMPLETED:
                    raise SttFailed(f"transcription {event.status.value}: {event.reason}")
                break
            text += event.text
            words += event.words
    finally:
        request.cancel()  # no-op once completed; frees the row if the caller went away
    return text.strip(), words


@dataclass
class _Row:
    request: SttRequest
    decoder: TranscriptDecoder
    step: int = 0  # model steps taken
    prefix_left: int = 0  # silence frames still to feed first
    suffix_left: int | None = None  # flush frames still to feed once the input ended
    audio_frames: int = 0  # frames of real audio read

    def next_input(self, suffix_frames: int) -> tuple[bool, bytes | None, float | None]:
        """What this row feeds the next step: (it steps, its audio frame (None: silence, of the
        prefix or the flush), when that frame arrived). A row that does not step waits for input,
        or has flushed (`suffix_left` 0: its request completes)."""
        if self.prefix_left:
            self.prefix_left -= 1
            return True, None, None
        if self.suffix_left is None:
            frame, ended, at = self.request._take()
            if ended:
                self.suffix_left = suffix_frames
                self.decoder.audio_ended(self.request.input_seconds)
            if frame is not None:
                self.audio_frames += 1
                return True, frame, at
            if not ended:
                return False, None, None
        if self.suffix_left == 0:
            return False, None, None
        self.suffix_left -= 1
        return True, None, None

    def publish(self, values: np.ndarray, input_at: float) -> None:
        """One step's output (text token, valid, end-of-turn probability, the extra heads) to the
        request's stream."""
        step = self.step
        self.step += 1
        events = self.decoder.feed(int(values[0]), step) if values[1] > 0.5 else []
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        words = tuple(e for e in events if isinstance(e, Word))
        heard = tuple(e for e in events if isinstance(e, (WordHeard, WordEnded)))
        if text or words or heard or self.request.live:
            self.request.events.push(SttPartial(text, words, float(values[2]), self.audio_frames / FRAME_RATE,
                                                input_at, tuple(float(v) for v in values[3:]), heard))


class _Launch:
    """One item's steps (`SttPool.launch_steps`): queued, the host work each step leaves (its outputs
    published, rows completed) waits in order for the host half, and a row steps at most as often as
    its stream has room (each step counted as one event: its events are not known yet)."""

    def __init__(self, queued: bool) -> None:
        self.queued = queued
        self.actions: list[Callable[[], None]] = []
        self.completing: set[int] = set()  # rows whose completion is done or waits in `actions`
        self.room: dict[int, int] = {}  # queued: events each row's stream may still take

    def may_step(self, i: int, row: "_Row") -> bool:
        if i in self.completing:
            return False
        return not self.queued or self.room.setdefault(i, row.request.events.room()) > 0

    def stepped(self, run: list[bool]) -> None:
        if self.queued:
            for i in np.flatnonzero(run):
                self.room[int(i)] -= 1

    def do(self, action: Callable[[], None]) -> None:
        if self.queued:
            self.actions.append(action)
        else:
            action()

    def finish(self) -> None:
        for action in self.actions:
            action()


class SttPool(SlackSource):
    priority = Priority.TRANSCRIPTION

    def __init__(self, checkpoint: SttCheckpoint, slots: int, *, max_queue: int = 64,
                 max_input_s: float = 3600.0, cuda_graphs: bool = True) -> None:
        if slots < 1:
            raise ValueError(f"stt slots must be at least 1, got {slots}")
        self.checkpoint = checkpoint
        self.slots = slots
        self.max_queue = max_queue
        self.max_input_s = max_input_s
        self.device = next(checkpoint.lm.parameters()).device
        self.gen = SttGen(checkpoint.lm)
        self._state = self.gen.init_state(slots)
        self._mimi_state = checkpoint.mimi.init_state(slots, self.device)
        self._steps = BucketedStep(self._device_step, (self._state, self._mimi_state), bucket_sizes(slots))
        self._use_graphs = cuda_graphs and self.device.type == "cuda"
        self._pinned = self.device.type == "cuda"
        self._frames_host = torch.zeros(slots, FRAME_SAMPLES, pin_memory=self._pinned)
        self._mask_host = torch.zeros(slots, dtype=torch.bool, pin_memory=self._pinned)
        # Rows and the waiting queue (row_pool.py): at most `max_queue` requests wait.
        self._pool: RowPool[SttRequest, _Row] = RowPool(slots, self._busy, max_pending=max_queue)
        self._next_id = 0
        self.counters = {"stt_requests": 0, "stt_steps": 0, "stt_audio_seconds": 0.0, "stt_completed": 0,
                         "stt_cancelled": 0, "stt_failed": 0, "stt_starved": 0}
        self._wanted: set[int] = set()  # rows that could step when this tick's slack began
        self._stepped: set[int] = set()  # ... and those that did

    @property
    def name(self) -> str:
        """The STT model's name (its checkpoint folder), as clients are told it."""
        return self.checkpoint.path.name or "stt"

    @property
    def _rows(self) -> list[_Row | None]:
        return self._pool.rows

    # ---- requests (event loop) ----

    def submit(self, loop: asyncio.AbstractEventLoop | None = None, *, temperature: float = 0.0,
               live: bool = False) -> SttRequest:
        """Queue a request; `temperature` 0 is greedy (Kyutai's setting), more samples the text.
        `live` (a realtime transcription session): refused unless a row is free now (a live
        stream cannot wait in the queue), and its stream gets a partial every step."""
        if not (isinstance(temperature, (int, float)) and 0 <= temperature <= 2):
            raise SttInputError(f"temperature must be between 0 and 2, got {temperature!r}.")
        loop = loop or asyncio.get_running_loop()

        def make() -> SttRequest:  # (under the row pool's lock, once the request is accepted)
            self._next_id += 1
            self.counters["stt_requests"] += 1
            return SttRequest(f"stt_{self._next_id}", OutputStream(f"stt_{self._next_id}", loop, OUTPUT_EVENTS),
                              self.max_input_s, temperature=float(temperature), live=live)

        try:
            return self._pool.enqueue(make, need_row=live)
        except PoolStopped:
            raise SttBusy("the server is shutting down; transcription is not taking requests.") from None

    def _busy(self, why: str) -> SttBusy:
        """The row pool's refusal: the queue is at its bound, or (a live request) no row is free."""
        if why == "pending":
            return SttBusy(f"all {self.slots} transcription rows are busy and {self.max_queue} "
                           f"requests are waiting; try again later.")
        return SttBusy(f"all {self.slots} transcription rows are busy; try again later.")

    # ---- slack source (engine thread) ----

    def offer(self, left_s: float | None, costs: CostModel) -> WorkItem | None:
        """Live sessions first, as realtime work (slack.py rule 1): steps of the live rows, as many
        as their audio holds, with the uploads in the live rows' bucket along (the bucket costs
        the same with them). Otherwise the uploads' steps, as throughput work. Either is sized to
        `left_s`."""
        self._admit()
        ready_by_row = [self._steps_ready(row) for row in self._rows]
        rows = [i for i, n in enumerate(ready_by_row) if n]
        if not rows:
            return None
        live = [i for i in rows if self._rows[i].request.live]
        if live:
            rows = [i for i in rows if i < self.bucket(live)]
        ready = max(ready_by_row[i] for i in (live or rows))
        key = step_key(self.bucket(rows))
        per_step = costs.estimate(key)
        if left_s is None:
            steps = MAX_STEPS_PER_ITEM
        elif per_step is None:
            steps = 1
        else:
            steps = max(1, min(MAX_STEPS_PER_ITEM, int(left_s / max(per_step, 1e-9))))
        steps = min(steps, ready)
        only = frozenset(rows) if live else None
        return WorkItem(key=key, units=steps, run=lambda: self.run_steps(steps, only), fail=self._fail_all,
                        realtime=bool(live), launch=lambda: self.launch_steps(steps, only)[1])

    def bucket(self, rows) -> int:
        """The rows a step over `rows` (indices) runs: the smallest bucket holding every one."""
        return self._steps.bucket(rows)

    def _admit(self) -> None:
        """Free the rows of cancelled and ended requests, then fill every free row from the queue."""
        cancelled = Terminal(Status.CANCELLED, "the client went away")
        self.counters["stt_cancelled"] += self._pool.release_ended(cancelled)
        self.counters["stt_cancelled"] += self._pool.admit(self._start_row, cancelled)

    def _start_row(self, i: int, request: SttRequest) -> _Row:
        mask = torch.zeros(self.slots, dtype=torch.bool, device=self.device)
        mask[i] = True
        self._state.reset(mask)
        self._state.text_temp[i] = request.temperature
        self._mimi_state.reset(mask)
        settings = self.checkpoint.settings
        offset = settings.prefix_frames / FRAME_RATE
        return _Row(request, TranscriptDecoder(self.checkpoint.tokenizer, self.gen.text_delay, offset),
                    prefix_left=settings.prefix_frames)

    def _runnable(self, row: _Row | None) -> bool:
        return row is not None and not row.request.events.finished and not row.request.cancelled \
            and row.request.events.room() > 0

    def _steps_ready(self, row: _Row | None) -> int:
        """Steps this row can take now (0 if none): input and output room permitting."""
        if not self._runnable(row):
            return 0
        if row.suffix_left is not None:
            return row.suffix_left + 1  # the last one completes the request
        frames, ended = row.request._frames_ready()
        ready = row.prefix_left + frames + (self.checkpoint.settings.suffix_frames + 1 if ended else 0)
        return min(ready, row.request.events.room())

    def run_steps(self, steps: int, only: frozenset[int] | None = None) -> int:
        """Up to `steps` batched steps (of the rows in `only`, if given; the others wait); stops
        early when no row can advance. Returns steps run."""
        done, _ = self.launch_steps(steps, only, queued=False)
        return done

    def launch_steps(self, steps: int, only: frozenset[int] | None = None,
                     queued: bool = True) -> tuple[int, Callable[[], None]]:
        """`run_steps`, and its host half: (steps run, the host half). Queued (engine/slack_queue.py),
        the steps' device work is queued with nothing read back, and the host half publishes each
        step's outputs and completes the rows that flushed, in step order, once the device is done;
        otherwise each step's are published at once and the host half does nothing."""
        launch = _Launch(queued)
        for done in range(steps):
            if not self._step_once(only, launch):
                return done, launch.finish
        return steps, launch.finish

    def _step_once(self, only: frozenset[int] | None, launch: "_Launch") -> bool:
        inputs: list[bytes | None] = [None] * self.slots  # silence where None
        made_at = time.monotonic()  # when this step's made-up frames (prefix, flush) were made
        arrivals = [made_at] * self.slots
        run = [False] * self.slots
        finishing: set[int] = set()
        for i, row in enumerate(self._rows):
            if not self._runnable(row) or (only is not None and i not in only) or not launch.may_step(i, row):
                continue
            run[i], frame, at = row.next_input(self.checkpoint.settings.suffix_frames)
            if frame is not None:
                inputs[i], arrivals[i] = frame, at
            elif not run[i] and row.suffix_left == 0:
                finishing.add(i)
        for i in finishing:
            launch.completing.add(i)
            launch.do(partial(self._complete, i))
        if not any(run):
            return False
        frames = join_rows(inputs, FRAME_SAMPLES)
        host = self._queue_device(frames, run) if launch.queued else self.run_device(frames, run)
        self.counters["stt_steps"] += 1
        self._stepped.update(i for i, flag in enumerate(run) if flag)
        launch.stepped(run)
        launch.do(partial(self._publish, host, run, arrivals))
        return True

    def _publish(self, host: np.ndarray | torch.Tensor, run: list[bool], arrivals: list[float]) -> None:
        """One step's outputs to its rows' streams."""
        values = host.numpy() if isinstance(host, torch.Tensor) else host
        for i in np.flatnonzero(run):
            self._rows[i].publish(values[i], arrivals[i])

    def _queue_device(self, frames: np.ndarray, run: list[bool]) -> torch.Tensor:
        """`run_device` with nothing waited for: the inputs in pinned memory of this step's own (the
        pool's staging buffers may still be read by a step queued before it), the outputs copied into
        pinned memory on the stream, to be read once the device is done (engine/slack_queue.py)."""
        n = self.bucket(i for i, flag in enumerate(run) if flag)
        pcm, mask = torch.from_numpy(frames[:n]), torch.tensor(run[:n])
        if self._pinned:
            pcm, mask = pcm.pin_memory(), mask.pin_memory()
        pcm, mask = pcm.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
        (out,) = self._steps(n, pcm, mask)
        return host_copy(out)

    def run_device(self, frames: np.ndarray, run: list[bool]) -> np.ndarray:
        """One step of the rows flagged in `run` (frames [slots, FRAME_SAMPLES]): the lowest
        bucket holding them, its graph if captured. Host [bucket, 3 + H] (text, valid, end_of_turn, the
        H extra heads)."""
        n = self.bucket(i for i, flag in enumerate(run) if flag)
        self._frames_host[:n].copy_(torch.from_numpy(frames[:n]))
        self._mask_host[:n].copy_(torch.tensor(run[:n]))
        pcm = self._frames_host[:n].to(self.device, non_blocking=True)
        mask = self._mask_host[:n].to(self.device, non_blocking=True)
        (out,) = self._steps(n, pcm, mask)
        return out.cpu().numpy()

    @torch.no_grad()
    def _device_step(self, state, mimi_state, pcm: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor]:
        codes = self.checkpoint.mimi.encode_step(pcm, mimi_state, mask)
        out = self.gen.step(state, codes, mask)
        return (torch.cat([out.packed(), out.heads], dim=1),)

    @property
    def graphed(self) -> bool:
        """Whether steps replay CUDA graphs (CUDA, after `warm_up`)."""
        return self._steps.graphed

    def _complete(self, i: int) -> None:
        row = self._rows[i]
        events = row.decoder.flush(row.step - 1)
        words = tuple(e for e in events if isinstance(e, Word))
        audio_s = row.audio_frames / FRAME_RATE
        if events:
            row.request.events.push(SttPartial("", words, float("nan"), audio_s,
                                               heard=tuple(e for e in events if isinstance(e, (WordHeard, WordEnded)))))
        self.counters["stt_audio_seconds"] += audio_s
        self.counters["stt_completed"] += 1
        self._pool.release(i, Terminal(Status.COMPLETED))

    def _fail_all(self, exc: Exception) -> None:
        """A step raised: the requests in it fail (the rows shared it); queued ones go on."""
        failed = Terminal(Status.FAILED, f"transcription failed: {type(exc).__name__}")
        self.counters["stt_failed"] += self._pool.end_rows(None, failed)

    # ---- engine hooks (slack.py) ----

    @property
    def live(self) -> int:
        return self._pool.live

    @property
    def free(self) -> int:  # rows a live request could take now
        return self._pool.takeable

    def slack_counters(self) -> dict:
        return {**self.counters, "stt_live": self.live, "stt_slots": self.slots, "stt_queued": self._pool.pending,
                "stt_model_delay_seconds": self.gen.text_delay / FRAME_RATE}

    def slack_started(self, deadline: float | None) -> None:
        """A tick's slack begins: count the rows the last tick left unstepped although they could
        step (starved: the slack was too short), and note who can step in this one. Manual mode
        (no deadline) never starves."""
        if deadline is not None:
            self.counters["stt_starved"] += len(self._wanted - self._stepped)
            self._wanted = {i for i, row in enumerate(self._rows) if self._steps_ready(row)}
        else:
            self._wanted = set()
        self._stepped = set()

    def slack_stop(self, terminal: Terminal) -> None:
        """The engine stopped (shutdown, drain, fatal error): every running and queued request
        ends with `terminal`, and later submits are refused."""
        live, queued = self._pool.stop(terminal)
        self.counters["stt_cancelled" if terminal.status is Status.CANCELLED else "stt_failed"] += live + queued

    # ---- start-up and manual use ----

    def warm_up(self, costs: CostModel) -> dict:
        """Capture each bucket's graph (CUDA), then time one step per bucket with no row running
        (by the model contract no state changes) and seed its cost estimate; returns {key: seconds}."""
        if self._use_graphs:
            self._steps.capture(self._idle_inputs, generators=(self.gen.generator,))
        measured = {}
        for n in reversed(self._steps.buckets):
            pcm, idle = self._idle_inputs(n)
            spent, _ = second_call_cost(lambda: self._steps(n, pcm, idle)[0].cpu())  # (the copy to the host syncs)
            costs.seed(step_key(n), spent)
            measured[step_key(n)] = spent
        return measured

    def _idle_inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of bucket n with no row running: silence, an all-False mask."""
        return torch.zeros(n, FRAME_SAMPLES, device=self.device), torch.zeros(n, dtype=torch.bool, device=self.device)

    def close(self) -> None:
        self._steps.close()

    def run_until_idle(self) -> None:
        """Manual mode (CLI, tests without an engine): step until no row can advance."""
        while (item := self.offer(None, CostModel())) is not None:
            before = self.counters["stt_steps"]
            try:
                item.run()
            except Exception as exc:
                item.fail(exc)
                raise
            if self.counters["stt_steps"] == before:  # only finished rows were closed
                continue
