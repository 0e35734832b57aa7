"""The contract every live-checkpoint transport meets."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

if TYPE_CHECKING:
    from ftdist.checkpointing._checksum import SegmentSum
    from ftdist.checkpointing._prefault import ReceiveReserve

T = TypeVar("T")


@dataclass(frozen=True)
class TransferStats:
    """One transfer, for the recovery timeline.

    Attributes:
        nbytes: bytes that crossed the wire.
        seconds: wall time of the transfer.
        route: how they travelled: ``"tcp"``, ``"local"`` (a Unix socket:
            the source is on this host), ``"direct"`` (copied out of the
            source's memory on this host), ``"direct+tcp"`` or
            ``"local+tcp"`` (chunks over both),
            ``"process group"``, ``"direct+process group"`` (a send to
            several ranks, some of which copied), or ``""`` where the
            transport does not say.
        tensor_sums: (receive only) the word sums of each received tensor
            that is plain, contiguous and on the host, by (address, byte
            count), as checked against the sender's: a receiver fingerprints
            what it received without reading it again. Empty where the
            transport does not say.
    """

    nbytes: int
    seconds: float
    route: str = ""
    tensor_sums: Mapping[tuple[int, int], SegmentSum] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @classmethod
    def of_receive(
        cls,
        nbytes: int,
        seconds: float,
        route: str,
        tensors: Mapping[int, torch.Tensor],
        sums: Mapping[int, SegmentSum],
    ) -> TransferStats:
        """A receive's stats, given the received tensors and their word sums
        by leaf index: :attr:`tensor_sums` keeps those :func:`sums_key` files."""
        kept: dict[tuple[int, int], SegmentSum] = {}
        for index, t in tensors.items():
            run, key = sums.get(index), sums_key(t)
            if run is not None and key is not None:
                kept[key] = run
        return cls(nbytes, seconds, route, kept)


def sums_key(t: object) -> tuple[int, int] | None:
    """Where :attr:`TransferStats.tensor_sums` files a tensor: its (address,
    byte count) when it is a plain, contiguous, non-empty host tensor, whose
    bytes in memory are its values in row-major order; else None."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return None
    # is_cpu and nbytes, not device.type and numel() * element_size(): this
    # runs once per received tensor, thousands in a deep model's state.
    if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    nbytes = t.nbytes
    return (t.data_ptr(), nbytes) if nbytes else None


class TransferProgress:
    """A receive's bytes so far, told to ``report`` as they arrive (thread-safe:
    chunked fetches add from several threads).

    Args:
        report: called with (bytes received, bytes expected).
    """

    def __init__(self, report: Callable[[int, int], None]) -> None:
        self._report = report
        self._lock = threading.Lock()
        self._done = 0
        self._total = 0

    def expect(self, nbytes: int) -> None:
        """``nbytes`` more are on their way (a stream's announced size)."""
        with self._lock:
            self._total += nbytes

    def add(self, nbytes: int) -> None:
        """``nbytes`` more arrived."""
        with self._lock:
            self._done += nbytes
            done, total = self._done, self._total
        self._report(done, total)


class CheckpointTransport(ABC, Generic[T]):
    """Moves a live state dict from a healthy replica to a recovering one.

    The Manager calls :meth:`send_checkpoint` on the source replicas and
    :meth:`recv_checkpoint` on the recovering ones, then
    :meth:`disallow_checkpoint` after the commit vote: once that returns the
    state may be mutated, so transports that serve the live state lazily
    must finish (or refuse) any transfer still reading it.
    """

    last_transfer: TransferStats | None = None
    # Told (bytes received so far, bytes expected) as a receive goes, by the
    # transports that can (ftdist's); the Manager sets it to show a heal's
    # progress on the lighthouse's dashboard.
    progress: Callable[[int, int], None] | None = None
    # Returns the receiver's own state, whose matching tensors a receive
    # overwrites in place (ftdist's transports; one built with its own
    # ``state_dict=`` uses that). The Manager sets it for the heal of a
    # replica that never committed: nothing in its tensors can be lost.
    receive_into: Callable[[], object] | None = None
    # Populated memory that a receive's fresh host tensors are carved out
    # of (ftdist's transports). The Manager sets it for the first heal of a
    # replica that never committed, having filled it during the quorum wait.
    receive_reserve: ReceiveReserve | None = None

    @abstractmethod
    def metadata(self) -> str:
        """What a peer needs to fetch this rank's checkpoint (e.g. a URL)."""

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Make ``state_dict`` of ``step`` available to ``dst_ranks`` (may return early).

        Raises:
            CheckpointError: the transfer failed (blocking transports).
        """

    def disallow_checkpoint(self) -> None:
        """Stop serving the state; returns once no transfer reads it any more."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetch the state dict of ``step`` from replica ``src_rank``.

        Raises:
            CheckpointError: wrong step, truncated or corrupted stream.
            TimeoutError: the source did not deliver within ``timeout``.
        """

    def shutdown(self, wait: bool = True) -> None:
        """Release the transport's resources (servers, threads)."""
