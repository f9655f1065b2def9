"""Kyutai DSM speech-to-text: one frame for a batch of independent rows, and the model's settings.

    gen = SttGen(model, settings)             # model: an LMModel with dep_q 0 (checkpoint.load_stt_checkpoint)
    state = gen.init_state(batch_size)
    out = gen.step(state, codes[B, n_q], exec_mask[B])
    out.text [B], out.valid [B], out.end_of_turn [B] (probability; NaN without the head)
    out.heads [B, H] (every extra head's probability of its entry 0)
    state.reset(mask[B])

An STT checkpoint is a Moshi-family LM with `dep_q` 0 (no depformer, no audio output): its
temporal transformer reads `n_q` Mimi codebooks of the *input* audio plus its own previous text
token and predicts text. The text stream is delayed by `delays[0]` frames (stt-1b-en_fr: 6 frames =
0.5 s), so the text of audio frame f comes out at step f + delay. Semantics are moshi 0.2.13
`LMGen._step` with dep_q 0 (same ring, same initial tokens), made per row like models/lm_gen.py:

1. the codes of frame s go to ring column s + delays[k] (audio delays are 0 in published STT);
2. the input is column s, initial tokens (text_card / card) where s <= a stream's delay;
3. temporal transformer -> text logits -> text token (greedy by default, as Kyutai runs STT);
4. the text goes to column s + 1; the returned token is the de-delayed text column
   s + 1 - max_delay + delays[0]; `valid` is False for a row's first max_delay steps.

Extra heads (`extra_heads_num_heads` linear heads of `extra_heads_dim` on the normalised hidden
state) give softmax probabilities; Kyutai's servers read head `END_OF_TURN_HEAD`, entry 0, as the
probability that the speaker has finished their turn (semantic VAD). It is reported for the
current step (no delay), exactly as the reference `step_with_extra_heads` does. `heads` holds entry 0
of every extra head, as moshi-server's ASR sends them (`Step.prs`); the end-of-turn column is its
`END_OF_TURN_HEAD` column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .config import FRAME_RATE, UNGENERATED_TOKEN, LMConfig
from .lm import LMModel
from .lm_gen import DelayedRows, ring_write, temporal_step
from .sampling import sample_tokens

END_OF_TURN_HEAD = 2  # the extra head Kyutai's servers (moshi-server, unmute) read as "pause / end of turn"
END_OF_TURN_INDEX = 0  # its entry that holds the end-of-turn probability


@dataclass(frozen=True)
class SttSettings:
    """config.json's `stt_config` (defaults: the reference's stt_from_file script)."""

    audio_silence_prefix_seconds: float = 1.0  # silence fed before a file's audio
    audio_delay_seconds: float = 5.0  # silence fed after it, so the delayed text comes out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SttSettings":
        known = {"audio_silence_prefix_seconds", "audio_delay_seconds"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"stt_config: unsupported key(s) {sorted(unknown)}")
        values = {k: float(v) for k, v in raw.items()}
        if any(v < 0 or not math.isfinite(v) for v in values.values()):
            raise ValueError(f"stt_config: values must be finite and >= 0, got {raw}")
        return cls(**values)

    @property
    def prefix_frames(self) -> int:
        return math.ceil(self.audio_silence_prefix_seconds * FRAME_RATE)

    @property
    def suffix_frames(self) -> int:
        return math.ceil(self.audio_delay_seconds * FRAME_RATE)


def check_stt_config(cfg: LMConfig) -> None:
    """Raise ValueError unless `cfg` describes a DSM speech-to-text LM."""
    if cfg.dep_q != 0:
        raise ValueError(f"an STT model has dep_q 0 (text output only); this config has dep_q {cfg.dep_q}")


@dataclass
class SttStepOutput:
    text: torch.Tensor  # [B] long: the de-delayed text token (-2 where not valid)
    valid: torch.Tensor  # [B] bool: False before a row's first max_delay steps, or not executed
    end_of_turn: torch.Tensor  # [B] float32 probability; NaN if the model has no such head
    heads: torch.Tensor  # [B, H] float32: each extra head's probability of its entry 0 (H = 0 without heads)

    def packed(self) -> torch.Tensor:
        """[B, 3] float32 (text, valid, end_of_turn): one tensor, so a step needs one host copy
        and a CUDA graph one output buffer. Text ids (< 2**24) and 0/1 flags are exact in float32."""
        return torch.stack([self.text.float(), self.valid.float(), self.end_of_turn.float()], dim=1)


@dataclass
class SttState(DelayedRows):
    text_temp: torch.Tensor  # [B] float, <= 0 greedy
    text_topk: torch.Tensor  # [B] long


class SttGen:
    def __init__(self, model: LMModel, *, text_temp: float = 0.0, text_topk: int = 0,
                 generator: torch.Generator | None = None) -> None:
        check_stt_config(model.cfg)
        self.model = model
        self.cfg = model.cfg
        self.text_temp, self.text_topk = text_temp, text_topk
        device = next(model.parameters()).device
        # Its own generator: transcription must never move the duplex model's random stream.
        self.generator = generator if generator is not None else torch.Generator(device=device).manual_seed(0)
        self.delays = torch.tensor(self.cfg.delays, dtype=torch.long, device=device)
        self.initial = model.initial_tokens(device)
        self.ring_size = self.cfg.max_delay + 2
        self.has_end_of_turn = self.cfg.extra_heads_num_heads > END_OF_TURN_HEAD

    @property
    def text_delay(self) -> int:
        """Frames between an audio frame and its text."""
        return self.cfg.delays[0]

    def init_state(self, batch_size: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> SttState:
        param = next(self.model.parameters())
        device = param.device if device is None else device
        dtype = param.dtype if dtype is None else dtype
        return SttState(
            transformer=self.model.transformer.init_state(batch_size, device, dtype),
            ring=DelayedRows.empty_ring(batch_size, self.cfg.num_codebooks, self.ring_size, device),
            offsets=torch.zeros(batch_size, dtype=torch.long, device=device),
            text_temp=torch.full((batch_size,), self.text_temp, dtype=torch.float32, device=device),
            text_topk=torch.full((batch_size,), self.text_topk, dtype=torch.long, device=device),
        )

    @torch.no_grad()
    def step(self, state: SttState, codes: torch.Tensor, exec_mask: torch.Tensor) -> SttStepOutput:
        """codes [B, >= n_q] long (Mimi codes of this frame; extra codebooks are ignored)."""
        cfg = self.cfg
        offsets = state.offsets
        audio = slice(1, 1 + cfg.n_q)
        ring_write(state.ring[:, audio], offsets[:, None] + self.delays[None, audio], codes[:, :cfg.n_q], exec_mask)

        hidden, text_logits = temporal_step(self.model, state, self.delays, self.initial, exec_mask)
        text = sample_tokens(text_logits, state.text_temp, state.text_topk, self.generator)

        new_offsets = torch.where(exec_mask, offsets + 1, offsets)
        ring_write(state.ring[:, :1], new_offsets[:, None], text[:, None], exec_mask)
        state.offsets.copy_(new_offsets)

        read = (new_offsets - cfg.max_delay + self.delays[0]) % self.ring_size
        out = state.ring[:, 0].gather(1, read[:, None])[:, 0]
        valid = (new_offsets > cfg.max_delay) & exec_mask
        heads = torch.stack([torch.softmax(head(hidden).float(), dim=-1)[:, END_OF_TURN_INDEX]
                             for head in self.model.extra_heads], dim=1) if self.cfg.extra_heads_num_heads \
            else torch.zeros(valid.shape[0], 0, device=valid.device)
        if self.has_end_of_turn:
            end_of_turn = heads[:, END_OF_TURN_HEAD]
        else:
            end_of_turn = torch.full(valid.shape, float("nan"), device=valid.device)
        return SttStepOutput(text=torch.where(valid, out, torch.full_like(out, UNGENERATED_TOKEN)),
                             valid=valid, end_of_turn=end_of_turn, heads=heads)
