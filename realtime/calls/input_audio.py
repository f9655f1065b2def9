"""Input audio as both OpenAI doors receive it: an append event's base64 audio decoded in the
session's format (a bad one is the client's `error`), or a WebRTC call's microphone track.
"""

from __future__ import annotations

import base64
import binascii
from typing import Awaitable, Callable, TypeVar

import numpy as np

from ..media.audio_formats import FormatError
from .event_reader import Event
from ..realtime_api.settings import ClientError
from .transport import Media

T = TypeVar("T")


def appended_audio(event: Event, decode: Callable[[bytes], T], fmt: str = "input format") -> T:
    """An append event's `audio` decoded by `decode` (the session's input format, `fmt` in the
    error); ClientError if it has none, is not base64, or is not the format's."""
    audio = event.get("audio")
    if not isinstance(audio, str):
        raise ClientError(f"{event['type']} needs 'audio': base64 audio in the session's {fmt}",
                          "missing_required_parameter", "audio")
    try:
        data = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise ClientError("audio is not valid base64", "invalid_value", "audio") from None
    try:  # apart from the base64: FormatError is a ValueError, and its message says what is wrong
        return decode(data)
    except FormatError as exc:
        raise ClientError(str(exc), "invalid_value", "audio") from None


async def hear_track(media: Media, hear: Callable[[np.ndarray], Awaitable[None]]) -> None:
    """A WebRTC call's microphone track, each chunk to `hear` (as an append's audio is), until it ends."""
    while (pcm := await media.read()) is not None:
        await hear(pcm)
