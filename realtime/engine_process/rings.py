"""Byte rings in shared memory: how audio crosses between an edge worker and the engine process.

One ring has one writer process and one reader process (single producer, single consumer), so
neither takes a lock. Rules this module keeps:
1. The segment holds two counters and the data: the bytes ever written and the bytes ever read,
   each alone on its cache line, then `capacity` bytes used as a circle. The writer alone moves
   the first, the reader alone the second. A record is its length (u32) then its bytes; a record
   that does not fit before the end of the circle starts at its beginning, after a wrap mark.
2. The writer stores the record's bytes before it moves its counter, and the reader reads them
   before it moves its own: on x86 stores are seen in the order they were made, so a reader never
   sees a counter ahead of the bytes it covers.
3. A full ring refuses the write (`write` returns False) rather than wait: the caller decides
   what a refused record costs (an audio frame is dropped and counted; see engine_process/core.py).
4. The segment's name lives only until the other side has attached: `attach` removes the name at
   once (POSIX shared memory stays mapped until both sides close it), so a process that dies,
   either one, leaves nothing behind. A creator whose peer never attached removes it itself.
"""

from __future__ import annotations

import struct
from multiprocessing import shared_memory

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_WRITTEN, _READ, _DATA = 0, 64, 128  # each counter on its own cache line
_WRAP = 0xFFFFFFFF  # a length that marks "the rest of the circle is unused; go to its start"


class ByteRing:
    """One shared-memory ring of records (module docstring). `create` on one side, `attach` on the other."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self._shm = shm
        self._buf = shm.buf
        self.capacity = len(shm.buf) - _DATA
        self.owner = owner

    @classmethod
    def create(cls, capacity: int) -> "ByteRing":
        shm = shared_memory.SharedMemory(create=True, size=_DATA + capacity)
        shm.buf[:_DATA] = bytes(_DATA)
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "ByteRing":
        shm = shared_memory.SharedMemory(name=name)
        shm.unlink()  # rule 4 (it also ends the resource tracker's record of the name)
        return cls(shm, owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    def _counter(self, at: int) -> int:
        return _U64.unpack_from(self._buf, at)[0]

    def used(self) -> int:
        """Bytes written and not yet read (wrap marks included)."""
        return self._counter(_WRITTEN) - self._counter(_READ)

    def write(self, *parts: bytes | memoryview) -> bool:
        """Append one record made of `parts`, or return False (nothing written) when it does not fit."""
        size = sum(len(p) for p in parts)
        written, read = self._counter(_WRITTEN), self._counter(_READ)
        at = written % self.capacity
        skip = 0 if self.capacity - at >= 4 + size else self.capacity - at  # to the circle's start (rule 1)
        if 4 + size + skip > self.capacity - (written - read):
            return False
        if skip:
            if skip >= 4:
                _U32.pack_into(self._buf, _DATA + at, _WRAP)
            at = 0
        _U32.pack_into(self._buf, _DATA + at, size)
        at += 4
        for part in parts:
            self._buf[_DATA + at:_DATA + at + len(part)] = part
            at += len(part)
        _U64.pack_into(self._buf, _WRITTEN, written + skip + 4 + size)  # last (rule 2)
        return True

    def read(self) -> bytes | None:
        """The oldest record (a copy), or None when the ring is empty."""
        written, read = self._counter(_WRITTEN), self._counter(_READ)
        if read == written:
            return None
        at = read % self.capacity
        left = self.capacity - at
        if left < 4 or _U32.unpack_from(self._buf, _DATA + at)[0] == _WRAP:
            read += left
            at = 0
        size = _U32.unpack_from(self._buf, _DATA + at)[0]
        record = bytes(self._buf[_DATA + at + 4:_DATA + at + 4 + size])
        _U64.pack_into(self._buf, _READ, read + 4 + size)
        return record

    def close(self, unlink: bool = False) -> None:
        """Detach; `unlink`: the creator's peer never attached, so remove the name too (rule 4)."""
        self._buf = None  # type: ignore[assignment]  # the memoryview must go before the mapping closes
        self._shm.close()
        if unlink:
            self._shm.unlink()
