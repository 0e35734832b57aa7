"""
Starting a Manager: the replica group's store, server, client and news
=======================================================================

Group rank 0 starts the replica group's :class:`ManagerServer` and publishes
its address in the replica group's store; every rank reads it and connects.
Store keys live under the torchelastic restart count, so ranks restarted by
torchrun never read the address of the server that died with the previous
attempt.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ftdist.manager.client import ManagerClient
from ftdist.manager.config import ManagerConfig
from ftdist.manager.news import FailureNews
from ftdist.manager.server import ManagerServer
from ftdist.process_group._store import host_store

logger = logging.getLogger(__name__)


@dataclass
class Bootstrap:
    """What a Manager needs from its replica group."""

    store: dist.Store
    own_store: dist.TCPStore | None
    server: ManagerServer | None
    client: ManagerClient
    replica_id: str
    lighthouse_addr: str | None
    connect_timeout: Any

    def start_news(self, on_failed: Callable[[str, str], None]) -> FailureNews:
        """Follow the lighthouse's failure news, calling ``on_failed`` per dead member."""
        return FailureNews(self.lighthouse_addr, self.replica_id, on_failed, self.connect_timeout)


def bootstrap(settings: ManagerConfig, replica_id: str | None) -> Bootstrap:
    """Connect to (or host) the replica group's store, start the server on rank 0, connect.

    Raises:
        RuntimeError: the store or the server is unreachable.
        CoordinationError: the lighthouse is unreachable (rank 0).
    """
    own: dist.TCPStore | None = None
    if settings.store_addr is None:
        # No authentication: it listens only where peers reach it (see host_store).
        own = host_store(settings.hostname, settings.connect_timeout)
        tcp: dist.Store = own
        advertised = f"{settings.hostname}:{own.port}"
    else:
        tcp = dist.TCPStore(
            settings.store_addr,
            int(settings.store_port or 0),
            is_master=False,
            wait_for_workers=False,
            timeout=settings.connect_timeout,
        )
        advertised = f"{settings.store_addr}:{settings.store_port}"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"ftdist/manager/{attempt}", tcp)

    server = None
    if settings.group_rank == 0:
        full_id = f"{replica_id}:{uuid.uuid4()}" if replica_id else str(uuid.uuid4())
        assert settings.lighthouse_addr
        server = ManagerServer(
            replica_id=full_id,
            lighthouse_addr=settings.lighthouse_addr,
            hostname=settings.hostname,
            bind=f"[::]:{settings.port}",
            store_addr=advertised,
            world_size=settings.group_world_size,
            heartbeat_interval=settings.heartbeat_interval,
            connect_timeout=settings.connect_timeout,
            quorum_retries=settings.quorum_retries,
        )
        store.set("manager_addr", server.address())
        store.set("replica_id", full_id)
        store.set("lighthouse_addr", settings.lighthouse_addr)
    manager_addr = store.get("manager_addr").decode()
    full_id = store.get("replica_id").decode()
    lighthouse = settings.lighthouse_addr or store.get("lighthouse_addr").decode() or None
    try:
        client = ManagerClient(manager_addr, settings.connect_timeout)
    except Exception:
        if server is not None:
            server.shutdown()
        raise
    return Bootstrap(store, own, server, client, full_id, lighthouse, settings.connect_timeout)
