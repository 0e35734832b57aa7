"""
What a handler and its owner see of a server, whichever runs it
================================================================

The lighthouse runs on one of two single-threaded gRPC servers: the HTTP/2
server written here (:mod:`ftdist._rpc.h2_server`, plaintext) or grpcio's
core (:mod:`ftdist._rpc.cq_server`, plaintext or TLS). Both give handlers
the same call object and their owner the same scheduling methods; these
protocols name that contract so the lighthouse is typed against it, not
against either server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

__all__ = ["RpcServer", "ServerCall", "decode_request", "handler_for", "run_handler"]

logger = logging.getLogger("ftdist.rpc")


class ServerCall(Protocol):
    """One call, used only on its server's thread.

    Attributes:
        method: the full method path, e.g. ``/torchft.LighthouseService/Quorum``.
        metadata: the client's invocation metadata, ``(key, value)`` pairs.
        done: the call has been answered (or its client went away).
        cancelled: its client cancelled it, disconnected or ran out of time.
    """

    method: str
    metadata: tuple[tuple[str, Any], ...]
    done: bool
    cancelled: bool

    def reply(self, payload: bytes) -> None:
        """Answer with ``payload`` and status OK; ignored once done."""

    def abort(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        """End with an error status after any queued messages; ignored once done."""

    def send(self, payload: bytes) -> None:
        """Queue one message of a server-streaming response; ignored once done."""

    @property
    def pending_messages(self) -> int:
        """Messages queued but not yet handed on."""

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the server thread if the client goes away first."""

    def metadata_value(self, key: str) -> str | None:
        """One invocation metadata value, or None."""


class RpcServer(Protocol):
    """The owner's side of a single-threaded server."""

    port: int

    def start(self) -> int:
        """Bind and serve; the port.

        Raises:
            OSError: if the address cannot be bound.
        """

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server thread. Thread-safe."""

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server thread after ``delay_s`` seconds. Thread-safe."""

    def run(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run ``fn`` on the server thread and return its result.

        Raises:
            RuntimeError: if the server is not running.
            TimeoutError: if it did not run in time.
        """

    def stop(self, grace_s: float) -> None:
        """Stop serving, cancel what is left after ``grace_s`` seconds, join."""


def handler_for(
    call: ServerCall,
    handlers: Mapping[str, Callable[[Any, bytes], None]],
    auth: Callable[[Any], str | None] | None,
) -> Callable[[Any, bytes], None] | None:
    """The handler for ``call``, or None once the call is refused:
    UNAUTHENTICATED when ``auth`` names a problem with its metadata (before
    its request is read), UNIMPLEMENTED for a method nobody serves."""
    if auth is not None:
        problem = auth(call.metadata)
        if problem is not None:
            call.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
            return None
    handler = handlers.get(call.method)
    if handler is None:
        call.abort(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {call.method}")
    return handler


def run_handler(handler: Callable[[Any, bytes], None], call: ServerCall, request: bytes) -> None:
    """Run ``handler``; a bug in it ends the call with INTERNAL, never the server."""
    try:
        handler(call, request)
    except Exception as exc:
        logger.exception("handler of %s failed", call.method)
        call.abort(grpc.StatusCode.INTERNAL, f"internal server error in {call.method}: {exc!r}")


def decode_request(call: ServerCall, message_type: Any, request: bytes) -> Any:
    """``request`` parsed as ``message_type``; None after aborting the call.

    A malformed request is the client's error: INVALID_ARGUMENT naming the
    expected message, and the server goes on.
    """
    try:
        return message_type.FromString(request)
    except DecodeError:
        call.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request is not a valid {message_type.DESCRIPTOR.full_name}",
        )
        return None
