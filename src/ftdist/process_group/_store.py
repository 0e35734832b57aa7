"""Store addresses: ``host:port/prefix`` parsing and client creation."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


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


# One client connection per store server, shared by every configure: a new
# TCPStore connection costs a millisecond and, on hosts whose resolver drops
# reverse lookups, an occasional multi-second stall.
_CLIENTS: dict[tuple[str, int], dist.TCPStore] = {}
_CLIENTS_LOCK = threading.Lock()


def _client(host: str, port: int, timeout: timedelta, reuse: bool) -> dist.TCPStore:
    key = (host, port)
    with _CLIENTS_LOCK:
        tcp = _CLIENTS.get(key) if reuse else None
        if tcp is None:
            tcp = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                timeout=timeout)
            if reuse:
                _CLIENTS[key] = tcp
    tcp.set_timeout(timeout)
    return tcp


def forget_store_client(store_addr: str) -> None:
    """Drop the shared connection to a store (after it failed), so the next use reconnects."""
    addr = parse_store_addr(store_addr)
    with _CLIENTS_LOCK:
        _CLIENTS.pop((addr.host, addr.port), None)


def create_store_client(
    store_addr: str, timeout: timedelta = timedelta(seconds=60), reuse: bool = True
) -> dist.Store:
    """Connect to the TCPStore at ``host:port/prefix`` and return a ``PrefixStore``.

    Args:
        store_addr: ``host:port/prefix``; see :func:`parse_store_addr`.
        timeout: how long store operations (and the connect) may block.
        reuse: share one connection per ``host:port`` in this process.

    Raises:
        ValueError: malformed address (before any connection is tried).
        RuntimeError: the store could not be reached within ``timeout``
            (``torch.distributed.DistStoreError``).
    """
    addr = parse_store_addr(store_addr)
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
    return dist.PrefixStore(addr.prefix, _client(addr.host, addr.port, timeout, reuse))
