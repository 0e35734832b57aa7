"""
Registering groups with torch by name
=====================================

Functional collectives, ``torch.compile``'d code and DeviceMesh find a group
by its name in torch's registry. :func:`register` puts an ftdist group there:

* With a default process group (``init_process_group`` was called), the
  group is created through ``torch.distributed.new_group`` on a backend
  named ``"{getBackendName()}:{name}"`` that hands back the group itself, as
  torchft does. torch then names it after its group counter, like every
  group it creates: right after registering,
  ``pg.group_name == str(dist.get_pg_count() - 1)``, and
  ``"{backend}:{name}"`` is its ``group_desc``.
* Without one (ftdist needs none), the group is registered directly under
  ``"{getBackendName()}:{name}"``, which is then its ``group_name``.
"""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta
from typing import Any, cast

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world


class _OwnRanks(dict):  # type: ignore[type-arg]
    """torch's global-to-group rank table for an ftdist group: the identity.

    It follows the group's current size, so nothing needs updating when the
    group is reconfigured or its size changes (a ManagedProcessGroup's size
    is the number of participating replicas).
    """

    def __init__(self, pg: Any) -> None:
        super().__init__()
        self._pg = weakref.ref(pg)

    def _size(self) -> int:
        pg = self._pg()
        return pg.size() if pg is not None else 0

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and 0 <= rank < self._size()

    def __getitem__(self, rank: int) -> int:
        if rank not in self:
            raise KeyError(rank)
        return rank

    def items(self):  # type: ignore[no-untyped-def]
        return [(r, r) for r in range(self._size())]

    def __len__(self) -> int:
        return self._size()

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self._size()))


# backend name -> the group that currently answers to it
_claims: dict[str, weakref.ref[Any]] = {}
_lock = threading.Lock()


def _claim(backend_name: str, pg: Any) -> None:
    with _lock:
        ref = _claims.get(backend_name)
        owner = ref() if ref is not None else None
        if owner is not None and owner is not pg:
            raise RuntimeError(
                f"another group is registered as {backend_name!r}; unregister it or pick "
                "another name"
            )
        _claims[backend_name] = weakref.ref(pg)


def _release(backend_name: str) -> None:
    with _lock:
        _claims.pop(backend_name, None)


def _creator(backend_name: str) -> Any:
    def create(store: Any, rank: int, world_size: int, timeout: Any) -> Any:
        ref = _claims.get(backend_name)
        pg = ref() if ref is not None else None
        if pg is None:
            raise RuntimeError(f"no group is being registered as {backend_name!r}")
        return pg

    return create


def _devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    elif torch.xpu.is_available():
        devices.append("xpu")
    return devices


def register(pg: Any, name: str) -> tuple[str, bool]:
    """Put ``pg`` in torch's registry; see the module docstring.

    Returns:
        ``(backend_name, through_world)``: the ``"{backend}:{name}"`` string,
        and whether torch's ``new_group`` created the entry (a default group
        exists) rather than a direct registration.

    Raises:
        RuntimeError: another live group is registered under the same name.
    """
    backend_name = f"{pg.getBackendName()}:{name}"
    _claim(backend_name, pg)
    try:
        if not dist.is_initialized():
            c10d._register_process_group(cast(Any, backend_name), pg)
            pg._set_group_name(backend_name)
            return backend_name, False
        if backend_name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(backend_name, _creator(backend_name), devices=_devices())
        created = dist.new_group(
            ranks=[dist.get_rank()],
            backend=backend_name,
            group_desc=backend_name,
            timeout=timedelta(seconds=60),  # unused: the group keeps its own timeout
        )
        if created is not pg:
            raise RuntimeError(f"torch created another group for {backend_name!r}")
        return backend_name, True
    except BaseException:
        _release(backend_name)
        raise


def unregister(pg: Any, backend_name: str, through_world: bool, group_name: str) -> None:
    """Undo :func:`register`, leaving ``pg`` itself running.

    ``destroy_process_group`` would also shut the group down; this drops
    only torch's records of it, the ones ``new_group`` made.
    """
    try:
        if through_world and _world.pg_map.get(pg) is not None:
            for table in (_world.pg_map, _world.pg_names, _world.pg_backend_config):
                table.pop(pg, None)
            _world.pg_coalesce_state.pop(pg, None)
            tag = _world.pg_to_tag.pop(pg, None)
            for key in {tag, ""} if tag is not None and tag.startswith("ptd:") else {tag}:
                members = _world.tags_to_pg.get(key) if key is not None else None
                if members is not None and pg in members:
                    members.remove(pg)
        c10d._unregister_process_group(cast(Any, group_name))
    finally:
        _release(backend_name)


__all__ = ["_OwnRanks", "register", "unregister"]
