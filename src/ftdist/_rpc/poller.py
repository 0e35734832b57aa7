"""
epoll with an object per descriptor
===================================

What :mod:`selectors` does for :mod:`ftdist._rpc.h2_server`, less its
per-event bookkeeping (a key object looked up and rebuilt for every event),
which shows when the server handles one event per gRPC call.
"""

from __future__ import annotations

import select
import socket
from typing import Any

__all__ = ["ERROR", "READ", "WRITE", "Poller"]

READ = select.EPOLLIN
WRITE = select.EPOLLOUT
ERROR = select.EPOLLERR | select.EPOLLHUP


class Poller:
    """An epoll set whose events come back as the object registered with
    each descriptor.

    Raises:
        KeyError: (from :meth:`modify` and :meth:`unregister`) for a
            descriptor that is not registered or already closed.
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._targets: dict[int, Any] = {}

    def register(self, sock: socket.socket, events: int, target: Any) -> None:
        """Watch ``sock`` for ``events`` (READ, WRITE); report them as ``target``."""
        fd = sock.fileno()
        self._epoll.register(fd, events)
        self._targets[fd] = target

    def modify(self, sock: socket.socket, events: int, target: Any) -> None:
        """Change what ``sock`` is watched for."""
        fd = sock.fileno()
        if fd < 0 or fd not in self._targets:
            raise KeyError(fd)
        self._epoll.modify(fd, events)
        self._targets[fd] = target

    def unregister(self, sock: socket.socket) -> None:
        """Stop watching ``sock``; call before closing it."""
        fd = sock.fileno()
        if self._targets.pop(fd, _MISSING) is _MISSING:
            raise KeyError(fd)
        self._epoll.unregister(fd)

    def select(self, timeout: float) -> list[tuple[Any, int]]:
        """Wait up to ``timeout`` seconds; (target, events) of what is ready."""
        targets = self._targets
        ready = []
        for fd, mask in self._epoll.poll(timeout):
            target = targets.get(fd, _MISSING)
            if target is not _MISSING:
                # An error or hang-up reads as readable: recv() then says which.
                ready.append((target, mask | READ if mask & ERROR else mask))
        return ready

    def close(self) -> None:
        """Close the epoll set."""
        self._epoll.close()
        self._targets.clear()


_MISSING = object()
