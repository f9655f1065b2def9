"""The text tokenizer: a thin SentencePiece wrapper, plus a tiny trainer for test checkpoints.

Moshi's text stream reserves ids 0..3: 0 = EPAD (end of padding), 1 = BOS, 2 = EOS,
3 = PAD. Servers drop 0 and 3 before sending text. Pieces mark a leading space with `▁`;
`piece()` turns that back into a plain space so streamed pieces concatenate into text.
"""

from __future__ import annotations

import io
from pathlib import Path

import sentencepiece

from .config import TEXT_EPAD, TEXT_PAD

SPACE_MARK = "\u2581"  # '▁', SentencePiece's word-boundary marker
DROPPED_TEXT_IDS = frozenset({TEXT_EPAD, TEXT_PAD})


class TokenizerError(ValueError):
    """A tokenizer file that cannot be loaded; the message names the file."""


class TextTokenizer:
    """SentencePiece model: encode text to ids, turn one generated id into its text piece."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.path))
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"tokenizer {self.path} could not be loaded: {err}") from err
        # Pieces are immutable, so resolve them once: piece() is called per generated token, each
        # tick for every session. Padding, control and unknown ids stream as "".
        sp = self._sp
        self._pieces = ["" if i in DROPPED_TEXT_IDS or sp.IsControl(i) or sp.IsUnknown(i)
                        else sp.IdToPiece(i).replace(SPACE_MARK, " ") for i in range(self.vocab_size)]

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    def encode(self, text: str) -> list[int]:
        return list(self._sp.EncodeAsIds(text))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; like `piece`, padding and ids outside the vocabulary give nothing (a model
        whose text card exceeds its tokenizer, e.g. random weights, must not stop the stream)."""
        size = self.vocab_size
        return self._sp.DecodeIds([i for i in ids if not self.is_special(i) and 0 <= i < size])

    def piece(self, token_id: int) -> str:
        """The text of one streamed token, `▁` replaced by a space ('' for special ids)."""
        return self._pieces[token_id] if 0 <= token_id < len(self._pieces) else ""

    def is_special(self, token_id: int) -> bool:
        """True for the padding ids (EPAD 0, PAD 3) that servers drop instead of sending."""
        return token_id in DROPPED_TEXT_IDS


# A little English for the tiny tokenizer: enough distinct characters and words for
# a few hundred pieces, fixed so the trained model is the same on every run.
_TINY_CORPUS = """\
Hello, how are you doing today? I am doing well, thank you for asking.
What would you like to talk about? We could talk about the weather, or music, or books.
The quick brown fox jumps over the lazy dog near the river bank.
I think that is a very good question. Let me think about it for a moment.
Yes, of course. No, I do not think so. Maybe we can try again later.
My name is Parley and I am a voice assistant that listens while it speaks.
Can you hear me? The sound is a little quiet, please speak up.
It was a bright cold day in April, and the clocks were striking thirteen.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
Tell me a story about a dragon who lived in a castle on a hill above the town.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten are easy.
Good morning! Good evening! Good night, and see you tomorrow.
Where are you from? I live in a small city by the sea with my family and my cat.
That sounds great. Really? Wow, I did not know that. Interesting, tell me more.
Please wait while I look that up for you. Here is what I found about it.
The system prompt says: you are a friendly and helpful teacher, answer briefly.
Jack and Jill went up the hill to fetch a pail of water, quickly and quietly.
Zebras, yaks, and xylophones make an unusual but complete alphabet exercise.
"""


def train_tiny_tokenizer(out_path: str | Path, vocab_size: int = 200) -> Path:
    """Train a small deterministic SentencePiece model on built-in English text.

    Ids 0..3 are `<unk>`, `<s>`, `</s>`, `<pad>` like the real Moshi tokenizer, so the text
    stream's EPAD (0) / PAD (3) conventions hold. `vocab_size` equals the LM's `text_card`.
    """
    out_path = Path(out_path)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.Train(
        sentence_iterator=iter(_TINY_CORPUS.splitlines() * 4),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        num_threads=1,
        minloglevel=2,
    )
    out_path.write_bytes(model.getvalue())
    return out_path
