"""Shared helpers for the lighthouse integration tests: servers on port 0,
clients that are always closed, threads that are always joined."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import ModuleType
from typing import Any

from ftdist.coordination import LighthouseClient, LighthouseServer, Quorum
from ftdist.errors import CoordinationError

TIMEOUT = 20.0  # seconds; generous, only hit when something is broken


def wait_for_status(
    lighthouse: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 60.0
) -> bool:
    """Poll ``lighthouse``'s status until ``predicate`` holds for it.

    ``lighthouse`` may list replicas of a replicated lighthouse
    (comma-separated): the status polled is then the leader's, the only one
    that holds heartbeats and waiting requests.

    Returns:
        Whether it held within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    replicas = [a for a in lighthouse.split(",") if a]
    while time.monotonic() < deadline:
        for address in replicas:
            try:
                with LighthouseClient(address, 2.0) as client:
                    while time.monotonic() < deadline:
                        document = client.status()
                        replication = document.get("replication")
                        if replication is not None and replication.get("role") != "leader":
                            break
                        if predicate(document):
                            return True
                        time.sleep(0.02)
            except (CoordinationError, TimeoutError):
                continue  # a replica that is down or restarting: try the next
        time.sleep(0.05)
    return False


def wait_for_quorum_request(lighthouse: str, other_than: str, timeout: float = 60.0) -> bool:
    """Wait until a replica group whose id does not start with ``other_than``
    has a quorum request waiting at ``lighthouse``.

    A survivor that holds for a restart must go on only then: a restart that
    only heartbeats is left out of a fast quorum (every previous member asked
    again), and one that is slow to reach its first quorum (a fresh process
    on a loaded machine) would miss every quorum of a survivor going on alone.

    Returns:
        Whether one was seen within ``timeout`` seconds.
    """
    return wait_for_status(
        lighthouse,
        lambda s: any(not w["replica_id"].startswith(other_than) for w in s.get("waiting", [])),
        timeout,
    )


def wait_for_heartbeats(lighthouse: str, count: int, timeout: float = 60.0) -> bool:
    """Wait until at least ``count`` replica groups heartbeat ``lighthouse``.

    A job's first quorum waits (up to the join timeout) only for groups the
    lighthouse already hears; a group whose process starts a second late on a
    loaded machine is simply not in it. Harnesses that need every group in
    the first quorum start training only after this returns True.

    Returns:
        Whether ``count`` healthy heartbeats were seen within ``timeout`` seconds.
    """
    return wait_for_status(
        lighthouse, lambda s: int(s.get("num_heartbeating", 0)) >= count, timeout
    )


def hold_port(port: int = 0) -> socket.socket:
    """A TCP socket bound on 127.0.0.1 at ``port`` (0: any free one) that never
    listens: connections there are refused, and while it is open no server of
    a test running beside this one can be given the port. For tests that need
    an address to stay dead, such as a stopped server's (one test's client
    once "reached" a stopped server's port that another test had been given).
    The caller closes it.

    Raises:
        OSError: ``port`` is taken.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # A stopped server's closed connections may linger in TIME_WAIT on the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


class Lighthouses:
    """Starts lighthouses and clients for one test, and closes them all."""

    def __init__(self) -> None:
        self.servers: list[LighthouseServer] = []
        self.clients: list[LighthouseClient] = []

    def server(self, **kwargs: Any) -> LighthouseServer:
        kwargs.setdefault("bind", "127.0.0.1:0")
        kwargs.setdefault("min_replicas", 1)
        kwargs.setdefault("http_port", -1)
        server = LighthouseServer(**kwargs)
        self.servers.append(server)
        return server

    def client(
        self, server_or_addr: LighthouseServer | str, connect_timeout: float = 10.0
    ) -> LighthouseClient:
        addr = server_or_addr if isinstance(server_or_addr, str) else server_or_addr.address()
        client = LighthouseClient(addr, connect_timeout)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for server in self.servers:
            server.shutdown()


@contextmanager
def pool(workers: int) -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """A thread pool that is joined before the test ends."""
    executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="test-worker")
    try:
        yield executor
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def quorum_round(
    client: LighthouseClient, replica_ids: list[str], timeout: float = TIMEOUT, **kwargs: Any
) -> dict[str, Quorum]:
    """Ask for a quorum for every replica at once and return each answer."""
    with pool(len(replica_ids)) as executor:
        futures = {
            rid: executor.submit(client.quorum, rid, timeout, **kwargs) for rid in replica_ids
        }
        return {rid: future.result(timeout + 5) for rid, future in futures.items()}


def member_ids(quorum: Quorum) -> list[str]:
    return [m.replica_id for m in quorum.participants]


def wait_until(predicate: Callable[[], bool], timeout: float = TIMEOUT, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        return json.loads(response.read())


class Heartbeater:
    """Heartbeats some replica ids from a thread until stopped."""

    def __init__(
        self, client: LighthouseClient, replica_ids: list[str], period: float = 0.05
    ) -> None:
        self._client = client
        self._ids = list(replica_ids)
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for rid in self._ids:
                try:
                    self._client.heartbeat(rid, timeout=2.0)
                except Exception:
                    pass  # the lighthouse may be going down in this test
            self._stop.wait(self._period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def torchft_manager_server(tft: ModuleType, lighthouse: str, replica_id: str) -> Any:
    """torchft's Rust manager server for a replica group of one rank, on any free port,
    its store advertised as ``store:1`` (``tft``: torchft's native module)."""
    return tft.ManagerServer(
        replica_id=replica_id,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="store:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=5),
        quorum_retries=0,
    )
