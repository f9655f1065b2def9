"""The voices a PersonaPlex checkpoint ships, all read when its backend is built (engine/backend.py).

Read at start, not when a session first asks: admission runs on the engine thread between ticks,
outside any slack budget, and an audio voice is loudness-normalised and Mimi-encoded (hundreds of ms
for a long one). Voices are small; one that cannot be read is logged and refused to the sessions that
ask for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from parley.models.voices import PersonaError, VoicePrompt, list_voices, load_voice, voice_candidates, voice_not_found

log = logging.getLogger("parley.engine.backend")


class VoiceLibrary:
    """Voices by file name, and the reason each one that could not be read was refused."""

    def __init__(self, voices_dir: Path | None, mimi, device: torch.device) -> None:
        self.voices_dir = voices_dir
        self._mimi = mimi
        self._device = device
        self._voices: dict[str, VoicePrompt] = {}
        self._errors: dict[str, str] = {}

    def load(self) -> None:
        """Read every voice in the folder (see the module doc)."""
        for name in list_voices(self.voices_dir):
            try:
                self._voices[name] = load_voice(self.voices_dir / name, mimi_encode=self._encode)
            except PersonaError as exc:
                self._errors[name] = str(exc)
                log.warning("voice %s cannot be used: %s", name, exc)

    def names(self) -> tuple[str, ...]:
        """File names of every voice (`.pt` and audio), sorted, those refused included."""
        return tuple(sorted([*self._voices, *self._errors]))

    def get(self, name: str) -> VoicePrompt:
        """A voice read at start, by a client's name for it (NATF0 and NATF0.pt: one file). It touches
        no file: a voice added to the folder later is refused (restart to serve it), as is a name that
        matches nothing (PersonaError)."""
        for candidate in voice_candidates(name):
            if candidate in self._voices:
                return self._voices[candidate]
            if candidate in self._errors:
                raise PersonaError(self._errors[candidate])
        raise voice_not_found(name, list(self.names()), " (the voices folder is read when the server starts)")

    def clear(self) -> None:
        self._voices.clear()
        self._mimi = None

    @torch.no_grad()
    def _encode(self, frames: torch.Tensor) -> torch.Tensor:
        """[N, 1920] -> [N, n_agent] codes through a fresh streaming encoder (an audio voice file)."""
        codes = self._mimi.encode(frames.reshape(1, -1).to(self._device))  # [1, K, N]
        return codes[0].T.cpu()
