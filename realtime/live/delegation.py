"""GPT-Live delegation on Parley: when a user turn ends, and which delegations a client may answer.

`TurnWatcher` follows one session's input without sockets: every 80 ms frame of the user's
audio goes through /v1/realtime's energy detector and turn rule (realtime_turns.is_loud,
turn_ended), and the paired STT's words and end-of-turn probability arrive through `heard`. A
turn starts on a loud frame and ends after quiet: with a paired STT semantically (its end-of-turn
head at eagerness `medium`: >= 0.5 after 160 ms of quiet, or 4 s of quiet), without one after
500 ms of quiet. At each turn's end the policy (live/policy.py) says whether it delegates. The
STT writes a word a little after it is said, so a pattern sees what was transcribed by then.

`Delegations` remembers the ids a session created: a `*.append` names one of them or none.
The policy and the book are the session's; whoever answers (the client now, a Responses
backend later) works from them.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from parley.models import FRAME_SAMPLES

from .policy import DelegationPolicy
from ..realtime_api.events import TurnDetection, new_id
from ..realtime_api.settings import ClientError
from ..realtime_api.turns import FRAME_MS, is_loud, turn_ended

MAX_DELEGATIONS = 256  # ids remembered per session (the oldest are forgotten first)


class TurnWatcher:
    """One session's user turns, from its input audio (24 kHz) and the STT's transcript."""

    def __init__(self, policy: DelegationPolicy, semantic: bool) -> None:
        self.policy = policy
        self.detection = TurnDetection(type="semantic_vad", eagerness="medium") if semantic else TurnDetection()
        self._pending = np.zeros(0, np.float32)
        self.speaking = False
        self.quiet_ms = 0
        self.end_of_turn = 0.0  # the STT's latest end-of-turn probability
        self.transcript = ""  # what the STT heard since the last turn ended

    def heard(self, text: str, end_of_turn: float) -> None:
        """One STT step: its new words and its end-of-turn probability (NaN: none this step)."""
        self.transcript += text
        if end_of_turn == end_of_turn:
            self.end_of_turn = end_of_turn

    def audio(self, pcm: np.ndarray) -> list[str]:
        """Feed input audio; returns the transcripts of the turns it ended that delegate (in order)."""
        frames = np.concatenate([self._pending, pcm]) if self._pending.size else pcm
        whole = frames.size - frames.size % FRAME_SAMPLES
        self._pending = frames[whole:].copy()
        delegating = []
        for start in range(0, whole, FRAME_SAMPLES):
            loud = is_loud(frames[start:start + FRAME_SAMPLES], self.detection)
            if loud and not self.speaking:
                self.speaking, self.quiet_ms = True, 0
            elif self.speaking:
                self.quiet_ms = 0 if loud else self.quiet_ms + FRAME_MS
                if turn_ended(self.detection, self.quiet_ms, self.end_of_turn):
                    self.speaking = False
                    said, self.transcript = self.transcript.strip(), ""
                    if self.policy.delegates(said):
                        delegating.append(said)
        return delegating


class Delegations:
    """The delegation ids one session created, which its appends may name."""

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()

    def create(self) -> str:
        delegation_id = new_id("dlg")
        self._ids[delegation_id] = None
        if len(self._ids) > MAX_DELEGATIONS:
            self._ids.popitem(last=False)
        return delegation_id

    def check(self, value: object, param: str = "delegation_id") -> str | None:
        """A `delegation_id` as sent: None, or an id this session created (ClientError otherwise)."""
        if value is None:
            return None
        if not isinstance(value, str) or value not in self._ids:
            raise ClientError(f"{param}: {value!r:.60} is not a delegation of this session (it names the id of "
                              "a session.delegation.created event, or null)", "invalid_value", param)
        return value
