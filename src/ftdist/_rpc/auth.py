"""
The job secret and TLS on gRPC
==============================

What :mod:`ftdist._auth` decides, applied to gRPC with gRPC's own means:
clients send the job token as ``authorization: Bearer <token>`` call
metadata; servers read the metadata of each call before anything else and
answer UNAUTHENTICATED without reading the request when it does not carry
the token; TLS is gRPC's ``ssl_channel_credentials`` and
``ssl_server_credentials``. The lighthouse checks metadata in its completion
queue server (:mod:`ftdist._rpc.cq_server`), the manager server with
:class:`TokenInterceptor`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from ftdist._auth import METADATA_KEY, TlsFiles, bearer, refusal
from ftdist._rpc.common import grpc_target
from ftdist._rpc.h2_client import H2Channel

__all__ = [
    "TokenInterceptor",
    "call_metadata",
    "metadata_refusal",
    "open_channel",
    "server_credentials",
    "unary_calls",
    "uses_tls",
]

Metadata = tuple[tuple[str, str], ...]


def call_metadata(token: str | None) -> Metadata | None:
    """The metadata every call of a client with ``token`` carries (None without one)."""
    return None if token is None else ((METADATA_KEY, bearer(token)),)


def metadata_refusal(
    metadata: Sequence[tuple[str, Any]] | None, token: str | None, what: str
) -> str | None:
    """Why a call with ``metadata`` is refused, or None to serve it.

    Args:
        metadata: the call's invocation metadata (key, value) pairs.
        token: the job token; None serves every call.
        what: the server, for the message ("this lighthouse").

    Returns:
        None, or the details of the UNAUTHENTICATED status to answer.
    """
    if token is None:
        return None
    presented = None
    for key, value in metadata or ():
        if key == METADATA_KEY:
            presented = value
            break
    return refusal(presented, token, what)


def _is_tls_address(address: str) -> bool:
    return address.strip().startswith("https://")


def uses_tls(address: str, tls: TlsFiles) -> bool:
    """Whether :func:`open_channel` opens ``address`` with TLS under ``tls``."""
    return tls.ca is not None or _is_tls_address(address)


def unary_calls(
    channel: grpc.Channel, address: str, tls: TlsFiles, rpc_client: str, *, send_timeout: bool
) -> Any:
    """What a client makes its unary calls on: an :class:`H2Channel` to
    ``address`` when ``rpc_client`` is ``"h2"`` and the address is plaintext,
    else ``channel`` itself (TLS always goes through grpcio). Either has
    grpcio's ``unary_unary``; close the first as well as ``channel``.

    Args:
        channel: the client's grpcio channel to ``address``.
        address: the server's address.
        tls: the client's TLS settings.
        rpc_client: ``"h2"`` or ``"grpcio"`` (already checked).
        send_timeout: send each call's timeout (see :class:`H2Channel`).
    """
    if rpc_client == "h2" and not uses_tls(address, tls):
        return H2Channel(grpc_target(address), send_timeout=send_timeout)
    return channel


def open_channel(address: str, options: list[tuple[str, Any]], tls: TlsFiles) -> grpc.Channel:
    """A channel to ``address``, over TLS when ``tls.ca`` is set or the address is ``https://``.

    Args:
        address: ``host:port``, ``http://host:port`` or ``https://host:port``.
        options: channel options.
        tls: the client's TLS settings; without a CA an ``https://`` address
            trusts the system's roots. A certificate and key, when set, are
            presented as the client's.

    Returns:
        The channel.

    Raises:
        ValueError: a malformed address.
        OSError: a TLS file cannot be read.
    """
    target = grpc_target(address)
    if not uses_tls(address, tls):
        return grpc.insecure_channel(target, options=options)
    pair = tls.server_pair()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.root(),
        private_key=pair[0] if pair else None,
        certificate_chain=pair[1] if pair else None,
    )
    if tls.server_name:
        options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.secure_channel(target, credentials, options=options)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials | None:
    """TLS credentials for a server with ``tls.cert`` and ``tls.key``, or None (plaintext).

    Clients are not asked for certificates: the job token authenticates
    them, TLS hides it and the traffic and authenticates the server.

    Raises:
        OSError: a TLS file cannot be read.
    """
    pair = tls.server_pair()
    if pair is None:
        return None
    return grpc.ssl_server_credentials([pair])


class TokenInterceptor(grpc.ServerInterceptor):
    """Answers UNAUTHENTICATED to every call of a ``grpc.server`` without the job token.

    The refused call's handler never runs and its request is not parsed.

    Args:
        token: the job token (None: every call is served).
        what: the server, for the message ("this manager server").
    """

    def __init__(self, token: str | None, what: str) -> None:
        self._token = token
        self._what = what

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """Serve the call if it carries the token, else refuse it."""
        problem = metadata_refusal(
            handler_call_details.invocation_metadata,
            self._token,
            self._what,
        )
        if problem is None:
            return continuation(handler_call_details)

        def refuse(request: bytes, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

        return grpc.unary_unary_rpc_method_handler(refuse)
