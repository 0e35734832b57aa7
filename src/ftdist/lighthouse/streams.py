"""
Failure-news streams as a death signal
======================================

Every rank of every replica group holds a failure-news stream open to the
lighthouse. A process that dies closes its connections at once, so a stream
that closes is the fastest failure signal there is, faster than the
heartbeat timeout, and it covers every rank of a group, not only the one
that heartbeats. :class:`StreamWatch` keeps the books: which streams are
open, which were lost, and which stayed lost past :data:`STREAM_GRACE_S`
(a reconnecting client is back within it; a dead process never).

Streams are counted per (replica id, listener). A named listener (a
process, ``host:pid``) lives while any stream of it is open: after a
partition its new stream may open before the lighthouse's side of the old,
half-open one is closed by the kernel (TCP's user timeout), and that late
close must not read as a death. Unnamed streams of a replica (older
clients) are counted together: the replica is lost when fewer are open
than before the loss.
"""

from __future__ import annotations

__all__ = ["STREAM_GRACE_S", "StreamWatch"]

# How long a lost stream may take to come back before its replica counts as
# failed. A reconnecting client is back within a few hundred ms.
STREAM_GRACE_S = 0.15

_Key = tuple[str, str]


class StreamWatch:
    """Open and lost failure-news streams; no clock of its own (``now`` is passed in)."""

    def __init__(self) -> None:
        self._open: dict[_Key, int] = {}
        # key -> (when it was lost, streams open before the loss)
        self._lost: dict[_Key, tuple[float, int]] = {}

    def opened(self, replica_id: str, listener: str = "") -> None:
        """A stream of ``listener`` in ``replica_id`` opened."""
        if replica_id:
            key = (replica_id, listener)
            self._open[key] = self._open.get(key, 0) + 1

    def closed(self, replica_id: str, listener: str, now: float) -> None:
        """A stream of ``listener`` in ``replica_id`` closed at ``now``."""
        if not replica_id:
            return
        key = (replica_id, listener)
        before = self._open.get(key, 0)
        self._open[key] = max(0, before - 1)
        self._lost.setdefault(key, (now, before))

    def forget(self, replica_id: str) -> None:
        """Ignore the lost streams of ``replica_id`` (it left on purpose)."""
        for key in [k for k in self._lost if k[0] == replica_id]:
            del self._lost[key]

    def expired(self, now: float) -> list[tuple[str, float]]:
        """Replicas whose lost stream stayed lost past the grace: (replica id, since).

        Each loss is returned once; a loss still within the grace is kept
        for a later call, one that came back is dropped.
        """
        out = []
        for key, (since, before) in list(self._lost.items()):
            replica_id, listener = key
            left = self._open.get(key, 0)
            if (left > 0) if listener else (left >= before):
                del self._lost[key]  # reconnected
                continue
            if now - since < STREAM_GRACE_S:
                continue
            del self._lost[key]
            if left == 0:
                self._open.pop(key, None)
            out.append((replica_id, since))
        return out
