"""The model a translation session runs on, and how its source ends: the door's one seam to it.

To the engine a translation session is a duplex session of a translating model: source audio in,
translated audio and its text out, one 80 ms frame a tick. Two things differ by model, and
`Translator` holds both:
- the languages its speech comes out in (`audio.output.language` must name one);
- what happens when the source ends (`session.close`): a model that knows (Hibiki's input
  end-of-stream code: `Session.end_input`) is told, and its stream ends by itself with
  Terminal(completed) once the translation is out (`owed_frames` None); one that does not is
  followed for `owed_frames` more frames.

`served_translator` picks the server's: the Hibiki model when the engine's duplex model translates
(`start_translator` built it: the translation record's service, server/modalities.py), else the
duplex model as a stand-in, which speaks English and has no end-of-source call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine_client import DuplexSession

if TYPE_CHECKING:
    from ..server.state import AppState

# The duplex stand-in's output after the source's last frame: one second of model frames (its
# reply to the last words lags them; Hibiki's end of translation ends its stream instead).
DUPLEX_OWED_FRAMES = 12
# What Hibiki and Hibiki-Zero speak: every source language comes out in English.
HIBIKI_LANGUAGES = ("en",)


@dataclass(frozen=True)
class Translator:
    modality: str  # the served-names modality `?model=` must name (server/served_models.py)
    languages: tuple[str, ...]  # ISO 639-1 codes of the output speech; the first is the session's default
    owed_frames: int | None  # frames followed after the source's last; None: the engine ends the stream
    name: str = ""  # its checkpoint's served name (a Hibiki's; the stand-in's is the duplex model's)

    def end_source(self, session: DuplexSession) -> None:
        """Tell the engine `session`'s source has ended (its last frame has been consumed): Hibiki
        writes its input end code and ends the stream when the translation is out. The duplex
        stand-in has nothing to be told."""
        if self.owed_frames is None:
            session.end_input()


DUPLEX_STAND_IN = Translator(modality="duplex", languages=("en",), owed_frames=DUPLEX_OWED_FRAMES)


def served_translator(state: "AppState") -> Translator:
    """The translating model this server serves."""
    return state.translator or DUPLEX_STAND_IN
