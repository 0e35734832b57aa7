"""
Starting a Manager: the replica group's store, server, client and news
=======================================================================

Group rank 0 starts the replica group's :class:`ManagerServer` and publishes
its address in the replica group's store; every rank reads it and connects.
Store keys live under the torchelastic restart count, so ranks restarted by
torchrun never read the address of the server that died with the previous
attempt. Group rank 0 also writes torchft's unprefixed ``manager_addr`` and
``replica_id``, and a first attempt accepts them, so a store prepared the
torchft way (or a torchft rank 0) works too.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ftdist._advertise import log_advertised
from ftdist.manager.client import ManagerClientLike
from ftdist.manager.config import MANAGER_ADDR_KEY, REPLICA_ID_KEY, ManagerConfig
from ftdist.manager.news import FailureNews
from ftdist.manager.server import ManagerServer
from ftdist.process_group._store import host_store

logger = logging.getLogger(__name__)

# Where group rank 0 tells the other ranks the lighthouse's address (for
# failure news); absent in a store prepared the torchft way.
LIGHTHOUSE_ADDR_KEY = "lighthouse_addr"


@dataclass
class Bootstrap:
    """What a Manager needs from its replica group.

    Attributes:
        server: the group's ManagerServer (group rank 0 of a real group).
        client: this rank's client of it.
        replica_id: the group's full id (with its uuid).
        news: the lighthouse's failure news, followed on a thread.
        connect: opens a client to another replica group's manager (a heal
            source).
        own_store: the store this rank hosts (a group of one), kept alive.
    """

    server: ManagerServer | None
    client: ManagerClientLike
    replica_id: str
    news: FailureNews
    connect: Callable[[str], ManagerClientLike]
    own_store: dist.TCPStore | None = None


def _class(name: str) -> Any:
    # Looked up on the package at call time, as torchft's Manager does, so
    # that code patching ``ftdist.manager.ManagerClient`` reaches it.
    import ftdist.manager as package

    return getattr(package, name)


def connect_client(address: str, connect_timeout: timedelta) -> ManagerClientLike:
    """A client of the manager server at ``address``.

    Raises:
        CoordinationError: the server is unreachable within ``connect_timeout``.
    """
    client: ManagerClientLike = _class("ManagerClient")(address, connect_timeout)
    return client


def await_keys(
    store: dist.Store, fallback: dist.Store | None, timeout: timedelta
) -> tuple[str, str]:
    """The manager address and replica id, from ``store`` or else ``fallback``.

    Group rank 0 publishes them; the other ranks poll for them (a blocking
    ``get`` could wait on one store while the keys appear in the other).

    Raises:
        torch.distributed.DistStoreError: neither store has them within ``timeout``.
    """
    keys = [MANAGER_ADDR_KEY, REPLICA_ID_KEY]
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.001
    while True:
        for source in (store, fallback):
            if source is not None and source.check(keys):
                addr, rid = (source.get(key).decode() for key in keys)
                return addr, rid
        if time.monotonic() > deadline:
            raise dist.DistStoreError(
                f"group rank 0 did not publish {keys} in the replica group's store within "
                f"{timeout}: is group rank 0 running, with the same MASTER_ADDR/MASTER_PORT?"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def bootstrap(
    config: ManagerConfig,
    replica_id: str | None,
    on_failed: Callable[[str, str], None],
    client: ManagerClientLike | None = None,
) -> Bootstrap:
    """Join (or host) the replica group's store, start the server on rank 0, connect.

    With ``client`` (the test seam) nothing is started or joined: that
    client answers everything, heal sources included.

    Raises:
        RuntimeError: the store or the server is unreachable.
        CoordinationError: the lighthouse is unreachable (rank 0).
    """
    if client is not None:
        fake = client
        rid = replica_id or "replica"
        news = FailureNews(None, rid, on_failed, config.connect_timeout)
        return Bootstrap(None, fake, rid, news, lambda address: fake)
    own: dist.TCPStore | None = None
    if config.store_addr is None:
        # No authentication: it listens only where peers reach it (see host_store).
        own = host_store(config.hostname, config.connect_timeout)
        tcp: dist.Store = own
        advertised = f"{config.hostname}:{own.port}"
    else:
        tcp = dist.TCPStore(
            config.store_addr,
            int(config.store_port or 0),
            is_master=False,
            wait_for_workers=False,
            timeout=config.connect_timeout,
        )
        advertised = f"{config.store_addr}:{config.store_port}"
    store = dist.PrefixStore(f"ftdist/manager/{config.restart_attempt}", tcp)

    server = None
    if config.group_rank == 0:
        full_id = f"{replica_id}:{uuid.uuid4()}" if replica_id else str(uuid.uuid4())
        if not config.lighthouse_addr:
            raise ValueError("group rank 0 needs a lighthouse address (FTDIST_LIGHTHOUSE)")
        server = _class("ManagerServer")(
            replica_id=full_id,
            lighthouse_addr=config.lighthouse_addr,
            hostname=config.hostname,
            bind=f"[::]:{config.port}",
            store_addr=advertised,
            world_size=config.group_world_size,
            heartbeat_interval=config.heartbeat_interval,
            connect_timeout=config.connect_timeout,
            quorum_retries=config.quorum_retries,
        )
        log_advertised(
            "the manager server", config.hostname, int(server.address().rsplit(":", 1)[1])
        )
        store.set(LIGHTHOUSE_ADDR_KEY, config.lighthouse_addr)
        store.set(MANAGER_ADDR_KEY, server.address())
        store.set(REPLICA_ID_KEY, full_id)
        # torchft's keys, unprefixed, for tools and torchft-style ranks.
        tcp.set(MANAGER_ADDR_KEY, server.address())
        tcp.set(REPLICA_ID_KEY, full_id)
    try:
        # A first attempt may also read torchft's unprefixed keys (a store
        # prepared the torchft way); a restarted one never does: they may
        # name the server that died with the previous attempt.
        manager_addr, full_id = await_keys(
            store, tcp if config.restart_attempt == "0" else None, config.connect_timeout
        )
        lighthouse = config.lighthouse_addr
        if not lighthouse and store.check([LIGHTHOUSE_ADDR_KEY]):
            lighthouse = store.get(LIGHTHOUSE_ADDR_KEY).decode() or None
        # Rank 0 hosts the server: its calls need no network hop.
        real = (
            server.local_client()
            if server is not None and hasattr(server, "local_client")
            else connect_client(manager_addr, config.connect_timeout)
        )
    except Exception:
        if server is not None:
            server.shutdown()
        raise
    news = FailureNews(lighthouse, full_id, on_failed, config.connect_timeout)

    def connect(address: str) -> ManagerClientLike:
        return connect_client(address, config.connect_timeout)

    return Bootstrap(server, real, full_id, news, connect, own)
