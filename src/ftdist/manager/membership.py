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
from datetime import timedelta
from typing import Any

from ftdist.manager.client import ManagerQuorumResult
from ftdist.process_group import ProcessGroup, ReconfigureOptions

__all__ = ["GroupMembership"]


def _handles(quorum: Any) -> list[str]:
    """The members' reconfigure handles, if the quorum carries one for each."""
    handles = list(getattr(quorum, "reconfigure_handles", None) or ())
    if len(handles) != quorum.replica_world_size or not all(handles):
        return []
    return handles


logger = logging.getLogger(__name__)


class GroupMembership:
    """Keeps one rank's process group configured for the current quorum.

    Each new quorum goes through the attribute :attr:`reconfigure`, the
    bound method by default; torchft's tests replace it (the Manager's
    ``_reconfigure_pg`` is an alias of it) to watch or fake reconfigures.

    Args:
        pg: the process group spanning the replica groups.
        group_rank: this rank inside its replica group; it names the store
            prefix, so that the group ranks of one replica group each build
            their own process group.
        timeout: how long a rebuild through reconfigure handles may take.
    """

    def __init__(self, pg: ProcessGroup, group_rank: int, timeout: timedelta) -> None:
        self.pg = pg
        self._group_rank = group_rank
        self._timeout = timeout
        self.quorum_id = -1
        self.members: list[str] = []
        self._following: ManagerQuorumResult | None = None
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
        self.members = list(getattr(quorum, "replica_ids", ()))
        self._following = quorum
        self.reconfigure(quorum.quorum_id, _handles(quorum))
        self.broken = False
        return time.perf_counter() - start

    def reconfigure(self, communicator_id: int, handles: list[str]) -> None:
        """Rebuild the process group for a new quorum.

        With ``handles`` (one reconfigure handle per member, in rank order,
        as today's torchft passes them), the group is rebuilt from them under
        ``communicator_id``; without, through the quorum's store
        (:meth:`configure`), as ftdist does.

        Args:
            communicator_id: the quorum's id.
            handles: the members' ``get_reconfigure_handle()`` strings, or [].

        Raises:
            ValueError: a handle is malformed or this group's is missing.
            RuntimeError: the process group could not be configured.
        """
        if not handles:
            self.configure()
            return
        opts = ReconfigureOptions()
        opts.uuid = communicator_id
        opts.handles = list(handles)
        opts.timeout = self._timeout
        self.pg.reconfigure(opts).wait()

    def configure(self) -> None:
        """Configure the group through the store of the quorum being followed.

        Raises:
            ValueError: no quorum is being followed, or its store address is
                malformed.
            RuntimeError: the process group could not be configured.
        """
        quorum = self._following
        if quorum is None:
            raise ValueError("no quorum to configure the process group for")
        # quorum_id alone repeats after a lighthouse restart; its creation
        # time makes the prefix unique.
        store = (
            f"{quorum.store_address}/ftdist/{quorum.quorum_id}-"
            f"{getattr(quorum, 'created_ns', 0)}/{self._group_rank}"
        )
        self.pg.configure(store, quorum.replica_rank, quorum.replica_world_size)

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
