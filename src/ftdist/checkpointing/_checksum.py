"""
Word-sum checksums
==================

The check on every byte a heal moves, and the fingerprints replicas compare.

Why not CRC-32: zlib's ``crc32`` (zlib 1.2, a byte-serial table walk) runs
at 1-2 GB/s on a core, and both ends of a heal pass every byte through it; it
capped transfers below what the socket carries and took tens of milliseconds
of every heal's load phase (the consistency fingerprint) for a 100 MB state.
The sums here are numpy reductions over 64-bit words, a few passes at cache
speed (about 18 GB/s on one core of the 2-core machine), and release the GIL
while they run.

Definition. The data is a sequence of *segments* (a tensor's bytes, a
header), each zero-padded to a whole number of little-endian 64-bit words;
``w_k`` is the ``k``-th word of the concatenation (``k`` from 0). The digest
is the pair, modulo ``2**64``::

    s1 = sum(w_k)            s2 = sum((k + 1) * w_k)

Any error confined to one word changes ``s1``; a word moved to another
position, a lost or repeated piece and a shifted segment change ``s2`` (each
word is weighted by its position). Like a CRC, it detects accidents, not
forgery (docs/checkpointing.md). Feeding a segment in pieces gives the same
digest as feeding it whole, whatever the split.
"""

from __future__ import annotations

import queue
import struct
import threading
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

MASK = (1 << 64) - 1
WORD = 8
# Words are summed in rows of this many: row sums carry the row's position,
# column sums the position inside the row, so no weight vector as long as the
# data is ever built. The width changes the speed, never the digest: numpy
# reduces 8 KiB rows (either axis) about three times as fast as 512-byte ones,
# which made the whole sum 1.8x faster (10 -> 18 GB/s on the 2-core machine).
_ROW = 1024
_COLUMN_WEIGHTS = np.arange(_ROW, dtype=np.uint64)
# Both sums read a block that is still in the core's cache after the first:
# blocks of 1-4 MiB ran at twice the speed of 16 MiB ones (two passes over DRAM).
_BLOCK_WORDS = 256 * 1024
_WORDS = np.dtype("<u8")
# Pieces of up to this many words take one dot product with a precomputed
# weight vector instead: two numpy calls where the rows take seven, whose
# fixed cost outweighed the summing on small tensors (a state of 3000 16 KiB
# tensors spent 20 us per tensor in _weighted, 8 us this way). At 64 KiB the
# dot product still wins (15 against 22 us), at 256 KiB the rows (35 against 42).
_SMALL_WORDS = 8192
_SMALL_WEIGHTS = np.arange(1, _SMALL_WORDS + 1, dtype=np.uint64)
# Updates of at most this many bytes (with the carry) are summed with Python
# ints: a tensor's header or a learning rate's repr, by the thousand in a
# large model's fingerprint, where numpy's per-call cost was most of it.
_TINY_BYTES = 64
_TINY_WORDS = [struct.Struct(f"<{n}Q") for n in range(_TINY_BYTES // WORD + 1)]


def _weighted(words: Any, base: int) -> tuple[int, int]:
    """``(sum w_j, sum (base + j + 1) w_j)`` mod 2**64 for a uint64 array."""
    n = len(words)
    rows = n // _ROW
    s1 = s2 = 0
    if rows:
        block = words[: rows * _ROW].reshape(rows, _ROW)
        row_sums = block.sum(axis=1, dtype=np.uint64)
        col_sums = block.sum(axis=0, dtype=np.uint64)
        total = int(row_sums.sum(dtype=np.uint64))
        by_row = int(row_sums @ np.arange(rows, dtype=np.uint64))
        by_col = int(col_sums @ _COLUMN_WEIGHTS)
        s1 = total
        s2 = (base + 1) * total + _ROW * by_row + by_col
    if n > rows * _ROW:
        rest = words[rows * _ROW :]
        start = base + rows * _ROW + 1
        weights = np.arange(start, start + len(rest), dtype=np.uint64)
        s1 += int(rest.sum(dtype=np.uint64))
        s2 += int(rest @ weights)
    return s1 & MASK, s2 & MASK


class SegmentSum(NamedTuple):
    """The sums of a run of whole segments on their own (counted from word 0).

    Sums compose: a run of ``words`` words placed after ``b`` others adds
    ``s1`` to the first sum and ``s2 + b * s1`` to the second, so a digest
    can be assembled from runs summed elsewhere (:meth:`WordSum.add`).
    """

    s1: int
    s2: int
    words: int


def own_sums(data: bytes | bytearray | memoryview) -> SegmentSum:
    """One whole segment's own sums: what a fresh :class:`WordSum` fed it and
    closed gives as :meth:`~WordSum.total`, with fewer calls (a deep model's
    fingerprint takes this per tensor, thousands of times).
    """
    view = memoryview(data).cast("B")
    n = len(view) // WORD
    if n > _SMALL_WORDS:
        digest = WordSum()
        digest.update(view)
        return digest.total()
    words = np.frombuffer(view, dtype=_WORDS, count=n)
    s1 = int(words.sum(dtype=np.uint64))
    s2 = int(words @ _SMALL_WEIGHTS[:n])
    if len(view) > n * WORD:  # the last word, zero-padded
        last = int.from_bytes(view[n * WORD :], "little")
        n += 1
        s1 += last
        s2 += n * last
    return SegmentSum(s1 & MASK, s2 & MASK, n)


# Segments of the same size, a multiple of this many bytes (whole rows), can
# be summed side by side (same_size_sums).
STACK_UNIT = _ROW * WORD


def same_size_sums(data: bytes | bytearray | memoryview, size: int) -> list[SegmentSum]:
    """The own sums of segments of ``size`` bytes (a multiple of
    :data:`STACK_UNIT`) lying back to back in ``data``: row and column sums
    of all of them at once, a few numpy calls for the lot, where a model's
    many equal weights each took two calls and a slow integer dot product.

    Raises:
        ValueError: ``size`` is not a positive multiple of :data:`STACK_UNIT`,
            or ``data`` is not whole segments of it.
    """
    view = memoryview(data).cast("B")
    if size <= 0 or size % STACK_UNIT or len(view) % size:
        raise ValueError(
            f"same_size_sums needs segments of a positive multiple of {STACK_UNIT} bytes "
            f"filling the data; got segments of {size} in {len(view)} bytes"
        )
    count, rows = len(view) // size, size // STACK_UNIT
    words = np.frombuffer(view, dtype=_WORDS).reshape(count, rows, _ROW)
    row_sums = words.sum(axis=2, dtype=np.uint64)
    col_sums = words.sum(axis=1, dtype=np.uint64)
    s1 = row_sums.sum(axis=1, dtype=np.uint64)
    # As _weighted with base 0 (uint64 arithmetic wraps, as the sums are defined).
    s2 = s1 + np.uint64(_ROW) * (row_sums @ np.arange(rows, dtype=np.uint64))
    s2 += col_sums @ _COLUMN_WEIGHTS
    n = size // WORD
    return [SegmentSum(int(a), int(b), n) for a, b in zip(s1, s2, strict=True)]


# digest_of joins segments below this size (each zero-padded to a whole word)
# into runs of up to _RUN_BYTES and folds each run at once: one copy and a few
# numpy calls per run where summing each segment took two or more, each of
# which lets go of the GIL; a source serving thousands of small tensors while
# its training thread runs waited for the GIL again after every one.
_DIGEST_JOIN_BELOW = 128 << 10
_RUN_BYTES = 4 << 20


def digest_of(segments: Iterable[bytes | bytearray | memoryview]) -> WordSum:
    """The digest of whole segments (each fed and closed in turn), without
    their own sums: small ones are joined and folded together.
    """
    digest = WordSum()
    run: list[bytes | memoryview] = []
    run_bytes = 0
    for segment in segments:
        view = memoryview(segment).cast("B")
        if len(view) >= _DIGEST_JOIN_BELOW:
            if run:  # what came before goes first: the sums weigh positions
                digest.update(b"".join(run))
                run, run_bytes = [], 0
            digest.update(view)
            digest.end_segment()
            continue
        run.append(view)
        pad = -len(view) % WORD
        if pad:
            run.append(_PADDING[:pad])
        run_bytes += len(view) + pad
        if run_bytes >= _RUN_BYTES:
            # Whole words: one segment of them sums as the padded segments do.
            digest.update(b"".join(run))
            run, run_bytes = [], 0
    if run:
        digest.update(b"".join(run))
    digest.end_segment()
    return digest


_PADDING = bytes(WORD)


class WordSum:
    """An incremental :mod:`word-sum <ftdist.checkpointing._checksum>` digest.

    ``update`` feeds the current segment (in any number of pieces);
    ``end_segment`` pads it to a whole word and starts the next.

    Args:
        record: keep each segment's own sums in :attr:`segments` (a
            receiver reuses a tensor's sums instead of reading it again).
    """

    __slots__ = ("_carry", "_mark", "_s1", "_s2", "_words", "segments")

    def __init__(self, record: bool = False) -> None:
        self._words = 0
        self._s1 = 0
        self._s2 = 0
        self._carry = b""
        self._mark = (0, 0, 0)
        self.segments: list[SegmentSum] | None = [] if record else None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Feed more bytes of the current segment (a contiguous buffer)."""
        view = memoryview(data).cast("B")
        if not len(view):
            return
        if len(view) + len(self._carry) <= _TINY_BYTES:
            raw = self._carry + bytes(view)
            whole = len(raw) // WORD
            if whole:
                self._fold_tiny(_TINY_WORDS[whole].unpack_from(raw))
            self._carry = raw[whole * WORD :]
            return
        if self._carry:
            need = WORD - len(self._carry)
            self._carry += bytes(view[:need])
            view = view[need:]
            if len(self._carry) < WORD:
                return
            self._fold(np.frombuffer(self._carry, dtype=_WORDS))
            self._carry = b""
        whole = len(view) // WORD
        if whole:
            self._fold(np.frombuffer(view, dtype=_WORDS, count=whole))
        if len(view) > whole * WORD:
            self._carry = bytes(view[whole * WORD :])

    def update_segments(self, pieces: Sequence[bytes | bytearray | memoryview]) -> None:
        """Feed whole segments, each as :meth:`update` then :meth:`end_segment` would.

        Many small segments (a model's small tensors) are joined and summed
        together, with each one's own sums split out with ``reduceat``: a few
        numpy calls for the lot instead of several per segment.
        """
        views = [memoryview(p).cast("B") for p in pieces]
        if len(views) < 2 or not self._joinable(len(v) for v in views):
            for view in views:
                self.update(view)
                self.end_segment()
            return
        self._fold_joined(b"".join(views), [len(v) for v in views])

    def update_joined(self, data: bytes | bytearray | memoryview, lengths: Sequence[int]) -> None:
        """Feed whole segments that lie back to back in ``data``, of ``lengths`` bytes
        (which add up to its length), as :meth:`update_segments` would feed them apart.

        Raises:
            ValueError: the lengths do not add up to the data's.
        """
        view = memoryview(data).cast("B")
        if sum(lengths) != len(view):
            raise ValueError(
                f"segments of {sum(lengths)} bytes in all given with {len(view)} bytes of data"
            )
        if len(lengths) > 1 and self._joinable(lengths):
            self._fold_joined(view, list(lengths))
            return
        offset = 0
        for n in lengths:
            self.update(view[offset : offset + n])
            self.end_segment()
            offset += n

    def _joinable(self, lengths: Iterable[int]) -> bool:
        # Whole words only, from a segment boundary: then the joined words'
        # positions are the segments' own.
        at_boundary = not self._carry and self._mark == (self._words, self._s1, self._s2)
        return at_boundary and not any(n % WORD for n in lengths)

    def _fold_joined(self, data: bytes | memoryview, lengths: list[int]) -> None:
        joined = np.frombuffer(data, dtype=_WORDS)
        self._fold(joined)
        if self.segments is not None:
            words = [n // WORD for n in lengths]
            starts = np.cumsum([0, *words[:-1]], dtype=np.int64)
            filled = [i for i, n in enumerate(words) if n]
            runs = {}
            if filled:
                at = starts[filled]
                s1s = np.add.reduceat(joined, at)
                # sum((start + j + 1) * w_j) over each segment, less start * s1:
                # each segment's own weighted sum (uint64 arithmetic wraps).
                weighted = joined * np.arange(1, len(joined) + 1, dtype=np.uint64)
                s2s = np.add.reduceat(weighted, at) - at.astype(np.uint64) * s1s
                runs = {
                    i: SegmentSum(int(a), int(b), words[i])
                    for i, a, b in zip(filled, s1s, s2s, strict=True)
                }
            empty = SegmentSum(0, 0, 0)
            self.segments.extend(runs.get(i, empty) for i in range(len(words)))
        self._mark = (self._words, self._s1, self._s2)

    def _fold_tiny(self, words: tuple[int, ...]) -> None:
        s1 = s2 = 0
        for weight, word in enumerate(words, self._words + 1):
            s1 += word
            s2 += weight * word
        self._s1 = (self._s1 + s1) & MASK
        self._s2 = (self._s2 + s2) & MASK
        self._words += len(words)

    def _fold(self, words: Any) -> None:
        n = len(words)
        if n <= _SMALL_WORDS:
            # numpy's integer dot wraps modulo 2**64, as the sums are defined.
            s1 = int(words.sum(dtype=np.uint64))
            s2 = int(words @ _SMALL_WEIGHTS[:n]) + self._words * s1
            self._s1 = (self._s1 + s1) & MASK
            self._s2 = (self._s2 + s2) & MASK
            self._words += n
            return
        for start in range(0, len(words), _BLOCK_WORDS):
            block = words[start : start + _BLOCK_WORDS]
            s1, s2 = _weighted(block, self._words)
            self._s1 = (self._s1 + s1) & MASK
            self._s2 = (self._s2 + s2) & MASK
            self._words += len(block)

    def _pad(self) -> None:
        if self._carry:
            self._fold_tiny(_TINY_WORDS[1].unpack(self._carry.ljust(WORD, b"\0")))
            self._carry = b""

    def end_segment(self) -> None:
        """Close the current segment (zero-padding it to a whole word)."""
        self._pad()
        if self.segments is not None:
            words, s1, s2 = self._mark
            self.segments.append(self._since(words, s1, s2))
            self._mark = (self._words, self._s1, self._s2)

    def _since(self, words: int, s1: int, s2: int) -> SegmentSum:
        own = (self._s1 - s1) & MASK
        return SegmentSum(own, (self._s2 - s2 - words * own) & MASK, self._words - words)

    def total(self) -> SegmentSum:
        """Everything fed, as one run (the current segment is closed first)."""
        self._pad()
        return self._since(0, 0, 0)

    def add(self, run: SegmentSum) -> None:
        """Append a run of whole segments summed elsewhere (closes the current segment)."""
        self._pad()
        self._s1 = (self._s1 + run.s1) & MASK
        self._s2 = (self._s2 + run.s2 + self._words * run.s1) & MASK
        self._words += run.words
        self._mark = (self._words, self._s1, self._s2)

    def digest(self) -> tuple[int, int]:
        """``(s1, s2)`` of everything fed (the current segment is closed first)."""
        self._pad()
        return self._s1, self._s2

    def fold64(self) -> int:
        """The digest as one 64-bit value (for fingerprints compared as numbers)."""
        s1, s2 = self.digest()
        # An odd multiplier keeps the fold a bijection in s2 for every s1.
        return (s1 ^ ((s2 * 0x9E3779B97F4A7C15) & MASK)) & MASK


_SEGMENT_END = object()
_DONE = object()
# A SumBehind hands its pieces to the helper once this many bytes are queued
# (a large piece goes at once).
BATCH_BYTES = 1 << 20
# Whole segments below this size are summed joined together
# (WordSum.update_segments); above it, joining costs more in the copy than it
# saves in numpy calls (64 KiB tensors: about even; 16 KiB: 11 against 16 us
# a tensor; 4 KiB: 8 against 12).
JOIN_BELOW = 64 << 10


class SumBehind:
    """A :class:`WordSum` fed on a helper thread, in order, behind the I/O.

    A transport that sums each piece before sending it (or after receiving
    it) leaves the socket idle meanwhile; summing on a helper thread while
    the next piece moves keeps both busy (numpy releases the GIL as it sums).
    Pieces must stay valid until :meth:`digest` returns. Use it as a context
    manager: leaving it stops the helper whatever happened.

    Small pieces and segment ends are handed over in batches of about
    :data:`BATCH_BYTES`: waking the helper for each cost more than summing
    it (a state of 3000 16 KiB tensors made 6000 hand-offs, each a futex
    wake and a GIL exchange with the thread doing the I/O).
    """

    def __init__(self, record: bool = False) -> None:
        self._sum = WordSum(record)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Started at the first hand-off: a stream refused at its header costs no thread.
        self._thread: threading.Thread | None = None
        self._batch: list[Any] = []
        self._batch_bytes = 0

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is _DONE:
                return
            self._sum_batch(batch)

    def _sum_batch(self, batch: list[Any]) -> None:
        # Small segments that came whole (a piece, then its end) are summed
        # together (WordSum.update_segments); the rest one by one.
        run: list[Any] = []
        after_end = True
        ended = False  # the next item is the end of a segment put in the run
        for i, item in enumerate(batch):
            if item is _SEGMENT_END:
                after_end = True
                if ended:
                    ended = False
                    continue
                if run:
                    self._sum.update_segments(run)
                    run = []
                self._sum.end_segment()
                continue
            whole = i + 1 < len(batch) and batch[i + 1] is _SEGMENT_END
            nbytes = len(item) if isinstance(item, bytes | bytearray) else item.nbytes
            if whole and after_end and nbytes < JOIN_BELOW:
                run.append(item)
                ended = True
            else:
                if run:
                    self._sum.update_segments(run)
                    run = []
                self._sum.update(item)
            after_end = False
        if run:
            self._sum.update_segments(run)

    def _add(self, item: Any, nbytes: int) -> None:
        self._batch.append(item)
        self._batch_bytes += nbytes
        if self._batch_bytes >= BATCH_BYTES:
            self._hand_over()

    def _hand_over(self) -> None:
        if not self._batch:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftdist-checksum", daemon=True)
            self._thread.start()
        self._queue.put(self._batch)
        self._batch = []
        self._batch_bytes = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Queue more bytes of the current segment."""
        self._add(data, len(data) if isinstance(data, bytes | bytearray) else data.nbytes)

    def end_segment(self) -> None:
        """Queue the end of the current segment."""
        self._add(_SEGMENT_END, 0)

    def digest(self) -> tuple[int, int]:
        """Wait for every queued piece; the digest of them all."""
        if self._thread is None:
            # Everything fit in one batch: summed here, no thread started.
            batch, self._batch, self._batch_bytes = self._batch, [], 0
            self._sum_batch(batch)
        else:
            self._hand_over()
            self.close()
        return self._sum.digest()

    @property
    def segments(self) -> list[SegmentSum] | None:
        """Each segment's own sums (see :class:`WordSum`); read after :meth:`digest`."""
        return self._sum.segments

    def close(self) -> None:
        """Stop the helper once the pieces handed to it are summed (idempotent).

        Pieces not yet handed over are dropped: after :meth:`digest` there
        are none, and a transfer closed early wants no sums.
        """
        self._batch = []
        self._batch_bytes = 0
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()

    def __enter__(self) -> SumBehind:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
