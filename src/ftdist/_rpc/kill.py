"""
The Kill call
=============

``torchft.ManagerService/Kill`` asks a replica group's manager server to
exit. Both the Manager's side (:mod:`ftdist.manager.client`) and the
lighthouse's dashboard (which kills a member on an operator's request) make
it; it lives with the gRPC plumbing so that the lighthouse needs nothing of
the manager package.
"""

from __future__ import annotations

import queue
import time
from datetime import timedelta

import grpc

from ftdist._auth import job_token, tls_files
from ftdist._durations import to_seconds
from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import torchft_pb2
from ftdist._rpc.auth import call_metadata, open_channel
from ftdist.errors import CoordinationError, CoordinationTimeoutError

__all__ = ["kill_manager"]


def kill_manager(
    address: str, msg: str, timeout: timedelta | float, token: str | None = None
) -> None:
    """Ask a replica group's ManagerServer to exit, via its ``Kill`` RPC.

    A manager exits inside the call, so a connection that drops after the
    request was sent counts as success; only failing to connect, or an error
    status the manager sent back, is an error.

    Args:
        address: the manager's address (``http://host:port`` or ``host:port``).
        msg: the reason, which the manager logs.
        timeout: how long to try to connect and call.
        token: the job token (default ``FTDIST_JOB_TOKEN``, then
            ``FTDIST_JOB_TOKEN_FILE``).

    Raises:
        ValueError: if the address or token is malformed.
        OSError: if a token or TLS file cannot be read.
        CoordinationError: if the manager cannot be reached or refuses.
        CoordinationTimeoutError: if the manager does not answer in time.
    """
    seconds = to_seconds(timeout, "timeout")
    metadata = call_metadata(job_token(token))
    deadline = time.monotonic() + seconds
    with open_channel(address, _rpc.client_channel_options(), tls_files()) as channel:
        # Connect first, and give up at the first failed attempt: a dead
        # manager should not keep the dashboard waiting for the whole timeout.
        states: queue.SimpleQueue[grpc.ChannelConnectivity] = queue.SimpleQueue()
        channel.subscribe(states.put, try_to_connect=True)
        try:
            while True:
                try:
                    state = states.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise CoordinationTimeoutError(
                        f"cannot reach manager at {address} within {seconds:g} s"
                    ) from None
                if state is grpc.ChannelConnectivity.READY:
                    break
                if state in (
                    grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                    grpc.ChannelConnectivity.SHUTDOWN,
                ):
                    raise CoordinationError(f"cannot reach manager at {address}")
        finally:
            channel.unsubscribe(states.put)
        call = channel.unary_unary(
            _rpc.MANAGER_KILL,
            request_serializer=torchft_pb2.KillRequest.SerializeToString,
            response_deserializer=torchft_pb2.KillResponse.FromString,
        )
        try:
            call(
                torchft_pb2.KillRequest(msg=msg),
                timeout=max(0.001, deadline - time.monotonic()),
                metadata=metadata,
            )
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() is grpc.StatusCode.UNAVAILABLE:
                return  # the manager exited before answering, as intended
            raise _rpc.map_rpc_error(exc, f"Kill call to manager at {address}") from exc
