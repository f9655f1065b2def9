"""A codec worker process: Ogg-Opus decode/encode for the sessions pinned to it.

Started by `parley.realtime.media.opus.CodecProcessPool` as `python -m parley.realtime.media.codec_worker FD`, where FD is
its end of a Unix socketpair. It imports only numpy, sphn and `media/opus_codec.py` (no torch: it starts in
well under a second) and serves one request at a time, in order, so a session's calls never reorder.

Wire format (little endian), parent -> worker:  op u8, stream u32, req u32, length u32, payload
                                worker -> parent:  status u8, req u32, length u32, payload
ops: DECODE (Ogg bytes -> float32 PCM bytes), ENCODE (1920 float32 samples -> Ogg bytes),
CLOSE (forget the stream; no reply). status: OK, OPUS_ERROR (the input stream is not Ogg-Opus;
the payload says why), ERROR (anything else). The first message is a READY reply (req 0).

The worker exits when the socket reaches EOF: the parent closed it (shutdown) or died (the
kernel closes its fds), so a worker never outlives its server.
"""

from __future__ import annotations

import signal
import socket
import struct
import sys

import numpy as np

from .opus_codec import OpusCodec, OpusError

REQUEST = struct.Struct("<BIII")
REPLY = struct.Struct("<BII")
OP_DECODE, OP_ENCODE, OP_CLOSE = 1, 2, 3
STATUS_OK, STATUS_OPUS_ERROR, STATUS_ERROR, STATUS_READY = 0, 1, 2, 3


def _codec(streams: dict[int, OpusCodec], sid: int) -> OpusCodec:
    if sid not in streams:
        streams[sid] = OpusCodec()
    return streams[sid]


def _read_exact(f, n: int) -> bytes | None:
    data = f.read(n)
    return data if data is not None and len(data) == n else None


def serve(sock: socket.socket) -> None:
    rfile = sock.makefile("rb", buffering=1 << 16)
    streams: dict[int, OpusCodec] = {}
    sock.sendall(REPLY.pack(STATUS_READY, 0, 0))
    while True:
        head = _read_exact(rfile, REQUEST.size)
        if head is None:
            return  # EOF: the server closed the socket or exited
        op, sid, req, n = REQUEST.unpack(head)
        payload = _read_exact(rfile, n) if n else b""
        if payload is None:
            return
        if op == OP_CLOSE:
            streams.pop(sid, None)
            continue
        try:
            if op == OP_DECODE:
                out, status = _codec(streams, sid).decode(payload).tobytes(), STATUS_OK
            elif op == OP_ENCODE:
                out, status = _codec(streams, sid).encode(np.frombuffer(payload, dtype=np.float32)), STATUS_OK
            else:
                out, status = f"unknown codec op {op}".encode(), STATUS_ERROR
        except OpusError as err:  # the bytes are not a valid Ogg-Opus stream
            out, status = str(err).encode(), STATUS_OPUS_ERROR
        except Exception as err:  # noqa: BLE001 - reported to the session, the worker goes on
            out, status = f"{type(err).__name__}: {err}".encode(), STATUS_ERROR
        sock.sendall(REPLY.pack(status, req, len(out)) + out)


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group: the server shuts its workers down itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    sock.setblocking(True)
    try:
        serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
