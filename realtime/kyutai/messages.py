"""moshi-server's WebSocket messages: one msgpack map per binary frame, tagged by `type`.

Kyutai's Rust server (kyutai-labs/moshi, `rust/moshi-server/src/asr.rs`, `tts.rs`, `py_module.rs`)
writes serde enums with `tag = "type"` through rmp-serde as maps. This module keeps its shapes:
- Out: exactly moshi-server's variants and field names. Its f32 fields (audio samples, `prs`) go out
  as msgpack float32 and its f64 fields (times) as float64, as rmp-serde writes them; a message
  holds only one kind, so each is packed with one setting.
- In: one msgpack map with a known `type` and exactly that variant's fields, of the right kinds;
  anything else is a `ProtocolError` naming what is wrong, answered on its own connection.
  (serde would drop an unknown field silently; a field Parley does not read is refused instead.)
- `pcm` arrives as float samples (24 kHz mono); `data` (Ogg pages) as msgpack bin, or as an array
  of byte values, the two forms rmp-serde reads into a `Vec<u8>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np

MAX_MARKER_ID = 2 ** 63 - 1  # Marker.id is an i64


class ProtocolError(ValueError):
    """A frame that is not one of the door's input messages."""


# ---- out ----

def _pack(message: dict, single_float: bool = False) -> bytes:
    return msgpack.packb(message, use_bin_type=True, use_single_float=single_float)


def ready() -> bytes:
    return _pack({"type": "Ready"})


def error(message: str) -> bytes:
    return _pack({"type": "Error", "message": message})


def word(text: str, start_time: float) -> bytes:
    return _pack({"type": "Word", "text": text, "start_time": float(start_time)})


def end_word(stop_time: float) -> bytes:
    return _pack({"type": "EndWord", "stop_time": float(stop_time)})


def marker(marker_id: int) -> bytes:
    return _pack({"type": "Marker", "id": marker_id})


def step(step_idx: int, prs: Sequence[float], buffered_pcm: int) -> bytes:
    return _pack({"type": "Step", "step_idx": step_idx, "prs": [float(p) for p in prs],
                  "buffered_pcm": buffered_pcm}, single_float=True)


def tts_text(text: str, start_s: float, stop_s: float) -> bytes:
    return _pack({"type": "Text", "text": text, "start_s": float(start_s), "stop_s": float(stop_s)})


def audio(pcm: np.ndarray) -> bytes:
    return _pack({"type": "Audio", "pcm": np.asarray(pcm, dtype=np.float32).tolist()}, single_float=True)


def ogg_opus(data: bytes) -> bytes:
    return _pack({"type": "OggOpus", "data": bytes(data)})


# ---- in ----

@dataclass(frozen=True)
class Init:
    pass


@dataclass(frozen=True)
class Marker:
    id: int


@dataclass(frozen=True)
class Audio:
    pcm: np.ndarray  # float32, 1-D


@dataclass(frozen=True)
class OggOpus:
    data: bytes


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Voice:
    embeddings: np.ndarray  # float32, 1-D
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Eos:
    pass


ASR_IN = ("Init", "Marker", "Audio", "OggOpus")
TTS_IN = ("Text", "Voice", "Eos")


def parse(frame: bytes, allowed: tuple[str, ...]) -> Any:
    """One binary frame -> one of the input messages named in `allowed` (ASR_IN or TTS_IN)."""
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for bad bytes; all mean the same here
        raise ProtocolError(f"a binary frame must hold one msgpack map: {type(exc).__name__}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ProtocolError("a message must be a msgpack map with a string `type`")
    kind = raw["type"]
    if kind not in allowed:
        raise ProtocolError(f"unknown message type {kind[:40]!r}; this door takes {', '.join(allowed)}")
    fields = {key: value for key, value in raw.items() if key != "type"}
    expected = _FIELDS[kind]
    missing, unknown = sorted(set(expected) - set(fields)), sorted(map(str, set(fields) - set(expected)))
    if missing or unknown:
        raise ProtocolError(f"{kind} takes the field(s) {', '.join(expected) or 'none'}"
                            + (f"; missing {', '.join(missing)}" if missing else "")
                            + (f"; unknown {', '.join(u[:40] for u in unknown[:5])}" if unknown else ""))
    return _BUILD[kind](fields)


def _floats(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       for v in value):
        raise ProtocolError(f"{name} must be an array of numbers")
    return np.asarray(value, dtype=np.float32)


def _marker(fields: dict) -> Marker:
    value = fields["id"]
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_MARKER_ID:
        raise ProtocolError("Marker.id must be a 64-bit integer")
    return Marker(value)


def _ogg(fields: dict) -> OggOpus:
    value = fields["data"]
    if isinstance(value, (bytes, bytearray)):
        return OggOpus(bytes(value))
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and 0 <= v < 256 for v in value):
        return OggOpus(bytes(value))
    raise ProtocolError("OggOpus.data must be bytes (msgpack bin, or an array of byte values)")


def _text(fields: dict) -> Text:
    if not isinstance(fields["text"], str):
        raise ProtocolError("Text.text must be a string")
    return Text(fields["text"])


def _voice(fields: dict) -> Voice:
    shape = fields["shape"]
    if not isinstance(shape, (list, tuple)) or not all(isinstance(v, int) and v > 0 for v in shape):
        raise ProtocolError("Voice.shape must be an array of positive integers")
    embeddings = _floats(fields["embeddings"], "Voice.embeddings")
    if embeddings.size != int(np.prod(shape)):
        raise ProtocolError(f"Voice.embeddings holds {embeddings.size} values; its shape {list(shape)} needs "
                            f"{int(np.prod(shape))}")
    return Voice(embeddings, tuple(shape))


_FIELDS = {"Init": (), "Marker": ("id",), "Audio": ("pcm",), "OggOpus": ("data",), "Text": ("text",),
           "Voice": ("embeddings", "shape"), "Eos": ()}
_BUILD = {"Init": lambda _: Init(), "Marker": _marker, "Audio": lambda f: Audio(_floats(f["pcm"], "Audio.pcm")),
          "OggOpus": _ogg, "Text": _text, "Voice": _voice, "Eos": lambda _: Eos()}
