"""
The HTTP server base
====================

:class:`DualStackHTTPServer` is the threading HTTP server every ftdist HTTP
endpoint builds on (the checkpoint server, the lighthouse dashboard, the
parameter server): an ``AF_INET6`` socket that also accepts IPv4 clients on
dual-stack hosts, and a deep accept backlog, so that the burst of
connections of a healing replica group's ranks is not dropped (socketserver's
default backlog of 5 makes a dropped connection wait for TCP's retransmission,
seconds). torchft calls it ``torchft.http._IPv6HTTPServer``;
:mod:`ftdist.http` re-exports it under that name.
"""

from __future__ import annotations

import contextlib
import socket
from http.server import ThreadingHTTPServer

__all__ = ["DualStackHTTPServer"]


class DualStackHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` on ``AF_INET6`` (IPv4 too) with a 1024-deep accept queue.

    Args:
        server_address: ``(host, port)``; ``("", 0)`` listens on every
            address at a free port.
        RequestHandlerClass: the handler class, as for ``ThreadingHTTPServer``.

    Raises:
        OSError: the address cannot be bound.
    """

    address_family = socket.AF_INET6
    request_queue_size = 1024

    def server_bind(self) -> None:
        """Bind, accepting IPv4 clients too when the socket is IPv6."""
        if self.address_family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()
