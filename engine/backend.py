"""The model side of one tick, behind a small protocol the engine can fabricate in tests.

A `FrameBackend` holds per-row state for `max_sessions` rows. Each tick the engine hands
it every row's input frame plus the live mask; rows outside the mask are computed on
(shapes stay fixed, so one CUDA graph serves any subset of sessions) but their state is
left untouched. Outputs stay on the device until `BackendOutput.to_host()`, which is the
tick's single device->host copy.

Idle rows are free (`ModelBackend`, row buckets): rows are allocated lowest first, so a tick
runs only the lowest `n` rows that hold every live row, `n` the smallest bucket (1, 2, 4, ...,
max_sessions) that fits, each bucket with its own CUDA graph over views of the state's lowest
rows. Rows above `n` are neither read nor written; `to_host` reports them not valid. The cost
of a bucket switch: the batch size of the matmuls changes, and on CUDA a different batch size
may round a row's last bits differently (the same holds for any batch-size change).

Error contract, so the engine can tell one bad session from a broken engine:
- `RowFailure` from `step`: the listed rows' inputs were refused *before* any state
  changed; the engine fails those sessions and reruns the step without them.
- `SessionRejected` from `prefill`: this session's options cannot be served (e.g. an
  unknown voice); only that open() fails.
- anything else: fatal; every stream fails and the engine is marked unhealthy.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterable, Protocol

import numpy as np
import torch

from parley.models.checkpoint import Checkpoint, load_checkpoint
from parley.models.lm_gen import LMGen, LMGenState
from parley.models.sampling import UNSEEDED
from parley.models.mimi import MimiState
from parley.models.paged_kv import block_size_for
from parley.models.persona_prompt import PromptPlan, build_prompt_frames, persona_tokens
from parley.models.voices import PersonaError

from .config import OptionsError, SamplingOptions, SessionOptions
from .bucketed_step import BucketedStep, bucket_sizes
from .cuda_graph import sync_device
from .kv_blocks import KvChanges, KvLayout
from .kv_storage import kv_storage
from .prompt_handoff import PromptHandoff
from .row_reset import RowReset
from .prompt_prefill import PREFILL_CHUNKS, PromptPrefill, PromptRunner
from .voice_library import VoiceLibrary

log = logging.getLogger("parley.engine.backend")


class RowFailure(Exception):
    """Some rows' inputs were refused before any state changed: {row: reason}."""

    def __init__(self, reasons: dict[int, str]) -> None:
        super().__init__("; ".join(f"row {r}: {why}" for r, why in sorted(reasons.items())))
        self.reasons = reasons


class SessionRejected(ValueError):
    """A session's options cannot be served; the message says why in a plain sentence."""


def default_dtype(device: str | torch.device) -> torch.dtype:
    """Weights in bfloat16 on CUDA, float32 on CPU (where bf16 matmuls are slow and inexact)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def kv_layout(checkpoint: Checkpoint, kv_dtype: torch.dtype | None, block_frames: int | None = None,
              divides: bool = False) -> KvLayout:
    """The temporal LM's paged KV ring in blocks of `block_frames` (None: the model's default,
    `paged_kv.block_size_for`, which also checks a given size; `divides`: a default that divides
    the ring, for page lists): what one block of every layer's keys and values (and fp8 scales)
    takes in bytes. OptionsError for a block longer than the ring."""
    tr = checkpoint.lm.transformer
    try:
        block_frames = block_size_for(tr.capacity, block_frames, divides)
    except ValueError as exc:
        raise OptionsError(f"a KV block of {block_frames} frames must be 1 .. the {tr.capacity}-frame window.") from exc
    dtype = kv_dtype or next(checkpoint.lm.parameters()).dtype
    head_dim = tr.d_model // tr.num_heads
    per_slot = 2 * tr.kv_heads * head_dim * dtype.itemsize  # a key and a value of every KV head
    if dtype == torch.float8_e4m3fn:
        per_slot += 2 * tr.kv_heads * 4  # their fp32 scales
    return KvLayout(window_frames=tr.capacity, block_frames=block_frames,
                    block_bytes=per_slot * len(tr.layers) * block_frames)


# A live row's input flag (the last column of a tick's inputs) when its frame carries the input
# end-of-stream code instead of its Mimi codes; 1.0 is plain live, 0.0 idle.
SOURCE_END = 2.0


def rows_mask(size: int, rows: Iterable[int]) -> torch.Tensor:
    """[size] bool host mask with `rows` set: how the engine names rows to the backend."""
    mask = np.zeros(size, dtype=bool)
    mask[list(rows)] = True
    return torch.from_numpy(mask)  # built in numpy: no torch call (each gives the GIL up)


@dataclass
class HostOutput:
    """One tick's outputs on the host, indexed by row."""

    pcm: np.ndarray  # [B, FRAME_SAMPLES] float32: each row's output audio frame
    text_tokens: np.ndarray  # [B] int64: each row's text token for this frame
    valid: np.ndarray  # [B] bool: False while a row is still inside its first max_delay steps


@dataclass
class BackendOutput:
    """One tick's outputs, possibly still on the device."""

    pcm: torch.Tensor  # [B, FRAME_SAMPLES] float
    text_tokens: torch.Tensor  # [B] integer
    valid: torch.Tensor  # [B] bool
    # Codes of this frame, kept on the device for tests and debugging (not copied to host).
    agent_codes: torch.Tensor | None = None  # [B, n_agent]: what was decoded into `pcm`
    user_codes: torch.Tensor | None = None  # [B, >= n_user]: Mimi's encoding of the input frame
    # (`encode_codebooks` of them: paired transcription reads more codebooks than the LM)
    side: torch.Tensor | None = None  # the FrameSideWork's output for this frame's rows, if any
    # The backend's row count when the tensors above hold only its lowest rows (a row bucket):
    # to_host pads the rows above with silence, text 0, not valid. None: they hold every row.
    rows: int | None = None

    # pcm, text and valid packed by `pack_host` already (the model backend does it inside its graph).
    packed: torch.Tensor | None = None
    # True when the step is only queued on the device and `to_host` waits for it: the host is free
    # until then (the engine runs a due full GC pass there, engine/gc_pauses.py).
    queued: bool = False

    def to_host(self) -> HostOutput:
        # One tensor, so the tick needs a single copy (and a single sync).
        packed = (self.packed if self.packed is not None else pack_host(self.pcm, self.text_tokens, self.valid)).cpu().numpy()
        if self.rows is not None and self.rows > packed.shape[0]:
            packed = np.concatenate([packed, np.zeros((self.rows - packed.shape[0], packed.shape[1]), np.float32)])
        return HostOutput(pcm=packed[:, :-2], text_tokens=packed[:, -2].astype(np.int64),
                          valid=packed[:, -1] > 0.5)


def pack_host(pcm: torch.Tensor, text_tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, FRAME_SAMPLES + 2] float32: each row's audio, text id and valid flag (ids < 2**24 and 0/1
    flags are exact in float32), what `BackendOutput.to_host` copies."""
    return torch.cat([pcm.float(), text_tokens.float()[:, None], valid.float()[:, None]], dim=1)


class FrameSideWork(Protocol):
    """Device work that reads each frame's Mimi latent and runs beside the LM (paired transcription,
    engine/stt_paired.py). On CUDA it is part of the frame's graph, on a stream of its own forked
    after the encode and joined before the frame ends, so it overlaps the LM and decode instead of
    following them; it must not write anything the frame reads."""

    generators: tuple[torch.Generator, ...]  # its own random streams, registered with the frame's graphs

    def __call__(self, latent: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """latent [n, dim, 1] and the frame's live mask [n] (device) -> its output [n, ...] (device)."""


class PrefillJob(Protocol):
    """A row's prompt, run a chunk at a time so a long prompt can use several ticks' slack."""

    frames_left: int  # prompt frames still to run; 0 when the row is ready to go live

    def run(self, max_frames: int | None = None) -> None:
        """Run up to `max_frames` more prompt frames (None: all that are left)."""


class FrameBackend(Protocol):
    max_sessions: int

    def step(self, frames: torch.Tensor, live_mask: torch.Tensor) -> BackendOutput:
        """frames: [B, FRAME_SAMPLES] float32 on the host; live_mask: [B] bool on the host."""

    def reset_rows(self, mask: torch.Tensor) -> None:
        """Return the masked rows to a fresh state, leaving the others untouched."""

    def set_sampling(self, row: int, sampling: SamplingOptions) -> None:
        """Per-row sampling settings (device tensors, so a captured graph sees changes)."""

    def start_prefill(self, row: int, options: SessionOptions) -> PrefillJob:
        """Check the options and plan the row's prompt (voice, persona); SessionRejected if they
        cannot be served. Once the job has run, the row's next step is the live conversation."""

    def warm_up_prefill(self, chunks: tuple[int, ...]) -> tuple[int, ...]:
        """Run one prompt chunk of each size on an idle row and leave no trace (kernels loaded, a
        cost to measure); returns the sizes run: none on a model without prompts."""

    def text_piece(self, token: int) -> str:
        """The text a token adds to the transcript ("" for padding)."""

    # Optional, paged KV states only (engine/kv_blocks.py): the engine's block pool's changes.
    # def map_kv_blocks(self, changes: KvChanges) -> None: releases, forgotten blocks, then assigned
    #     blocks, into the state's block table; engine thread, between ticks.

    # Optional: forced text (spoken commentary). A backend without these two refuses it (Engine.force_text).
    # def text_tokens(self, text: str) -> list[int]: the ids that say `text` in the text stream (any thread).
    # def force_text(self, row: int, ids: list[int]) -> bool: queue them on the row from its next
    #     pause (models/forced_text.py); False when they do not fit. Engine thread, between ticks.

    def synchronize(self) -> None:
        """Wait for the device's queued work (slack items are timed after it)."""

    def close(self) -> None:
        """Free device memory. Called once, after the engine thread has stopped."""


def _encode_codebooks(checkpoint: Checkpoint, asked: int | None) -> int:
    """Mimi codebooks a frame encodes: n_user (what the LM reads) unless more are asked for."""
    levels = checkpoint.mimi.quantizer.levels
    if asked is not None and not checkpoint.lm_config.n_user <= asked <= levels:
        raise ValueError(f"encode_codebooks must be between {checkpoint.lm_config.n_user} and this Mimi's "
                         f"{levels} codebooks, got {asked}")
    return asked or checkpoint.lm_config.n_user


class ModelBackend:
    """The real frame: Mimi encode -> LMGen.step -> Mimi decode for `max_sessions` rows.

    All per-row state (LM KV ring, token ring, offsets, sampling, Mimi streams) lives in
    device tensors allocated once here. On CUDA the whole frame is one graph per row bucket
    (see bucketed_step.py and the module doc); on CPU it runs eagerly with the same code.
    """

    def __init__(self, checkpoint: Checkpoint, max_sessions: int, *, cuda_graphs: bool = True,
                 seed: int | None = None, kv_dtype: torch.dtype | None = None,
                 encode_codebooks: int | None = None, row_buckets: bool | None = None,
                 side_work: FrameSideWork | None = None, kv_blocks: int | None = None,
                 kv_block_frames: int | None = None, paged_attention: str = "parley") -> None:
        # kv_dtype, kv_blocks, kv_block_frames, paged_attention: the temporal KV ring's layout, one
        # object (engine/kv_storage.py): dense in kv_dtype (default the model's; torch.float8_e4m3fn
        # halves it), or with kv_blocks a pool of that many blocks of kv_block_frames frames that the
        # engine's KvBlockPool hands out (`map_kv_blocks`), read by our kernel or by FlashInfer's
        # ("flashinfer": page lists the pool plans before each step, `plan_kv_step`).
        # encode_codebooks: Mimi codebooks encoded per frame (default n_user); more for paired
        # transcription, whose STT reads them from `BackendOutput.user_codes` (the LM reads the first n_user).
        # row_buckets: run each tick on the lowest rows that hold every live row (default: on CUDA;
        # off on CPU, where every tick runs all rows, bit for bit as before).
        # side_work: run beside each frame's LM (FrameSideWork), its output in BackendOutput.side.
        self.kv = kv_storage(kv_dtype, kv_blocks, kv_block_frames, paged_attention)
        self.max_sessions = max_sessions
        self._side_work = side_work
        self.encode_codebooks = _encode_codebooks(checkpoint, encode_codebooks)
        self.checkpoint, self.cfg = checkpoint, checkpoint.lm_config
        self.device = next(checkpoint.lm.parameters()).device
        self._mimi, self._tokenizer = checkpoint.mimi, checkpoint.tokenizer
        sampling = checkpoint.sampling  # a row's sampling after reset_rows, unless set_sampling
        if seed is not None:
            torch.manual_seed(seed)
        self._gen = LMGen(checkpoint.lm, text_temp=sampling.text_temperature, text_topk=sampling.text_top_k,
                          audio_temp=sampling.audio_temperature, audio_topk=sampling.audio_top_k)
        self._lm_state = self.kv.init_state(self._gen, max_sessions)
        self._mimi_state = self._mimi.init_state(max_sessions, self.device)
        if row_buckets is None:
            row_buckets = self.device.type == "cuda"
        self._buckets = bucket_sizes(max_sessions) if row_buckets else [max_sessions]
        self.kv.attach(self._buckets, self.device)
        self._voices = VoiceLibrary(checkpoint.voices_dir, self._mimi, self.device)  # read at start (PersonaPlex)
        # A tick's input rows, [audio frame | live flag] (FRAME_SAMPLES + 1 float32): one upload a tick.
        self._inputs_host = torch.zeros(max_sessions, self._mimi.frame_size + 1, pin_memory=self.device.type == "cuda")
        self._inputs_np = self._inputs_host.numpy()  # the same memory
        self._source_ends: set[int] = set()  # rows whose next frame carries the input end code (Hibiki)
        # A prefilled row's last prompt frame runs inside its next regular tick (engine/prompt_handoff.py).
        self._handoff = PromptHandoff(max_sessions, self.cfg, self.device, self._device_mask)
        self._side_stream = torch.cuda.Stream(self.device) if side_work and self.device.type == "cuda" else None
        self._frames = self._frame_steps(cuda_graphs)
        self._reset = RowReset(self._reset_program, max_sessions, self.device, cuda_graphs)
        self._prompts = self._prompt_runner(cuda_graphs)

    def _prompt_runner(self, cuda_graphs: bool) -> PromptRunner | None:
        """PersonaPlex prompts run on a state of their own (engine/prompt_prefill.py), one CUDA
        graph per chunk class on CUDA; warmed up here so the first session's prompt does not
        pay for loading kernels and picking matmul algorithms (a cold chunk can take longer than
        a whole tick). Moshi: None."""
        if self.checkpoint.model_type != "personaplex":
            return None
        prompts = PromptRunner(self._gen, self.kv.dtype, graphs=cuda_graphs and self.device.type == "cuda")
        if self.device.type == "cuda":
            prompts.warm_up(PREFILL_CHUNKS)
        self._voices.load()
        return prompts

    @property
    def kv_paged(self) -> bool:
        """Whether the KV ring is paged: the engine's KV block pool must then drive its block table."""
        return self.kv.paged

    @classmethod
    def load(cls, source: str | Path, max_sessions: int, device: str = "cpu",
             dtype: torch.dtype | None = None, mimi_dtype: torch.dtype | None = None, **kwargs) -> "ModelBackend":
        """Load a checkpoint (directory or HF repo id) and build the backend on `device`; `mimi_dtype`
        as load_checkpoint takes it (None: auto)."""
        return cls(load_checkpoint(source, device, dtype or default_dtype(device), mimi_dtype=mimi_dtype),
                   max_sessions, **kwargs)

    # ---- the frame ----

    def plan_kv_step(self, positions: np.ndarray, taken_at: np.ndarray) -> None:
        """The next step's positions (-1: a row that does not step) and when each row took each
        KV block (the engine's pool, `KvBlockPool.decode_positions`), for the KV layout's planning."""
        self.kv.plan_step(positions, taken_at)

    def _frame_steps(self, cuda_graphs: bool) -> BucketedStep:
        """Per bucket n, the frame over views of the lowest n rows; on CUDA one graph each."""
        frames = BucketedStep(self._frame, (self._lm_state, self._mimi_state), self._buckets)
        if cuda_graphs and self.device.type == "cuda":
            side = self._side_work
            frames.capture(self._idle_frame_inputs, generators=side.generators if side is not None else ())
        return frames

    def _idle_frame_inputs(self, n: int) -> tuple[torch.Tensor, ...]:
        """A bucket's capture inputs: silence, no row live (by the model contract no state changes);
        the KV layout readied for it (page lists of rows that do not step)."""
        self.kv.before_capture(n)
        return (torch.zeros(n, self._mimi.frame_size + 1, device=self.device),)

    def _frame(self, lm_state: LMGenState, mimi_state: MimiState, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Device-only work for one tick over the rows of `lm_state` / `mimi_state` (a bucket's
        views of the lowest rows); captured as one graph per bucket on CUDA. `inputs` [n, FRAME_SAMPLES
        + 1]: each row's audio frame and its live flag (1.0: live), one upload. Returns the outputs
        packed for the host (`pack_host`), then audio, text, valid flags, agent and user codes (and
        the side work's output) apart. The handoff tensors are read in place, as the state is."""
        frames, live = inputs[:, :-1].contiguous(), inputs[:, -1] > 0.5
        source_end = inputs[:, -1] > 1.5  # flag SOURCE_END: this frame's user codes are the end code
        force_text, force_audio, prompt_user, prompt_mask = self._handoff.inputs(inputs.shape[0])
        # A row in its handoff frame reads the prompt's user codes; its encoder waits for real audio.
        # `encoding` and `latent` are read by the side work: they must stay referenced until the join
        # below, or the main stream could reuse their memory while the side stream still reads it
        # (in a graph replay nothing orders the two branches before the join).
        encoding = live & ~prompt_mask
        latent = self._mimi.encode_latent_step(frames, mimi_state, encoding)
        codes = self._mimi.quantize(latent, self.encode_codebooks)
        side = self._fork_side_work(latent, encoding)
        user_codes = torch.where(prompt_mask[:, None], prompt_user, codes[:, :self.cfg.n_user])
        user_codes = torch.where(source_end[:, None], self.checkpoint.lm.input_eos_token, user_codes)
        out = self._gen.step(lm_state, user_codes, live, force_text, force_audio)
        if codes.shape[1] > self.cfg.n_user:
            user_codes = torch.cat([user_codes, codes[:, self.cfg.n_user:]], dim=1)
        # Decode only real frames: a row inside its delay holds "not generated" (-2) codes,
        # which would corrupt its decoder state (and index out of range).
        decode = live & out.valid
        agent = torch.where(decode[:, None], out.audio, torch.zeros_like(out.audio)).clamp(0, self.cfg.card - 1)
        pcm = self._mimi.decode_step(agent, mimi_state, decode)
        if self._side_stream is not None:  # join: the frame (and its graph) ends after the side work
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        del encoding, latent  # only now may their memory be reused (see above)
        return (pack_host(pcm, out.text, decode), pcm, out.text, decode, agent, user_codes) + \
            ((side,) if side is not None else ())

    def _fork_side_work(self, latent: torch.Tensor, live: torch.Tensor) -> torch.Tensor | None:
        """Start the side work on its own stream (CUDA; joined at the end of `_frame`), else inline."""
        if self._side_work is None:
            return None
        if self._side_stream is None:
            return self._side_work(latent, live)
        self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side_stream):
            return self._side_work(latent, live)

    def warm_up_prefill(self, chunks: tuple[int, ...]) -> tuple[int, ...]:
        """Run one prompt chunk of each length and forget it (the engine times these to seed its
        chunk costs, engine/prefill_source.py). Moshi takes no prompt: nothing runs."""
        if self._prompts is None:
            return ()
        ran = self._prompts.warm_up(chunks)
        self.synchronize()
        return ran

    def bucket(self, live_mask: torch.Tensor) -> int:
        """The rows a tick with this host live mask runs: the smallest bucket holding every live row."""
        return self._frames.bucket(np.flatnonzero(live_mask.numpy()).tolist())

    @torch.no_grad()
    def step(self, frames: torch.Tensor, live_mask: torch.Tensor) -> BackendOutput:
        # Host work in numpy, a handful of torch calls: each gives the GIL up (engine/row_reset.py says why).
        live = live_mask.numpy()
        stepped = {row for row in self._handoff.rows if live[row]}
        n = self.bucket(live_mask)
        self._inputs_np[:n, :-1] = frames.numpy()[:n]  # pinned on CUDA: the upload is asynchronous
        self._inputs_np[:n, -1] = live[:n]
        for row in self._source_ends:
            self._inputs_np[row, -1] = SOURCE_END if live[row] else 0.0
        self._source_ends.clear()
        inputs = self._inputs_host[:n]
        self.kv.before_step(n)  # page lists, with FlashInfer's decode
        if not self._frames.graphed:  # a graph copies its inputs in itself
            inputs = inputs.to(self.device, non_blocking=True)
        packed, pcm, text, valid, agent, user, *side = self._frames(n, inputs)
        if stepped:  # their handoff frame is done
            self._handoff.clear(stepped)
        return BackendOutput(pcm=pcm, text_tokens=text, valid=valid, agent_codes=agent,
                             user_codes=user, side=side[0] if side else None, packed=packed,
                             rows=self.max_sessions if n < self.max_sessions else None, queued=pcm.is_cuda)

    # ---- per-row control (engine thread, between ticks) ----

    def reset_rows(self, mask: torch.Tensor) -> None:
        self._reset(mask)  # `mask` is on the host (protocol); one graph replay on CUDA (row_reset.py)
        self._handoff.forget(set(np.flatnonzero(mask.numpy()).tolist()))

    def _reset_program(self, mask: torch.Tensor) -> None:
        """Device work of a reset, `mask` on the device: also restores the default sampling."""
        self._gen.reset(self._lm_state, mask)
        self._mimi_state.reset(mask)
        self._handoff.clear_device(mask)

    @property
    def translates(self) -> bool:
        """A translation model (Hibiki): its sessions' source can end (`end_source`)."""
        return self.checkpoint.model_type == "hibiki"

    def end_source(self, row: int) -> None:
        """The row's next step writes the input end-of-stream code into every user codebook (the
        frame after its last audio), as the reference's `add_input_eos`; engine thread, between ticks."""
        self._source_ends.add(row)

    def set_sampling(self, row: int, sampling: SamplingOptions) -> None:
        self._lm_state.set_sampling(row, text_temp=sampling.text_temperature,
                                    text_topk=sampling.text_top_k, audio_temp=sampling.audio_temperature,
                                    audio_topk=sampling.audio_top_k,
                                    text_seed=UNSEEDED if sampling.text_seed is None else sampling.text_seed,
                                    audio_seed=UNSEEDED if sampling.audio_seed is None else sampling.audio_seed)

    def prefill(self, row: int, options: SessionOptions) -> None:
        """The whole prompt at once (offline runs, benchmarks)."""
        self.start_prefill(row, options).run()

    @torch.no_grad()
    def start_prefill(self, row: int, options: SessionOptions) -> "PromptPrefill":
        """PersonaPlex: voice + silence + persona + silence, run as batched passes over the
        prompt (not one tick per frame); its last frame rides in the row's first tick. Moshi:
        an empty job."""
        if self.checkpoint.model_type != "personaplex":
            if options.voice or options.persona:
                name = "Hibiki" if self.translates else "Moshi"
                raise SessionRejected(f"this model is {name}, which takes no voice or persona; leave them out.")
            return PromptPrefill(None, None, None)
        if options.voice and self.checkpoint.voices_dir is None:
            raise SessionRejected("this checkpoint ships no voices.")
        try:
            voice = self._voices.get(options.voice) if options.voice else None
            plan = build_prompt_frames(self.cfg, voice, persona_tokens(self._tokenizer, options.persona))
        except PersonaError as exc:  # told to the client: the server's directory stays out of it
            raise SessionRejected(str(exc).replace(str(self.checkpoint.voices_dir), "the voices folder")) from exc
        if plan.num_frames > self.cfg.context:
            raise SessionRejected(f"the persona prompt takes {plan.num_frames} frames, more than the model's "
                                  f"{self.cfg.context}-frame context; shorten the persona.")
        dtype = next(self.checkpoint.lm.parameters()).dtype
        x = self._gen.embed_frames(plan.prefill_columns.to(self.device))
        if plan.embeddings is not None:
            x = torch.cat([plan.embeddings.to(self.device, dtype), x])
        return PromptPrefill(self._prompts, x, partial(self._adopt_prompt, row, plan))

    def _adopt_prompt(self, row: int, plan: PromptPlan, job: PromptPrefill, frames: int) -> None:
        """`job` ran the whole prompt: the row takes it, its ring the plan's last columns, and its
        handoff frame is armed for the row's next tick."""
        self._prompts.adopt(job, self._lm_state, row, frames, plan.ring_tokens)
        self._handoff.arm(row, plan)

    def voice_names(self) -> tuple[str, ...]:
        """File names of every voice `start_prefill` can load (`.pt` and audio), sorted: the
        voices folder as it was at start (a checkpoint with voices is a PersonaPlex one, whose
        backend reads them all when it is built)."""
        return self._voices.names()

    def _device_mask(self, rows: set[int]) -> torch.Tensor:
        return rows_mask(self.max_sessions, rows).to(self.device)

    def text_piece(self, token: int) -> str:
        return self._tokenizer.piece(token)

    def text_tokens(self, text: str) -> list[int]:
        # An end-of-padding token first: in the model's text stream it says a word follows.
        ids = self._tokenizer.encode(text)
        return [self.cfg.existing_text_end_padding_id, *ids] if ids else []

    def map_kv_blocks(self, changes: KvChanges) -> None:
        """The KV block pool's changes into the paged state, in their order (engine thread, between
        ticks), batched (TransformerState.map_blocks)."""
        self.kv.map_blocks(changes)

    def force_text(self, row: int, ids: list[int]) -> bool:
        return self._lm_state.forced.push(row, ids)

    def synchronize(self) -> None:
        sync_device(self.device)

    def close(self) -> None:
        self._frames.close()
        self._reset.close()
        if self._prompts is not None:
            self._prompts.close()
        self._frames = None  # type: ignore[assignment]  # (its steps hold views of the state)
        self._lm_state = self._mimi_state = None  # type: ignore[assignment]
        self.checkpoint = None  # type: ignore[assignment]
        self._gen = None  # type: ignore[assignment]
        self._mimi = None  # type: ignore[assignment]
        self._voices.clear()
        if self.device.type == "cuda":
            gc.collect()  # modules hold reference cycles: collect them before returning the cache
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:  # cuBLAS keeps per-stream workspaces in the cache
                clear_workspaces()
            torch.cuda.empty_cache()

