"""
The in-process manager client
=============================

Group rank 0 hosts its replica group's :class:`~ftdist.manager.server.ManagerServer`,
so its own calls need no network: :class:`LocalManagerClient` hands each
request straight to the server's handler with a stand-in for gRPC's servicer
context, and a handler's abort comes back as the same ``grpc.RpcError``
shape a remote call raises, so the Manager handles both alike.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from ftdist.manager.client import ManagerClient

if TYPE_CHECKING:
    from ftdist.manager.server import ManagerServer

__all__ = ["LocalContext", "LocalManagerClient"]


class _LocalCallError(grpc.RpcError, grpc.Call):
    """A status a handler aborted with, for a call that never left the process."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> tuple[()]:
        return ()

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


class LocalContext:
    """The part of a gRPC servicer context the handlers use, for a local call."""

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _LocalCallError(code, details)


class LocalManagerClient(ManagerClient):
    """A client of a ManagerServer in this very process, without the network.

    Group rank 0 hosts its replica group's server: its own calls go
    straight to the handlers (no serialization, no loopback round trip, no
    thread hop through gRPC), with the same validation, answers and errors.
    """

    def __init__(self, server: ManagerServer) -> None:
        self.addr = server.address()
        self._metadata = None

        def local(handler: Any) -> Any:
            def call(request: Any, timeout: float, metadata: Any = None) -> Any:
                return handler(request, LocalContext(timeout))

            return call

        self._quorum_rpc = local(server._quorum)
        self._metadata_rpc = local(server._checkpoint_metadata)
        self._commit_rpc = local(server._should_commit)
        self._kill_rpc = local(server._kill)

    def close(self) -> None:
        """Nothing to release."""
