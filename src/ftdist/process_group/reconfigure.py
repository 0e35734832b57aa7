"""
Reconfiguring by handles (torchft's current API)
================================================

Besides ``configure(store_addr, rank, world_size)``, every ftdist group
speaks the reconfiguration API of today's torchft:

* ``pg.get_reconfigure_handle()``: a JSON string naming this group (a fixed
  id), a TCPStore it hosts (``host:port``) and its global rank, if known.
* ``pg.reconfigure(opts)``: ``opts.handles`` lists every member's handle in
  rank order; this group's rank is the index of its own handle, and all
  members meet on the first handle's store under the prefix
  ``ftdist/{opts.uuid}`` (torchft's groups use ``torchft/{uuid}``; the two
  kinds never share a rendezvous). Returns a completed Work.
* :func:`reconfigure_with_store`: exchange the handles through a store and
  reconfigure, for code without a Manager (the Manager exchanges them
  through the lighthouse).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch._C._distributed_c10d as c10d

from ftdist._durations import as_timedelta


@dataclass
class _ReconfigureOptions:
    """What a reconfiguration needs; torch's own class where torch has one (>= 2.14).

    Args:
        uuid: the communicator id; members meet under ``ftdist/{uuid}``.
        handles: every member's :meth:`get_reconfigure_handle`, in rank
            order (a list: the order is the rank assignment).
        timeout: how long the rendezvous may take (None: the group's timeout).
        hints: backend hints (unused by ftdist groups).
    """

    uuid: int = 0
    handles: list[str] = field(default_factory=list)
    timeout: timedelta | None = None
    hints: dict[str, str] = field(default_factory=dict)


ReconfigureOptions: Any = getattr(c10d, "ReconfigureOptions", None) or _ReconfigureOptions

DEFAULT_RECONFIGURE_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class Rendezvous:
    """Where and as what a group meets its peers, read from the handles.

    Args:
        store_addr: ``host:port/ftdist/{uuid}`` on the first handle's store.
        rank: this group's rank: the index of its own handle.
        world_size: the number of handles.
        uuid: the communicator id.
        global_ranks: every member's global rank, if all handles carry one.
    """

    store_addr: str
    rank: int
    world_size: int
    uuid: int
    global_ranks: list[int] | None


def make_handle(handle_id: str, host: str, store_port: int, global_rank: int | None) -> str:
    """The JSON handle of a group whose rendezvous store listens at ``host:store_port``."""
    shown = f"[{host}]" if ":" in host else host
    return json.dumps(
        {
            "id": handle_id,
            "store": f"{shown}:{store_port}",
            "global_rank": global_rank,
        }
    )


def rendezvous(opts: Any, handle_id: str) -> Rendezvous:
    """Read a group's rank and meeting place from ``opts.handles``.

    Raises:
        ValueError: ``handles`` is not a list, is empty, holds a handle that
            is not one of :meth:`get_reconfigure_handle`'s, or lacks this
            group's own handle.
    """
    handles = opts.handles
    if not isinstance(handles, list):
        raise ValueError(
            "torchft process groups require ordered handles: ReconfigureOptions.handles must "
            f"be a list in rank order, got {type(handles).__name__}"
        )
    if not handles:
        raise ValueError(
            "ReconfigureOptions.handles is empty; list every member's get_reconfigure_handle(), "
            "this group's included"
        )
    peers = []
    for handle in handles:
        try:
            peer = json.loads(handle)
            peers.append((str(peer["id"]), str(peer["store"]), peer.get("global_rank")))
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(
                f"{handle!r} is not a reconfigure handle (a get_reconfigure_handle() string)"
            ) from exc
    ids = [p[0] for p in peers]
    if handle_id not in ids:
        raise ValueError(
            f"this group's handle (id {handle_id}) is not among the {len(ids)} handles; list "
            "every member's get_reconfigure_handle(), this group's included"
        )
    global_ranks = [p[2] for p in peers]
    return Rendezvous(
        store_addr=f"{peers[0][1]}/ftdist/{int(opts.uuid)}",
        rank=ids.index(handle_id),
        world_size=len(peers),
        uuid=int(opts.uuid),
        global_ranks=None if any(g is None for g in global_ranks) else global_ranks,
    )


def reconfigure_with_store(
    pg: Any,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta | float = DEFAULT_RECONFIGURE_TIMEOUT,
) -> None:
    """Exchange reconfigure handles through a store, then reconfigure ``pg``.

    Every member calls this with the same ``store_addr`` (unique per
    reconfiguration, e.g. ``localhost:1234/my/prefix/1``), its own ``rank``
    and the same ``world_size``.

    Args:
        pg: the group (anything with ``get_reconfigure_handle`` and
            ``reconfigure``).
        store_addr: ``host:port/prefix`` of the store to exchange handles on.
        rank: this member's rank.
        world_size: the number of members.
        timeout: how long the exchange may take (a timedelta or seconds).

    Raises:
        TypeError/ValueError: invalid rank, world size, timeout or address
            (before any connection).
        torch.distributed.DistStoreError: a member did not post its handle
            within ``timeout`` (``pg`` is left as it was).
        torch.distributed.DistNetworkError: the store could not be reached
            within ``timeout`` (``pg`` is left as it was).
        RuntimeError: the reconfiguration itself failed.
    """
    from ftdist.process_group import create_store_client
    from ftdist.process_group.base import validate_topology

    validate_topology(rank, world_size)
    timeout = as_timedelta(timeout, "timeout")
    store = create_store_client(store_addr, timeout)
    store.set(f"handle/{rank}", pg.get_reconfigure_handle())
    if rank == 0:
        store.set("uuid", str(random.getrandbits(63)))
    keys = ["uuid", *(f"handle/{peer}" for peer in range(world_size))]
    store.wait(keys, timeout)
    communicator_id, *handles = store.multi_get(keys)
    opts = ReconfigureOptions()
    opts.uuid = int(communicator_id)
    opts.handles = [h.decode("utf-8") for h in handles]
    opts.timeout = timeout
    pg.reconfigure(opts).wait()


__all__ = [
    "ReconfigureOptions",
    "Rendezvous",
    "make_handle",
    "reconfigure_with_store",
    "rendezvous",
]
