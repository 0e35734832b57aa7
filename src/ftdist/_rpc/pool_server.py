"""
grpcio's thread-pool server, for handlers that wait
===================================================

The manager server's calls wait for the rest of their replica group. On its
own HTTP/2 server (:mod:`ftdist._rpc.h2_server`) they are parked on the one
server thread and answered when their round ends, whichever thread ends it.
grpcio's completion queue (:mod:`ftdist._rpc.cq_server`) cannot be woken
from another thread, so a round ended on another thread would be answered
only at the queue's next poll. Over TLS (or with
``FTDIST_MANAGER_RPC_SERVER=grpcio``) the manager server therefore serves on
``grpc.server``: each call runs a blocking handler on a thread of a pool,
which waits for its round and returns the answer.

This is that server behind the same small surface as the others: ``port``,
:meth:`PoolServer.start`, :meth:`PoolServer.stop`, and
:meth:`PoolServer.call_soon`, which runs its function at once on the
calling thread (nothing here is owned by one thread).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from ftdist._rpc.auth import TokenInterceptor

__all__ = ["BlockingHandler", "PoolServer"]

BlockingHandler = tuple[Callable[[Any, Any], Any], Any, Any]
"""``(handler(request, context) -> response, request class, response class)``."""


class PoolServer:
    """``grpc.server`` on a thread pool, serving blocking handlers.

    Args:
        bind: listen address, ``host:port``.
        service: the gRPC service name, e.g. ``torchft.ManagerService``.
        handlers: method name to :data:`BlockingHandler`.
        options: grpcio server options.
        max_workers: threads in the pool: each waiting call holds one.
        token: the job token every call must carry (None: every call is served).
        what: the server, in a refusal ("this manager server").
        credentials: TLS credentials; None serves plaintext.

    Raises:
        OSError: (from :meth:`start`) if the address cannot be bound.
    """

    def __init__(
        self,
        bind: str,
        service: str,
        handlers: Mapping[str, BlockingHandler],
        options: list[tuple[str, int]],
        *,
        max_workers: int,
        token: str | None,
        what: str,
        credentials: grpc.ServerCredentials | None,
    ) -> None:
        self._bind = bind
        self._credentials = credentials
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ftdist-rpc")
        self._server = grpc.server(
            self._pool,
            options=options,
            interceptors=[TokenInterceptor(token, what)] if token else None,
        )
        methods = {
            name: grpc.unary_unary_rpc_method_handler(
                handler, request.FromString, response.SerializeToString
            )
            for name, (handler, request, response) in handlers.items()
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, methods),)
        )
        self.port = 0

    def start(self) -> int:
        """Bind, start serving and return the bound port.

        Raises:
            OSError: if the address cannot be bound.
        """
        try:
            if self._credentials is None:
                port = self._server.add_insecure_port(self._bind)
            else:
                port = self._server.add_secure_port(self._bind, self._credentials)
        except RuntimeError:  # grpcio's way of saying the bind failed
            port = 0
        if not port:
            self._pool.shutdown(wait=False)
            raise OSError(f"cannot bind gRPC server to {self._bind} (address in use?)")
        self.port = int(port)
        self._server.start()
        return self.port

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now, on the calling thread."""
        fn()

    def stop(self, grace_s: float) -> None:
        """Stop serving: calls still running are cancelled after ``grace_s``
        seconds; join the pool. Idempotent."""
        self._server.stop(grace=grace_s).wait(grace_s + 5)
        self._pool.shutdown(wait=True)
