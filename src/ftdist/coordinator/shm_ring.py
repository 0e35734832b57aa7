"""
The shared-memory ring buffer under :class:`~ftdist.coordinator.MessageQueue`
==========================================================================

One writer and ``n_reader`` readers on one host share ``max_chunks`` chunks
of ``max_chunk_bytes`` each. Each chunk has a flag row of ``1 + n_reader``
bytes: ``[written, read_by_0, ..., read_by_{n-1}]``.

Invariants:

- The writer takes chunks in order and only a chunk that is unwritten
  (``written == 0``) or read by every reader; so it never overwrites what a
  reader has not seen, and at most ``max_chunks`` messages are in flight
  (that is the back-pressure).
- Readers take chunks in the same order and read a chunk once
  (``written == 1`` and their own flag 0), then set their own flag.
- The writer publishes a chunk by clearing every reader flag *before*
  setting ``written``; the other order would briefly show a chunk as
  partly read to a reader that polls in between.

A chunk holds one message as frames: a kind byte (inline or overflow), a
frame count, then each frame with its length. The frames come from the
trusted writer of the same job; :func:`read_frames` still checks every
length against the chunk so a torn chunk is an error, not a wild read.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import uuid
from collections.abc import Sequence
from multiprocessing.shared_memory import SharedMemory
from typing import Any

# Chunk kinds (the first byte of a chunk).
INLINE = 0
OVERFLOW = 1

_HEADER = struct.Struct("<BI")  # kind, frame count
_LENGTH = struct.Struct("<Q")

# A lock round trip is a full memory barrier on every platform CPython runs
# on; flags and data are written through plain memoryview stores, which a
# weakly ordered CPU (ARM) could otherwise reorder.
_FENCE = threading.Lock()


def memory_fence() -> None:
    """Order every shared-memory store before it ahead of every one after it."""
    _FENCE.acquire()
    _FENCE.release()


def attach_shm(name: str) -> mmap.mmap:
    """Map the existing POSIX shared-memory segment ``name``, read-write.

    Unlike ``SharedMemory(name)`` on Python < 3.13 this does not register
    the segment with the resource tracker, which belongs to its creator
    (a reader's tracker would unlink it when the reader exits, and one
    tracker shared by several processes would be told twice).

    Raises:
        FileNotFoundError: no such segment on this host.
    """
    import _posixshmem  # the module SharedMemory itself uses

    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


class ShmRingBuffer:
    """A ring of fixed-size chunks in POSIX shared memory, with per-reader flags.

    Args:
        n_reader: readers on this host (at least 1).
        max_chunk_bytes: bytes per chunk; a message whose frames do not fit
            goes through the queue's socket instead (see ``OVERFLOW``).
        max_chunks: chunks in the ring (messages in flight at most).
        name: attach to the writer's segment of this name; None creates a
            new segment (the writer).

    Raises:
        TypeError, ValueError: a size is not a positive int.
        FileNotFoundError: ``name`` does not exist on this host.
        ValueError: the segment named is smaller than the layout needs.
    """

    def __init__(
        self, n_reader: int, max_chunk_bytes: int, max_chunks: int, name: str | None = None
    ) -> None:
        self.n_reader = _check_positive("n_reader", n_reader)
        self.max_chunk_bytes = _check_positive("max_chunk_bytes", max_chunk_bytes)
        self.max_chunks = _check_positive("max_chunks", max_chunks)
        self.metadata_size = 1 + n_reader
        self.total_bytes = (max_chunk_bytes + self.metadata_size) * max_chunks
        self.metadata_offset = max_chunk_bytes * max_chunks
        self.is_creator = name is None
        self._shm: SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        if name is None:
            self._shm = SharedMemory(
                name=f"ftdist_mq_{uuid.uuid4().hex[:16]}", create=True, size=self.total_bytes
            )
            self.name = self._shm.name
            buf = self._shm.buf
            assert buf is not None
        else:
            self._mmap = attach_shm(name)
            self.name = name
            buf = memoryview(self._mmap)
            if len(buf) < self.total_bytes:
                size = len(buf)
                buf.release()
                self._mmap.close()
                raise ValueError(
                    f"shared memory segment {name!r} has {size} bytes, the ring needs "
                    f"{self.total_bytes}; the handle does not match the segment"
                )
        self._buf: memoryview = buf
        if self.is_creator:
            buf[self.metadata_offset : self.total_bytes] = bytes(
                self.total_bytes - self.metadata_offset
            )
        self._unlinked = False

    def handle(self) -> tuple[int, int, int, str]:
        """``(n_reader, max_chunk_bytes, max_chunks, name)``: what a reader attaches with."""
        return (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.name)

    def __reduce__(self) -> tuple[type[ShmRingBuffer], tuple[int, int, int, str]]:
        return (type(self), self.handle())

    # -- views -----------------------------------------------------------------
    def data(self, idx: int) -> memoryview:
        """Chunk ``idx``'s data bytes."""
        start = idx * self.max_chunk_bytes
        return self._buf[start : start + self.max_chunk_bytes]

    def metadata(self, idx: int) -> memoryview:
        """Chunk ``idx``'s flag row ``[written, read_by_0, ...]``."""
        start = self.metadata_offset + idx * self.metadata_size
        return self._buf[start : start + self.metadata_size]

    # -- protocol ----------------------------------------------------------------
    def writable(self, idx: int) -> bool:
        """True when the writer may overwrite chunk ``idx``: unwritten or read by all."""
        meta = self._buf[
            self.metadata_offset + idx * self.metadata_size : self.metadata_offset
            + (idx + 1) * self.metadata_size
        ]
        if meta[0] == 0:
            return True
        return all(meta[1:])

    def unread_by(self, idx: int) -> list[int]:
        """The readers (by local index) that have not read a written chunk ``idx``."""
        meta = self.metadata(idx)
        if meta[0] == 0:
            return []
        return [i for i in range(self.n_reader) if meta[1 + i] == 0]

    def begin_write(self, idx: int) -> None:
        """Take chunk ``idx`` for writing (it must be :meth:`writable`)."""
        self._buf[self.metadata_offset + idx * self.metadata_size] = 0
        memory_fence()

    def publish(self, idx: int) -> None:
        """Make chunk ``idx`` visible to every reader: reader flags first, then ``written``."""
        start = self.metadata_offset + idx * self.metadata_size
        memory_fence()
        self._buf[start + 1 : start + self.metadata_size] = bytes(self.n_reader)
        memory_fence()
        self._buf[start] = 1
        memory_fence()

    def readable(self, idx: int, reader: int) -> bool:
        """True when reader ``reader`` has an unread, written chunk at ``idx``."""
        start = self.metadata_offset + idx * self.metadata_size
        buf = self._buf
        return buf[start] == 1 and buf[start + 1 + reader] == 0

    def mark_read(self, idx: int, reader: int) -> None:
        """Record that ``reader`` is done with chunk ``idx``."""
        memory_fence()
        self._buf[self.metadata_offset + idx * self.metadata_size + 1 + reader] = 1
        memory_fence()

    # -- lifetime ---------------------------------------------------------------
    @property
    def size(self) -> int:
        """Bytes mapped (at least :attr:`total_bytes`; pages may round it up)."""
        return len(self._buf)

    def unlink(self) -> None:
        """Remove the segment's name (creator only); attached mappings stay valid.

        The writer unlinks as soon as every local reader has attached, so a
        crash later cannot leave a segment behind in ``/dev/shm``.
        """
        if self._shm is not None and not self._unlinked:
            self._unlinked = True
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap the segment (and unlink it, if this process created it)."""
        self.unlink()
        try:
            if self._shm is not None:
                self._shm.close()
            else:
                self._buf.release()
                assert self._mmap is not None
                self._mmap.close()
        except BufferError:
            # A view of the data is still alive somewhere (an object being
            # decoded); the mapping goes when it does.
            pass


def frames_size(frames: Sequence[memoryview | bytes]) -> int:
    """Bytes that :func:`write_frames` needs for ``frames``."""
    return _HEADER.size + sum(_LENGTH.size + len(memoryview(f).cast("B")) for f in frames)


def write_frames(chunk: memoryview, frames: Sequence[memoryview | bytes]) -> None:
    """Write ``frames`` inline into ``chunk`` (the caller checked :func:`frames_size`)."""
    _HEADER.pack_into(chunk, 0, INLINE, len(frames))
    pos = _HEADER.size
    for frame in frames:
        view = memoryview(frame).cast("B")
        n = len(view)
        _LENGTH.pack_into(chunk, pos, n)
        pos += _LENGTH.size
        chunk[pos : pos + n] = view
        pos += n


def mark_overflow(chunk: memoryview) -> None:
    """Mark ``chunk`` as a placeholder for a message sent through the socket."""
    _HEADER.pack_into(chunk, 0, OVERFLOW, 0)


def chunk_kind(chunk: memoryview) -> int:
    """``INLINE`` or ``OVERFLOW``.

    Raises:
        ValueError: the kind byte is neither (a torn or foreign chunk).
    """
    kind = chunk[0]
    if kind not in (INLINE, OVERFLOW):
        raise ValueError(f"corrupt message queue chunk: unknown kind byte {kind}")
    return int(kind)


def read_frames(chunk: memoryview, copy_first: bool = True) -> list[Any]:
    """The frames of an inline chunk, copied out of shared memory.

    They are copied because the chunk is reused as soon as it is released,
    and objects unpickled from out-of-band buffers (numpy arrays) would
    otherwise alias it. With ``copy_first=False`` the first frame (the
    pickle) is a view into ``chunk`` instead, for a caller that unpickles it
    and releases the view before it releases the chunk.

    Raises:
        ValueError: a length runs past the chunk.
    """
    size = len(chunk)
    if size < _HEADER.size:
        raise ValueError("corrupt message queue chunk: shorter than its header")
    _kind, count = _HEADER.unpack_from(chunk, 0)
    pos = _HEADER.size
    frames = []
    for i in range(count):
        if pos + _LENGTH.size > size:
            raise ValueError(f"corrupt message queue chunk: frame {i} header past the end")
        (n,) = _LENGTH.unpack_from(chunk, pos)
        pos += _LENGTH.size
        if n > size - pos:
            raise ValueError(f"corrupt message queue chunk: frame {i} of {n} bytes past the end")
        view = chunk[pos : pos + n]
        frames.append(view if i == 0 and not copy_first else bytearray(view))
        pos += n
    return frames


__all__ = [
    "INLINE",
    "OVERFLOW",
    "ShmRingBuffer",
    "attach_shm",
    "chunk_kind",
    "frames_size",
    "mark_overflow",
    "memory_fence",
    "read_frames",
    "write_frames",
]
