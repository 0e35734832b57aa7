"""
A gRPC call's outcome, from what the server sent
================================================

What :mod:`ftdist._rpc.h2_client` makes of a finished stream: the response
message, or an :class:`H2RpcError` shaped as grpcio's errors are (the same
``code()``, ``details()`` and ``trailing_metadata()``), so that code written
for grpcio's client handles both. The status comes from the trailers (or the
headers of a trailers-only response); an HTTP status other than 200 maps to
a gRPC code as gRPC's own clients map it.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable

import grpc

from ftdist._rpc.h2_call import decode_metadata, message_prefix

__all__ = ["H2RpcError", "outcome"]

# gRPC's mapping of an HTTP status that is not 200 to a call's status.
_HTTP_STATUS = {
    400: grpc.StatusCode.INTERNAL,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.UNIMPLEMENTED,
    429: grpc.StatusCode.UNAVAILABLE,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.UNAVAILABLE,
}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class H2RpcError(grpc.RpcError, grpc.Call):
    """A failed call, shaped as grpcio's: ``code()``, ``details()``, ``trailing_metadata()``."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailing = trailing

    def code(self) -> grpc.StatusCode:
        """The call's status code."""
        return self._code

    def details(self) -> str:
        """The server's message (or what went wrong on the way)."""
        return self._details

    def initial_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """Not kept: always empty."""
        return ()

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The trailers the server sent beside the status, ``grpc-`` ones left out."""
        return self._trailing

    def is_active(self) -> bool:
        """A failed call is over: False."""
        return False

    def time_remaining(self) -> float | None:
        """A failed call has no time left to run: None."""
        return None

    def cancel(self) -> bool:
        """Nothing to cancel: False."""
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """The call is over: False (the callback is not kept)."""
        return False


def outcome(
    headers: list[tuple[bytes, bytes]] | None,
    trailers: list[tuple[bytes, bytes]] | None,
    body: bytes | bytearray,
) -> bytes:
    """The response message of a unary call whose stream ended.

    Args:
        headers: the response's header fields.
        trailers: its trailer fields (for a trailers-only response, its headers).
        body: the DATA it carried: one length-prefixed gRPC message.

    Returns:
        The message's bytes.

    Raises:
        H2RpcError: the call's status if not OK, or INTERNAL / UNKNOWN /
            UNIMPLEMENTED for a response that breaks the protocol.
    """
    http_status = dict(headers or ()).get(b":status", b"")
    if http_status != b"200":
        status = int(http_status) if http_status.isdigit() else 0
        code = _HTTP_STATUS.get(status, grpc.StatusCode.UNKNOWN)
        raise H2RpcError(code, f"Received http2 header with status: {status}")
    found = dict(trailers or ())
    raw_status = found.get(b"grpc-status")
    if raw_status is None or not raw_status.isdigit():
        raise H2RpcError(grpc.StatusCode.UNKNOWN, "the response carried no grpc-status")
    code = _CODES.get(int(raw_status), grpc.StatusCode.UNKNOWN)
    if code is not grpc.StatusCode.OK:
        details = urllib.parse.unquote(found.get(b"grpc-message", b"").decode("latin-1"))
        raise H2RpcError(code, details, _metadata(trailers or []))
    if len(body) < 5:
        raise H2RpcError(grpc.StatusCode.INTERNAL, "the response carried no message")
    compressed, length = message_prefix.unpack_from(body)
    if compressed:
        raise H2RpcError(grpc.StatusCode.UNIMPLEMENTED, "compressed responses are not supported")
    if len(body) != 5 + length:
        raise H2RpcError(grpc.StatusCode.INTERNAL, "the response is not one whole message")
    return bytes(body[5:])


def _metadata(fields: list[tuple[bytes, bytes]]) -> tuple[tuple[str, str | bytes], ...]:
    out: list[tuple[str, str | bytes]] = []
    for name, value in fields:
        if name.startswith((b":", b"grpc-")) or name == b"content-type":
            continue
        out.append((name.decode("latin-1"), decode_metadata(name, value)))
    return tuple(out)
