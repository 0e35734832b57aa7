"""
gRPC plumbing shared by the coordination clients and servers
============================================================

Address parsing, channel and server options, the mapping from gRPC status to
Python exceptions, and the method paths of both protocols. Method paths are
spelled out instead of using ``*_pb2_grpc`` stubs: the stubs pin the exact
grpcio version that generated them, and the servers need raw-bytes handlers
(to serialize one quorum once for all its members) that stubs cannot express.
"""

from __future__ import annotations

import grpc

from ftdist.errors import CoordinationError, CoordinationTimeoutError

__all__ = [
    "EVENTS_LEAVE",
    "EVENTS_REPORT_HEAL",
    "EVENTS_STATUS",
    "EVENTS_SUBSCRIBE",
    "FOLLOW_LEADER_METADATA",
    "LEADER_METADATA",
    "LIGHTHOUSE_HEARTBEAT",
    "LIGHTHOUSE_QUORUM",
    "MANAGER_CHECKPOINT_METADATA",
    "MANAGER_KILL",
    "MANAGER_QUORUM",
    "MANAGER_SHOULD_COMMIT",
    "NOT_LEADER_PREFIX",
    "RPC_CLIENTS",
    "client_channel_options",
    "grpc_target",
    "map_rpc_error",
    "pick_rpc_client",
    "server_options",
]

LIGHTHOUSE_SERVICE = "torchft.LighthouseService"
LIGHTHOUSE_QUORUM = f"/{LIGHTHOUSE_SERVICE}/Quorum"
LIGHTHOUSE_HEARTBEAT = f"/{LIGHTHOUSE_SERVICE}/Heartbeat"
MANAGER_SERVICE = "torchft.ManagerService"
MANAGER_QUORUM = f"/{MANAGER_SERVICE}/Quorum"
MANAGER_CHECKPOINT_METADATA = f"/{MANAGER_SERVICE}/CheckpointMetadata"
MANAGER_SHOULD_COMMIT = f"/{MANAGER_SERVICE}/ShouldCommit"
MANAGER_KILL = f"/{MANAGER_SERVICE}/Kill"
EVENTS_SERVICE = "ftdist.LighthouseEvents"
EVENTS_SUBSCRIBE = f"/{EVENTS_SERVICE}/Subscribe"
EVENTS_STATUS = f"/{EVENTS_SERVICE}/Status"
EVENTS_LEAVE = f"/{EVENTS_SERVICE}/Leave"
EVENTS_REPORT_HEAL = f"/{EVENTS_SERVICE}/ReportHeal"

# The replicated lighthouse (ftdist.lighthouse.replica). A client that sends
# FOLLOW_LEADER_METADATA ("1") with a call to a replica that is not the
# leader gets FAILED_PRECONDITION, details starting with NOT_LEADER_PREFIX,
# and the leader's gRPC address (empty while none is known) in the trailing
# LEADER_METADATA: it moves there itself. A call without it (torchft's own
# clients) is forwarded to the leader by the replica.
FOLLOW_LEADER_METADATA = "ftdist-follow-leader"
LEADER_METADATA = "ftdist-leader"
NOT_LEADER_PREFIX = "not the leader"

# How a client makes its unary calls on plaintext: ftdist's own HTTP/2
# client (ftdist._rpc.h2_client, from the calling thread) or a grpcio channel.
RPC_CLIENTS = ("h2", "grpcio")


def pick_rpc_client(chosen: str, variable: str, name: str = "rpc_client") -> str:
    """``chosen`` (a setting's value) as one of :data:`RPC_CLIENTS`.

    Servers pick between the same two (ftdist's own HTTP/2 server or
    grpcio's core), so their settings are checked here too.

    Args:
        chosen: the argument's or the environment's value, any case.
        variable: the environment variable that sets it, named in the error.
        name: the argument that sets it, named in the error.

    Raises:
        ValueError: for anything but ``h2`` or ``grpcio``.
    """
    picked = chosen.strip().lower()
    if picked not in RPC_CLIENTS:
        raise ValueError(
            f"{name} ({chosen!r}) must be one of {', '.join(RPC_CLIENTS)}; "
            f"set {variable}=h2 (the default) or grpcio"
        )
    return picked


# A replica that forwards calls answers UNAVAILABLE with details starting
# with NO_LEADER_YET while no leader is elected (the call entered no quorum),
# and passes a leader's UNAVAILABLE on with details starting with
# FORWARDED_PREFIX (that leader is gone, and its parked calls with it).
NO_LEADER_YET = "no lighthouse leader is elected yet"
FORWARDED_PREFIX = "forwarded to the leader"

# A quorum of 1024 members with user data can be several MiB.
_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# What a server takes in one request (one member's request, not a quorum).
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# A client's stream window: what gRPC's bandwidth probe grew it to.
_CLIENT_WINDOW_BYTES = 4 * 1024 * 1024


def grpc_target(address: str) -> str:
    """Turn ``host:port``, ``http://host:port`` or ``https://host:port`` into a gRPC target.

    Args:
        address: the server address; ``[v6]:port`` works too, and a trailing
            ``/`` is ignored. ``https://`` asks for TLS (see
            :func:`ftdist._rpc.auth.open_channel`).

    Returns:
        ``host:port``.

    Raises:
        ValueError: for an empty address or one without a port.
    """
    target = address.strip()
    for scheme in ("http://", "https://"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
            break
    target = target.rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r} must be host:port or http://host:port.")
    return target


def client_channel_options() -> list[tuple[str, int]]:
    """Options every client channel uses.

    Reconnects back off from 100 ms to 1 s, and each connect attempt gives
    up after that backoff (gRPC's ``min_reconnect_backoff_ms`` is also its
    shortest connect timeout), so a fresh SYN leaves at least once a second:
    a lighthouse behind a partition is reached again within about a second
    of the partition's end. torchft's client backs off to 10 s, and a
    connect begun during a cut then retried only seconds after the network
    was back (TCP resends a lost SYN after 1, 3, 7 s). Keepalive pings every
    60 s with a 20 s timeout notice a server that vanished without closing
    the connection. Bandwidth probing is off, as on the servers (see
    :func:`server_options`): gRPC's client otherwise answers data it receives
    with a PING the server must acknowledge (3 to 6 in 20 quorum calls of
    1024 members), wake-ups the lighthouse pays for every group. The probe
    is also what gave the window its 4 MiB, so the window is set to that
    outright: a quorum of a thousand groups (67 KB) arrives without waiting
    for a WINDOW_UPDATE.

    Returns:
        gRPC channel options.
    """
    return [
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", _CLIENT_WINDOW_BYTES),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ]


def server_options() -> list[tuple[str, int]]:
    """Options every server uses.

    ``so_reuseport`` is off so that binding a port another process holds
    fails loudly instead of silently sharing it. Clients may ping every 10 s
    (torchft's ping every 60 s; gRPC's default would reject that), and the
    server pings idle clients so a vanished one frees its parked requests.
    gRPC's admission control starts cancelling new calls at random once 1000
    are waiting for the handler loop; a round of 1024 replica groups arrives
    all at once by design, so the limits are raised far above any job size.
    Bandwidth probing is off: gRPC's server otherwise answers a client's
    data with a PING to estimate the link (it sized its receive window for
    bulk uploads), and every client has to wake up and acknowledge it. The
    requests here are small; at 512 replica groups those pings were 1.3 per
    group and round and cost the clients a fifth more CPU than torchft's
    lighthouse does. The probe also grew the receive window to 4 MiB; it is
    set to the largest request outright, so that none waits for a
    WINDOW_UPDATE half-way.

    Returns:
        gRPC server options.
    """
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.server.max_pending_requests", 1 << 16),
        ("grpc.server.max_pending_requests_hard_limit", 1 << 17),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", MAX_REQUEST_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ]


def map_rpc_error(exc: grpc.RpcError, what: str) -> Exception:
    """Translate a failed call into the exception the API promises.

    Deadline and cancellation become :class:`CoordinationTimeoutError` (a
    ``TimeoutError``), everything else :class:`CoordinationError` (a
    ``RuntimeError``), as torchft's bindings map them. The message keeps the
    server's own text (and a timeout's ends with torchft's wording).

    Args:
        exc: the error grpc raised.
        what: what was being done, e.g. "Quorum call to lighthouse at h:1".

    Returns:
        The exception to raise (``raise map_rpc_error(e, ...) from e``).

    It returns the exception instead.
    """
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    name = code.name if code is not None else "UNKNOWN"
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        # The tail is torchft's wording for the same timeout: code written
        # against torchft matches its message with a regex.
        return CoordinationTimeoutError(
            f'{what} timed out: {name}: {details} (status: Cancelled, message: "Timeout expired")'
        )
    if code is grpc.StatusCode.UNAVAILABLE:
        return CoordinationError(f"{what} failed, server unavailable: {details}")
    return CoordinationError(f"{what} failed: {name}: {details}")
