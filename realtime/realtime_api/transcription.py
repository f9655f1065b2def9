"""`/v1/realtime?intent=transcription`: a transcription-only session on a standalone STT row.

What OpenAI clients get: GA `session.update` with `session.type: "transcription"` (GA events:
`session.created` / `.updated` with the transcription session object), beta
`transcription_session.update` (`transcription_session.created` / `.updated`); then
`input_audio_buffer.*` as in a conversation, turn detection (server_vad on energy, semantic_vad on
the STT's end-of-turn head) committing turns, and `conversation.item.input_audio_transcription.delta`
/ `.completed` (`.failed` if the row fails). There are no responses: the model never speaks, and
`response.*` / item events are refused with an `error`.

Why a standalone row (engine/stt_pool.py) and not a paired one: a paired row rides beside a duplex
row, so a transcription session would hold a duplex slot and pay for a 7B frame whose reply nobody
hears. The pool's rows cost only the STT, run in the slack, and serve any server with an STT model
(even one whose Mimi differs from the duplex model's). The row is live: refused (1013) when every row
is taken, never queued, and it gets a partial every step so the end-of-turn probability keeps coming.

Everything a connection does with its settings, input audio and turn events is `RealtimeConnection`'s
and `Turns`' (realtime_api/connection.py, realtime_api/turns.py); this module swaps the engine session for the
STT request.
"""

from __future__ import annotations

import logging

import numpy as np

from ..engine_client import EngineClient, Status, SttBusy, SttInputError, Terminal, TranscriptionJob
from .events import Dialect, Event, SessionConfig, TurnDetection, new_id
from .connection import RealtimeConnection
from .settings import ClientError, ModelCaps, apply_session_update
from ..sessions.session import CLOSE_GOING_AWAY, CLOSE_TRY_AGAIN_LATER, EdgeSession

log = logging.getLogger("parley.realtime")

NO_RESPONSES = "a transcription session has no responses or conversation items: the model never speaks"


class TranscriptionConnection(RealtimeConnection):
    def __init__(self, edge: EdgeSession, dialect: Dialect, model: str, client: EngineClient) -> None:
        super().__init__(edge, dialect, model, served=(), transcription_sessions=True)  # no session.model
        self.client = client
        self.caps = ModelCaps(prompts=False, transcribe=True, transcribe_sessions=True,
                              transcription_models=self.edge.models.of("stt"))
        # Transcription off until an update turns it on (OpenAI's default); no responses to create
        # or interrupt.
        self.turns.set_config(SessionConfig(id=new_id("sess"), model=model, type="transcription",
                                            turn_detection=TurnDetection(create_response=False,
                                                                         interrupt_response=False)))
        self.request: TranscriptionJob | None = None
        refuse = self._refuse_conversation
        self._handlers.update({
            "session.update": self._on_transcription_update,
            "transcription_session.update": self._on_transcription_update,
            "conversation.item.create": refuse, "conversation.item.retrieve": refuse,
            "conversation.item.truncate": refuse, "conversation.item.delete": refuse,
            "response.create": refuse, "response.cancel": refuse, "output_audio_buffer.clear": refuse,
        })

    async def run(self) -> None:
        edge = self.edge
        try:
            self.request = await self.client.submit_transcription(live=True)
        except SttBusy as exc:
            await self.send(self.events.error(f"server full: {exc}", "session_limit_reached", kind="server_error"))
            await edge.outbox.refuse(CLOSE_TRY_AGAIN_LATER, "full", "server full: every transcription row is taken")
            return
        await self.send(self.events.session_created(self.config))
        try:
            await edge.run_duplex(self._follow_transcript(self.request), self._receive_loop())
        finally:
            self.request.cancel()  # frees the row at the pool's next offer

    async def _on_transcription_update(self, event: Event) -> None:
        beta = event.get("type") == "transcription_session.update"
        if self.events.dialect is Dialect.BETA and not beta:
            raise ClientError("this is a transcription session: update it with transcription_session.update",
                              "invalid_value", "type")
        config, refused = apply_session_update(event.get("session"), self.config, self.caps, beta_transcription=beta)
        for exc in refused:
            await self.error(exc)
        self.turns.set_config(config)
        await self.send(self.events.session_updated(config))

    async def _refuse_conversation(self, event: Event) -> None:
        raise ClientError(f"{event.get('type')}: {NO_RESPONSES}", "unsupported_parameter", "type")

    def _hear(self, pcm: np.ndarray) -> None:
        """Input audio goes to the STT row as it arrives (the row steps when a frame is whole)."""
        if not pcm.size or self.request is None:
            return
        try:
            self.request.feed(pcm)
        except SttInputError as exc:
            raise ClientError(str(exc), "invalid_value", "audio") from None

    async def _follow_transcript(self, request: TranscriptionJob) -> None:
        """Transcript pieces and end-of-turn probabilities to Turns, until the row ends."""
        async for event in request.events:
            if isinstance(event, Terminal):
                if event.status is Status.FAILED:
                    await self.send_all(self.turns.transcript_failed(event.reason))
                    await self.send(self.events.error(f"transcription failed: {event.reason}", "session_failed",
                                                      kind="server_error"))
                elif event.status is Status.CANCELLED and not request.cancelled:  # the server is stopping
                    await self.send(self.events.error(f"transcription ended: {event.reason}",
                                                      "server_shutting_down", kind="server_error"))
                    await self.edge.outbox.close_socket(CLOSE_GOING_AWAY, event.reason)
                log.info("realtime transcription session %d ended: %s", self.edge.number, event.status.value)
                return
            if await self.send_all(self.turns.transcript(event.text, event.end_of_turn)):
                self.edge.counters.transcript_sent("standalone", event.input_at)
