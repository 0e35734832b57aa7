"""
The checkpoint stream format
============================

A state dict crosses the wire as one stream, written straight from the live
tensors and read straight into the tensors that will hold the result: no
serialised copy of the whole state exists on either side. Version 3::

    prefix (32) | header (JSON, ASCII) | tensor bytes ... | trailer (24)

    prefix  = magic "FTDCKPT3" | header length u64 | body length u64
              | CRC-32 of the header u32 | flags u32      (little endian)
    trailer = bytes before the trailer u64 | word sums s1 u64, s2 u64

The header is plain data (see :mod:`ftdist.checkpointing._codec`): the step,
the state's tree with tensors as references, each tensor's dtype, shape,
strides, device and kind, and which tensors this stream carries. It is at
most :data:`MAX_HEADER_BYTES` long (checked before anything is allocated for
it, and read as it arrives), and its CRC-32 is checked before a byte of it is
parsed. Tensor bytes are each tensor's memory as laid out (any dense stride
order, so a transposed tensor travels without a copy and arrives transposed);
tensors with gaps travel row-major. The trailer catches truncation and
corruption of the body: a damaged stream is an error, never a silently wrong
model. Its sums (:mod:`._checksum`, each tensor one segment) replaced
version 2's CRC-32 of the whole stream, which ran at a third of the socket's
speed and capped every heal.

The process-group transport sends the same bytes as separate messages
(prefix, header, tensors, trailer): each tensor of :data:`SMALL_TENSOR_BYTES`
or more alone, smaller ones in batches (:func:`runs`), which its prefix says
with :data:`FLAG_BATCHED`. A stream's flags are all zero, and a receiver
refuses a flag it does not know, so an older peer refuses a newer layout
instead of waiting for messages that never come.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ftdist._gcpause import gc_paused
from ftdist.checkpointing import _codec
from ftdist.checkpointing._checksum import (
    JOIN_BELOW,
    STACK_UNIT,
    SegmentSum,
    SumBehind,
    WordSum,
    own_sums,
    same_size_sums,
)
from ftdist.checkpointing._codec import LeafMeta, dense_stride
from ftdist.errors import CheckpointError

MAGIC = b"FTDCKPT3"
_OLD_MAGICS = (b"FTDSTCK1", b"FTDCKPT2")
FORMAT = 3
_PREFIX = struct.Struct("<8sQQII")
PREFIX_BYTES = _PREFIX.size
_TRAILER = struct.Struct("<QQQ")
TRAILER_BYTES = _TRAILER.size
# A header describes every leaf (about 150 bytes a tensor): 128 MiB is room
# for ~800k tensors, and bounds what a peer can make a receiver hold.
MAX_HEADER_BYTES = 128 << 20
# Device-to-host copies and header reads go in pieces of this size, so a GPU
# state never needs a second full copy in host memory.
CHUNK_BYTES = 16 << 20
# Host memory is sent, received and summed in pieces of this size: the helper
# thread sums a piece while it is still in the cache the socket copy left it
# in. 4 MiB pieces made an in-place HTTP receive 1.2x as fast as 16 MiB ones
# (3.6 vs 3.0 GB/s, 1 GiB on loopback, medians of 9); 1 MiB ones were slower.
PIECE_BYTES = 4 << 20
_HEADER_KEYS = {"format", "step", "tree", "tensors", "carried"}
# The batches of :func:`runs`. Tensors smaller than SMALL_TENSOR_BYTES are
# received in batches closed at BATCH_BYTES or MOST_BATCHED tensors (Linux's
# IOV_MAX, so that a direct read copies a batch in one system call). The
# process-group transport sends them so, and its peer computes the same runs
# from the header: these are part of that wire (FLAG_BATCHED), apart from the
# tuning of PIECE_BYTES, and change only with a new flag.
SMALL_TENSOR_BYTES = 256 << 10
BATCH_BYTES = 4 << 20
MOST_BATCHED = 1024
# The prefix's flags. A process-group stream whose tensors travel in
# :func:`runs`, one message each (part of the wire: both ends compute them).
FLAG_BATCHED = 1
# A process-group sender on this host offers its memory to read directly: an
# offer message follows the header (pg_transport.py, :mod:`._direct`).
FLAG_DIRECT = 2


def runs(sizes: Sequence[int]) -> list[int]:
    """How tensors of ``sizes`` bytes, in stream order, are received: the
    lengths of consecutive runs, each a tensor of :data:`SMALL_TENSOR_BYTES`
    or more alone, or a batch of smaller ones closed once it holds
    :data:`BATCH_BYTES` or :data:`MOST_BATCHED` tensors.

    A batch is therefore under ``BATCH_BYTES + SMALL_TENSOR_BYTES`` bytes.
    Part of the process-group wire (:data:`FLAG_BATCHED`): changing it
    changes which messages a peer expects.
    """
    out: list[int] = []
    count = batched = 0
    for nbytes in sizes:
        if nbytes >= SMALL_TENSOR_BYTES:
            if count:
                out.append(count)
                count = batched = 0
            out.append(1)
            continue
        count += 1
        batched += nbytes
        if batched >= BATCH_BYTES or count >= MOST_BATCHED:
            out.append(count)
            count = batched = 0
    if count:
        out.append(count)
    return out


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a 1-D uint8 tensor: a view when ``t`` is dense, else a row-major copy."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if t.is_contiguous():
        # The common case, without the stride checks (a state of thousands
        # of small tensors takes this per tensor on both ends).
        return t.view(-1).view(torch.uint8)
    if dense_stride(tuple(t.shape), tuple(t.stride())):
        flat = t.as_strided((t.numel(),), (1,), t.storage_offset())
    else:
        flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8)


def host_view(flat: torch.Tensor) -> memoryview:
    """The bytes of a 1-D uint8 CPU tensor, without a copy."""
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(cast(Any, flat.numpy())).cast("B")


def sum_flat(digest: WordSum, flat: torch.Tensor) -> None:
    """Feed a 1-D uint8 tensor (any device) to ``digest`` as one segment."""
    if flat.device.type == "cpu":
        digest.update(host_view(flat))
    else:
        for start in range(0, flat.numel(), CHUNK_BYTES):
            digest.update(host_view(flat[start : start + CHUNK_BYTES].cpu()))
    digest.end_segment()


def sum_tensor(digest: WordSum, t: torch.Tensor) -> None:
    """Feed the contents of ``t`` (any device, any layout), row-major, as one segment."""
    sum_flat(digest, t.detach().contiguous().reshape(-1).view(torch.uint8))


# Tensors of up to this size are summed side by side with others of their
# size (tensor_sums); a larger one's sums cost little more than its bytes.
STACK_MOST = 1 << 20


def tensor_sums(tensors: list[torch.Tensor]) -> list[SegmentSum]:
    """Each tensor's sums, over its values' bytes in row-major order (as
    :func:`sum_tensor` feeds them; a 1-D uint8 tensor's are its bytes), in order.

    Plain host tensors are summed in groups of up to :data:`PIECE_BYTES`,
    wherever they stand in the list: small ones joined together
    (:meth:`~._checksum.WordSum.update_segments`), those of one size in whole
    rows side by side (:func:`~._checksum.same_size_sums`; a model's layers
    share a few shapes, and its weights and biases alternate). A model of
    3000 small tensors took 0.18-0.27 s to fingerprint one by one.
    """
    out: list[SegmentSum | None] = [None] * len(tensors)
    small: list[tuple[int, memoryview]] = []
    small_bytes = 0
    stacks: dict[int, list[tuple[int, memoryview]]] = {}

    def close_small() -> None:
        nonlocal small, small_bytes
        joined = WordSum(record=True)
        joined.update_segments([view for _, view in small])
        for (i, _), run in zip(small, joined.segments or (), strict=True):
            out[i] = run
        small, small_bytes = [], 0

    def close_stack(size: int) -> None:
        group = stacks.pop(size)
        if len(group) == 1:
            out[group[0][0]] = own_sums(group[0][1])
            return
        sums = same_size_sums(b"".join(view for _, view in group), size)
        for (i, _), run in zip(group, sums, strict=True):
            out[i] = run

    for i, t in enumerate(tensors):
        t = t.detach()
        if t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg():
            # Plain host memory, the common case, with the fewest calls.
            view = host_view(flat_bytes(t))
            size = len(view)
            if size < JOIN_BELOW:
                small.append((i, view))
                small_bytes += size
                if small_bytes >= PIECE_BYTES:
                    close_small()
            elif 0 < size <= STACK_MOST and size % STACK_UNIT == 0:
                group = stacks.setdefault(size, [])
                group.append((i, view))
                if len(group) * size >= PIECE_BYTES:
                    close_stack(size)
            else:
                out[i] = own_sums(view)
            continue
        own = WordSum()
        sum_flat(own, t.contiguous().reshape(-1).view(torch.uint8))
        out[i] = own.total()
    if small:
        close_small()
    for size in list(stacks):
        close_stack(size)
    return cast(list[SegmentSum], out)


@dataclass(frozen=True)
class Stream:
    """One planned stream: its prefix and header, and the tensors whose bytes follow.

    Attributes:
        head: prefix and header bytes.
        tensors: the carried tensors, in stream order.
        body_len: bytes of tensor data.
    """

    head: bytes
    tensors: list[torch.Tensor]
    body_len: int

    @property
    def size(self) -> int:
        """Total bytes of the stream (for Content-Length)."""
        return len(self.head) + self.body_len + TRAILER_BYTES


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@gc_paused()
def plan(state_dict: Any, step: int, num_chunks: int = 1) -> list[Stream]:
    """Split a state dict into ``num_chunks`` streams (tensors dealt round-robin).

    Every stream's header describes the whole state, so each decodes alone.
    Nothing is copied: the streams refer to the live tensors.

    Raises:
        TypeError: a leaf cannot travel (the message names it), or ``step``
            is not an int.
        ValueError: the header would exceed :data:`MAX_HEADER_BYTES`.
    """
    if type(step) is not int:
        raise TypeError(f"step must be an int, got {step!r}")
    enc = _codec.encode(state_dict)
    try:
        tree = json.dumps(enc.tree, separators=(",", ":"))
        metas = json.dumps(enc.metas, separators=(",", ":"))
    except ValueError as exc:  # an int too long to print
        raise TypeError(f"cannot send the state: {exc}") from exc
    n = max(1, num_chunks)
    streams = []
    for chunk in range(n):
        carried = list(range(chunk, len(enc.tensors), n))
        header = (
            f'{{"format":{FORMAT},"step":{step},"carried":{json.dumps(carried)},'
            f'"tree":{tree},"tensors":{metas}}}'
        ).encode("ascii")
        if len(header) > MAX_HEADER_BYTES:
            raise ValueError(
                f"the checkpoint header is {len(header)} bytes, more than the "
                f"{MAX_HEADER_BYTES} a peer accepts: the state has too many leaves"
            )
        tensors = [enc.tensors[i] for i in carried]
        body = sum(_nbytes(t) for t in tensors)
        prefix = _PREFIX.pack(MAGIC, len(header), body, zlib.crc32(header), 0)
        streams.append(Stream(prefix + header, tensors, body))
    return streams


def chunks(stream: Stream) -> Generator[memoryview | bytes, None, None]:
    """The stream as a sequence of buffers; the last one is the trailer.

    CPU tensors are yielded as views of their own memory, :data:`PIECE_BYTES`
    at a time; other devices' tensors are copied to the host
    :data:`CHUNK_BYTES` at a time.
    """
    total = len(stream.head)
    yield stream.head
    # Each piece is summed on a helper thread while the caller sends it.
    with SumBehind() as digest:
        for t in stream.tensors:
            flat = flat_bytes(t)
            size = PIECE_BYTES if flat.device.type == "cpu" else CHUNK_BYTES
            for start in range(0, flat.numel(), size):
                piece = flat[start : start + size]
                buf = host_view(piece if piece.device.type == "cpu" else piece.cpu())
                digest.update(buf)
                total += len(buf)
                yield buf
            digest.end_segment()
        sums = digest.digest()
    yield _TRAILER.pack(total, *sums)


def trailer_bytes(total: int, digest: WordSum) -> bytes:
    """The trailer for ``total`` bytes whose tensor data summed to ``digest``."""
    return _TRAILER.pack(total, *digest.digest())


@dataclass(frozen=True)
class Header:
    """A checked stream header.

    Attributes:
        step: the step of the state.
        tree: the state's tree (plain data, checked).
        leaves: every tensor leaf of the state, in table order.
        carried: the indices of the leaves this stream carries, in order.
        body_len: bytes of tensor data that follow.
    """

    step: int
    tree: Any
    leaves: list[LeafMeta]
    carried: list[int]
    body_len: int


def with_flags(head: bytes, flags: int) -> bytes:
    """A stream's head (prefix and header) with the prefix's ``flags`` set."""
    magic, header_len, body_len, header_crc, _ = _PREFIX.unpack_from(head)
    return _PREFIX.pack(magic, header_len, body_len, header_crc, flags) + head[PREFIX_BYTES:]


def parse_prefix(raw: bytes, what: str, known: int = 0) -> tuple[int, int, int, int]:
    """Check a stream prefix: (header length, body length, header CRC-32, flags).

    Args:
        known: the flags this receiver understands; any other is refused.

    Raises:
        CheckpointError: not a version-3 stream, a flag not in ``known``, or
            a header longer than :data:`MAX_HEADER_BYTES`.
    """
    magic, header_len, body_len, header_crc, flags = _PREFIX.unpack(raw)
    if magic != MAGIC:
        if magic in _OLD_MAGICS:
            raise CheckpointError(
                f"{what} sent an older ftdist checkpoint format; run the same ftdist version "
                "in every replica"
            )
        raise CheckpointError(f"{what} did not send an ftdist checkpoint stream")
    if flags & ~known:
        # The trailer's sums cover the tensor bytes only: every prefix field
        # is checked here, this one included.
        raise CheckpointError(
            f"{what} sent a checkpoint stream with flags {flags:#x}, of which this "
            f"receiver knows {known:#x}: run the same ftdist version in every replica"
        )
    if not 0 < header_len <= MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{what} announced a checkpoint header of {header_len} bytes "
            f"(at most {MAX_HEADER_BYTES} are accepted)"
        )
    return header_len, body_len, header_crc, flags


def parse_header(raw: bytes, header_crc: int, body_len: int, what: str) -> Header:
    """Check the header's CRC-32, then decode and check it.

    Raises:
        CheckpointError: the CRC differs, or the header is not what
            :func:`plan` writes.
    """
    if zlib.crc32(raw) != header_crc:
        raise CheckpointError(f"the checkpoint header from {what} is corrupt (CRC-32 mismatch)")
    try:
        doc = json.loads(raw.decode("ascii"))
        if type(doc) is not dict or set(doc) != _HEADER_KEYS or doc["format"] != FORMAT:
            raise _codec.bad("not a version-3 header object")
        step = _codec.as_int(doc["step"], "step", -(1 << 63), (1 << 63) - 1)
        leaves = _codec.check(doc["tree"], doc["tensors"])
        carried = doc["carried"]
        if type(carried) is not list or any(
            type(i) is not int or not 0 <= i < len(leaves) for i in carried
        ):
            raise _codec.bad("the carried list is not a list of tensor indices")
        if len(set(carried)) != len(carried):
            raise _codec.bad("the carried list repeats a tensor")
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} (from {what})") from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as exc:
        raise CheckpointError(f"malformed checkpoint header from {what}: {exc!r:.200}") from None
    if sum(leaves[i].nbytes for i in carried) != body_len:
        raise CheckpointError(
            f"{what} announced {body_len} bytes of tensor data, its header describes "
            f"{sum(leaves[i].nbytes for i in carried)}"
        )
    return Header(step, doc["tree"], leaves, carried, body_len)


class StreamReader:
    """Reads a stream through ``readinto`` and checks it as it goes.

    Args:
        readinto: fills a memoryview, returning the number of bytes read
            (0 at end of stream), like ``io.RawIOBase.readinto``.
        what: names the source in error messages.
    """

    def __init__(self, readinto: Callable[[memoryview], int], what: str) -> None:
        self._readinto = readinto
        self.what = what
        # Summed on a helper thread while the next piece arrives; each
        # tensor's own sums are kept for the receiver (TransferStats.tensor_sums).
        self._digest = SumBehind(record=True)
        self.total = 0
        self._staging: memoryview | None = None

    def close(self) -> None:
        """Stop the summing helper (idempotent; reading is over)."""
        self._digest.close()

    def _fill(self, view: memoryview, count: bool = True) -> None:
        got = 0
        while got < len(view):
            n = self._readinto(view[got:])
            if not n:
                raise CheckpointError(
                    f"checkpoint stream from {self.what} was truncated after "
                    f"{self.total + got} bytes"
                )
            got += n
        if count:
            self.total += len(view)

    def read_header(self, size: int | None = None) -> Header:
        """Read, check and decode the prefix and header.

        Args:
            size: the stream's length when known (HTTP Content-Length); it
                must agree with the prefix.

        Raises:
            CheckpointError: not a version-3 stream, too long a header, a
                corrupt header, or truncated.
        """
        prefix = bytearray(PREFIX_BYTES)
        self._fill(memoryview(prefix))
        header_len, body_len, header_crc, _ = parse_prefix(bytes(prefix), self.what)
        if size is not None and size != PREFIX_BYTES + header_len + body_len + TRAILER_BYTES:
            raise CheckpointError(
                f"{self.what} sent {size} bytes but its stream prefix announces "
                f"{PREFIX_BYTES + header_len + body_len + TRAILER_BYTES}"
            )
        # Grown as bytes arrive: a peer that announces a long header and
        # sends nothing makes this process hold nothing.
        raw = bytearray()
        while len(raw) < header_len:
            piece = bytearray(min(header_len - len(raw), CHUNK_BYTES))
            self._fill(memoryview(piece))
            raw += piece
        return parse_header(bytes(raw), header_crc, body_len, self.what)

    def read_exact(self, nbytes: int) -> bytes:
        """The next ``nbytes`` of the exchange that are not stream bytes (not summed or counted).

        Raises:
            CheckpointError: the stream ends first.
        """
        raw = bytearray(nbytes)
        self._fill(memoryview(raw), count=False)
        return bytes(raw)

    def absorb(self, piece: memoryview) -> None:
        """Sum and count tensor bytes that arrived another way (a direct memory read)."""
        self._digest.update(piece)
        self.total += len(piece)

    def end_tensor(self) -> None:
        """One tensor's bytes are all in."""
        self._digest.end_segment()

    def read_into(self, flat: torch.Tensor, progress: Callable[[int], None] | None = None) -> None:
        """Fill a 1-D uint8 CPU tensor (one tensor's bytes) from the stream.

        ``progress`` is told the size of each piece read.
        """
        view = host_view(flat)
        for start in range(0, len(view), PIECE_BYTES):
            piece = view[start : start + PIECE_BYTES]
            self._fill(piece)
            self._digest.update(piece)
            if progress is not None:
                progress(len(piece))
        self.end_tensor()

    def read_batch(self, flats: list[torch.Tensor], progress: Callable[[int], None]) -> None:
        """Fill small 1-D uint8 CPU tensors, in stream order, with one read.

        Their bytes land in a staging buffer first and are copied out: one
        read through the HTTP response's layers instead of one per tensor,
        which cost more than the copy for tensors of a few KiB. Each tensor
        stays a segment of its own; ``progress`` is told the batch's size.
        """
        views = [host_view(flat) for flat in flats]
        nbytes = sum(len(view) for view in views)
        if self._staging is None or len(self._staging) < nbytes:
            self._staging = memoryview(bytearray(max(nbytes, 1 << 16)))
        staging = self._staging
        self._fill(staging[:nbytes])
        offset = 0
        for view in views:
            end = offset + len(view)
            if end > offset:  # an empty tensor's view is read-only
                view[:] = staging[offset:end]
            # Summed from the tensor: the staging buffer is refilled next batch.
            self._digest.update(view)
            self._digest.end_segment()
            offset = end
        progress(nbytes)

    def read_trailer(self) -> None:
        """Check the trailer against what was read.

        Raises:
            CheckpointError: the byte count or the sums differ.
        """
        raw = bytearray(TRAILER_BYTES)
        self._fill(memoryview(raw), count=False)
        check_trailer(raw, self.total, self._digest, self.what)

    def tensor_sums(self) -> list[SegmentSum]:
        """Each tensor's own sums, in stream order (after :meth:`read_trailer`)."""
        return list(self._digest.segments or ())


def check_trailer(
    raw: bytes | bytearray, total: int, digest: WordSum | SumBehind, what: str
) -> None:
    """Compare a received trailer with the byte count and sums of what came before it.

    Raises:
        CheckpointError: they differ.
    """
    sent_total, *sent_sums = _TRAILER.unpack(bytes(raw))
    sums = list(digest.digest())
    if (sent_total, sent_sums) != (total, sums):
        raise CheckpointError(
            f"checkpoint stream from {what} is corrupt: received {total} bytes with "
            f"word sums {sums[0]:#018x}/{sums[1]:#018x}, sender wrote {sent_total} bytes with "
            f"{sent_sums[0]:#018x}/{sent_sums[1]:#018x}"
        )


def check_step(header: Header, step: int, what: str) -> None:
    """Refuse a state of another step than the one asked for.

    Raises:
        CheckpointError: the steps differ.
    """
    if header.step != step:
        raise CheckpointError(
            f"refusing checkpoint of step {header.step} from {what}: expected step {step}"
        )


def same_state(a: Header, b: Header, what: str) -> None:
    """Check that two chunk headers describe the same state.

    Raises:
        CheckpointError: they differ.
    """
    if a.step != b.step or a.tree != b.tree or a.leaves != b.leaves:
        raise CheckpointError(f"the chunks from {what} describe different states")
