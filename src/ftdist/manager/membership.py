"""
The process group's membership
===============================

A Manager's process group spans the replica groups of the current quorum
(one rank of each: the same group rank). :class:`GroupMembership` rebuilds
it when the quorum changes, and aborts it when the lighthouse reports that
one of its members died, so that a collective waiting on the dead member
fails at once instead of waiting out its timeout.
"""

from __future__ import annotations

import logging
import time

from ftdist.manager.client import ManagerQuorumResult
from ftdist.process_group import ProcessGroup

__all__ = ["GroupMembership"]

logger = logging.getLogger(__name__)


class GroupMembership:
    """Keeps one rank's process group configured for the current quorum.

    Args:
        pg: the process group spanning the replica groups.
        group_rank: this rank inside its replica group; it names the store
            prefix, so that the group ranks of one replica group each build
            their own process group.
    """

    def __init__(self, pg: ProcessGroup, group_rank: int) -> None:
        self.pg = pg
        self._group_rank = group_rank
        self.quorum_id = -1
        self.members: list[str] = []
        # Aborted on failure news: rebuild at the next quorum even if its
        # id did not change (the dead member may be back by then).
        self.broken = False

    def follow(self, quorum: ManagerQuorumResult) -> float | None:
        """Rebuild the group if ``quorum`` is a new one (or the group was aborted).

        Returns:
            Seconds the rebuild took, or None when nothing changed.

        Raises:
            ValueError: the quorum's store address is malformed.
            RuntimeError: the process group could not be configured (a peer
                did not arrive within the group's timeout).
        """
        if quorum.quorum_id == self.quorum_id and not self.broken:
            return None
        start = time.perf_counter()
        self.quorum_id = quorum.quorum_id
        self.members = list(quorum.replica_ids)
        # quorum_id alone repeats after a lighthouse restart; its creation
        # time makes the prefix unique.
        store = (
            f"{quorum.store_address}/ftdist/{quorum.quorum_id}-{quorum.created_ns}/"
            f"{self._group_rank}"
        )
        self.pg.configure(store, quorum.replica_rank, quorum.replica_world_size)
        self.broken = False
        return time.perf_counter() - start

    def member_failed(self, replica_id: str, own_replica_id: str) -> bool:
        """Abort the group if ``replica_id`` is one of its other members.

        Work still in flight fails (so the step does not commit); work that
        completed stays valid. The next quorum rebuilds the group.

        Returns:
            Whether the group was aborted.
        """
        if replica_id not in self.members or replica_id == own_replica_id:
            return False
        self.broken = True
        self.pg.abort()
        return True

    def abort_stuck(self) -> None:
        """Abort a backend stuck past the Manager's own deadline.

        A stopped peer or a hung Baby child: aborting fails what waits on it
        (and kills a hung child); the next quorum rebuilds the group.
        """
        self.broken = True
        self.pg.abort()
