"""
The user state a Manager moves and checks
=========================================

Training code registers its state under keys: ``"default"`` for the
``state_dict``/``load_state_dict`` pair given to the Manager (or to
``set_state_dict_fns``), others through ``register_state_dict_fn``. When a
replica heals, everything registered crosses from a healthy peer and is
loaded under the same keys, together with the Manager's own counters.

Separately, the **consistency parts** are what must be identical on every
replica at the same step: by default the parameters of the models wrapped by
ftdist's ``DistributedDataParallel`` and the state of the optimizers wrapped
by ``OptimizerWrapper``. State that legitimately differs between replicas
(BatchNorm running statistics, RNG states, a data loader's position, the
local weights of LocalSGD) is not compared unless the user opts it in with
``register_consistency_fn``. Replicas compare fingerprints of these parts
after every reconfigure; a replica whose parts disagree with the majority
heals from it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ftdist.checkpointing._rwlock import RWLock
from ftdist.manager.fingerprint import MAX_PARTS, fingerprint, fold_parts, plan

__all__ = ["ConsistencyParts", "StateRegistration", "UserState"]

DEFAULT_KEY = "default"


class UserState:
    """The registered ``(load_state_dict, state_dict)`` pairs, by key.

    Layout of what :meth:`save` returns (torchft's two generations differ):
    with only the ``"default"`` pair registered it is that pair's state
    itself (the seed-era layout); once another key is registered it is a
    dict by key, ``"default"`` included (today's layout). :meth:`load`
    follows the same rule, so both sides of a heal agree.

    Reads for healing peers can be fenced off while the user mutates the
    state (:meth:`disallow_read`); saving then waits for :meth:`allow_read`.

    Args:
        timeout: how long :meth:`disallow_read` waits for reads in progress.
    """

    def __init__(self, timeout: timedelta) -> None:
        self._load: dict[str, Callable[[Any], None]] = {}
        self._save: dict[str, Callable[[], Any]] = {}
        self._lock = RWLock(timeout=timeout.total_seconds())
        self._read_allowed = True

    def register(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Register one pair under ``key``.

        Raises:
            TypeError: either function is not callable, or ``key`` is not a str.
            ValueError: ``key`` is already registered.
        """
        if not isinstance(key, str):
            raise TypeError(f"the state key must be a str, got {key!r}")
        if not callable(load_state_dict) or not callable(state_dict):
            raise TypeError(
                f"load_state_dict and state_dict for {key!r} must be callables, got "
                f"{type(load_state_dict).__name__} and {type(state_dict).__name__}"
            )
        if key in self._load:
            raise ValueError(f"a state_dict function is already registered under {key!r}")
        self._load[key] = load_state_dict
        self._save[key] = state_dict

    def replace_default(
        self, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Register the ``"default"`` pair, replacing the one registered before.

        Raises:
            TypeError: either function is not callable.
        """
        self._load.pop(DEFAULT_KEY, None)
        self._save.pop(DEFAULT_KEY, None)
        self.register(DEFAULT_KEY, load_state_dict, state_dict)

    def __bool__(self) -> bool:
        return bool(self._save)

    def _keyed(self) -> bool:
        return set(self._save) != {DEFAULT_KEY}

    def save(self) -> Any:
        """The registered state, in the layout of the class docstring.

        Waits while reads are disallowed (up to the timeout).

        Raises:
            TimeoutError: reads stayed disallowed for the whole timeout.
        """
        with self._lock.r_lock():
            if not self._keyed():
                return self._save[DEFAULT_KEY]()
            return {key: fn() for key, fn in self._save.items()}

    def load(self, state: Any) -> None:
        """Load a state :meth:`save` returned on a peer.

        Raises:
            KeyError: a registered key is missing from a keyed ``state``.
        """
        if not self._keyed():
            self._load[DEFAULT_KEY](state)
            return
        if not isinstance(state, dict):
            raise KeyError(
                f"the received state is a {type(state).__name__}, not a dict by key; "
                "every replica must register the same state keys"
            )
        for key, load in self._load.items():
            if key not in state:
                raise KeyError(
                    f"the received state has no {key!r} part (it has "
                    f"{sorted(state)}); every replica must register the same keys"
                )
            load(state[key])

    def disallow_read(self) -> None:
        """Fence off reads (healing peers) until :meth:`allow_read`; idempotent.

        Raises:
            TimeoutError: a read in progress did not finish within the timeout.
        """
        if self._read_allowed:
            self._lock.w_acquire()
            self._read_allowed = False

    def allow_read(self) -> None:
        """Let reads go on again; idempotent."""
        if not self._read_allowed:
            self._read_allowed = True
            self._lock.w_release()

    @property
    def read_allowed(self) -> bool:
        """Whether reads are allowed."""
        return self._read_allowed

    @property
    def lock(self) -> RWLock:
        """The read/write lock fencing the state (replaceable, e.g. by a test double)."""
        return self._lock

    @lock.setter
    def lock(self, lock: RWLock) -> None:
        self._lock = lock


class ConsistencyParts:
    """The parts of the state that must be identical on every replica."""

    def __init__(self) -> None:
        self._parts: dict[str, Callable[[], Any]] = {}

    def register(self, key: str, state_fn: Callable[[], Any]) -> str:
        """Compare ``state_fn()`` across replicas under ``key``.

        A key already taken gets a numeric suffix (two wrapped models).

        Returns:
            The key used.

        Raises:
            TypeError: ``state_fn`` is not callable.
        """
        if not callable(state_fn):
            raise TypeError(
                f"the consistency function for {key!r} must be callable, got "
                f"{type(state_fn).__name__}"
            )
        unique, n = key, 1
        while unique in self._parts:
            n += 1
            unique = f"{key}{n}"
        self._parts[unique] = state_fn
        return unique

    def unregister(self, key: str) -> None:
        """Stop comparing ``key``.

        Raises:
            KeyError: nothing is registered under ``key``.
        """
        if key not in self._parts:
            raise KeyError(f"no consistency part {key!r}; registered: {sorted(self._parts)}")
        del self._parts[key]

    def keys(self) -> list[str]:
        """The registered keys."""
        return sorted(self._parts)

    def __bool__(self) -> bool:
        return bool(self._parts)

    def _state(self) -> dict[str, Any]:
        return {key: fn() for key, fn in self._parts.items()}

    def fingerprint(self) -> dict[str, int]:
        """The word-sum digest of each part (see :func:`~ftdist.manager.fingerprint.fingerprint`)."""
        return fold_parts(fingerprint(self._state()), MAX_PARTS)

    def plan(self, carried: Any) -> dict[str, bytes]:
        """How a receiver of ``carried`` rebuilds :meth:`fingerprint` (see
        :func:`~ftdist.manager.fingerprint.plan`)."""
        return plan(self._state(), carried)


class StateRegistration:
    """The Manager's state API: what moves when a replica heals, and what
    must be identical on every replica (see the module docstring)."""

    _user_state: UserState
    _consistency: ConsistencyParts

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Register user state under ``key`` (e.g. one for the model, one for the optimizer).

        Raises:
            TypeError: either function is not callable.
            ValueError: ``key`` is already registered.
        """
        self._user_state.register(key, load_state_dict, state_dict)

    def set_state_dict_fns(
        self, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Set (or replace) the state the Manager moves when healing.

        The pair given to the constructor is replaced (the seed-era
        semantics); other keys registered with :meth:`register_state_dict_fn`
        stay.

        Raises:
            TypeError: either function is not callable.
        """
        self._user_state.replace_default(load_state_dict, state_dict)

    def register_consistency_fn(self, key: str, state_fn: Callable[[], Any]) -> str:
        """Opt a part of the state into the cross-replica consistency check.

        ``state_fn()`` must be identical on every replica at the same step
        (ftdist's DDP registers the model's parameters, ``OptimizerWrapper``
        the optimizer's state). After each reconfigure the replicas compare
        fingerprints of every registered part; a replica that disagrees with
        the majority heals from it.

        Returns:
            The key used (a suffix is added when ``key`` is taken).

        Raises:
            TypeError: ``state_fn`` is not callable.
        """
        return self._consistency.register(key, state_fn)

    def unregister_consistency_fn(self, key: str) -> None:
        """Opt a part out of the consistency check (see :meth:`register_consistency_fn`).

        Raises:
            KeyError: no part is registered under ``key``.
        """
        self._consistency.unregister(key)

    def consistency_keys(self) -> list[str]:
        """The parts compared across replicas."""
        return self._consistency.keys()

    def allow_state_dict_read(self) -> None:
        """Let healing peers read the state again (see :meth:`disallow_state_dict_read`)."""
        self._user_state.allow_read()

    def disallow_state_dict_read(self) -> None:
        """Fence off healing peers' reads of the state while it is being mutated.

        Raises:
            TimeoutError: a read in progress did not end within the timeout.
        """
        self._user_state.disallow_read()
