"""The delayed-streams-modeling (DSM) text state machine: which text token a TTS row feeds next.

A DSM TTS model does not read a time-aligned transcript: it *asks* for the next word by
sampling `NEW_WORD` (0), and otherwise `PAD` (3). This module turns the model's wishes plus the
request's words into the text token that is actually fed back, with these rules (Kyutai's
`tts-1.6b-en_fr` behaviour, moshi 0.2.13 `StateMachine`):

- any sampled token other than NEW_WORD / PAD counts as PAD;
- PAD is forced while the current word still has tokens queued, or while `forced_padding` > 0;
- NEW_WORD is forced once `remaining_padding` reaches 0 (`max_padding` pads in a row at most);
- on NEW_WORD the next entry is popped: a word queues its tokens (the first is fed at once),
  resets `remaining_padding` to `max_padding` and sets `forced_padding` to its padding; a break
  entry (no tokens) only sets `forced_padding`;
- NEW_WORD with no entry left marks the end of speech (`end_step`);
- the second text stream carries the tokens of the word `second_stream_ahead` words ahead
  (queued when a word is consumed) and NEW_WORD itself; the fed token is the muxed
  `(second + 1) * card + main` (-1 on the second stream embeds to zero).

Two implementations with one behaviour:
- `DsmReference`: plain Python, one row, deques. The oracle in tests.
- `DsmRows`: every row's state in tensors, `step()` is a handful of tensor ops with no host
  sync, so a TTS pool can run it inside a CUDA graph. Per-row words live in padded arrays.

The text frontend (`split_words`) also lives here: the transcription engineer reuses the
token conventions (`DsmTokens`) for the ASR direction.
"""

from __future__ import annotations

import copy
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from .host_rows import copy_from_host

NEW_WORD = 0
PAD = 3
MAIN_SPEAKER = 1  # BOS: prefixed to the first word of the main speaker's turn
OTHER_SPEAKER = 2
ZERO = -1  # embeds to an exact zero
# DsmRows' per-row counters, one column each of its state.
_COUNTERS = ("n_entries", "next_entry", "q_pos", "q_end", "la_pos", "la_end", "remaining", "forced", "end_step")


@dataclass(frozen=True)
class DsmTokens:
    """Stream conventions: `card` is the text card + 1 (the mux base)."""

    card: int
    new_word: int = NEW_WORD
    pad: int = PAD


@dataclass(frozen=True)
class WordEntry:
    """One entry of a request's script: a word (its tokens) or a break (no tokens)."""

    tokens: tuple[int, ...]
    text: str
    padding: int  # steps during which the model may not ask for the next word


# ---------------------------------------------------------------------------------------------
# Text frontend

_BREAK = re.compile(r'<break\s+time="(\d+(?:\.\d*)?)s"\s*/?>')
MAX_BREAK_S = 10.0


def normalise(text: str) -> str:
    """The published model's input normalisation: curly apostrophe, colons and parentheses."""
    return text.replace("\u2019", "'").replace(":", " ").replace("(", "").replace(")", "")


def split_words(text: str, encode: Callable[[str], list[int]], frame_rate: float,
                padding_between: int = 1, speaker_token: int | None = MAIN_SPEAKER) -> list[WordEntry]:
    """Text -> entries. `<break time="1.5s"/>` becomes a pad-only entry (capped at MAX_BREAK_S);
    `speaker_token` (None: single-speaker model) is prefixed to the first word."""
    entries: list[WordEntry] = []
    first = True
    pos = 0
    text = normalise(text)
    for match in [*_BREAK.finditer(text), None]:
        chunk = text[pos:match.start() if match else len(text)]
        for word in chunk.split():
            tokens = list(encode(word))
            if first and speaker_token is not None:
                tokens.insert(0, speaker_token)
            first = False
            padding = max(0, padding_between + len(tokens) - 1) if padding_between > 0 else 0
            entries.append(WordEntry(tuple(tokens), word, padding))
        if match is not None:
            seconds = min(float(match.group(1)), MAX_BREAK_S)
            entries.append(WordEntry((), "", int(round(seconds * frame_rate))))
            pos = match.end()
    return entries


# ---------------------------------------------------------------------------------------------
# The oracle: one row, plain Python


@dataclass
class _RowState:
    entries: deque[WordEntry]
    remaining_padding: int
    forced_padding: int
    queued: deque[int] = field(default_factory=deque)
    lookahead: deque[int] = field(default_factory=deque)
    end_step: int | None = None
    word_steps: list[tuple[str, int]] = field(default_factory=list)  # (word, step consumed)


class DsmReference:
    """Straightforward single-row state machine (the test oracle for `DsmRows`)."""

    def __init__(self, tokens: DsmTokens, entries: Sequence[WordEntry], second_stream_ahead: int = 2,
                 max_padding: int = 8, initial_padding: int = 2) -> None:
        self.ids = tokens
        self.ahead = second_stream_ahead
        self.max_padding = max_padding
        self.state = _RowState(deque(entries), initial_padding, initial_padding)

    def _word_ahead(self) -> tuple[int, ...]:
        seen = 0
        for entry in self.state.entries:
            if entry.tokens:
                seen += 1
                if seen == self.ahead:
                    return entry.tokens
        return ()

    def step(self, step: int, sampled: int) -> int:
        ids, s = self.ids, self.state
        want_word = sampled == ids.new_word
        if s.queued or s.forced_padding > 0:
            want_word = False
        elif s.remaining_padding <= 0:
            want_word = True
        if want_word:
            if s.entries:
                entry = s.entries.popleft()
                if entry.tokens:
                    s.word_steps.append((entry.text, step))
                    s.queued.extend(entry.tokens)
                    if self.ahead:
                        s.lookahead.extend(self._word_ahead())
                    s.remaining_padding = self.max_padding
                else:
                    want_word = False  # a break reads as a pad
                s.forced_padding = entry.padding
            else:
                want_word = bool(self.ahead) and s.end_step is None
                if s.end_step is None:
                    s.end_step = step
        if want_word:
            main = ids.new_word
        else:
            s.remaining_padding = max(s.remaining_padding - 1, 0)
            s.forced_padding = max(s.forced_padding - 1, 0)
            main = s.queued.popleft() if s.queued else ids.pad
        if not self.ahead:
            return main
        second = -1
        if main == ids.new_word:  # NEW_WORD goes on the second stream; main feeds the word at once
            second = ids.new_word
            main = s.queued.popleft() if s.queued else ids.pad
        elif s.lookahead:
            second = s.lookahead.popleft()
        return (second + 1) * ids.card + main


# ---------------------------------------------------------------------------------------------
# Vectorised rows


class DsmRows:
    """The state machine for B rows in tensors. `load` (host, at admission) writes one row's
    script; `step` (device only, graph-safe) advances every row given in `active`.

    Layout per row: the tokens of its words back to back in `tokens[b]`; entry e spans
    `start[b, e] .. start[b, e] + length[b, e]` and, once consumed, extends the lookahead queue
    up to `ahead_end[b, e]` (the end of the word `second_stream_ahead` words later: those words
    are consecutive in `tokens`, so the lookahead FIFO is one span `la_pos .. la_end`).
    """

    def __init__(self, batch: int, max_entries: int, max_tokens: int, tokens: DsmTokens,
                 second_stream_ahead: int = 2, max_padding: int = 8, initial_padding: int = 2,
                 device: torch.device | str | None = None) -> None:
        self.ids = tokens
        self.ahead = second_stream_ahead
        self.max_padding = max_padding
        self.initial_padding = initial_padding
        self.max_entries = max_entries
        self.max_tokens = max_tokens

        # Every per-row array and counter is a view into one [batch, width] tensor, so `load`
        # writes a whole row with one host -> device copy (an admission's eager ops are what it costs).
        spans = [("tokens", max_tokens + 1)]  # one spare slot: gathers at the end stay in range
        spans += [(name, max_entries + 1) for name in ("start", "length", "padding", "ahead_end", "word_step")]
        spans += [(name, 0) for name in _COUNTERS]
        self._columns: dict[str, slice | int] = {}
        width = 0
        for name, size in spans:
            self._columns[name] = slice(width, width + size) if size else width
            width += size or 1
        self._bind(torch.zeros(batch, width, dtype=torch.long, device=device))
        self.word_step.fill_(-1)  # the step each entry was consumed at
        self.end_step.fill_(-1)  # -1: not ended

    def _bind(self, state: torch.Tensor) -> None:
        """Hold `state` [rows, width] and name its columns (each array and counter a view of it)."""
        self.state = state
        for name, column in self._columns.items():
            setattr(self, name, self.state[:, column])

    def leading_rows(self, n: int) -> "DsmRows":
        """These rows' state machine over rows [0, n) only: its state is a view of this one's
        lowest rows, so `step` through it updates them in place and never touches the rows above."""
        view = copy.copy(self)
        view._bind(self.state[:n])
        return view

    def check(self, entries: Sequence[WordEntry]) -> None:
        """ValueError when the script does not fit a row."""
        n_tokens = sum(len(e.tokens) for e in entries)
        reason = None
        if len(entries) > self.max_entries:
            reason = f"{len(entries)} words and breaks (at most {self.max_entries})"
        elif n_tokens > self.max_tokens:
            reason = f"{n_tokens} text tokens (at most {self.max_tokens})"
        if reason is not None:
            raise ValueError(f"the text is too long for a TTS row: {reason}")

    def load(self, row: int, entries: Sequence[WordEntry]) -> None:
        """Write a fresh script into `row` (one host -> device copy; not for a captured graph)."""
        self.check(entries)
        values, first_ahead = self._script_values(entries)
        cols = self._columns
        values[cols["word_step"]] = -1
        for name, value in (("n_entries", len(entries)), ("next_entry", 0), ("q_pos", 0), ("q_end", 0),
                            ("la_pos", first_ahead), ("la_end", first_ahead), ("remaining", self.initial_padding),
                            ("forced", self.initial_padding), ("end_step", -1)):
            values[cols[name]] = value
        copy_from_host(self.state[row], values)

    def extend(self, row: int, entries: Sequence[WordEntry], started: bool) -> None:
        """`row`'s script grew: `entries` is all of it so far, the loaded entries first, unchanged.
        Rewrites the script's arrays (an earlier word's lookahead may only now exist) and its
        length, never the counters the steps move; `started` False (no entry consumed yet): the
        lookahead queue's start too, which its first word `second_stream_ahead` in sets. The rows
        that use this step only while `second_stream_ahead` + 1 unconsumed words are loaded (or the
        text has ended), so no step ever reads an entry, or a lookahead, that is not there yet:
        the steps are those the whole script would have taken (engine/tts_pool.py)."""
        self.check(entries)
        values, first_ahead = self._script_values(entries)
        cols = self._columns
        script = slice(0, cols["ahead_end"].stop)  # tokens, start, length, padding, ahead_end: one span
        copy_from_host(self.state[row, script], values[script])
        counters = [("n_entries", len(entries))]
        if not started:
            counters += [("la_pos", first_ahead), ("la_end", first_ahead)]
        for name, value in counters:
            self.state[row, cols[name]] = value

    def _script_values(self, entries: Sequence[WordEntry]) -> tuple[np.ndarray, int]:
        """A row's values with `entries`' arrays written (counters zero), and where its lookahead
        queue starts."""
        flat: list[int] = []
        starts, lengths, pads = [], [], []
        word_ends: list[int] = []  # end of each word that has tokens, in order
        word_rank: list[int] = []  # per entry: how many token-words come before it, inclusive
        for entry in entries:
            starts.append(len(flat))
            lengths.append(len(entry.tokens))
            pads.append(entry.padding)
            flat.extend(entry.tokens)
            if entry.tokens:
                word_ends.append(len(flat))
            word_rank.append(len(word_ends))
        ahead_end = []
        for rank, length in zip(word_rank, lengths):
            target = rank - 1 + self.ahead  # index of the token-word `ahead` after this one
            if not self.ahead or not length:
                ahead_end.append(-1)  # unused: breaks and no second stream leave the queue as is
            else:
                ahead_end.append(word_ends[target] if target < len(word_ends) else -1)
        # The lookahead queue starts empty at the first token-word `ahead` words in (its start).
        first_ahead = word_ends[self.ahead - 1] if self.ahead and self.ahead - 1 < len(word_ends) else len(flat)
        values = np.zeros(self.state.shape[1], dtype=np.int64)
        cols = self._columns
        for name, array in (("tokens", flat), ("start", starts), ("length", lengths), ("padding", pads),
                            ("ahead_end", ahead_end)):
            values[cols[name].start:cols[name].start + len(array)] = array
        return values, first_ahead

    def step(self, step: torch.Tensor, sampled: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """step [B] (each row's own step index), sampled [B] text tokens, active [B] bool ->
        the muxed text token to feed [B]. Inactive rows' state is unchanged."""
        ids = self.ids
        rows = torch.arange(sampled.shape[0], device=sampled.device)
        queued = self.q_pos < self.q_end
        want = sampled == ids.new_word
        want = torch.where(queued | (self.forced > 0), False, torch.where(self.remaining <= 0, True, want))
        has_entry = self.next_entry < self.n_entries
        pop = want & has_entry & active
        e = self.next_entry.clamp(max=self.max_entries)
        e_start, e_len = self.start[rows, e], self.length[rows, e]
        is_word = pop & (e_len > 0)
        q_pos = torch.where(is_word, e_start, self.q_pos)
        q_end = torch.where(is_word, e_start + e_len, self.q_end)
        e_ahead = self.ahead_end[rows, e]
        la_end = torch.where(is_word & (e_ahead >= 0), e_ahead, self.la_end)
        remaining = torch.where(is_word, self.max_padding, self.remaining)
        forced = torch.where(pop, self.padding[rows, e], self.forced)
        self.word_step[rows, e] = torch.where(pop, step, self.word_step[rows, e])
        next_entry = self.next_entry + pop.long()
        # NEW_WORD past the last entry: the end of speech (asked again only once with a 2nd stream).
        at_end = want & ~has_entry & active
        not_ended = self.end_step < 0
        end_step = torch.where(at_end & not_ended, step, self.end_step)
        want = torch.where(pop, is_word, torch.where(want & ~has_entry, bool(self.ahead) & not_ended, want))

        # Main stream: NEW_WORD, else the next queued token, else PAD (pads count down the counters).
        queued = q_pos < q_end
        is_pad = ~want
        remaining = torch.where(is_pad, (remaining - 1).clamp(min=0), remaining)
        forced = torch.where(is_pad, (forced - 1).clamp(min=0), forced)
        head = self.tokens[rows, q_pos.clamp(max=self.max_tokens)]
        main = torch.where(is_pad, torch.where(queued, head, ids.pad), ids.new_word)
        q_pos = q_pos + (is_pad & queued).long()
        la_pos = self.la_pos
        if self.ahead:
            # NEW_WORD moves to the second stream and main feeds the word's next token at once
            # (a queued token equal to NEW_WORD is treated the same way, as the published model was).
            to_second = main == ids.new_word
            queued = q_pos < q_end
            head = self.tokens[rows, q_pos.clamp(max=self.max_tokens)]
            main = torch.where(to_second, torch.where(queued, head, ids.pad), main)
            q_pos = q_pos + (to_second & queued).long()
            la_has = la_pos < la_end
            la_head = self.tokens[rows, la_pos.clamp(max=self.max_tokens)]
            second = torch.where(to_second, ids.new_word, torch.where(la_has, la_head, -1))
            la_pos = la_pos + (~to_second & la_has).long()
            main = (second + 1) * ids.card + main

        for name, new in (("q_pos", q_pos), ("q_end", q_end), ("la_pos", la_pos), ("la_end", la_end),
                          ("remaining", remaining), ("forced", forced), ("next_entry", next_entry),
                          ("end_step", end_step)):
            old = getattr(self, name)
            old.copy_(torch.where(active, new, old))
        return main
