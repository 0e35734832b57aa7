"""
Prefaulting fresh receive tensors
=================================

A heal receives into tensors it has just allocated, and fresh memory is paid
for at first touch: the kernel faults in and zeroes every 4 KiB page, about
0.4 s per GB on the development machine, more than the socket copy itself.
Done by the receiving thread, that cost adds to the transfer byte for byte.

:class:`Prefaulter` moves it to a helper thread that walks the tensors in
stream order with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+). That call
maps the pages writable without writing to them, so it never races with the
bytes the receiver has already put there; the receiver, arriving at a page,
finds it ready (or faults it itself when it overtook the helper; either
order is correct). ctypes releases the GIL for the call. Where the call is
missing (older kernels, other systems) the helper does nothing.

The helper stays at most :data:`WINDOW` bytes ahead of what has arrived, and
the receiver allocates tensors only as the window reaches them: a peer that
announces a large state and sends nothing makes the receiver hold no more
than the window beyond what it sent.

Huge pages (``MADV_HUGEPAGE``) were tried first and dropped: with the usual
``defrag=madvise`` setting a fault may compact memory synchronously, and
transfers stalled to a quarter of their speed now and then.

A replica that never committed knows a heal is likely before it knows its
size: it waits for its first quorum, with a core idle, and the heal then
brings its optimizer's state, which it lacks. A :class:`ReceiveReserve`
spends that wait populating memory, as much as the replica's own CPU
tensors hold (the size of one momentum buffer per parameter), and the
receive carves its fresh tensors out of it, each a storage of its own whose
pages are already there. The first touch costs 0.3 to 1 s per GB on the
development machine from one day to the next: up to half of a 100 MB heal's
transfer when half of it is a new optimizer's state. What the receive
leaves is given back to the kernel when it ends; a guess too small leaves
the rest to the prefaulter, as before.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import mmap
import sys
import threading
from typing import Any

import torch

from ftdist.checkpointing import _dtensor
from ftdist.checkpointing._codec import LeafMeta, where
from ftdist.checkpointing._targets import tensors_by_path
from ftdist.errors import CheckpointError

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux 5.14+
# The kernel's page: madvise wants its ranges aligned to it (64 KiB on some
# aarch64 hosts, where a 4 KiB-aligned range is refused).
_PAGE = mmap.PAGESIZE
# Pages are populated this many bytes per call: small enough to stay just
# ahead of the receiver, large enough that calls cost nothing.
_STEP = 8 << 20
# How far ahead of the bytes received memory is allocated and populated.
WINDOW = 64 << 20
# Tensors smaller than this are left to the receiver.
MIN_BYTES = 1 << 20


@functools.cache
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The process's own symbols: ctypes.util.find_library would run
        # ldconfig in a subprocess, on the heal's critical path.
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    # Probe once: a kernel without the advice answers EINVAL.
    probe = torch.empty(2 * _PAGE, dtype=torch.uint8)
    start = -(-probe.data_ptr() // _PAGE) * _PAGE
    if fn(start, _PAGE, _MADV_POPULATE_WRITE) != 0:
        return None
    return fn


class Prefaulter:
    """Populates fresh CPU tensors' pages on a helper thread, in stream order.

    The receiver :meth:`add` s each tensor (in the order its bytes come,
    fresh or not) before reading it, and reports each piece read with
    :meth:`advance`. A context manager; leaving it stops the helper and
    joins it.
    """

    def __init__(self) -> None:
        self._madvise = _madvise()
        self._cond = threading.Condition()
        # (stream offset where the range's bytes end, start address, length)
        self._ranges: collections.deque[tuple[int, int, int]] = collections.deque()
        self._added = 0  # stream bytes of every tensor added
        self._received = 0
        self._stopped = False
        self._thread: threading.Thread | None = None

    @property
    def added(self) -> int:
        """Stream bytes of the tensors added so far."""
        return self._added

    def wants_more(self) -> bool:
        """Whether the window ahead of the bytes received has room for another tensor."""
        return self._added < self._received + WINDOW

    def add(self, t: torch.Tensor, fresh: bool) -> None:
        """The next tensor in stream order; its pages are populated if ``fresh``."""
        nbytes = t.numel() * t.element_size()
        offset = self._added
        self._added += nbytes
        if not fresh or self._madvise is None or t.device.type != "cpu" or nbytes < MIN_BYTES:
            return
        base = t.data_ptr()
        # Whole pages inside the tensor only: a page shared with another
        # allocation is not ours to touch.
        first = -(-base // _PAGE) * _PAGE
        end = (base + nbytes) // _PAGE * _PAGE
        with self._cond:
            for a in range(first, end, _STEP):
                length = min(_STEP, end - a)
                self._ranges.append((offset + (a + length - base), a, length))
            self._cond.notify()
        if self._thread is None and self._ranges:
            self._thread = threading.Thread(target=self._run, name="ftdist-prefault", daemon=True)
            self._thread.start()

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more bytes of the stream arrived."""
        with self._cond:
            self._received += nbytes
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not (
                    self._ranges and self._ranges[0][0] <= self._received + WINDOW
                ):
                    self._cond.wait()
                if self._stopped:
                    return
                _, start, length = self._ranges.popleft()
            if self._madvise(start, length, _MADV_POPULATE_WRITE) != 0:
                return

    def __enter__(self) -> Prefaulter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()


class ReceiveReserve:
    """Memory populated on a helper thread for the fresh tensors of a receive
    that may come.

    :meth:`take` carves a tensor of its own out of it; :meth:`close` stops
    the helper and gives back what nothing took. A context manager.

    Args:
        nbytes: the memory to set aside (rounded up to whole pages).

    Raises:
        ValueError: ``nbytes`` is not a positive int.
        OSError: the memory cannot be mapped (an address-space limit, strict
            overcommit).
    """

    def __init__(self, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"ReceiveReserve(nbytes={nbytes!r}): give a positive number of bytes")
        self._size = -(-nbytes // _PAGE) * _PAGE
        # Private: a shared anonymous mapping would stay shared with any
        # process the trainer forks (data loader workers).
        self._map = mmap.mmap(-1, self._size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(self._map)
        self._base = ctypes.addressof(anchor)
        del anchor  # its export would keep the map from closing
        self._lock = threading.Lock()
        self._next = 0  # the first byte not yet taken
        self._taken = 0
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        fn = _madvise()
        if fn is not None:
            self._thread = threading.Thread(
                target=self._populate, args=(fn,), name="ftdist-reserve", daemon=True
            )
            self._thread.start()

    @classmethod
    def like(cls, state: object, limit: int) -> ReceiveReserve | None:
        """A reserve as large as the CPU tensors of ``state`` (at most ``limit``
        bytes), or None: nothing to reserve, or no way to populate memory here.

        A replica that never stepped lacks its optimizer's state; the common
        optimizers keep one or two tensors per parameter, as large as it.

        Raises:
            OSError: the memory cannot be mapped.
        """
        if not cls.possible(limit):
            return None
        total = 0
        for t in tensors_by_path(state).values():
            if _dtensor.is_dtensor(t):
                t = _dtensor.local_tensor(t)
            nbytes = t.numel() * t.element_size()
            if t.device.type == "cpu" and nbytes >= MIN_BYTES:
                total += -(-nbytes // _PAGE) * _PAGE
        total = min(total, limit)
        return cls(total) if total >= MIN_BYTES else None

    @staticmethod
    def possible(limit: int) -> bool:
        """Whether a reserve of at most ``limit`` bytes can be had and populated here."""
        return limit > 0 and _madvise() is not None

    @property
    def nbytes(self) -> int:
        """The memory set aside."""
        return self._size

    @property
    def taken(self) -> int:
        """Bytes carved out so far."""
        return self._taken

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory was carved out of this reserve."""
        start = t.untyped_storage().data_ptr()
        return self._base <= start < self._base + self._size

    def _populate(self, fn: Any) -> None:
        for start in range(0, self._size, _STEP):
            if self._stop.is_set():
                return
            if fn(self._base + start, min(_STEP, self._size - start), _MADV_POPULATE_WRITE) != 0:
                return

    def stop(self) -> None:
        """Stop populating (the receive has begun: its own helper takes over)."""
        self._stop.set()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A flat uint8 CPU tensor of ``nbytes`` with a storage of its own
        (exactly that size), or None when the rest is too small."""
        if nbytes < MIN_BYTES:
            return None
        with self._lock:
            if self._closed or self._next + nbytes > self._size:
                return None
            start = self._next
            self._next = -(-(start + nbytes) // _PAGE) * _PAGE
            self._taken += nbytes
            view = memoryview(self._map)[start : start + nbytes]
        return torch.frombuffer(view, dtype=torch.uint8)

    def close(self) -> None:
        """Stop the helper and give back every page nothing took."""
        self.stop()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._next == 0:
                    self._map.close()
                elif self._next < self._size:
                    # The carved tensors keep the mapping; its tail's pages go back.
                    self._map.madvise(mmap.MADV_DONTNEED, self._next, self._size - self._next)
            except OSError as exc:  # advice only: the heal it served stands
                logger.info("could not give back an unused receive reserve: %r", exc)

    def __enter__(self) -> ReceiveReserve:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def allocate(
    meta: LeafMeta, device: torch.device, reserve: ReceiveReserve | None = None
) -> torch.Tensor:
    """An uninitialised tensor laid out as ``meta`` says (on the host, carved
    out of ``reserve`` while it has room).

    Raises:
        CheckpointError: the memory cannot be had.
    """
    if reserve is not None and device.type == "cpu":
        flat = reserve.take(meta.nbytes)
        if flat is not None:
            # The strides are dense in some order: the flat bytes hold them exactly.
            return flat.view(meta.dtype).as_strided(meta.shape, meta.stride)
    try:
        t = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)
    except RuntimeError as exc:
        raise CheckpointError(
            f"cannot allocate {meta.nbytes} bytes for {where(meta.path)}: {exc}"
        ) from exc
    return t
