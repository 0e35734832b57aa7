"""
HTTP server base
================

``_IPv6HTTPServer`` (torchft's ``torchft.http`` name): a threading HTTP
server on an IPv6 socket, which also accepts IPv4 clients on dual-stack
hosts, with a deep accept backlog so that many peers can connect at once
(every rank of a healing replica fetches at the same moment).
"""

from __future__ import annotations

import socket
from http.server import ThreadingHTTPServer


class _IPv6HTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` on ``AF_INET6`` with a 1024-deep accept queue.

    Args:
        server_address: ``(host, port)``; ``("", 0)`` listens on every
            address at a free port.
        RequestHandlerClass: the handler class, as for ``ThreadingHTTPServer``.

    Raises:
        OSError: the address cannot be bound.
    """

    address_family = socket.AF_INET6
    request_queue_size = 1024


__all__ = ["_IPv6HTTPServer"]
