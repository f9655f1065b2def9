"""PersonaPlex prompt building: the voice prompt and the system prompt replayed before a session.

PersonaPlex conditions the LM by replaying, one frame per step, before the session goes live:

1. the voice prompt (agent audio codes, PAD text, "sine" user codes), given either as Mimi
   codes of a `.wav` (24 kHz mono, -24 LUFS) or as a `.pt` of precomputed LM input
   embeddings plus the token ring left after them (`voices.py` reads both);
2. `SILENCE_FRAMES` frames of agent silence codes;
3. the persona text, wrapped as `<system> ... <system>`, one SentencePiece token per frame;
4. `SILENCE_FRAMES` more silence frames.

Everything here is a pure function over tensors: the engine turns a `PromptPlan` into one
batched `LMGen.prefill` for one row while other rows stay live. `docs/personaplex.md` gives
the reference behaviour this reproduces and the exact handoff to the live session.

Frames and columns. A *frame* is frame-aligned: `[text, agent 0..7, user 0..7]` of one
80 ms step. A *column* is what the temporal transformer reads at one position: the ring
layout, where stream k holds frame `j - delay[k]` (so acoustic codebooks lag one frame) and
stream k holds its initial token while `j <= delay[k]`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .config import FRAME_RATE, TEXT_PAD, UNGENERATED_TOKEN, LMConfig
from .voices import PersonaError, VoicePrompt

# Mimi codes PersonaPlex forces for agent silence and for the user's "sine" input
# (`SILENCE_TOKENS` / `SINE_TOKENS` in PersonaPlex's `moshi/models/lm.py`; fixed constants,
# not computed at startup).
SILENCE_TOKENS: tuple[int, ...] = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
SINE_TOKENS: tuple[int, ...] = (430, 1268, 381, 1611, 1095, 1495, 56, 472)

SILENCE_FRAMES = int(0.5 * FRAME_RATE)  # 6: PersonaPlex's `audio_silence_frame_cnt`
SYSTEM_TAG = "<system>"

PHASE_VOICE = "voice"
PHASE_SILENCE = "silence"
PHASE_PERSONA = "persona"

EmbedFrames = Callable[[torch.Tensor], torch.Tensor]


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


# --------------------------------------------------------------------------- persona text


def wrap_persona(text: str) -> str:
    """Wrap a persona in system tags the way PersonaPlex does.

    Surrounding whitespace is stripped; text that already starts and ends with `<system>` is
    kept as is, anything else becomes `"<system> " + text + " <system>"`.
    """
    cleaned = text.strip()
    if cleaned.startswith(SYSTEM_TAG) and cleaned.endswith(SYSTEM_TAG):
        return cleaned
    return f"{SYSTEM_TAG} {cleaned} {SYSTEM_TAG}"


def persona_tokens(tokenizer: _Encoder, text: str) -> list[int]:
    """Text-stream tokens of a persona: SentencePiece ids of `wrap_persona(text)`.

    An empty string means no persona phase at all (PersonaPlex only wraps a non-empty
    `text_prompt`; whitespace-only text is wrapped like any other).
    """
    if not text:
        return []
    return [int(i) for i in tokenizer.encode(wrap_persona(text))]


# --------------------------------------------------------------------------- frames -> columns


def initial_column(cfg: LMConfig) -> torch.Tensor:
    """The ring's initial tokens: text `text_card`, audio `card` (embed as the start tokens)."""
    col = torch.full((cfg.num_codebooks,), cfg.card, dtype=torch.long)
    col[0] = cfg.text_card
    return col


def delay_frames(frames: torch.Tensor, cfg: LMConfig, start: int = 0,
                 pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Frame-aligned tokens -> transformer input columns, applying the stream delays.

    `frames` `[T, K]` are frames `start .. start+T-1`. Column j takes stream k from frame
    `j - delay[k]`; streams with `j <= delay[k]` take the initial token (as both reference
    ring implementations do). `pending` `[max_delay + 1, K]` carries what earlier frames already
    wrote into columns `start .. start+max_delay` (-2 = nothing). Returns the `[T, K]` columns
    and the spill `[max_delay, K]`: columns `start+T ..` as far as these frames wrote them.
    """
    k_all = cfg.num_codebooks
    depth = cfg.max_delay
    delays = torch.tensor(cfg.delays, dtype=torch.long)
    if frames.dim() != 2 or frames.shape[1] != k_all:
        raise PersonaError(f"prompt frames have shape {list(frames.shape)}, expected [T, {k_all}]")
    window = torch.full((depth + 1, k_all), UNGENERATED_TOKEN, dtype=torch.long)
    if pending is not None:
        window.copy_(pending)
    init = initial_column(cfg)
    streams = torch.arange(k_all)
    out = torch.empty((frames.shape[0], k_all), dtype=torch.long)
    for i in range(frames.shape[0]):
        window[delays, streams] = frames[i].to(torch.long)
        col = window[0].clone()
        is_init = (start + i) <= delays
        out[i] = torch.where(is_init, init, col)
        window = torch.cat([window[1:], torch.full((1, k_all), UNGENERATED_TOKEN, dtype=torch.long)])
    return out, window[:depth].clone()


def _voice_frames(codes: torch.Tensor, cfg: LMConfig, sine: Sequence[int]) -> torch.Tensor:
    n = codes.shape[0]
    frames = torch.empty((n, cfg.num_codebooks), dtype=torch.long)
    frames[:, 0] = TEXT_PAD
    frames[:, 1:1 + cfg.n_agent] = codes.to(torch.long)
    frames[:, 1 + cfg.n_agent:] = torch.as_tensor(list(sine), dtype=torch.long)
    return frames


def _personaplex_ring(frames: torch.Tensor, cfg: LMConfig) -> torch.Tensor:
    """PersonaPlex's `[K, max_delay + 3]` token ring after forcing `frames` from offset 0."""
    width = cfg.max_delay + 3
    ring = torch.full((cfg.num_codebooks, width), UNGENERATED_TOKEN, dtype=torch.long)
    init = initial_column(cfg)
    for o in range(frames.shape[0]):
        for k, d in enumerate(cfg.delays):
            ring[k, (o + d) % width] = frames[o, k]
        for k, d in enumerate(cfg.delays):
            if o <= d:
                ring[k, o % width] = init[k]
    return ring


def voice_to_pt(voice: VoicePrompt, embed_frames: EmbedFrames, cfg: LMConfig,
                sine: Sequence[int] = SINE_TOKENS) -> VoicePrompt:
    """Turn a codes voice (from a `.wav`) into PersonaPlex's `.pt` form for this LM.

    Embeddings of columns `0 .. N-2` via `embed_frames(columns [N-1, K]) -> [N-1, dim]`
    (`LMGen.embed_frames`), and the `[K, max_delay + 3]` ring PersonaPlex holds afterwards.
    """
    if voice.codes is None:
        raise PersonaError(f"voice {voice.source} has no codes to convert")
    _check_codes(voice, cfg)
    if voice.num_frames < 2:
        raise PersonaError(f"voice {voice.source} has {voice.num_frames} frame(s); a .pt voice needs at least 2")
    frames = _voice_frames(voice.codes, cfg, sine)
    columns, _ = delay_frames(frames, cfg)
    emb = embed_frames(columns[:-1])
    return VoicePrompt(source=voice.source, embeddings=emb.detach(), cache=_personaplex_ring(frames, cfg))


def _check_codes(voice: VoicePrompt, cfg: LMConfig) -> None:
    assert voice.codes is not None
    if voice.codes.dim() != 2 or voice.codes.shape[1] != cfg.n_agent or voice.codes.shape[0] < 1:
        raise PersonaError(f"voice {voice.source}: codes have shape {list(voice.codes.shape)}, "
                           f"expected [frames, {cfg.n_agent}]")


# --------------------------------------------------------------------------- the prompt plan


@dataclass(frozen=True)
class PromptPhase:
    name: str  # "voice", "silence" or "persona"
    start: int  # first prompt frame
    length: int  # frames


@dataclass(frozen=True)
class PromptPlan:
    """The whole PersonaPlex prefill of one session, in order, as transformer inputs.

    The prompt is `num_frames` frames F; frame j is read by the transformer as column j.
    - `frames` `[F, K]`: frame-aligned forced tokens (text, agent codes, user codes); rows of a
      `.pt` voice are -2 (only their embeddings are known).
    - `embeddings` `[E, dim]` or None: LM inputs of columns `0 .. E-1` (a `.pt` voice).
    - `columns` `[F - E, K]`: token inputs of columns `E .. F-1` (embed them with
      `LMGen.embed_frames`).
    - `spill` `[max_delay, K]`: what the last frames already wrote into columns `F ..`
      (the agent/user acoustic codes of frame F-1; -2 elsewhere).

    Handoff to the live session, reproducing PersonaPlex exactly:

        x = cat([plan.embeddings, gen.embed_frames(plan.prefill_columns)])   # F-1 inputs
        gen.prefill(state, row, x, ring_tokens=plan.ring_tokens)            # offset F-1
        gen.step(..., user_codes=plan.first_step_user, force_text=plan.first_step_force_text,
                 force_audio=plan.first_step_force_audio)                   # the handoff step

    Columns `0 .. F-2` need no sampling (every output there is forced). The handoff step reads
    column F-1, samples text and agent semantic of column F and forces its agent acoustic codes
    (frame F-1's, still due because of the delay); it returns the last silence frame. Live user
    frames start at the step after. This equals stepping all F frames with forcing.
    """

    phases: tuple[PromptPhase, ...]
    frames: torch.Tensor
    embeddings: torch.Tensor | None
    columns: torch.Tensor
    spill: torch.Tensor
    n_agent: int
    delays: tuple[int, ...]

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def num_embedded(self) -> int:
        return 0 if self.embeddings is None else int(self.embeddings.shape[0])

    @property
    def prefill_columns(self) -> torch.Tensor:
        """Token inputs of columns `E .. F-2`: with `embeddings`, the F-1 inputs to prefill."""
        return self.columns[:-1]

    @property
    def ring_tokens(self) -> torch.Tensor:
        """`[K, 1]`: column F-1, the handoff step's input (`LMGen.prefill`'s `ring_tokens`)."""
        return self.columns[-1:].T.contiguous()

    def ring(self, width: int) -> torch.Tensor:
        """The `[K, width]` token ring after prefilling columns `0 .. F-2` (offset F-1).

        Column `(F-1) % width` holds the last prompt column, columns `(F-1+d) % width` the
        spill, the rest -2. `width` must exceed `max_delay`.
        """
        depth = self.spill.shape[0]
        if width <= depth:
            raise PersonaError(f"a ring of {width} columns cannot hold the prompt's {depth + 1} live columns")
        k_all = self.columns.shape[1]
        ring = torch.full((k_all, width), UNGENERATED_TOKEN, dtype=torch.long)
        last = self.num_frames - 1
        ring[:, last % width] = self.columns[-1]
        for d in range(depth):
            ring[:, (last + 1 + d) % width] = self.spill[d]
        return ring

    @property
    def first_step_user(self) -> torch.Tensor:
        """User codes of the last prompt frame (the sine), the input of the handoff step.

        Rebuilt from the ring (stream k of frame F-1 sits in column F-1+delay[k]), so it also
        holds when the last frame came from a `.pt` voice.
        """
        stack = torch.cat([self.columns[-1:], self.spill])
        k = torch.arange(self.columns.shape[1])
        frame = stack[torch.tensor(self.delays, dtype=torch.long), k]
        return frame[1 + self.n_agent:].clone()

    @property
    def first_step_force_text(self) -> int:
        """-2: the handoff step samples its text (column F is not forced)."""
        return int(self.spill[0, 0]) if self.spill.shape[0] else UNGENERATED_TOKEN

    @property
    def first_step_force_audio(self) -> torch.Tensor:
        """Agent codes of column F: forced where frame F-1 spilled (acoustic), -2 (sample) elsewhere."""
        if self.spill.shape[0] == 0:
            return torch.full((self.n_agent,), UNGENERATED_TOKEN, dtype=torch.long)
        return self.spill[0, 1:1 + self.n_agent].clone()


def _token_frames(cfg: LMConfig, agent: Sequence[int], user: Sequence[int], texts: Sequence[int]) -> torch.Tensor:
    frames = torch.empty((len(texts), cfg.num_codebooks), dtype=torch.long)
    frames[:, 0] = torch.as_tensor(list(texts), dtype=torch.long)
    frames[:, 1:1 + cfg.n_agent] = torch.as_tensor(list(agent), dtype=torch.long)
    frames[:, 1 + cfg.n_agent:] = torch.as_tensor(list(user), dtype=torch.long)
    return frames


def build_prompt_frames(cfg: LMConfig, voice: VoicePrompt | None, persona: Sequence[int] = (), *,
                        silence_frames: int = SILENCE_FRAMES,
                        silence: Sequence[int] = SILENCE_TOKENS,
                        sine: Sequence[int] = SINE_TOKENS) -> PromptPlan:
    """Plan PersonaPlex's prefill: voice, silence, persona (if any), silence.

    `persona` is the token list from `persona_tokens`. Voice frames force PAD text, the voice's
    agent codes and `sine` user codes; silence frames PAD, `silence`, `sine`; persona frames one
    persona token, `silence`, `sine`. `voice=None` (a Parley extension; PersonaPlex always has
    a voice) starts with the first silence block.
    """
    _check_prompt_args(cfg, persona, silence_frames, silence, sine)
    k_all = cfg.num_codebooks
    phases: list[PromptPhase] = []
    frame_blocks: list[torch.Tensor] = []
    embeddings: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    lead_columns: list[torch.Tensor] = []
    start = 0

    if voice is not None and voice.codes is not None:
        _check_codes(voice, cfg)
        frame_blocks.append(_voice_frames(voice.codes, cfg, sine))
        phases.append(PromptPhase(PHASE_VOICE, 0, voice.num_frames))
    elif voice is not None:
        embeddings, first_column, pending = _voice_pt_state(voice, cfg)
        n = voice.num_frames
        frame_blocks.append(torch.full((n, k_all), UNGENERATED_TOKEN, dtype=torch.long))
        lead_columns.append(first_column[None])
        phases.append(PromptPhase(PHASE_VOICE, 0, n))
        start = n

    pos = sum(b.shape[0] for b in frame_blocks)
    blocks = [(PHASE_SILENCE, [TEXT_PAD] * silence_frames)]
    if persona:
        blocks.append((PHASE_PERSONA, [int(t) for t in persona]))
    blocks.append((PHASE_SILENCE, [TEXT_PAD] * silence_frames))
    for name, texts in blocks:
        if texts:
            frame_blocks.append(_token_frames(cfg, silence, sine, texts))
            phases.append(PromptPhase(name, pos, len(texts)))
            pos += len(texts)

    frames = torch.cat(frame_blocks) if frame_blocks else torch.empty((0, k_all), dtype=torch.long)
    if frames.shape[0] == 0:
        raise PersonaError("the prompt is empty: give a voice, a persona or silence frames")
    token_frames = frames[start:]
    columns, spill = delay_frames(token_frames, cfg, start=start, pending=pending)
    if lead_columns:
        columns = torch.cat(lead_columns + [columns])
    if embeddings is not None and embeddings.shape[0] + columns.shape[0] != frames.shape[0]:
        raise AssertionError("prompt plan lost a column")  # internal invariant
    return PromptPlan(phases=tuple(phases), frames=frames, embeddings=embeddings, columns=columns,
                      spill=spill, n_agent=cfg.n_agent, delays=tuple(cfg.delays))


def _check_prompt_args(cfg: LMConfig, persona: Sequence[int], silence_frames: int,
                       silence: Sequence[int], sine: Sequence[int]) -> None:
    """`build_prompt_frames`'s arguments against the LM: codebook counts, token range, silence length."""
    n_agent, n_user = cfg.n_agent, cfg.n_user
    if len(silence) != n_agent:
        raise PersonaError(f"silence codes have {len(silence)} codebooks, the LM has {n_agent} agent codebooks")
    if len(sine) != n_user:
        raise PersonaError(f"sine codes have {len(sine)} codebooks, the LM has {n_user} user codebooks")
    for tok in persona:
        if not 0 <= int(tok) < cfg.text_card:
            raise PersonaError(f"persona token {tok} is outside the text vocabulary [0, {cfg.text_card})")
    if silence_frames < 0:
        raise PersonaError(f"silence_frames must be >= 0, got {silence_frames}")


def _voice_pt_state(voice: VoicePrompt, cfg: LMConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a `.pt` voice: (embeddings [N-1, dim], column N-1 [K], pending window from column N)."""
    assert voice.embeddings is not None and voice.cache is not None
    emb, cache = voice.embeddings, voice.cache
    k_all, depth = cfg.num_codebooks, cfg.max_delay
    if emb.dim() != 2 or emb.shape[1] != cfg.dim:
        raise PersonaError(f"voice {voice.source}: embeddings have shape {list(emb.shape)}, "
                           f"this LM needs [frames, {cfg.dim}]")
    if cache.dim() != 2 or cache.shape[0] != k_all or cache.shape[1] < depth + 2:
        raise PersonaError(f"voice {voice.source}: cache has shape {list(cache.shape)}, "
                           f"this LM needs [{k_all}, {depth + 3}]")
    width = cache.shape[1]
    n = voice.num_frames
    delays = torch.tensor(cfg.delays, dtype=torch.long)
    last = cache[:, (n - 1) % width].clone()
    last = torch.where((n - 1) <= delays, initial_column(cfg), last)
    # Columns n .. n+depth: stream k was written there by frames <= n-1 only if delay[k] >= d.
    pending = torch.full((depth + 1, k_all), UNGENERATED_TOKEN, dtype=torch.long)
    for d in range(1, depth + 1):
        col = cache[:, (n - 1 + d) % width]
        pending[d - 1] = torch.where(delays >= d, col, torch.full_like(col, UNGENERATED_TOKEN))
    return emb, last, pending
