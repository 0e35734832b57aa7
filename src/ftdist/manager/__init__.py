"""
The Manager
===========

Everything that runs the fault-tolerant step protocol of one replica group:

* :mod:`~ftdist.manager.manager`: :class:`Manager`, one per rank: quorum,
  allreduce, commit vote; :mod:`~ftdist.manager.round`: each step's quorum
  round, on the quorum thread.
* :mod:`~ftdist.manager.allreduce_result`: what its allreduce returns;
  :mod:`~ftdist.manager.lazy_work`: today's torchft's lazy
  ``_ManagedWork``, for code that builds one; :mod:`~ftdist.manager.internals`:
  torchft's private Manager attributes.
* :mod:`~ftdist.manager.state`: the user state it moves and the
  consistency parts it compares; :mod:`~ftdist.manager.membership`: the
  process group following the quorum.
* :mod:`~ftdist.manager.config`: :class:`ManagerConfig`, every setting
  resolved once (argument > environment > default).
* :mod:`~ftdist.manager.bootstrap`: the replica group's store, server and
  client; :mod:`~ftdist.manager.news`: the lighthouse's failure news.
* :mod:`~ftdist.manager.heal`: heals, their timelines, loading a received
  state and checking it; :mod:`~ftdist.manager.fingerprint`: state
  fingerprints and the heal check's plan.
* :mod:`~ftdist.manager.server` / :mod:`~ftdist.manager.client`: the replica
  group's :class:`ManagerServer` (in group rank 0) and its client, speaking
  torchft's ``torchft.ManagerService``; :mod:`~ftdist.manager.rule`: the pure
  per-rank quorum rule the server applies.

Invariants:

* **The step moves only on a commit.** ``should_commit()`` is an AND of every
  group rank's vote; a step with an error, or with fewer participants than
  ``min_replica_size``, changes nothing.
* **Errors inside a step are values.** A failed collective or transfer is
  recorded and makes the vote no; it never raises into the training loop.
  Misuse raises at once.
* **Healing is whole.** A replica behind the quorum's max step receives the
  state of an up-to-date peer and loads it before it votes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftdist.manager.allreduce_result import AllreduceResult
    from ftdist.manager.client import ManagerClient
    from ftdist.manager.config import (
        CONNECT_TIMEOUT_SEC_ENV,
        IS_TRITON_AVAILABLE,
        MANAGER_ADDR_KEY,
        MANAGER_PORT_ENV,
        QUORUM_RETRIES_ENV,
        QUORUM_TIMEOUT_SEC_ENV,
        REPLICA_ID_KEY,
        TIMEOUT_SEC_ENV,
        TORCH_FR_DUMP_TEMP_FILE_ENV,
        ManagerConfig,
        extract_trailing_digits,
        get_timeout,
    )
    from ftdist.manager.heal import HealTimeline
    from ftdist.manager.lazy_work import (
        _ManagedFuture as _ManagedFuture,
    )
    from ftdist.manager.lazy_work import (
        _ManagedWork as _ManagedWork,
    )
    from ftdist.manager.lazy_work import (
        _ManagerLogger as _ManagerLogger,
    )
    from ftdist.manager.lazy_work import (
        _SimpleFuture as _SimpleFuture,
    )
    from ftdist.manager.manager import ExceptionWithTraceback, Manager, WorldSizeMode
    from ftdist.manager.server import ManagerServer
    from ftdist.process_group.work import CompletedWork as _DummyWork  # noqa: F401

# Loaded on first use: the lighthouse and the command line import the
# server and client modules of this package, and must not pay for torch.
_EXPORTS: dict[str, str | tuple[str, str]] = {
    "AllreduceResult": "ftdist.manager.allreduce_result",
    "CONNECT_TIMEOUT_SEC_ENV": "ftdist.manager.config",
    "IS_TRITON_AVAILABLE": "ftdist.manager.config",
    "TORCH_FR_DUMP_TEMP_FILE_ENV": "ftdist.manager.config",
    "extract_trailing_digits": "ftdist.manager.config",
    "get_timeout": "ftdist.manager.config",
    "_DummyWork": ("ftdist.process_group.work", "CompletedWork"),
    "MANAGER_ADDR_KEY": "ftdist.manager.config",
    "MANAGER_PORT_ENV": "ftdist.manager.config",
    "QUORUM_RETRIES_ENV": "ftdist.manager.config",
    "QUORUM_TIMEOUT_SEC_ENV": "ftdist.manager.config",
    "REPLICA_ID_KEY": "ftdist.manager.config",
    "TIMEOUT_SEC_ENV": "ftdist.manager.config",
    "ExceptionWithTraceback": "ftdist.manager.manager",
    "HealTimeline": "ftdist.manager.heal",
    "Manager": "ftdist.manager.manager",
    "ManagerClient": "ftdist.manager.client",
    "ManagerConfig": "ftdist.manager.config",
    "ManagerServer": "ftdist.manager.server",
    "WorldSizeMode": "ftdist.manager.config",
    "_ManagedFuture": "ftdist.manager.lazy_work",
    "_ManagedWork": "ftdist.manager.lazy_work",
    "_ManagerLogger": "ftdist.manager.lazy_work",
    "_SimpleFuture": "ftdist.manager.lazy_work",
}


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'ftdist.manager' has no attribute {name!r}")
    module, attr = (where, name) if isinstance(where, str) else where
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "CONNECT_TIMEOUT_SEC_ENV",
    "IS_TRITON_AVAILABLE",
    "MANAGER_ADDR_KEY",
    "MANAGER_PORT_ENV",
    "QUORUM_RETRIES_ENV",
    "QUORUM_TIMEOUT_SEC_ENV",
    "REPLICA_ID_KEY",
    "TIMEOUT_SEC_ENV",
    "TORCH_FR_DUMP_TEMP_FILE_ENV",
    "AllreduceResult",
    "ExceptionWithTraceback",
    "HealTimeline",
    "Manager",
    "ManagerClient",
    "ManagerConfig",
    "ManagerServer",
    "WorldSizeMode",
    "extract_trailing_digits",
    "get_timeout",
]
