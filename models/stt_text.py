"""STT text stream -> text pieces and timed words, one row at a time on the host.

    dec = TranscriptDecoder(tokenizer, text_delay=6, offset_s=0.0)
    events = dec.feed(token, step)      # a valid STT output token of `step` (0-based)
    events += dec.flush(step)           # end of audio: the word still open ends there

DSM text conventions (Kyutai STT): 3 = PAD (nothing new), 0 = EPAD ("end of padding": a word
starts right after it), other ids are SentencePiece pieces of the current word. The timing rule is
moshi-server's ASR (`asr.rs`): a step's time is (step + 1 - text_delay) / 12.5 s; a word starts at
the time of the last EPAD before it and ends at the next EPAD after it (or at `flush`); several words in one segment share its span.

Beside those, `feed` and `flush` report each segment as moshi-server's ASR messages it, for the door
that speaks its protocol (realtime/kyutai/): `WordHeard` once its text is complete (the first PAD or
EPAD after its pieces; its end is not known yet), then `WordEnded` when it ends (the next EPAD, a new
word without one, or `flush`). Consumers that want only `TextDelta` / `Word` skip them by type.

Kept apart from the TTS text machinery on purpose (its DSM state machine feeds text *in*); the two
can share the piece/word helpers once both have landed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import FRAME_RATE, TEXT_EPAD, TEXT_PAD
from .tokenizer import TextTokenizer


@dataclass(frozen=True)
class TextDelta:
    text: str  # a piece of transcript text as it arrives ("▁" already turned into a space)


@dataclass(frozen=True)
class Word:
    text: str
    start: float  # seconds from the start of the audio
    end: float


@dataclass(frozen=True)
class WordHeard:
    text: str  # the segment's text, as the tokenizer decodes its pieces (one word, or rarely several)
    start: float  # seconds from the start of the audio: the end of the segment before it


@dataclass(frozen=True)
class WordEnded:
    end: float  # the heard segment ends here (seconds from the start of the audio)


class TranscriptDecoder:
    def __init__(self, tokenizer: TextTokenizer, text_delay: int, offset_s: float = 0.0) -> None:
        self._tok = tokenizer
        self._delay = text_delay
        self._offset = offset_s  # subtracted from every time (a silence prefix)
        self._word: list[int] = []
        self._word_start = 0.0
        self._pending: Word | None = None  # complete text, waiting for its end (the next EPAD)
        self._text = ""
        self._audio_end: float | None = None  # set once the input ended: no time goes past it

    @property
    def text(self) -> str:
        """Everything transcribed so far."""
        return self._text.strip()

    def audio_ended(self, seconds: float) -> None:
        """The input is `seconds` long: words the flush frames close end there, not after it."""
        self._audio_end = seconds

    def _time(self, step: int) -> float:
        at = max(0.0, (step + 1 - self._delay) / FRAME_RATE - self._offset)
        return at if self._audio_end is None else min(at, self._audio_end)

    def feed(self, token: int, step: int) -> list[TextDelta | Word | WordHeard | WordEnded]:
        out: list[TextDelta | Word | WordHeard | WordEnded] = []
        if token in (TEXT_PAD, TEXT_EPAD):
            if self._word:
                self._pending = self._open_word(self._word_start)
                if self._pending is not None:
                    out.append(WordHeard(self._pending.text, self._pending.start))
            if token == TEXT_EPAD:
                now = self._time(step)
                if self._pending is not None:
                    out += self._end_pending(now)
                self._word_start = now
            return out
        if token < 0 or self._tok.is_special(token):
            return out
        if self._pending is not None:  # a new word began without an EPAD: the old one ends here
            out += self._end_pending(self._time(step))
            self._word_start = self._time(step)
        self._word.append(token)
        piece = self._tok.piece(token)
        if not self._text and piece.startswith(" "):
            piece = piece[1:]
        if piece:
            self._text += piece
            out.append(TextDelta(piece))
        return out

    def _open_word(self, end: float) -> Word | None:
        """The word made of the pieces so far (None if they decode to nothing)."""
        text = self._tok.decode(self._word).strip()
        self._word = []
        return Word(text, self._word_start, end) if text else None

    def _end_pending(self, end: float) -> list[Word | WordEnded]:
        """The heard segment ends at `end`: its words, then the end itself."""
        assert self._pending is not None
        words: list[Word | WordEnded] = list(_split(self._pending.text, self._pending.start, end))
        self._pending = None
        return [*words, WordEnded(end)]

    def flush(self, step: int) -> list[TextDelta | Word | WordHeard | WordEnded]:
        """The audio ended after `step`: close the open word at that time."""
        end = self._time(step)
        out: list[TextDelta | Word | WordHeard | WordEnded] = []
        if self._word:
            self._pending = self._open_word(end)
            if self._pending is not None:
                out.append(WordHeard(self._pending.text, self._pending.start))
        if self._pending is not None:
            out += self._end_pending(max(end, self._pending.start))
        return out


def _split(text: str, start: float, end: float) -> list[Word]:
    """A segment between two EPADs is normally one word; when the model packed several words into
    it (fast speech, or no EPAD at all), each gets a share of the span by its length."""
    words = text.split()
    total = sum(len(w) for w in words)
    out, at = [], start
    for w in words:
        step = (end - start) * len(w) / total
        out.append(Word(w, at, at + step))
        at += step
    return out
