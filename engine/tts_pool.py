"""TTS requests as slack work: a fixed pool of rows over one DSM TTS model (models/tts.py).

    pool = TtsPool(lm, mimi, slots=16, voice_frames=125)   # its own rows, state, Mimi stream
    pool.warm_up(engine.slack_costs); engine.add_slack_source(pool)  # graphs captured and costed before start()
    job = pool.submit(TtsRequest(...), loop)         # event loop; TtsPoolFull when every slot is taken
    async for event in job.stream: ...               # TtsAudio / TtsWord partials, then one Terminal
    job.cancel()                                     # the row is freed at the next tick

Scheduling (engine/slack.py rule 1: realtime items, then throughput items, each least served first):
- After each duplex tick the pool runs as many batched steps as the slack allows, each one work
  item whose measured cost fits before the next boundary.
- Realtime or throughput (slack.py rule 1), by what the rows it steps need: an admission, and a
  step of any row that has not yet reached its first audio or that is less than
  `realtime_lead_frames` (~1 s) of audio ahead of a listener who started playing at its first
  audio (wall time since then, on the pool's clock), is realtime work: first audio is what a
  user waits on, and a listener within a second of running dry is at risk from a run of short
  slacks. Such a step takes only the rows of that row's bucket (the others in it come along:
  same cost), and is due (`WorkItem.due_s`) when its least lead runs out: a live
  transcription's frame, due now, goes first while the row still has a lead. A step of rows
  all further ahead is throughput work: a client downloading faster than real time gets audio
  as fast as its fair share of the slack allows, and no faster at the expense of live
  transcription or images. What a client has read is no measure: a
  client reading as fast as audio comes has read it all, however far ahead of real time.
- Two step kinds, one CUDA graph each per row bucket on CUDA (eager on CPU): `text` (backbone +
  text sampling + DSM state machine: rows still inside the 16-frame audio delay need nothing
  else) and `full` (plus depformer and Mimi decode). A full step runs every eligible row at once
  (within a bucket the batch costs the same whichever rows are in it). Warm-up rows first: a new
  row's first audio waits on its 16 warm-up steps, so once every row past its warm-up has had
  this tick's step (real time kept for them), the warm-up rows take text steps of their own (a
  fraction of a full step's cost) until they are through; a text step also runs where a full
  one does not fit.
- A row is eligible while its stream holds fewer than `lead_frames` undelivered frames: that
  caps its lead over its client (a few seconds), bounds memory, and is the back-pressure
  (nothing is ever dropped: a row waits instead). A client reading in real time gets its row
  stepped only as fast as it listens; one reading faster gets audio as fast as the slack allows.
- When a tick's slack cannot give an eligible row a step, the duplex tick still wins; that row
  is counted in `starved`. After `force_after_ticks` ticks in a row without any step (a cost
  estimate above the slack never gets measured again, so without this a pool could stall for
  good), one step is forced as a tick's first slack item (slack.py rule 3) and counted in
  `forced`: liveness over one possibly late tick, only under overload.
- Idle rows are free (row buckets, as the duplex frame's in backend.py): rows are taken lowest
  first, and a step runs only the lowest `n` rows holding every row it steps, `n` the smallest
  bucket (1, 2, 4, ..., slots) that fits, over views of those rows' state (TtsGen.leading_rows
  and the Mimi decoder's); rows above are neither read nor written. Each (kind, bucket) has its
  own cost key (`step_key`), all measured by warm_up / slack_prepare before the first live item.
  Default on CUDA; off on CPU (`row_buckets`), where every step runs all rows bit for bit as
  before: a batch-size change may round a row's last bits differently.
- Admission (voice -> cross-attention keys, script -> the row's DSM arrays) is its own work item
  over the whole pool (one graph).
- A failure inside a step ends the requests of that step's rows (FAILED) and nothing else.
- Text that streams in (`TtsRequest.text_open`: Kyutai's `/api/tts_streaming`): the job's later words
  come by `TtsJob.append` and its end by `end_text`, taken onto the row at the next offer
  (DsmRows.extend). Until the text ends, the row steps only while it holds the DSM's lookahead
  (`second_stream_ahead`) + 1 words it has not consumed, so every step reads only words that are
  there, and the frames equal the whole script's; a row short of words waits (no step, no cost).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import numpy as np
import torch

from parley.models.dsm import WordEntry, split_words
from parley.models.mimi.codec import Mimi, MimiState
from parley.models.tts import FRAME_RATE, TtsConfig, TtsGen, TtsLM, TtsSampling

from .bucketed_step import BucketedStep, bucket_sizes
from .cuda_graph import CUDAGraphRunner, sync_device
from .host_rows import row_copy
from .row_pool import PoolStopped, RowPool
from .slack import CostModel, Priority, SlackSource, WorkItem, second_call_cost
from .slack_queue import host_copy
from .stream import OutputStream, Status, Terminal

log = logging.getLogger("parley.engine.tts")

FORCE_AFTER_TICKS = 25  # 2 s without a step: force one (see the module docstring)
LEAD_FRAMES = 38  # ~3 s of undelivered audio per row, at most
REALTIME_LEAD_FRAMES = 13  # ~1 s ahead of a real-time listener: steps up to it are realtime work
MAX_ENTRIES = 2400  # words and breaks per request (4096 characters make at most ~2050 words)
MAX_TOKENS = 8300  # text tokens per request
FRAME_DROP = 2  # the first two decoded frames click (the reference drops them too)
ADMIT_KEY = ("tts", "admit")
STEP_KINDS = ("text", "full")


def step_key(kind: str, rows: int) -> tuple:
    """Cost key of one step of `kind` over a bucket of `rows` rows."""
    return ("tts", kind, rows)


class TtsPoolFull(RuntimeError):
    """Every TTS slot is taken; retry later."""


@dataclass(frozen=True)
class TtsRequest:
    entries: tuple[WordEntry, ...]
    voices: tuple[torch.Tensor, ...]  # [1, dim, frames] each (one voice, or up to 5 speakers)
    conditions: dict  # sum conditions, e.g. {"control": "ok", "cfg": "2.0"}
    padding_bonus: float = 0.0
    text_temperature: float = TtsSampling.text_temperature
    text_top_k: int = TtsSampling.text_top_k
    audio_temperature: float = TtsSampling.audio_temperature
    audio_top_k: int = TtsSampling.audio_top_k
    text_open: bool = False  # more words may follow (TtsJob.append) until TtsJob.end_text


@dataclass(frozen=True)
class TtsAudio:
    pcm: np.ndarray  # float32 [1920]: one 80 ms frame at 24 kHz, in [-0.99, 0.99]


@dataclass(frozen=True)
class TtsWord:
    text: str
    start_s: float  # in the request's audio
    stop_s: float


class TtsJob:
    """One request's handle on the event loop side."""

    def __init__(self, request: TtsRequest, stream: OutputStream) -> None:
        self.request = request
        self.stream = stream
        self.request_id = stream.request_id
        self._cancelled = threading.Event()
        self.frames = 0  # audio frames pushed so far (engine thread)
        self._lock = threading.Lock()
        self._more: list[WordEntry] = []  # words appended, not yet on the row
        self._text_ended = not request.text_open

    def append(self, entries: Sequence[WordEntry]) -> None:
        """More words of a `text_open` request (event loop; no speaker token: they follow the first)."""
        with self._lock:
            if self._text_ended:
                raise ValueError("words were appended after the text ended")
            self._more.extend(entries)

    def end_text(self) -> None:
        """No more words: the row may consume its last ones and end."""
        with self._lock:
            self._text_ended = True

    def take_text(self) -> tuple[list[WordEntry], bool]:
        """Engine thread: the words appended since the last call, and whether the text has ended."""
        with self._lock:
            more, self._more = self._more, []
            return more, self._text_ended

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class _Row:
    job: TtsJob
    steps: int = 0  # frames stepped (the row's offset)
    budget: int = 0  # steps after which the request has overrun its bound (never expected)
    words_seen: int = 0  # entries consumed so far
    pending_word: tuple[str, int] | None = None  # (text, step) of the last word, stop not yet known
    ended_at: int = -1  # the DSM end step, once known
    first_audio_at: float | None = None  # the pool's clock when the row pushed its first audio frame
    entries: list[WordEntry] = field(default_factory=list)  # the script on the row so far
    text_ended: bool = True  # False while a text_open request may still append words

    def advance(self, info: list[int], pcm: np.ndarray | None, first: int) -> Terminal | None:
        """One step's results for this row: `info` (valid, frame index, entries consumed, DSM end
        step), `pcm` its decoded frame (a full step) and `first` the frame index heard first.
        Pushes the words and audio it finished; returns the request's end, if this is it."""
        self.steps += 1
        valid, frame_index, consumed, end_step = info
        if consumed > self.words_seen:
            self._word(consumed)
        if end_step >= 0 and self.ended_at < 0:
            self.ended_at = end_step
            self._flush_word(end_step)
        if pcm is not None and valid and frame_index >= first and (self.ended_at < 0
                                                                   or frame_index < first + self.ended_at):
            self.job.stream.push(TtsAudio(row_copy(pcm)))
            self.job.frames += 1
        if self.ended_at >= 0 and frame_index + 1 >= first + self.ended_at:
            return Terminal(Status.COMPLETED)
        if self.steps > self.budget:
            return Terminal(Status.FAILED, "the text did not finish within its step budget")
        return None

    def _word(self, consumed: int) -> None:
        """The step consumed an entry: emit the previous word with its stop time. The state
        machine takes at most one entry per step (DsmRows.step), at the row's own step index,
        which is `self.steps - 1` here: no device read needed."""
        assert consumed == self.words_seen + 1, "the DSM consumes at most one entry per step"
        entry, step = self.entries[self.words_seen], self.steps - 1
        if entry.tokens:  # (a break: the words around it carry the timing)
            self._flush_word(step)
            self.pending_word = (entry.text, step)
        self.words_seen = consumed

    def _flush_word(self, stop_step: int) -> None:
        if self.pending_word is None:
            return
        text, start = self.pending_word
        # Text step s is heard in audio frame s + delay, i.e. s - FRAME_DROP in the emitted audio.
        self.job.stream.push(TtsWord(text, max(start - FRAME_DROP, 0) / FRAME_RATE,
                                     max(stop_step - FRAME_DROP, 0) / FRAME_RATE))
        self.pending_word = None


def text_entries(text: str, encode: Callable[[str], list[int]], speaker_token: int | None) -> tuple[WordEntry, ...]:
    """A TtsRequest's `entries` for `text`: normalised, one entry per word (its tokens, from the
    model's tokenizer's `encode`), a `<break time="1.5s"/>` a pad-only entry; `speaker_token`
    (None: a single-speaker model) opens the first word."""
    return tuple(split_words(text, encode, FRAME_RATE, padding_between=1, speaker_token=speaker_token))


def step_budget(entries: Sequence[WordEntry], delay: int, max_padding: int = 8, initial_padding: int = 2) -> int:
    """An upper bound on the steps a script can take: each entry is consumed within its tokens,
    padding and `max_padding` + 2 steps; then the audio delay and the tail."""
    return initial_padding + sum(len(e.tokens) + e.padding + max_padding + 2 for e in entries) + delay + 16


def warm_request(cfg: TtsConfig, voice_frames: int | None, conditions: dict | None) -> TtsRequest:
    """A one-word request that warm-up admissions load (silent voices; `conditions` None: each
    condition's first value)."""
    voices = (torch.zeros(1, cfg.speaker.dim, voice_frames),) if cfg.cross_attention else ()
    if conditions is None:
        conditions = {name: cfg.lut_values(name)[0] for name in cfg.fuse_sum}
    return TtsRequest((WordEntry((0,), "warm", 0),), voices, conditions)


class TtsPool(SlackSource):
    priority = Priority.TTS

    def __init__(self, lm: TtsLM, mimi: Mimi, slots: int, *, lead_frames: int = LEAD_FRAMES,
                 voice_frames: int | None = None, max_entries: int = MAX_ENTRIES, max_tokens: int = MAX_TOKENS,
                 cuda_graphs: bool = True, output_events: int | None = None,
                 force_after_ticks: int = FORCE_AFTER_TICKS, row_buckets: bool | None = None,
                 warm_conditions: dict | None = None, realtime_lead_frames: int = REALTIME_LEAD_FRAMES,
                 now: Callable[[], float] = time.monotonic) -> None:
        # warm_conditions: the conditions requests will carry (the service's), so the admissions
        # warm_up measures are theirs, condition sum cached (default: each condition's first value).
        # row_buckets: step only the lowest rows holding the stepped ones (default: on CUDA; off on
        # CPU, where every step runs all rows bit for bit as before; see the module docstring).
        if slots < 1:
            raise ValueError("a TTS pool needs at least one slot")
        if lm.cfg.cross_attention and voice_frames is None:
            raise ValueError("this TTS model attends to voices: give the pool voice_frames (frames per voice file)")
        self.slots = slots
        self.lead_frames = lead_frames
        self.realtime_lead_frames = realtime_lead_frames  # a row's lead that ends its realtime steps
        self._now = now  # wall time, for a row's lead over a real-time listener (tests pass a fake one)
        self.output_events = output_events or lead_frames + 8  # room for the words beside the frames
        self.device = lm.text_linear.weight.device
        self._gen = TtsGen(lm, slots, max_entries, max_tokens, voice_frames=voice_frames)
        self._voice_frames = voice_frames
        self.mimi = mimi  # the codec its rows decode with (read-only: weights may be shared)
        self._mimi_state = mimi.init_state(slots, self.device)
        self._card = lm.cfg.lm.card
        self.delay = lm.cfg.audio_delay_frames
        # Rows and the queue (row_pool.py): pending + live at most `slots`, so submit refuses at once.
        self._pool: RowPool[TtsJob, _Row] = RowPool(
            slots, lambda why: TtsPoolFull(f"all {slots} TTS slots are busy"), reserve_rows=True)
        # Per row, the admission's host inputs (its mask and its index), made once: never written.
        self._row_select = [(torch.arange(slots) == b, torch.tensor([b], dtype=torch.long)) for b in range(slots)]
        row_buckets = self.device.type == "cuda" if row_buckets is None else row_buckets
        self.buckets = bucket_sizes(slots) if row_buckets else [slots]
        # Per kind, per bucket n: the device step over views of the lowest n rows (model and Mimi decoder).
        self._steps = {kind: BucketedStep(partial(self._device_step, kind=kind), (self._gen, self._mimi_state),
                                          self.buckets) for kind in STEP_KINDS}
        self._admit_graph: CUDAGraphRunner | None = None
        self.warm_conditions = warm_conditions  # what warm-up admissions carry (set before warm_up)
        self._use_graphs = cuda_graphs and self.device.type == "cuda"
        self._wanted: set[int] = set()  # rows eligible at this tick's first offer
        self._stepped: set[int] = set()
        self.force_after_ticks = force_after_ticks
        self._idle_ticks = 0  # consecutive ticks where rows wanted a step and none ran
        # Counters (engine thread writes, anyone reads).
        self.steps = {"text": 0, "full": 0}
        self.frames_out = self.starved = self.forced = 0
        self.completed = self.cancelled = self.failed = 0

    # ---- event loop side ----

    def submit(self, request: TtsRequest, loop: asyncio.AbstractEventLoop) -> TtsJob:
        job = TtsJob(request, OutputStream(uuid.uuid4().hex, loop, self.output_events))
        try:
            self._pool.enqueue(lambda: job)
        except PoolStopped as stopped:  # nothing will run it: end it now rather than wait forever
            job.stream.finish(stopped.terminal)
        return job

    @property
    def _rows(self) -> list[_Row | None]:
        return self._pool.rows

    @property
    def graphed(self) -> bool:
        """Whether the steps replay CUDA graphs (CUDA, after `warm_up`)."""
        return self._steps["full"].graphed

    @property
    def step_keys(self) -> list[tuple]:
        """Every step's cost key: one per (kind, bucket)."""
        return [step_key(kind, n) for kind in STEP_KINDS for n in self.buckets]

    def bucket(self, rows: Sequence[int]) -> int:
        """The rows a step over `rows` (indices) runs: the smallest bucket holding every one."""
        return self._steps["full"].bucket(rows)

    @property
    def live(self) -> int:
        return self._pool.live

    @property
    def free(self) -> int:  # requests the pool would take now
        return self._pool.takeable

    def slack_counters(self) -> dict:
        return {"tts_live": self.live, "tts_slots": self.slots, "tts_steps_text": self.steps["text"],
                "tts_steps_full": self.steps["full"], "tts_frames": self.frames_out, "tts_starved": self.starved,
                "tts_forced": self.forced,
                "tts_completed": self.completed, "tts_cancelled": self.cancelled, "tts_failed": self.failed}

    # ---- engine thread ----

    def warm_up(self, costs: CostModel) -> dict:
        """Capture the graphs (CUDA) and measure each step kind and an admission, seeding those
        costs in `costs` (the runner's cost model), so the first live item already has an estimate
        (slack.py rule 2); returns {key: seconds}. The measured admissions carry
        `warm_conditions` (set it before)."""
        conditions = self.warm_conditions
        idle = torch.zeros(self.slots, dtype=torch.bool, device=self.device)
        if self._use_graphs:
            pool = None  # one step runs at a time: the step graphs of both kinds share memory
            for kind in reversed(STEP_KINDS):  # the full steps' largest bucket first: it sizes the pool
                pool = self._steps[kind].capture(lambda n: (idle[:n],), pool=pool)
            # The admission's device part (row reset, Mimi reset, voice -> cross-attention keys and
            # values: hundreds of small kernels, whose launches alone would take much of a tick's
            # slack eagerly). Captured with
            # no row selected and row 0 as the voice's target: no row is live yet.
            warm = warm_request(self._gen.lm.cfg, self._voice_frames, conditions)
            voice = tuple(t.to(self.device) for t in self._gen.voice_inputs(warm.voices))
            index = torch.zeros(1, dtype=torch.long, device=self.device)
            self._admit_graph = CUDAGraphRunner(self._admit_device, (idle, index, *voice))
        measured = dict(self._measure())
        for key, seconds in measured.items():
            costs.seed(key, seconds)
        return measured

    def slack_prepare(self, costs: CostModel) -> None:
        """On the engine thread, before its first tick: run each key twice here and seed the
        second (this thread's first eager calls are cold)."""
        for key, seconds in self._measure():
            costs.seed(key, seconds)

    def _measure(self) -> list[tuple[tuple, float]]:
        """Each key's cost (every step kind in every bucket, and an admission), run twice, the
        second kept: a step with no row active (by the model contract no state changes), or an
        admission of a one-word script into row 0 (no live row reads it, and a real admission
        resets it), so no live item runs on an unmeasured key and the first request's admission
        meets warm kernels."""
        work = [(step_key(kind, n), partial(self._steps[kind], n, torch.zeros(n, dtype=torch.bool, device=self.device)))
                for kind in STEP_KINDS for n in self.buckets]
        work.append((ADMIT_KEY, self._warm_admit))
        return [(key, second_call_cost(run, partial(sync_device, self.device))[0]) for key, run in work]

    def _warm_admit(self) -> None:
        self._load_row(0, warm_request(self._gen.lm.cfg, self._voice_frames, self.warm_conditions))

    def offer(self, left_s: float | None, costs: CostModel) -> WorkItem | None:
        self.cancelled += self._pool.release_ended(Terminal(Status.CANCELLED, "the client went away"))
        self._take_text()
        job, cancelled = self._pool.front(Terminal(Status.CANCELLED, "cancelled before it started"))
        self.cancelled += cancelled
        if job is not None:
            return WorkItem(key=ADMIT_KEY, run=lambda: self._admit(job), fail=lambda exc: self._fail_job(job, exc),
                            realtime=True)
        eligible = self._eligible()
        if not eligible:
            return None
        leads = {b: self._lead_s(self._rows[b]) for b in eligible}
        behind = [b for b in eligible if leads[b] < self.realtime_lead_frames / FRAME_RATE]
        if behind:  # realtime: those rows' bucket (the rows above it wait for a throughput step)
            eligible = [b for b in eligible if b < self.bucket(behind)]
        warm = [b for b in eligible if self._rows[b].steps < self.delay]
        kind, rows = ("text", warm) if len(warm) == len(eligible) else ("full", eligible)
        if kind == "full" and warm:
            # Warm-up rows first (their first audio waits on them): once every row past its
            # warm-up has had this tick's step (real time kept), the warm-up rows take text steps
            # of their own, a fraction of a full step's cost; and where a full step would not
            # fit, a text step still may.
            caught_up = all(b in self._stepped for b in eligible if b not in warm)
            estimate = costs.estimate(step_key("full", self.bucket(eligible)))
            if caught_up or (left_s is not None and estimate is not None and estimate > left_s):
                kind, rows = "text", warm
        forced = self._idle_ticks >= self.force_after_ticks
        if forced:
            self._idle_ticks = 0
            self.forced += 1
        lead = min(leads[b] for b in rows)
        return WorkItem(key=step_key(kind, self.bucket(rows)), run=lambda: self._step(rows, kind),
                        fail=lambda exc: self._fail_rows(rows, exc), forced=forced,
                        realtime=lead < self.realtime_lead_frames / FRAME_RATE, due_s=max(lead, 0.0),
                        launch=lambda: self._launch_step(rows, kind))

    def _lead_s(self, row: _Row) -> float:
        """Seconds of audio `row` has ahead of a listener playing it in real time since its first
        frame came out (0 before that: first audio is due now). Under `realtime_lead_frames` its
        steps are realtime work, due when the lead would run out."""
        if row.first_audio_at is None:
            return 0.0
        return row.job.frames / FRAME_RATE - (self._now() - row.first_audio_at)

    def slack_started(self, deadline: float | None) -> None:
        """A tick's slack begins (slack.py): count the rows the last tick could not step
        (starved), and note who wants a step in this one. Manual mode (no deadline) never starves."""
        if deadline is None:
            self._wanted, self._stepped = set(), set()
            return
        self.starved += len(self._wanted - self._stepped)
        self._idle_ticks = self._idle_ticks + 1 if self._wanted and not self._stepped else 0
        self._wanted = set(self._eligible())
        self._stepped = set()

    def _eligible(self) -> list[int]:
        return [b for b, row in enumerate(self._rows)
                if row is not None and row.job.stream.buffered < self.lead_frames and self._has_words(row)]

    def _has_words(self, row: _Row) -> bool:
        """Whether `row` may step: its text ended, or it holds the lookahead + 1 unconsumed words
        (module docstring: then no step reads a word that is not there yet)."""
        if row.text_ended:
            return True
        left = sum(1 for entry in row.entries[row.words_seen:] if entry.tokens)
        return left > self._gen.dsm.ahead

    def _take_text(self) -> None:
        """Streamed words and text ends onto their rows (before this offer's eligibility)."""
        for b, row in enumerate(self._rows):
            if row is None or row.text_ended:
                continue
            more, ended = row.job.take_text()
            if more:
                try:
                    self._gen.dsm.extend(b, row.entries + more, started=row.words_seen > 0)
                except ValueError as exc:  # the script outgrew the row
                    self.failed += self._pool.end_rows([b], Terminal(Status.FAILED, str(exc)))
                    continue
                row.entries += more
                row.budget = step_budget(row.entries, self.delay)
            row.text_ended = ended

    def _admit(self, job: TtsJob) -> None:
        """The pending job `offer` left at the front of the queue (a declined admission item
        finds it there again) takes the lowest free row."""
        row = self._pool.reserve(job)
        self._load_row(row, job.request)
        self._pool.place(row, _Row(job, budget=step_budget(job.request.entries, self.delay),
                                   entries=list(job.request.entries), text_ended=not job.request.text_open))

    def _load_row(self, row: int, req: TtsRequest) -> None:
        """Reset `row` and load `req` into it: the checks and the voice on the host, then the
        device part (one graph replay on CUDA), then the script and settings."""
        voice = self._gen.voice_inputs(req.voices)
        self._gen.dsm.check(req.entries)
        mask, index = self._row_select[row]
        if self._admit_graph is not None:
            self._admit_graph(mask, index, *voice)
        else:
            self._admit_device(mask.to(self.device), index.to(self.device), *voice)
        self._gen.begin(row, req.entries, req.conditions, req.padding_bonus, req.text_temperature,
                        req.text_top_k, req.audio_temperature, req.audio_top_k)

    @torch.no_grad()
    def _admit_device(self, mask: torch.Tensor, index: torch.Tensor, *voice: torch.Tensor) -> tuple:
        """Device-only part of an admission (captured on CUDA): `mask`'s rows start over (model
        state and Mimi decoder), row `index` takes the voice's cross-attention keys and values."""
        self._gen.reset_rows(mask, index, *voice)
        self._mimi_state.decoder.reset(mask)
        return ()

    @torch.no_grad()
    def _device_step(self, gen: TtsGen, mimi_state: MimiState, active: torch.Tensor,
                     kind: str) -> tuple[torch.Tensor, ...]:
        """Device-only work of one step over the rows of `gen` / `mimi_state` (a bucket's views
        of the lowest rows); captured per (kind, bucket) on CUDA."""
        out = gen.step(active, full=kind == "full")
        if kind == "full":
            decode = out.valid & (out.frame_index >= self.delay)
            codes = torch.where(decode[:, None], out.frame[:, 1:], 0).clamp(0, self._card - 1)
            pcm = self.mimi.decode_step(codes, mimi_state, decode).clamp(-0.99, 0.99)
        else:
            pcm = torch.zeros(gen.batch, self.mimi.frame_size, device=self.device)
        info = torch.stack([out.valid.long(), out.frame_index, gen.dsm.next_entry, gen.dsm.end_step], dim=1)
        return pcm, info

    def _step(self, rows: list[int], kind: str) -> None:
        self._launch_step(rows, kind, queued=False)()

    def _launch_step(self, rows: list[int], kind: str, queued: bool = True) -> Callable[[], None]:
        """One step over `rows` queued, and its host half (the rows' words and audio pushed). Queued
        (engine/slack_queue.py) its results are copied to the host without a wait, for the host half
        to read once the device is done; otherwise they are on the host when this returns."""
        active = torch.zeros(self.bucket(rows), dtype=torch.bool)
        active[rows] = True
        pcm, info = self._steps[kind](len(active), active.to(self.device, non_blocking=True))
        # One device -> host copy of the small per-row results, read as Python ints at once: the loop
        # in `_advance` then makes no torch call per row (each would release and retake the GIL, and
        # with the edge's threads busy every retake can wait).
        copy = host_copy if queued else torch.Tensor.cpu
        info_host = copy(info)
        pcm_host = copy(pcm.float()) if kind == "full" else None
        self.steps[kind] += 1
        self._stepped.update(rows)
        return partial(self._advance, rows, info_host, pcm_host)

    def _advance(self, rows: list[int], info: torch.Tensor, pcm: torch.Tensor | None) -> None:
        """A step's results (on the host) to its rows: words and audio pushed, finished rows released."""
        info_rows = info.tolist()
        pcm_host = pcm.numpy() if pcm is not None else None
        first = self.delay + FRAME_DROP
        for b in rows:
            row = self._rows[b]
            frames = row.job.frames
            end = row.advance(info_rows[b], None if pcm_host is None else pcm_host[b], first)
            self.frames_out += row.job.frames - frames
            if row.first_audio_at is None and row.job.frames:
                row.first_audio_at = self._now()
            if end is not None:
                self._pool.release(b, end)
                self.completed += end.status is Status.COMPLETED
                self.failed += end.status is Status.FAILED

    def slack_stop(self, terminal: Terminal) -> None:
        """The engine stopped: every live and pending request ends with `terminal`."""
        self._pool.stop(terminal)

    def _fail_rows(self, rows: list[int], exc: Exception) -> None:
        self.failed += self._pool.end_rows(rows, Terminal(Status.FAILED, f"synthesis failed: {type(exc).__name__}"))

    def _fail_job(self, job: TtsJob, exc: Exception) -> None:
        # (admission may have taken the row before raising)
        self._pool.fail_job(job, Terminal(Status.FAILED, f"the request could not start: {exc}"))
        self.failed += 1
