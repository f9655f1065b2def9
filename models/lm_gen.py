"""One LM frame for a batch of independent rows: token ring, temporal step, sampling, depformer.

    gen = LMGen(model, text_temp=..., text_topk=..., audio_temp=..., audio_topk=..., generator=None)
    state = gen.init_state(batch_size)
    out = gen.step(state, user_codes[B, n_user], exec_mask[B], force_text=None, force_audio=None)
    out.text [B], out.audio [B, n_agent], out.valid [B]
    gen.reset(state, mask[B])
    state.set_sampling(mask[B] or row, text_temp=..., text_topk=..., audio_temp=..., audio_topk=...)
    x = gen.embed_frames(tokens[T, n_q + 1]);  gen.prefill(state, row, x, ring_tokens)
    prompt = gen.prompt_state();  gen.model.transformer(x[None], prompt)   # or apart, then:
    gen.adopt_prompt(state, row, prompt, T, ring_tokens)

Semantics are moshi 0.2.13 `LMGen._step`, made per row (every row has its own offset, so a row
can start, reset or pause while the others run) and free of host syncs:

Ring: `ring[b, stream, offset % CT]` with CT = max_delay + 2, filled with -2 ("not generated").
At step s of a row (s = its offset):
1. the user codes of frame s go to column s + delay (user semantic: s, user acoustic: s + 1);
2. the temporal input is column s, with the initial tokens (text_card / card) for every stream
   whose delay has not elapsed yet (s <= delay);
3. temporal transformer -> text logits -> text token; depformer n_agent steps -> agent codes;
4. text and agent codes go to column s + 1;
5. the returned frame is de-delayed, column s + 1 - max_delay + delay: text and semantic from
   column s (step s - 1's output), acoustic from column s + 1 (this step's): one coherent frame.
   `valid` is False for a row's first max_delay steps and for rows not executing.

Rows where `exec_mask` is False are computed but their ring, offset and KV are left untouched.

Forcing (teacher forcing, PersonaPlex prompts): `force_text[b]` / `force_audio[b, k]` other than -2
replace the sampled token, both in the ring and as the next depformer step's input.
Forced text (spoken commentary): `state.forced.push(row, ids)` queues text tokens that replace the
row's sampled ones from its next pause on, the same way (models/forced_text.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import UNGENERATED_TOKEN, SamplingDefaults
from .forced_text import FORCED_TEXT_CAPACITY, ForcedText
from .lm import LMModel
from .sampling import UNSEEDED, sample_tokens
from .transformer import TransformerState


@dataclass
class LMStepOutput:
    text: torch.Tensor  # [B] long: text token of the returned frame
    audio: torch.Tensor  # [B, n_agent] long: agent codes of the returned frame
    valid: torch.Tensor  # [B] bool: False before a row's first complete frame, or when not executed


@dataclass
class DelayedRows:
    """The rows of a delayed-streams LM (the duplex model's, the STT's): the temporal KV state,
    the ring of delayed tokens and each row's frame count."""

    transformer: TransformerState  # temporal KV ring and positions, per row
    ring: torch.Tensor  # [B, n_q + 1, max_delay + 2] long, -2 = not generated
    offsets: torch.Tensor  # [B] long: frames stepped by each row

    @staticmethod
    def empty_ring(batch_size: int, num_codebooks: int, ring_size: int, device) -> torch.Tensor:
        return torch.full((batch_size, num_codebooks, ring_size), UNGENERATED_TOKEN, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        return self.offsets.shape[0]

    def reset(self, mask: torch.Tensor) -> None:
        """Masked rows start over: empty KV ring and token ring, frame 0; other rows are untouched."""
        self.transformer.reset(mask)
        self.ring.masked_fill_(mask[:, None, None], UNGENERATED_TOKEN)
        self.offsets.masked_fill_(mask, 0)


@dataclass
class LMGenState(DelayedRows):
    depformer: TransformerState  # scratch KV over the steps of one frame; cleared every frame
    # Per-row sampling settings; tensors so that a captured graph reads the current values.
    text_temp: torch.Tensor  # [B] float, <= 0 is greedy
    text_topk: torch.Tensor  # [B] long, <= 0 is no top-k
    audio_temp: torch.Tensor  # [B] float
    audio_topk: torch.Tensor  # [B] long
    defaults: tuple[float, int, float, int]  # (text_temp, text_topk, audio_temp, audio_topk)
    # Per-row seeds, UNSEEDED (-1) for the shared generator: a seeded row's draws depend only on
    # (seed, its step, the sampler), so the same input gives the same output (models/sampling.py).
    text_seed: torch.Tensor  # [B] long
    audio_seed: torch.Tensor  # [B] long
    forced: ForcedText  # per-row queues of text tokens to force from the row's next pause

    def reset(self, mask: torch.Tensor) -> None:
        """Masked rows return to a fresh session (including the default sampling settings)."""
        super().reset(mask)
        self.set_sampling(mask, *self.defaults, text_seed=UNSEEDED, audio_seed=UNSEEDED)
        self.forced.reset(mask)

    def set_sampling(self, rows: torch.Tensor | int, text_temp: float | None = None, text_topk: int | None = None,
                     audio_temp: float | None = None, audio_topk: int | None = None,
                     text_seed: int | None = None, audio_seed: int | None = None) -> None:
        """Write sampling settings into `rows`, a [B] bool mask on the device or one row's index
        (None leaves a setting unchanged; a seed of UNSEEDED returns the row to the shared
        generator). A mask syncs nothing (a reset's graph runs it); a row is one write a setting."""
        for tensor, value in ((self.text_temp, text_temp), (self.text_topk, text_topk),
                              (self.audio_temp, audio_temp), (self.audio_topk, audio_topk),
                              (self.text_seed, text_seed), (self.audio_seed, audio_seed)):
            if value is None:
                continue
            if isinstance(rows, int):
                tensor[rows] = value
            else:
                tensor.masked_fill_(rows, value)


class LMGen:
    def __init__(self, model: LMModel, *, text_temp: float = SamplingDefaults.text_temperature,
                 text_topk: int = SamplingDefaults.text_top_k, audio_temp: float = SamplingDefaults.audio_temperature,
                 audio_topk: int = SamplingDefaults.audio_top_k, generator: torch.Generator | None = None):
        self.model = model
        self.cfg = model.cfg
        self.generator = generator
        self.defaults = (text_temp, text_topk, audio_temp, audio_topk)
        device = next(model.parameters()).device
        self.delays = torch.tensor(self.cfg.delays, dtype=torch.long, device=device)
        self.initial = model.initial_tokens(device)
        self.ring_size = self.cfg.max_delay + 2
        # The text ids that mark a pause, where forced text may start (models/forced_text.py).
        self.pauses = torch.tensor([self.cfg.existing_text_padding_id, self.cfg.existing_text_end_padding_id],
                                   dtype=torch.long, device=device)

    # -- state ----------------------------------------------------------------------------------

    def init_state(self, batch_size: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
                   kv_blocks: int | None = None, block_size: int | None = None) -> LMGenState:
        """`kv_dtype` (e.g. torch.float8_e4m3fn) sets the temporal KV ring's dtype; default `dtype`.
        `kv_blocks` (default None: dense rings): the temporal ring is paged, a pool of `kv_blocks`
        blocks of `block_size` slots (models/paged_kv.py) whose blocks the caller assigns to rows
        (`state.transformer.assign_blocks`) before they are written. The depformer stays dense."""
        param = next(self.model.parameters())
        device = param.device if device is None else device
        dtype = param.dtype if dtype is None else dtype
        text_temp, text_topk, audio_temp, audio_topk = self.defaults

        def full(value, kind):
            return torch.full((batch_size,), value, dtype=kind, device=device)

        return LMGenState(
            transformer=self.model.transformer.init_state(batch_size, device, dtype, kv_dtype, kv_blocks, block_size),
            depformer=self.model.depformer.init_state(batch_size, device, dtype),
            ring=DelayedRows.empty_ring(batch_size, self.cfg.num_codebooks, self.ring_size, device),
            offsets=full(0, torch.long),
            text_temp=full(text_temp, torch.float32), text_topk=full(text_topk, torch.long),
            audio_temp=full(audio_temp, torch.float32), audio_topk=full(audio_topk, torch.long),
            defaults=self.defaults, text_seed=full(UNSEEDED, torch.long), audio_seed=full(UNSEEDED, torch.long),
            forced=ForcedText.empty(batch_size, FORCED_TEXT_CAPACITY, device),
        )

    def reset(self, state: LMGenState, mask: torch.Tensor) -> None:
        state.reset(mask)

    # -- one frame ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, state: LMGenState, user_codes: torch.Tensor, exec_mask: torch.Tensor,
             force_text: torch.Tensor | None = None, force_audio: torch.Tensor | None = None) -> LMStepOutput:
        cfg = self.cfg
        n_agent = cfg.n_agent
        offsets = state.offsets

        # 1. User codes of this frame, written at their delayed columns.
        user = slice(1 + n_agent, 1 + cfg.n_q)
        self._write(state.ring[:, user], offsets[:, None] + self.delays[None, user], user_codes, exec_mask)

        # 2-3. Temporal input from the ring, temporal transformer, then text.
        hidden, text_logits = temporal_step(self.model, state, self.delays, self.initial, exec_mask)
        text = sample_tokens(text_logits, state.text_temp, state.text_topk, self.generator,
                             seeds=state.text_seed, counter=offsets, stream=0)
        # Queued text (commentary) where no prompt token is forced this step.
        queue_rows = exec_mask if force_text is None else exec_mask & (force_text == UNGENERATED_TOKEN)
        text = _forced(state.forced.apply(text, queue_rows, self.pauses), force_text)

        # 4. Depformer: agent codes, autoregressive over codebooks.
        audio = self.depformer(state, hidden, text, force_audio, offsets)

        # 5. Outputs go to column offset + 1.
        new_offsets = torch.where(exec_mask, offsets + 1, offsets)
        generated = torch.cat([text[:, None], audio], dim=1)
        self._write(state.ring[:, :1 + n_agent], new_offsets[:, None].expand(-1, 1 + n_agent), generated, exec_mask)
        state.offsets.copy_(new_offsets)

        # 6. De-delayed read-back: stream with delay d from column offset + 1 - max_delay + d.
        read = (new_offsets[:, None] - cfg.max_delay + self.delays[None, :1 + n_agent]) % self.ring_size
        frame = state.ring[:, :1 + n_agent].gather(2, read[..., None])[..., 0]
        valid = (new_offsets > cfg.max_delay) & exec_mask
        return LMStepOutput(text=frame[:, 0], audio=frame[:, 1:], valid=valid)

    @torch.no_grad()
    def depformer(self, state: LMGenState, hidden: torch.Tensor, text: torch.Tensor,
                  force_audio: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Step 4 of a frame alone (the frame profiler times it): hidden [B, dim] and the text
        token [B] -> agent codes [B, n_agent]. `offsets`: the rows' steps before this frame (for
        seeded rows' draws; default the state's)."""
        offsets = state.offsets if offsets is None else offsets
        # PersonaPlex has dep_q = 16: steps n_agent..15 predict the user's codebooks, which we
        # teacher-force with the real user codes anyway. The depformer is causal over its steps
        # (step k attends to steps <= k only, with step-k weights), so those later steps cannot
        # change the agent codes: we run only the first n_agent steps (half the depformer cost).
        state.depformer.clear()
        prev = text
        codes = []
        for k in range(self.cfg.n_agent):
            logits = self.model.depformer_logits(k, hidden, prev, state.depformer)
            token = sample_tokens(logits, state.audio_temp, state.audio_topk, self.generator,
                                  seeds=state.audio_seed, counter=offsets, stream=1 + k)
            token = _forced(token, None if force_audio is None else force_audio[:, k])
            codes.append(token)
            prev = token
        return torch.stack(codes, dim=1)

    def _write(self, ring: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
               exec_mask: torch.Tensor) -> None:
        ring_write(ring, positions, values, exec_mask)

    # -- prefill (PersonaPlex prompts) ----------------------------------------------------------

    @torch.no_grad()
    def embed_frames(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T, n_q + 1] (already delayed: the temporal input columns) -> embeddings [T, dim]."""
        return self.model.embed(tokens)

    @torch.no_grad()
    def prefill(self, state: LMGenState, row: int, embeddings: torch.Tensor,
                ring_tokens: torch.Tensor | None = None) -> None:
        """Run the temporal transformer over T input frames of one row at once; other rows untouched.

        embeddings [T, dim]: the temporal inputs of steps offset .. offset + T - 1 (see `embed_frames`).
        ring_tokens [n_q + 1, k] (k <= max_delay + 2): the delayed token columns offset + T - k + 1 ..
        offset + T, written into the row's ring so that the next `step` reads what stepping would have
        left there (the last column is the next step's input; its user semantic entry is rewritten by
        that step). None leaves the ring "not generated" (-2). The text logits of the prompt are
        not used, so they are not computed. The caller keeps T <= the transformer context; a prompt
        prefilled when the window is already full would lose a few keys (see transformer.py).
        """
        self.model.transformer(embeddings[None], state.transformer.row(row))
        self._prefilled(state, row, embeddings.shape[0], ring_tokens)

    def prompt_state(self, kv_dtype: torch.dtype | None = None) -> TransformerState:
        """A batch-of-one temporal state to run a prompt on apart from the live rows (fixed
        addresses, so the passes can be CUDA graphs): `self.model.transformer(x[1, T, dim], it)`
        from position 0, chunk after chunk, then `adopt_prompt` hands it to a row."""
        return self.model.transformer.init_state(1, kv_dtype=kv_dtype)

    @torch.no_grad()
    def adopt_prompt(self, state: LMGenState, row: int, prompt: TransformerState, frames: int,
                     ring_tokens: torch.Tensor | None = None) -> None:
        """Row `row` (just reset) takes the first `frames` frames of a prompt run on `prompt` (see
        `prompt_state`): the state `prefill` of those frames, with these ring tokens, leaves."""
        state.transformer.adopt_prefix(row, prompt, frames)
        self._prefilled(state, row, frames, ring_tokens)

    def _prefilled(self, state: LMGenState, row: int, frames: int, ring_tokens: torch.Tensor | None) -> None:
        """The row's offset and token ring after `frames` prompt frames (see `prefill`)."""
        state.offsets[row] += frames
        ring = state.ring[row]
        ring.fill_(UNGENERATED_TOKEN)
        if ring_tokens is not None:
            k = ring_tokens.shape[1]
            assert k <= self.ring_size, f"ring_tokens has {k} columns, the ring holds {self.ring_size}"
            cols = (state.offsets[row] - k + 1 + torch.arange(k, device=ring.device)) % self.ring_size
            ring.scatter_(1, cols[None].expand(ring.shape[0], k), ring_tokens.to(ring.device))


def temporal_step(model: LMModel, rows: DelayedRows, delays: torch.Tensor, initial: torch.Tensor,
                  exec_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2 and 3 of a frame (the module docstring), shared by the duplex LM and the STT: the
    temporal input from the ring (`ring_inputs`), then the temporal transformer. Returns its
    hidden state [B, dim] and text logits [B, text_card]."""
    tokens = ring_inputs(rows.ring, rows.offsets, delays, initial, exec_mask)
    hidden, text_logits = model.temporal(model.embed(tokens)[:, None], rows.transformer, exec_mask)
    return hidden[:, 0], text_logits[:, 0]


def ring_inputs(ring: torch.Tensor, offsets: torch.Tensor, delays: torch.Tensor, initial: torch.Tensor,
                exec_mask: torch.Tensor) -> torch.Tensor:
    """Each row's temporal input [B, streams]: ring column `offset`, with the initial tokens where
    a stream's delay has not elapsed (offset <= delay); rows not executing read initial tokens too,
    so they never embed garbage."""
    column = (offsets % ring.shape[2])[:, None, None].expand(-1, ring.shape[1], 1)
    tokens = ring.gather(2, column)[..., 0]
    is_init = (offsets[:, None] <= delays[None]) | ~exec_mask[:, None]
    return torch.where(is_init, initial[None], tokens)


def ring_write(ring: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, exec_mask: torch.Tensor) -> None:
    """ring[b, s, positions[b, s] % CT] = values[b, s] for executing rows (in place; ring may be a view)."""
    index = (positions % ring.shape[2])[..., None]
    old = ring.gather(2, index)
    ring.scatter_(2, index, torch.where(exec_mask[:, None, None], values[..., None], old))


def _forced(sampled: torch.Tensor, forced: torch.Tensor | None) -> torch.Tensor:
    if forced is None:
        return sampled
    return torch.where(forced != UNGENERATED_TOKEN, forced, sampled)
