"""
torchft's private Manager names
===============================

torchft's tests, and tools written against torchft, reach into the
Manager's private attributes: they read ``_quorum_id`` or
``_participating_replica_world_size``, set ``_healing``, replace
``_reconfigure_pg`` or ``_state_dict_lock`` with mocks, and call
``_manager_state_dict()``. :class:`TorchftInternals` gives the
:class:`~ftdist.manager.Manager` these names with torchft's meaning, on top
of ftdist's own state:

* ``_participating_replica_rank`` / ``_participating_replica_world_size``
  (and the early-2025 ``_participating_rank`` / ``_participating_world_size``)
  and ``_healing`` are written by the quorum thread when a round ends, and
  read by the training thread after it waited for the round (as in
  torchft), so a test may set them.
* ``_reconfigure_pg(communicator_id, handles)`` is how every quorum round
  rebuilds the process group: through the handles (today's torchft) when the
  quorum carries one per member, else through the quorum's store.
* ``_quorum_id``, ``_state_dict_lock``, ``_is_state_dict_read_allowed``,
  ``_logger`` mirror the Manager's membership and user state.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ftdist.checkpointing import CheckpointTransport
from ftdist.checkpointing._rwlock import RWLock
from ftdist.manager.managed_work import _ManagerLogger

if TYPE_CHECKING:
    from ftdist.manager.membership import GroupMembership
    from ftdist.manager.round import QuorumRound, RoundOutcome
    from ftdist.manager.state import ConsistencyParts, UserState

__all__ = ["MANAGER_STATE_KEY", "TorchftInternals", "manager_counters"]

# Where the Manager's own counters travel in a heal's state (torchft's
# "torchft", renamed with the package).
MANAGER_STATE_KEY = "ftdist"


def manager_counters(state: dict[str, Any]) -> dict[str, int]:
    """The Manager's counters in a received state (torchft's key accepted too).

    Raises:
        KeyError: the state carries no counters.
    """
    counters = state.get(MANAGER_STATE_KEY)
    if counters is None:
        counters = state.get("torchft")
    if counters is None:
        raise KeyError(
            f"the received state has no Manager counters ({MANAGER_STATE_KEY!r}); "
            f"it has {sorted(state)}"
        )
    return dict(counters)


class TorchftInternals:
    """torchft's private Manager attributes (see the module docstring)."""

    _pg: Any
    _transport: CheckpointTransport[Any]
    _timeout: timedelta
    _membership: GroupMembership
    _round: QuorumRound
    _user_state: UserState
    _consistency: ConsistencyParts
    _replica_id: str
    _group_rank: int

    # Class defaults: the quorum thread's (or a test's) writes shadow them.
    _healing: bool = False
    _participating_replica_rank: int | None = None
    _participating_replica_world_size: int = 0

    if TYPE_CHECKING:

        def state_dict(self) -> dict[str, int]: ...

    # -- participation, as the quorum thread left it -----------------------------------
    def _run_round(self, **kwargs: Any) -> RoundOutcome:
        """One quorum round (on the quorum thread); records this replica's part in it."""
        outcome = self._round.run(**kwargs)
        self._participating_replica_rank = outcome.participating_rank
        self._participating_replica_world_size = outcome.participating_world_size
        self._healing = outcome.heal
        return outcome

    @property
    def _participating_rank(self) -> int | None:
        """torchft's early-2025 name of ``_participating_replica_rank``."""
        return self._participating_replica_rank

    @_participating_rank.setter
    def _participating_rank(self, value: int | None) -> None:
        self._participating_replica_rank = value

    @property
    def _participating_world_size(self) -> int:
        """torchft's early-2025 name of ``_participating_replica_world_size``."""
        return self._participating_replica_world_size

    @_participating_world_size.setter
    def _participating_world_size(self, value: int) -> None:
        self._participating_replica_world_size = value

    # -- the process group ----------------------------------------------------------
    @property
    def _quorum_id(self) -> int:
        """The quorum the process group was last configured for (-1 before any)."""
        return self._membership.quorum_id

    @_quorum_id.setter
    def _quorum_id(self, value: int) -> None:
        self._membership.quorum_id = value

    def _reconfigure_pg(self, communicator_id: int, handles: list[str]) -> None:
        """Rebuild the process group for a new quorum; every round calls this.

        With ``handles`` (one reconfigure handle per member, in rank order,
        as today's torchft passes them), the group is rebuilt from them under
        ``communicator_id``; without, through the quorum's store, as ftdist
        does.

        Args:
            communicator_id: the quorum's id.
            handles: the members' ``get_reconfigure_handle()`` strings, or [].

        Raises:
            ValueError: a handle is malformed or this group's is missing.
            RuntimeError: the process group could not be configured.
        """
        if handles:
            from ftdist.process_group import ReconfigureOptions

            opts = ReconfigureOptions()
            opts.uuid = communicator_id
            opts.handles = list(handles)
            opts.timeout = self._timeout
            self._pg.reconfigure(opts).wait()
            return
        self._membership.configure()

    def _reconfigure_hook(self, communicator_id: int, handles: list[str]) -> None:
        # Looked up at call time, so that a replaced _reconfigure_pg is used.
        self._reconfigure_pg(communicator_id, handles)

    # -- the checkpoint transport -----------------------------------------------------
    @property
    def _checkpoint_transport(self) -> CheckpointTransport[Any]:
        """How state moves when healing; replacing it reaches the quorum round too."""
        return self._transport

    @_checkpoint_transport.setter
    def _checkpoint_transport(self, transport: CheckpointTransport[Any]) -> None:
        self._transport = transport
        # Those built on it (after the Manager's constructor set it first).
        healer = self.__dict__.get("_healer")
        if healer is not None:
            healer.transport = transport
        round_ = self.__dict__.get("_round")
        if round_ is not None:
            round_.transport = transport

    # -- the user state --------------------------------------------------------------
    def _manager_state_dict(self) -> dict[str, Any]:
        """What a healing peer receives: the user state and the Manager's counters.

        Taken under the state's read lock (see ``disallow_state_dict_read``).
        ``"consistency"`` (fingerprints of the parts compared across
        replicas) is present only when such parts are registered.

        Raises:
            TimeoutError: reads stayed disallowed for the whole timeout.
        """
        state: dict[str, Any] = {
            "user": self._user_state.save(),
            MANAGER_STATE_KEY: self.state_dict(),
        }
        if self._consistency:
            state["consistency"] = self._consistency.fingerprint()
        return state

    @property
    def _state_dict_lock(self) -> RWLock:
        """The lock that fences healing peers' reads of the user state."""
        return self._user_state.lock

    @_state_dict_lock.setter
    def _state_dict_lock(self, lock: RWLock) -> None:
        self._user_state.lock = lock

    @property
    def _is_state_dict_read_allowed(self) -> bool:
        """Whether healing peers may read the user state now."""
        return self._user_state.read_allowed

    @functools.cached_property
    def _logger(self) -> _ManagerLogger:
        """torchft's prefixed logger of this Manager."""
        return _ManagerLogger(self, getattr(self, "_replica_id", "?"), self._group_rank)
