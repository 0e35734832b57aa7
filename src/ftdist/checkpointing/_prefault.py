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
"""

from __future__ import annotations

import collections
import ctypes
import functools
import sys
import threading
from typing import Any

import torch

_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE = 4096
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
