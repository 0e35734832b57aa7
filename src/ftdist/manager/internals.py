"""
torchft's private Manager names
===============================

torchft's tests, and tools written against torchft, reach into the
Manager's private attributes: they read ``_quorum_id`` or
``_participating_replica_world_size``, set ``_healing``, replace
``_reconfigure_pg`` or ``_state_dict_lock`` with mocks, and call
``_manager_state_dict()``. :class:`TorchftInternals` gives the
:class:`~ftdist.manager.Manager` these names as aliases of where each thing
lives in ftdist; nothing here does anything of its own:

======================================  ========================================
torchft's name                          ftdist's
======================================  ========================================
``_participating_replica_rank``,        :class:`~ftdist.manager.round.Participation`
``_participating_replica_world_size``,  (the quorum thread writes it when a
``_healing`` (and the early-2025        round ends)
``_participating_rank``/``_world_size``)
``_quorum_id``                          :attr:`GroupMembership.quorum_id`
``_reconfigure_pg``                     :meth:`GroupMembership.reconfigure`
``_checkpoint_transport``               the :class:`~ftdist.manager.heal.Healer`'s transport
``_manager_state_dict()``               :func:`ftdist.manager.heal.heal_state`
``_state_dict_lock``,                   :class:`~ftdist.manager.state.UserState`
``_is_state_dict_read_allowed``
``_logger``                             :class:`~ftdist.manager.lazy_work.ManagerLogger`
======================================  ========================================
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ftdist.manager.heal import MANAGER_STATE_KEY, heal_state, manager_counters
from ftdist.manager.lazy_work import ManagerLogger

if TYPE_CHECKING:
    from collections.abc import Callable

    from ftdist.manager.heal import Healer
    from ftdist.manager.membership import GroupMembership
    from ftdist.manager.round import Participation
    from ftdist.manager.state import ConsistencyParts, UserState

__all__ = ["MANAGER_STATE_KEY", "TorchftInternals", "manager_counters"]


def _alias(owner: str, name: str, doc: str) -> property:
    """A read-write attribute that is ``self.<owner>.<name>``."""

    def get(self: Any) -> Any:
        return getattr(getattr(self, owner), name)

    def set_(self: Any, value: Any) -> None:
        setattr(getattr(self, owner), name, value)

    return property(get, set_, doc=doc)


class TorchftInternals:
    """torchft's private Manager attributes (see the module docstring)."""

    _participation: Participation
    _membership: GroupMembership
    _healer: Healer
    _user_state: UserState
    _consistency: ConsistencyParts
    _group_rank: int

    if TYPE_CHECKING:

        def state_dict(self) -> dict[str, int]: ...

    _participating_replica_rank = _alias("_participation", "rank", "torchft: this rank's part.")
    _participating_replica_world_size = _alias(
        "_participation", "world_size", "torchft: how many replica groups take part."
    )
    _healing = _alias("_participation", "healing", "torchft: this replica heals this step.")
    _participating_rank = _alias("_participation", "rank", "torchft 2025's name of the rank.")
    _participating_world_size = _alias(
        "_participation", "world_size", "torchft 2025's name of the world size."
    )
    _quorum_id = _alias("_membership", "quorum_id", "The quorum the group was configured for.")
    _checkpoint_transport = _alias("_healer", "transport", "How state moves when healing.")
    _state_dict_lock = _alias("_user_state", "lock", "The lock fencing peers' state reads.")

    @property
    def _is_state_dict_read_allowed(self) -> bool:
        """Whether healing peers may read the user state now."""
        return self._user_state.read_allowed

    @property
    def _reconfigure_pg(self) -> Callable[[int, list[str]], None]:
        """Rebuilds the process group for each new quorum (see ``GroupMembership``).

        Replacing it (a mock, a patch) replaces what every round calls;
        deleting the replacement restores ftdist's.
        """
        return self._membership.reconfigure

    @_reconfigure_pg.setter
    def _reconfigure_pg(self, fn: Callable[[int, list[str]], None]) -> None:
        # An instance attribute shadows the method; the deleter removes it.
        self._membership.reconfigure = fn  # type: ignore[method-assign, assignment]

    @_reconfigure_pg.deleter
    def _reconfigure_pg(self) -> None:
        self._membership.__dict__.pop("reconfigure", None)

    def _manager_state_dict(self) -> dict[str, Any]:
        """What a healing peer receives (:func:`~ftdist.manager.heal.heal_state`).

        Raises:
            TimeoutError: reads stayed disallowed for the whole timeout.
        """
        return heal_state(self._user_state, self.state_dict(), self._consistency)

    @functools.cached_property
    def _logger(self) -> ManagerLogger:
        """torchft's prefixed logger of this Manager."""
        return ManagerLogger(self, getattr(self, "_replica_id", "?"), self._group_rank)

    def _prefix(self) -> str:
        """What this rank's log lines start with: ``[replica_id/group_rank - step n]``."""
        # Not through the cached _logger: that froze the replica id it saw
        # first, and failure news may arrive before the id is known.
        replica_id = getattr(self, "_replica_id", "?")
        return f"[{replica_id}/{self._group_rank} - step {getattr(self, '_step', 0)}]"
