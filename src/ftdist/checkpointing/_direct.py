"""
Direct reads of a source's memory
=================================

A receiver on the same host as its source copies the tensor bytes straight
out of the source process with ``process_vm_readv`` (Linux's cross-memory
attach). That is one copy, made by the kernel on the receiver's CPU. The
local socket costs two, one of them on the source, whose training is what
the host needs its cores for during a heal. On this project's 2-core
machine a 100 MB heal stream took 25 ms of the source's CPU over the socket
and takes about 6 ms (its checksums) this way.

It rides on the local-socket HTTP exchange (:mod:`._http_server`)::

    request:   GET /checkpoint/{step}/{key} with  X-Ftdist-Direct: 1
    answer:    200 with  X-Ftdist-Direct: <the source's pid>  and no length
    body:      prefix | header | manifest | <waits for the receiver> | rest
    manifest:  count u64 | (address u64, length u64) per carried tensor
    receiver:  b"S": it may not read that memory; the rest is the tensor
                     bytes and the trailer, as in a plain stream
               b"G": it may (one byte was copied); then b"+" per 64 MiB
                     copied, each within the socket timeout, and b"M" when
                     every tensor is copied; the rest is the trailer

Who may read is the kernel's decision, by ptrace's rules: the same user and
a dumpable source, or ``CAP_SYS_PTRACE``. Yama's ``ptrace_scope`` 1 (the
default on Ubuntu) lets a process read only its descendants, and container
profiles may forbid the call. Refused, the receiver answers ``S`` and the
heal streams over the socket at the old speed, with one log line saying why.
The receiver reads only from the pid the kernel names as the socket's peer
(``SO_PEERCRED``), and only when the source names the same pid: a source in
another pid namespace, or a forked copy of the listener, is streamed from.

:class:`~.pg_transport.PGTransport` copies the same way, its offer and
answers being messages on the process group (see there).

The source holds its state's read lock until it has the verdict, so the
state cannot change under the copy. Each side sums what it holds (the
source its memory, the receiver what it copied) and the trailer compares
them, as for a stream: a state that changed mid-copy, or a manifest that
lied, is an error, never a silently wrong model.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import struct
import sys
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ftdist.checkpointing._checksum import SumBehind, WordSum, digest_of
from ftdist.checkpointing._http_server import peer_credentials
from ftdist.checkpointing._wire import PIECE_BYTES, host_view
from ftdist.errors import CheckpointError

logger = logging.getLogger("ftdist.checkpointing.http")

HEADER = "X-Ftdist-Direct"
GO = b"G"
PROGRESS = b"+"
COPIED = b"M"
STREAM = b"S"
# A progress byte per this many bytes copied: the source waits for each
# within its socket timeout, as a stream's writes do, so a large state read
# by a slow receiver does not need the whole copy within one timeout.
PROGRESS_BYTES = 64 << 20
_COUNT = struct.Struct("<Q")
_ENTRY = struct.Struct("<QQ")
# Linux's IOV_MAX: process_vm_readv refuses more iovecs in one call.
_IOV_MAX = 1024
# errno values by which the kernel says "not this process's to read".
_REFUSED = {errno.EPERM, errno.EACCES, errno.ESRCH, errno.ENOSYS}


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _bind() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):  # a libc without it (glibc < 2.15, some musl builds)
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return call


_READV = _bind()


def supported() -> bool:
    """Whether this platform has ``process_vm_readv`` (Linux with a libc that binds it)."""
    return _READV is not None


def read_memory(pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy ``nbytes`` at address ``remote`` of process ``pid`` to ``local`` in this one.

    Raises:
        OSError: the kernel refused or failed (its errno: EPERM or ESRCH
            when this process may not read ``pid``, EFAULT for an address
            outside its memory).
    """
    if _READV is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available here")
    mine, theirs = _IoVec(), _IoVec()
    done = 0
    while done < nbytes:
        mine.iov_base, mine.iov_len = local + done, nbytes - done
        theirs.iov_base, theirs.iov_len = remote + done, nbytes - done
        # ctypes releases the GIL around the call: training threads run on.
        got = _READV(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid} copied nothing")
        done += got


def read_memory_many(pid: int, spans: list[tuple[int, int, int]]) -> None:
    """Copy each (local address, remote address, length) of ``spans`` from
    process ``pid`` into this one, in one system call when the kernel takes
    them all (at most ``IOV_MAX``, 1024 on Linux, per call).

    Raises:
        OSError: as :func:`read_memory`.
    """
    if _READV is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available here")
    todo = [span for span in spans if span[2]]
    while todo:
        count = min(len(todo), _IOV_MAX)
        mine, theirs = (_IoVec * count)(), (_IoVec * count)()
        for i, (local, remote, nbytes) in enumerate(todo[:count]):
            mine[i].iov_base, mine[i].iov_len = local, nbytes
            theirs[i].iov_base, theirs[i].iov_len = remote, nbytes
        got = _READV(pid, mine, count, theirs, count, 0)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid} copied nothing")
        # A short copy stops at an iovec's edge (the kernel does not split
        # one, but a later kernel might): go on from the first byte missing.
        rest = []
        for local, remote, nbytes in todo[:count]:
            if got >= nbytes:
                got -= nbytes
                continue
            rest.append((local + got, remote + got, nbytes - got))
            got = 0
        todo = rest + todo[count:]


IDENTITY_BYTES = 16 + _COUNT.size
"""The length of :func:`host_identity`'s answer."""


def host_identity() -> bytes | None:
    """What two processes share when one may name the other by pid: the
    kernel's boot id and the pid namespace (None where /proc cannot tell).

    A process group, unlike the local socket, names no peer process: its
    peers compare this before they take a pid from each other.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = uuid.UUID(f.read().strip()).bytes
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except (OSError, ValueError):
        return None
    return boot + _COUNT.pack(namespace)


def manifest(flats: list[torch.Tensor]) -> bytes:
    """Where the source's carried tensors live: count, then (address, length) each."""
    entries = [_ENTRY.pack(f.data_ptr(), f.numel()) for f in flats]
    return _COUNT.pack(len(entries)) + b"".join(entries)


def manifest_bytes(count: int) -> int:
    """The length of :func:`manifest`'s answer for ``count`` tensors."""
    return _COUNT.size + count * _ENTRY.size


def parse_manifest(
    read: Callable[[int], bytes], lengths: list[int], what: str
) -> list[tuple[int, int]]:
    """Read a manifest with ``read(n)`` and check it against the header's lengths.

    Raises:
        CheckpointError: it names another number of tensors or other lengths.
    """
    (count,) = _COUNT.unpack(read(_COUNT.size))
    if count != len(lengths):
        raise CheckpointError(
            f"{what} offered {count} tensors to read directly, its header carries {len(lengths)}"
        )
    entries = [_ENTRY.unpack(read(_ENTRY.size)) for _ in range(count)]
    for (_, length), want in zip(entries, lengths, strict=True):
        if length != want:
            raise CheckpointError(
                f"{what} offered a tensor of {length} bytes to read directly, its header "
                f"describes {want}"
            )
    return entries


def source_digest(flats: list[torch.Tensor]) -> WordSum:
    """The word sums a stream of these tensors' bytes (1-D uint8, CPU) would end with."""
    return digest_of(host_view(flat) for flat in flats)


def same_user(sock: socket.socket) -> bool:
    """Whether the peer of a Unix socket runs as this process's user (``SO_PEERCRED``)."""
    try:
        return peer_credentials(sock)[1] == os.getuid()
    except OSError:
        return False


def wait_copied(sock: socket.socket) -> None:
    """The source's side: wait for the receiver's progress bytes, then its ``M``.

    Raises:
        OSError: the receiver went quiet past the socket timeout, hung up,
            or sent something else.
    """
    while True:
        byte = sock.recv(1)
        if byte == COPIED:
            return
        if byte != PROGRESS:
            raise ConnectionAbortedError(f"the peer sent {byte!r} during a direct read")


_warned: set[int] = set()


def refused(exc: OSError) -> bool:
    """Whether ``exc`` means this process may not read the source (so: stream instead)."""
    if exc.errno not in _REFUSED:
        return False
    if exc.errno not in _warned:
        _warned.add(exc.errno)
        logger.info(
            "the kernel does not let this process read a checkpoint source's memory (%s); "
            "heals from peers on this host stream over the local socket instead. Same user "
            "and Yama ptrace_scope 0, or CAP_SYS_PTRACE, allow the faster direct read "
            "(docs/checkpointing.md)",
            exc,
        )
    return True


class Tally(Protocol):
    """What a direct copy reports its bytes to: the stream's reader, or a
    process-group receiver's sums."""

    what: str

    def absorb(self, piece: memoryview) -> None:
        """Sum and count bytes that were copied."""

    def end_tensor(self) -> None:
        """One tensor's bytes are all in."""


class CopySums:
    """A :class:`Tally` of its own, for a receiver that reads no stream (the
    process-group transport): summed on a helper thread while the kernel
    copies the next piece. Close :attr:`digest` when done.

    Args:
        what: the source, for messages.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.digest = SumBehind(record=True)
        self.total = 0

    def absorb(self, piece: memoryview) -> None:
        """Sum and count bytes that were copied."""
        self.digest.update(piece)
        self.total += len(piece)

    def end_tensor(self) -> None:
        """One tensor's bytes are all in."""
        self.digest.end_segment()


class DirectBody:
    """The receiver's side: copies each carried tensor out of the source's memory.

    Args:
        pid: the source's pid (checked against the socket's peer).
        entries: the manifest, in stream order.
        reader: the stream, which sums and counts each copied piece and
            reads the trailer after.
        send: sends the receiver's one-byte messages (``G``/``S``, ``+``,
            ``M``) to the source.
    """

    def __init__(
        self,
        pid: int,
        entries: list[tuple[int, int]],
        reader: Tally,
        send: Callable[[bytes], None],
    ) -> None:
        self._pid = pid
        self._entries = entries
        self._reader = reader
        self._send = send
        self._since = 0  # bytes copied since the last progress byte

    def start(self, addressable: bool) -> bool:
        """Tell the source whether this receiver copies (``G``) or wants the stream (``S``).

        Args:
            addressable: whether the source named the socket peer's pid.

        Raises:
            CheckpointError: the probe failed for another reason than permission.
            OSError: the source is gone.
        """
        go = addressable and self._probe()
        self._send(GO if go else STREAM)
        return go

    def _probe(self) -> bool:
        first = next(((addr, n) for addr, n in self._entries if n), None)
        if first is None:
            return True
        scratch = ctypes.create_string_buffer(1)
        try:
            read_memory(self._pid, ctypes.addressof(scratch), first[0], 1)
        except OSError as exc:
            if refused(exc):
                return False
            raise CheckpointError(f"reading {self._reader.what}'s memory failed: {exc}") from exc
        return True

    def fill(self, batch: list[tuple[int, torch.Tensor]], progress: Callable[[int], None]) -> None:
        """Copy carried tensors, (position, 1-D uint8 CPU tensor) each: one
        in pieces, or a batch of small ones in one system call.

        Raises:
            CheckpointError: the kernel's copy failed.
        """
        if len(batch) == 1:
            self._fill_one(*batch[0], progress)
            return
        spans = [(flat.data_ptr(), self._entries[pos][0], flat.numel()) for pos, flat in batch]
        try:
            read_memory_many(self._pid, spans)
        except OSError as exc:
            raise CheckpointError(
                f"reading {self._reader.what}'s memory failed in a batch of "
                f"{len(batch)} tensors: {exc}"
            ) from exc
        nbytes = 0
        for _, flat in batch:
            if flat.numel():
                self._reader.absorb(host_view(flat))
            self._reader.end_tensor()
            nbytes += flat.numel()
        progress(nbytes)
        self._copied(nbytes)

    def _fill_one(self, position: int, flat: torch.Tensor, progress: Callable[[int], None]) -> None:
        remote = self._entries[position][0]
        if flat.numel():
            view = host_view(flat)
            base = flat.data_ptr()
            for start in range(0, len(view), PIECE_BYTES):
                piece = view[start : start + PIECE_BYTES]
                try:
                    read_memory(self._pid, base + start, remote + start, len(piece))
                except OSError as exc:
                    raise CheckpointError(
                        f"reading {self._reader.what}'s memory failed after {start} bytes of "
                        f"a tensor: {exc}"
                    ) from exc
                self._reader.absorb(piece)
                progress(len(piece))
                self._copied(len(piece))
        self._reader.end_tensor()

    def _copied(self, nbytes: int) -> None:
        self._since += nbytes
        if self._since >= PROGRESS_BYTES:
            self._since = 0
            self._send(PROGRESS)

    def finish(self) -> None:
        """Tell the source every tensor is copied (it then sends the trailer).

        Raises:
            OSError: the connection is gone.
        """
        self._send(COPIED)
