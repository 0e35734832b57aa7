"""The contract every live-checkpoint transport meets."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class TransferStats:
    """One transfer, for the recovery timeline.

    Attributes:
        nbytes: bytes that crossed the wire.
        seconds: wall time of the transfer.
    """

    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class CheckpointTransport(ABC, Generic[T]):
    """Moves a live state dict from a healthy replica to a recovering one.

    The Manager calls :meth:`send_checkpoint` on the source replicas and
    :meth:`recv_checkpoint` on the recovering ones, then
    :meth:`disallow_checkpoint` after the commit vote: once that returns the
    state may be mutated, so transports that serve the live state lazily
    must finish (or refuse) any transfer still reading it.
    """

    last_transfer: TransferStats | None = None

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
