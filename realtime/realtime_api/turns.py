"""`/v1/realtime` bookkeeping without sockets: the model's output frames and the client's input
audio in, OpenAI events out. The connection (`realtime_api/connection.py`) only moves bytes.

Responses follow the full-duplex model's own activity (Parley's design, see docs/protocols.md):
- a response starts on the first output frame whose audio is above `ACTIVITY_RMS` or which
  carries text, when turn detection is on with `create_response`; otherwise only
  `response.create` opens one, and the model's speech outside responses is not sent;
- it ends after `END_QUIET_FRAMES` quiet frames (`CREATE_GRACE_FRAMES` if it never spoke),
  when its `max_output_tokens` is reached (status `incomplete`), on `response.cancel`, or
  when the user starts speaking and `interrupt_response` is on (status `cancelled`);
- after a cancel or a cut-off the agent is muted until it has been quiet for
  `END_QUIET_FRAMES`, so the rest of that utterance does not come back as a new response.
Input: an energy detector per 80 ms frame emits `speech_started` / `speech_stopped` (while turn
detection is on) and commits the buffer as a user item at speech end. With `semantic_vad` the
turn ends when the paired STT's end-of-turn probability reaches the `eagerness` threshold after
at least `SEMANTIC_MIN_QUIET_MS` of quiet, or at the eagerness's timeout (speech start stays
energy-based). With input transcription on, the STT's words are sent as
`conversation.item.input_audio_transcription.delta` for the item being spoken, and
`.completed` when it is committed (words after the commit go to the next item).
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from parley.models import FRAME_SAMPLES, SAMPLE_RATE

from ..media.audio_formats import InputDecoder, OutputEncoder
from ..sessions.limits import ConversationBudget
from .events import (AssistantItem, Event, Events, ResponseState, SessionConfig, TurnDetection, UserItem,
                            new_id)
from .settings import EAGERNESS, ClientError, ResponseOptions

FRAME_MS = FRAME_SAMPLES * 1000 // SAMPLE_RATE  # 80
ACTIVITY_RMS = 0.01  # ~ -40 dBFS: agent audio above this (or any transcript text) is speech
END_QUIET_FRAMES = 10  # 800 ms of quiet ends a response (and lifts the mute after a cancel)
CREATE_GRACE_FRAMES = 25  # a response.create with no speech completes empty after 2 s
SPEECH_RMS_AT_HALF = 0.02  # input energy detector: RMS at OpenAI's default threshold 0.5
MIN_COMMIT_SAMPLES = SAMPLE_RATE // 10  # 100 ms: less is input_audio_buffer_commit_empty
MAX_ITEMS = 256  # conversation items remembered for retrieve / truncate / delete
SEMANTIC_MIN_QUIET_MS = 160  # at least two quiet frames before the end-of-turn head may end a turn
CANCELLED = {"type": "cancelled", "reason": "client_cancelled"}
INTERRUPTED = {"type": "cancelled", "reason": "turn_detected"}
CUT_OFF = {"type": "incomplete", "reason": "max_output_tokens"}


def rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm * pcm))) if pcm.size else 0.0


# The user-turn rules, shared with GPT-Live's delegation policy (live/delegation.py).

def is_loud(frame: np.ndarray, td: TurnDetection) -> bool:
    """The energy detector's verdict on one 80 ms input frame."""
    return rms(frame) > SPEECH_RMS_AT_HALF * (td.threshold / 0.5)


def turn_ended(td: TurnDetection, quiet_ms: int, end_of_turn: float) -> bool:
    """Whether the user's turn is over after `quiet_ms` of quiet, the paired STT's latest
    end-of-turn probability being `end_of_turn` (semantic_vad)."""
    if td.type != "semantic_vad":
        return quiet_ms >= td.silence_duration_ms
    threshold, timeout_ms = EAGERNESS[td.eagerness]
    return (quiet_ms >= SEMANTIC_MIN_QUIET_MS and end_of_turn >= threshold) or quiet_ms >= timeout_ms


@dataclass
class InputState:
    """The input side's books: samples since the last commit and the energy detector."""

    total_samples: int = 0  # all input so far (the audio clock for *_ms fields)
    buffered_samples: int = 0  # since the last commit / clear
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    speaking: bool = False
    speech_item: str | None = None
    quiet_ms: int = 0


class Turns:
    """One connection's responses, conversation items and voice activity."""

    def __init__(self, events: Events, config: SessionConfig, budget: ConversationBudget) -> None:
        self.events = events
        self.budget = budget  # bytes the conversation's items may hold (reliability: bounded memory)
        self.config = config
        self.conversation_id = new_id("conv")
        self.response: ResponseState | None = None
        self.response_quiet = 0  # quiet frames in the open response
        self.response_spoke = False  # the open response has had any speech yet
        self.muted = False  # after a cancel / cut-off, until the agent goes quiet
        self.mute_quiet = 0
        self.items: OrderedDict[str, Event] = OrderedDict()
        self.last_item_id: str | None = None
        self.input = InputState()
        self.transcribed = ""  # transcribed since the last commit
        self.end_of_turn = 0.0  # the STT's latest end-of-turn probability
        self.decoder = InputDecoder(config.input_format)
        self.encoder = OutputEncoder(config.output_format)

    def set_config(self, config: SessionConfig) -> None:
        """A session.update took effect: new formats get fresh codec streams."""
        if config.input_format != self.config.input_format:
            self.decoder = InputDecoder(config.input_format)
        if config.output_format != self.config.output_format:
            self.encoder = OutputEncoder(config.output_format)
        self.config = config

    # ---- the model's output ----

    def output_frame(self, pcm: np.ndarray, text: str) -> list[Event]:
        """One 80 ms output frame -> the events it makes (none for quiet frames between responses)."""
        out: list[Event] = []
        active = bool(text) or rms(pcm) > ACTIVITY_RMS
        if self.muted:
            self.mute_quiet = 0 if active else self.mute_quiet + 1
            if self.mute_quiet >= END_QUIET_FRAMES:
                self.muted = False
            return out
        if self.response is None:
            td = self.config.turn_detection
            if not active or td is None or not td.create_response:
                return out
            out += self.start_response(ResponseOptions.of_session(self.config))
        response = self.response
        assert response is not None

        def room() -> bool:
            return response.max_output_tokens is None or response.output_tokens < response.max_output_tokens

        if response.item.audio and room():
            wire = base64.b64encode(self.encoder.encode(pcm)).decode()
            out.append(self.events.audio_delta(response, wire))
            response.audio_frames += 1
        if text and room():
            response.item.transcript += text
            response.text_pieces += 1
            out.append(self.events.transcript_delta(response, text) if response.item.audio
                       else self.events.text_delta(response, text))
        if not room():
            return out + self.finish_response("incomplete", CUT_OFF, mute=True)
        if active:
            self.response_quiet, self.response_spoke = 0, True
        else:
            self.response_quiet += 1
        limit = END_QUIET_FRAMES if self.response_spoke else CREATE_GRACE_FRAMES
        if self.response_quiet >= limit:
            out += self.finish_response("completed", None)
        return out

    def start_response(self, options: ResponseOptions) -> list[Event]:
        if self.response is not None:
            raise ClientError(f"Conversation already has an active response in progress: {self.response.id}",
                              "conversation_already_has_active_response")
        self.muted = False
        item = AssistantItem(new_id("item"), audio=options.audio)
        response = ResponseState(new_id("resp"), self.conversation_id, item, previous_item_id=self.last_item_id,
                                 max_output_tokens=options.max_output_tokens, metadata=options.metadata,
                                 in_conversation=options.in_conversation)
        self.response, self.response_quiet, self.response_spoke = response, 0, False
        out = [self.events.response_created(response, self.config), self.events.output_item_added(response)]
        if response.in_conversation:
            self._remember(item.to_dict(self.events.dialect))
            out += self.events.item_added(item.to_dict(self.events.dialect), response.previous_item_id)
        return out + [self.events.content_part_added(response)]

    def finish_response(self, status: str, details: Event | None, mute: bool = False) -> list[Event]:
        """End the open response (no-op without one); `mute` drops the rest of the utterance."""
        response = self.response
        if response is None:
            return []
        self.response = None
        if mute:
            self.muted, self.mute_quiet = True, 0
        response.status, response.status_details = status, details
        response.item.status = "completed" if status == "completed" else "incomplete"
        item = response.item.to_dict(self.events.dialect)
        if response.in_conversation and item["id"] in self.items:
            self.items[item["id"]] = item
            self.budget.set(item["id"], self.budget.size_of(item))
        if response.item.audio:
            out = [self.events.audio_done(response), self.events.transcript_done(response)]
        else:
            out = [self.events.text_done(response)]
        out += [self.events.content_part_done(response), self.events.output_item_done(response)]
        if response.in_conversation:
            out += self.events.item_done(item, response.previous_item_id)
        return out + [self.events.response_done(response, self.config)]

    def cancel(self) -> list[Event]:
        if self.response is None:
            raise ClientError("Cancellation failed: no active response found", "response_cancel_not_active")
        return self.finish_response("cancelled", CANCELLED, mute=True)

    # ---- the client's input ----

    def input_audio(self, data: bytes) -> tuple[np.ndarray, list[Event]]:
        """Wire bytes in the session's input format -> 24 kHz PCM for the model, and the detector's events."""
        return self.heard(self.decoder.decode(data))

    def heard(self, pcm: np.ndarray) -> tuple[np.ndarray, list[Event]]:
        """24 kHz PCM the model is about to hear (appended, or from an audio item) -> detector events."""
        out: list[Event] = []
        tracker = self.input
        tracker.buffered_samples += pcm.size
        td = self.config.turn_detection
        frames = np.concatenate([tracker.pending, pcm])
        whole = frames.size // FRAME_SAMPLES * FRAME_SAMPLES
        tracker.pending = frames[whole:]
        for start in range(0, whole, FRAME_SAMPLES):
            tracker.total_samples += FRAME_SAMPLES
            if self.response is not None:
                self.response.input_frames += 1
            if td is None:
                continue
            loud = is_loud(frames[start:start + FRAME_SAMPLES], td)
            clock_ms = tracker.total_samples * 1000 // SAMPLE_RATE
            if loud and not tracker.speaking:
                tracker.speaking, tracker.quiet_ms = True, 0
                tracker.speech_item = tracker.speech_item or new_id("item")  # transcript deltas may have named it
                start_ms = max(0, clock_ms - FRAME_MS - td.prefix_padding_ms)
                out.append(self.events.speech_started(start_ms, tracker.speech_item))
                if td.interrupt_response and self.response is not None:
                    out += self.finish_response("cancelled", INTERRUPTED, mute=True)
            elif tracker.speaking:
                tracker.quiet_ms = 0 if loud else tracker.quiet_ms + FRAME_MS
                if self._turn_ended(tracker.quiet_ms):
                    tracker.speaking = False
                    item_id = tracker.speech_item or new_id("item")
                    out.append(self.events.speech_stopped(clock_ms, item_id))
                    out += self._commit(item_id)
        return pcm, out

    def _turn_ended(self, quiet_ms: int) -> bool:
        td = self.config.turn_detection
        assert td is not None
        return turn_ended(td, quiet_ms, self.end_of_turn)

    def _commit(self, item_id: str) -> list[Event]:
        previous = self.last_item_id
        item = UserItem(item_id).to_dict(self.events.dialect)
        self._remember(item)
        seconds = self.input.buffered_samples / SAMPLE_RATE
        self.input.buffered_samples = 0
        self.input.speech_item = None
        out = [self.events.committed(item_id, previous), *self.events.item_entered(item, previous)]
        if self.config.transcription is not None:
            heard, self.transcribed = self.transcribed.strip(), ""
            out.append(self.events.transcription_completed(item_id, heard, seconds))
        return out

    # ---- the paired STT's transcript ----

    def transcript(self, text: str, end_of_turn: float) -> list[Event]:
        """One STT step: its words (if any) and its end-of-turn probability (NaN: none this step)."""
        if end_of_turn == end_of_turn:  # not NaN
            self.end_of_turn = end_of_turn
        if not text or self.config.transcription is None:
            return []
        if self.input.speech_item is None:
            self.input.speech_item = new_id("item")
        self.transcribed += text
        return [self.events.transcription_delta(self.input.speech_item, text)]

    def transcript_failed(self, reason: str) -> list[Event]:
        if self.config.transcription is None:
            return []
        return [self.events.transcription_failed(self.input.speech_item or new_id("item"), reason)]

    def commit(self) -> list[Event]:
        if self.input.buffered_samples < MIN_COMMIT_SAMPLES:
            ms = self.input.buffered_samples * 1000 // SAMPLE_RATE
            raise ClientError(f"buffer too small: expected at least 100ms of audio, but buffer only has {ms}ms",
                              "input_audio_buffer_commit_empty")
        speech = self.input.speech_item if self.input.speaking else None
        return self._commit(speech or new_id("item"))

    def clear(self) -> list[Event]:
        self.input.buffered_samples = 0
        return [self.events.cleared()]

    # ---- conversation items ----

    def add_item(self, item: Event, previous_item_id: object) -> list[Event]:
        """A client item, appended: the model hears the conversation in order, so it cannot be inserted."""
        if previous_item_id is not None and previous_item_id != self.last_item_id:
            raise ClientError("items can only be appended: previous_item_id must be the last item's id or left "
                              "out (the model hears the conversation in order)", "invalid_value", "previous_item_id")
        size = self.budget.size_of(item)
        if not self.budget.fits(item["id"], size):
            raise ClientError(f"the item ({size} bytes) would take this session's conversation past its "
                              f"{self.budget.max_bytes}-byte budget; delete items first", "conversation_too_large",
                              "item")
        previous = self.last_item_id
        self._remember(item, size)
        return self.events.item_entered(item, previous)

    def item(self, item_id: object) -> Event:
        if not isinstance(item_id, str) or item_id not in self.items:
            raise ClientError(f"Item with item_id '{item_id!s:.60}' not found", "item_not_found", "item_id")
        return self.items[item_id]

    def delete(self, item_id: object) -> list[Event]:
        item = self.item(item_id)
        del self.items[item["id"]]
        self.budget.discard(item["id"])
        if self.last_item_id == item["id"]:
            self.last_item_id = next(reversed(self.items), None)
        return [self.events.item_deleted(item["id"])]

    def _remember(self, item: Event, size: int | None = None) -> None:
        """Store an item; the oldest go when over MAX_ITEMS or the byte budget (a client's own
        items were checked against the budget before; the server's are small)."""
        self.items[item["id"]] = item
        self.items.move_to_end(item["id"])
        self.budget.set(item["id"], self.budget.size_of(item) if size is None else size)
        while len(self.items) > MAX_ITEMS or (self.budget.used > self.budget.max_bytes and len(self.items) > 1):
            old_id, _ = self.items.popitem(last=False)
            self.budget.discard(old_id)
        self.last_item_id = item["id"]
