"""Store addresses: ``host:port/prefix`` parsing, client creation, and the
listening address of a replica group's own store."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ftdist._advertise import log_advertised
from ftdist.process_group import config


@dataclass(frozen=True)
class StoreAddress:
    """A parsed ``host:port/prefix`` store address.

    Attributes:
        host: hostname, IPv4 address, or IPv6 address without brackets.
        port: TCP port of the TCPStore server.
        prefix: key prefix that isolates one configure from another.
    """

    host: str
    port: int
    prefix: str

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}/{self.prefix}"


def parse_store_addr(store_addr: str) -> StoreAddress:
    """Parse ``host:port/prefix`` (``[v6]:port/prefix`` and bare v6 hosts too).

    The port is whatever follows the last ``:`` before the first ``/``, so a
    bracket-less IPv6 host such as ``fd00::1:29500/x`` also parses.

    Raises:
        TypeError: ``store_addr`` is not a str.
        ValueError: the address has no port, a non-numeric or out-of-range
            port, an empty host or an empty prefix; the message names the value
            and the expected form.
    """
    if not isinstance(store_addr, str):
        raise TypeError(f"store_addr must be a str like 'host:port/prefix', got {store_addr!r}")
    fix = "expected 'host:port/prefix', e.g. 'localhost:29500/ftdist/0' or '[::1]:29500/ftdist/0'"
    hostport, sep, prefix = store_addr.partition("/")
    if not sep or not prefix:
        raise ValueError(f"store_addr {store_addr!r} has no '/prefix'; {fix}")
    host, colon, port_s = hostport.rpartition(":")
    if not colon or not port_s.isdigit():
        raise ValueError(f"store_addr {store_addr!r} has no numeric port; {fix}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"store_addr {store_addr!r} has an unclosed '['; {fix}")
        host = host[1:-1]
    if not host:
        raise ValueError(f"store_addr {store_addr!r} has an empty host; {fix}")
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"store_addr {store_addr!r} has port {port} outside 1..65535; {fix}")
    return StoreAddress(host, port, prefix)


class StoreClients:
    """The store connections of one process group, reused across its configures.

    A new TCPStore connection costs a millisecond and, on hosts whose
    resolver drops reverse lookups, an occasional multi-second stall; a group
    reconfigures against the same store again and again. Connections are not
    shared between groups: a TCPStore client runs one request at a time, so
    two groups in a rendezvous at once would block each other.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, int], dist.TCPStore] = {}

    def client(self, store_addr: str, timeout: timedelta) -> dist.Store:
        """A ``PrefixStore`` for ``store_addr`` on this group's connection.

        Raises:
            ValueError: malformed address.
            RuntimeError: the store is unreachable within ``timeout``.
        """
        addr = parse_store_addr(store_addr)
        key = (addr.host, addr.port)
        with self._lock:
            tcp = self._clients.get(key)
            if tcp is None:
                tcp = dist.TCPStore(
                    addr.host, addr.port, is_master=False, wait_for_workers=False, timeout=timeout
                )
                self._clients[key] = tcp
        tcp.set_timeout(timeout)
        return dist.PrefixStore(addr.prefix, tcp)

    def forget(self, store_addr: str) -> None:
        """Drop the connection to a store that failed; the next use reconnects."""
        try:
            addr = parse_store_addr(store_addr)
        except (TypeError, ValueError):
            return
        with self._lock:
            self._clients.pop((addr.host, addr.port), None)


def _store_classes() -> tuple[Any, Any]:
    # Looked up on the package at call time, so that torchft-style tests can
    # patch ftdist.process_group.TCPStore / PrefixStore.
    package = sys.modules.get("ftdist.process_group")
    return (
        getattr(package, "TCPStore", dist.TCPStore),
        getattr(package, "PrefixStore", dist.PrefixStore),
    )


def create_store_client(store_addr: str, timeout: timedelta = timedelta(seconds=60)) -> dist.Store:
    """Connect to the TCPStore at ``host:port/prefix`` and return a ``PrefixStore``.

    Args:
        store_addr: ``host:port/prefix``; see :func:`parse_store_addr`.
        timeout: how long store operations (and the connect) may block.

    Raises:
        ValueError: malformed address (before any connection is tried).
        TypeError: ``timeout`` is not a timedelta.
        RuntimeError: the store could not be reached within ``timeout``
            (``torch.distributed.DistStoreError``).
    """
    addr = parse_store_addr(store_addr)
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
    tcp_store, prefix_store = _store_classes()
    tcp = tcp_store(
        host_name=addr.host,
        port=addr.port,
        is_master=False,
        wait_for_workers=False,
        timeout=timeout,
    )
    store: dist.Store = prefix_store(addr.prefix, tcp)
    return store


def store_bind_host(hostname: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The address a replica group's own TCPStore listens on; None for every interface.

    A TCPStore has no authentication, so it listens only where its peers
    reach it: ``FTDIST_STORE_BIND`` when set (``0.0.0.0`` or ``::`` for every
    interface), else the advertised ``hostname`` when it is an IP address
    (``127.0.0.1`` keeps a single-host job on loopback), else the one
    address ``hostname`` resolves to when that is not a loopback address.
    A name that resolves to loopback (as Debian maps the host's own name)
    or to several addresses gives no safe choice: every interface, as
    torch does.

    Args:
        hostname: the name peers use for this host.
        environ: the environment to read (``os.environ`` when None).

    Returns:
        An IP address, or None.
    """
    explicit = config.store_bind(environ)
    if explicit:
        return None if explicit in ("0.0.0.0", "::", "*") else explicit
    candidate = hostname.strip().strip("[]")
    try:
        literal = ipaddress.ip_address(candidate)
    except ValueError:
        pass
    else:
        return None if literal.is_unspecified else candidate
    try:
        infos = socket.getaddrinfo(candidate, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    addresses = {str(info[4][0]) for info in infos}
    if len(addresses) != 1:
        return None
    (address,) = addresses
    try:
        resolved = ipaddress.ip_address(address)
    except ValueError:  # a scoped IPv6 address: leave it to torch
        return None
    return None if resolved.is_loopback else address


def host_store(
    hostname: str, timeout: timedelta, environ: Mapping[str, str] | None = None
) -> dist.TCPStore:
    """Start a TCPStore server on a free port of :func:`store_bind_host`'s address.

    Args:
        hostname: the name peers use for this host.
        timeout: the store's operation timeout.
        environ: the environment to read (``os.environ`` when None).

    Returns:
        The store (its ``port`` is the bound port).

    Raises:
        OSError: the address cannot be bound.
        RuntimeError: torch cannot start the store.
    """
    host = store_bind_host(hostname, environ)
    if host is None:
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        log_advertised("a process-group store", hostname, store.port)
        return store
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here on and closes it
    try:
        store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=fd,
        )
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    log_advertised("a process-group store", hostname, port)
    return store
