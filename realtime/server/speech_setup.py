"""Load what `POST /v1/audio/speech` serves: the TTS checkpoint, its voice set, the engine's
text front end over them (engine/speech.py) and the pool.

    service = load_speech_service(source, slots=4, voices="kyutai/tts-voices", voice_map=None,
                                  device="cuda", dtype=torch.bfloat16)
    register_slack_source(engine, service.pool)   # realtime/server/services.py: warm-up, then add; before engine.start()
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from parley.engine import SpeechFrontEnd, TtsPool
from parley.models import CheckpointError, Mimi, VoiceStore, load_tts_checkpoint, share_equal_tensors

from ..http.speech import SpeechService
from ..http.speech_options import DEFAULT_VOICES

log = logging.getLogger("parley.speech")


def load_speech_service(source: str | Path, *, slots: int, voices: str | Path | None,
                        voice_map: str | Path | None, device: str, dtype: torch.dtype,
                        share_mimi: Mimi | None = None, mimi_dtype: torch.dtype | None = None,
                        read_voices: bool = True) -> SpeechService:
    """`share_mimi`: a loaded codec (the duplex model's); the TTS Mimi's weights equal to it are
    shared, not held twice (Kyutai's TTS ships the duplex model's Mimi file). `read_voices`: read
    every voice now (a server: no request then reads a file); `parley tts` reads the one it uses."""
    checkpoint = load_tts_checkpoint(source, device, dtype, mimi_dtype)
    if share_mimi is not None and (shared := share_equal_tensors(checkpoint.mimi, share_mimi)):
        log.info("the TTS model's Mimi shares %.0f MB of weights with the duplex model's", shared / 1e6)
    cfg = checkpoint.config
    speaker = cfg.speaker
    if speaker is None:
        raise CheckpointError(f"TTS checkpoint {source} has no speaker cross-attention (a voice-prefix model "
                              "such as kyutai/tts-0.75b-en-public); Parley serves the cross-attention layout")
    store = VoiceStore.open(voices or DEFAULT_VOICES, cfg.voice_suffix, speaker.dim, voice_map)
    # every voice read now (read_voices): no request reads a file, and a broken one stops the start
    front_end = SpeechFrontEnd.for_checkpoint(checkpoint, store, read_voices=read_voices)
    frames = store.load(store.names()[0]).shape[-1]
    # warm admissions carry the requests' conditions (warmed where the pool is registered)
    pool = TtsPool(checkpoint.lm, checkpoint.mimi, slots, voice_frames=frames, warm_conditions=front_end.conditions)
    log.info("TTS %s: %d slots, %d voices from %s", checkpoint.path.name, slots, len(store.names()),
             store.directory)
    return SpeechService(pool=pool, front_end=front_end, codebooks=cfg.lm.n_q, model=checkpoint.path.name)
