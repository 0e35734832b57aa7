"""
The user state a Manager moves when healing
===========================================

Training code registers its state under keys (``"default"`` for the
``state_dict``/``load_state_dict`` pair given to the Manager, others through
:meth:`~ftdist.manager.Manager.register_state_dict_fn`). When a replica heals,
everything registered crosses from a healthy peer and is loaded under the
same keys, together with the Manager's own counters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ftdist.manager.heal import fingerprint

__all__ = ["UserState"]


class UserState:
    """The registered ``(load_state_dict, state_dict)`` pairs, by key."""

    def __init__(self) -> None:
        self._load: dict[str, Callable[[Any], None]] = {}
        self._save: dict[str, Callable[[], Any]] = {}

    def register(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Register one pair under ``key``.

        Raises:
            TypeError: either function is not callable.
            ValueError: ``key`` is already registered.
        """
        if not callable(load_state_dict) or not callable(state_dict):
            raise TypeError(
                f"load_state_dict and state_dict for {key!r} must be callables, got "
                f"{type(load_state_dict).__name__} and {type(state_dict).__name__}"
            )
        if key in self._load:
            raise ValueError(f"a state_dict function is already registered under {key!r}")
        self._load[key] = load_state_dict
        self._save[key] = state_dict

    def replace(
        self,
        load_state_dict: Callable[[Any], None],
        state_dict: Callable[[], Any],
        key: str = "default",
    ) -> None:
        """Register ``key``, replacing what was registered under it.

        Raises:
            TypeError: either function is not callable.
        """
        self._load.pop(key, None)
        self._save.pop(key, None)
        self.register(key, load_state_dict, state_dict)

    def __bool__(self) -> bool:
        return bool(self._save)

    def save(self) -> dict[str, Any]:
        """Every registered state, by key."""
        return {key: fn() for key, fn in self._save.items()}

    def load(self, states: dict[str, Any]) -> None:
        """Load ``states`` (as :meth:`save` returned them) under their keys.

        Raises:
            KeyError: a registered key is missing from ``states``.
        """
        for key, load in self._load.items():
            if key not in states:
                raise KeyError(
                    f"the received state has no {key!r} part (it has "
                    f"{sorted(states)}); every replica must register the same keys"
                )
            load(states[key])

    def fingerprint(self) -> dict[str, int]:
        """CRC-32 of each part of the current state (see :func:`~ftdist.manager.heal.fingerprint`)."""
        return fingerprint({"user": self.save()})
