"""
etcd v3 client
==============

The few etcd v3 calls the replicated lighthouse needs, spoken over gRPC with
the grpcio and protobuf ftdist already depends on: KV ``Range``, ``Put``,
``DeleteRange`` and ``Txn``; Lease ``Grant``, ``KeepAlive``, ``Revoke`` and
``TimeToLive``; Maintenance ``Status``. The messages are a cut-down copy of
etcd's (``ftdist/_rpc/proto/etcd.proto``, etcd's field numbers); calls name
etcd's services by path, so no generated stub pins a grpcio version.

Not a third-party client: ``etcd3`` fails at import on today's protobuf, the
others are asyncio-only, and torchelastic's speaks the v2 API etcd 3.6 removed.

Failover between endpoints: every call has a deadline (``timeout``). An
endpoint that is unreachable, stalled, or a member cut off from its
cluster's majority is given up after its share of the deadline and the call
moves to the next endpoint; the one that answered is tried first next time.
Calls are retried only within their deadline, and every call ftdist makes is
safe to apply twice (guarded transactions, puts of the same value, revokes).

TLS: ``https://`` endpoints use TLS, trusting ``ca`` (else the system's
roots) and presenting ``cert``/``key`` when given.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import grpc

from ftdist._auth import TlsFiles
from ftdist._durations import to_seconds
from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import etcd_pb2 as pb
from ftdist._rpc.auth import open_channel
from ftdist.errors import EtcdError

__all__ = [
    "EtcdClient",
    "KeyValue",
    "Lease",
    "MemberStatus",
    "TxnResult",
    "create_revision_is",
    "delete_op",
    "get_op",
    "parse_endpoints",
    "prefix_end",
    "put_op",
    "value_is",
]

logger = logging.getLogger("ftdist.etcd.client")

_KV_RANGE = "/etcdserverpb.KV/Range"
_KV_PUT = "/etcdserverpb.KV/Put"
_KV_DELETE = "/etcdserverpb.KV/DeleteRange"
_KV_TXN = "/etcdserverpb.KV/Txn"
_LEASE_GRANT = "/etcdserverpb.Lease/LeaseGrant"
_LEASE_REVOKE = "/etcdserverpb.Lease/LeaseRevoke"
_LEASE_KEEPALIVE = "/etcdserverpb.Lease/LeaseKeepAlive"
_LEASE_TTL = "/etcdserverpb.Lease/LeaseTimeToLive"
_STATUS = "/etcdserverpb.Maintenance/Status"

# Codes after which another endpoint may do better: the member is down,
# stalled, restarting, or has no leader (etcd answers UNAVAILABLE for "leader
# changed" and "no leader").
_RETRY_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}
)
_DEFAULT_TIMEOUT = timedelta(seconds=1)
# An attempt on one endpoint gets at least this much of the deadline, so a
# call with a short deadline still reaches a healthy member.
_MIN_ATTEMPT_S = 0.15

R = TypeVar("R")


def parse_endpoints(spec: str | Sequence[str]) -> tuple[str, ...]:
    """Read etcd endpoints: ``http://h1:2379,http://h2:2379`` or a list of them.

    Args:
        spec: the endpoints, comma-separated or as a sequence.

    Returns:
        The endpoints in order, each ``scheme://host:port``.

    Raises:
        TypeError: ``spec`` is neither a string nor a sequence of strings.
        ValueError: an entry is not an ``http(s)://host:port`` URL, one is
            repeated, there is none, or they mix ``http`` and ``https``.
    """
    if isinstance(spec, str):
        entries = [e.strip() for e in spec.split(",")]
    elif isinstance(spec, Sequence) and all(isinstance(e, str) for e in spec):
        entries = [e.strip() for e in spec]
    else:
        raise TypeError(f"etcd endpoints must be a string or a list of strings, got {spec!r}")
    fix = "give etcd endpoints as a comma-separated list of http://host:port (or https://)"
    if not entries or all(not e for e in entries):
        raise ValueError(f"no etcd endpoint in {spec!r}; {fix}")
    endpoints: list[str] = []
    for entry in entries:
        parsed = urllib.parse.urlsplit(entry)
        try:
            port = parsed.port
        except ValueError:
            port = None
        if (
            parsed.scheme not in ("http", "https")
            or not parsed.hostname
            or port is None
            or parsed.path not in ("", "/")
            or parsed.query
        ):
            raise ValueError(f"etcd endpoint {entry!r} is not an http(s)://host:port URL; {fix}")
        normal = f"{parsed.scheme}://{parsed.netloc}"
        if normal in endpoints:
            raise ValueError(f"etcd endpoint {entry!r} is given twice in {spec!r}; {fix}")
        endpoints.append(normal)
    if len({e.split("://")[0] for e in endpoints}) > 1:
        raise ValueError(
            f"etcd endpoints {spec!r} mix http:// and https://; a cluster is reached one way"
        )
    return tuple(endpoints)


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


@dataclass(frozen=True, slots=True)
class KeyValue:
    """A key as etcd holds it.

    Attributes:
        key: the key.
        value: its value.
        create_revision: the revision that created it (the fencing token of
            a leader key).
        mod_revision: the revision that last changed it.
        version: how often it changed since it was created.
        lease: the lease it is attached to (0: none).
    """

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_proto(cls, kv: pb.KeyValue) -> KeyValue:
        """Copy an etcd ``KeyValue`` message."""
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


@dataclass(frozen=True, slots=True)
class TxnResult:
    """What a transaction did: whether every comparison held (``succeeded``:
    the success branch ran), the store's ``revision`` after it, and the keys
    each range operation of the branch that ran found (``ranges``, in order)."""

    succeeded: bool
    revision: int
    ranges: tuple[tuple[KeyValue, ...], ...]


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease: its ``id``, and ``ttl_s``, the TTL etcd granted in
    seconds (it raises a short one to its minimum, 1.5 election timeouts)."""

    id: int
    ttl_s: int


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """How one endpoint answered a status probe.

    Attributes:
        endpoint: the endpoint probed.
        ok: whether it answered.
        version: the etcd version it runs ("" when not ok).
        is_leader: whether it is the raft leader of its cluster.
        raft_term: its raft term.
        latency_s: how long it took to answer.
        error: why it did not answer ("" when ok).
    """

    endpoint: str
    ok: bool
    version: str = ""
    is_leader: bool = False
    raft_term: int = 0
    latency_s: float = 0.0
    error: str = ""


def create_revision_is(key: bytes, revision: int) -> pb.Compare:
    """A comparison that holds while ``key`` has this create revision (0: absent)."""
    return pb.Compare(
        result=pb.Compare.EQUAL, target=pb.Compare.CREATE, key=key, create_revision=revision
    )


def value_is(key: bytes, value: bytes) -> pb.Compare:
    """A comparison that holds while ``key`` holds ``value``."""
    return pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.VALUE, key=key, value=value)


def put_op(key: bytes, value: bytes, lease: int = 0) -> pb.RequestOp:
    """A put for a transaction branch."""
    return pb.RequestOp(request_put=pb.PutRequest(key=key, value=value, lease=lease))


def get_op(key: bytes) -> pb.RequestOp:
    """A single-key range for a transaction branch."""
    return pb.RequestOp(request_range=pb.RangeRequest(key=key))


def delete_op(key: bytes) -> pb.RequestOp:
    """A single-key delete for a transaction branch."""
    return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key))


class _Endpoint:
    """One endpoint's channel and method callables, made on first use."""

    def __init__(self, endpoint: str, tls: TlsFiles) -> None:
        self.endpoint = endpoint
        self.channel = open_channel(endpoint, _rpc.client_channel_options(), tls)
        unary = self.channel.unary_unary
        self.range = unary(
            _KV_RANGE, pb.RangeRequest.SerializeToString, pb.RangeResponse.FromString
        )
        self.put = unary(_KV_PUT, pb.PutRequest.SerializeToString, pb.PutResponse.FromString)
        self.delete = unary(
            _KV_DELETE, pb.DeleteRangeRequest.SerializeToString, pb.DeleteRangeResponse.FromString
        )
        self.txn = unary(_KV_TXN, pb.TxnRequest.SerializeToString, pb.TxnResponse.FromString)
        self.grant = unary(
            _LEASE_GRANT, pb.LeaseGrantRequest.SerializeToString, pb.LeaseGrantResponse.FromString
        )
        self.revoke = unary(
            _LEASE_REVOKE,
            pb.LeaseRevokeRequest.SerializeToString,
            pb.LeaseRevokeResponse.FromString,
        )
        self.ttl = unary(
            _LEASE_TTL,
            pb.LeaseTimeToLiveRequest.SerializeToString,
            pb.LeaseTimeToLiveResponse.FromString,
        )
        self.status = unary(
            _STATUS, pb.StatusRequest.SerializeToString, pb.StatusResponse.FromString
        )
        self.keepalive = self.channel.stream_stream(
            _LEASE_KEEPALIVE,
            pb.LeaseKeepAliveRequest.SerializeToString,
            pb.LeaseKeepAliveResponse.FromString,
        )


class EtcdClient:
    """A thread-safe client of one etcd cluster.

    Args:
        endpoints: the cluster's client URLs (see :func:`parse_endpoints`).
        timeout: the default deadline of each call (a timedelta or seconds).
        ca: PEM file of the certificates to trust for ``https://`` endpoints.
        cert: PEM client certificate to present (with ``key``).
        key: its private key.
        server_name: the name expected in the members' certificates, when it
            is not their host name.

    Raises:
        ValueError: malformed endpoints or timeout, or a certificate without
            its key.
        TypeError: endpoints or timeout of the wrong type.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: timedelta | float = _DEFAULT_TIMEOUT,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        server_name: str | None = None,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = to_seconds(timeout, "timeout")
        if (cert is None) != (key is None):
            raise ValueError(
                f"an etcd client certificate needs its key (got cert={cert!r}, key={key!r}); "
                "give both or neither"
            )
        self._tls = TlsFiles(cert=cert, key=key, ca=ca, server_name=server_name)
        self._lock = threading.Lock()
        self._conns: dict[str, _Endpoint] = {}
        self._current = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"EtcdClient(endpoints={','.join(self.endpoints)!r})"

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every channel; later calls raise :class:`EtcdError`. Idempotent."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, {}
        for conn in conns.values():
            conn.channel.close()

    # -- KV -----------------------------------------------------------------

    def range(
        self,
        key: bytes,
        *,
        prefix: bool = False,
        limit: int = 0,
        newest_first: bool = False,
        timeout: float | None = None,
    ) -> list[KeyValue]:
        """Read one key, or every key under a prefix (linearizable).

        Args:
            key: the key or prefix.
            prefix: read every key that starts with ``key``.
            limit: at most this many keys (0: all).
            newest_first: in descending key order (with ``limit``: the last
                keys).
            timeout: this call's deadline in seconds (default: the client's).

        Returns:
            The keys found, in key order.

        Raises:
            EtcdError: no endpoint answered within the deadline.
        """
        request = pb.RangeRequest(
            key=key,
            range_end=prefix_end(key) if prefix else b"",
            limit=limit,
            sort_order=pb.RangeRequest.DESCEND if newest_first else pb.RangeRequest.NONE,
        )
        response = self._unary(lambda c: c.range, request, "Range", timeout)
        return [KeyValue.from_proto(kv) for kv in response.kvs]

    def get(self, key: bytes, *, timeout: float | None = None) -> KeyValue | None:
        """Read one key.

        Returns:
            The key, or None when absent.

        Raises:
            EtcdError: no endpoint answered within the deadline.
        """
        found = self.range(key, timeout=timeout)
        return found[0] if found else None

    def put(self, key: bytes, value: bytes, *, lease: int = 0, timeout: float | None = None) -> int:
        """Write one key, attached to ``lease`` when it is not 0.

        Returns:
            The store's revision after the write.

        Raises:
            EtcdError: no endpoint answered within the deadline, or the lease
                does not exist.
        """
        request = pb.PutRequest(key=key, value=value, lease=lease)
        return int(self._unary(lambda c: c.put, request, "Put", timeout).header.revision)

    def delete(self, key: bytes, *, prefix: bool = False, timeout: float | None = None) -> int:
        """Delete one key, or every key under a prefix.

        Returns:
            How many keys were deleted.

        Raises:
            EtcdError: no endpoint answered within the deadline.
        """
        request = pb.DeleteRangeRequest(key=key, range_end=prefix_end(key) if prefix else b"")
        return int(self._unary(lambda c: c.delete, request, "DeleteRange", timeout).deleted)

    def txn(
        self,
        compare: Iterable[pb.Compare],
        success: Iterable[pb.RequestOp],
        failure: Iterable[pb.RequestOp] = (),
        *,
        timeout: float | None = None,
    ) -> TxnResult:
        """Run a transaction: ``success`` if every comparison holds, else ``failure``.

        Returns:
            Which branch ran, the revision after it, and what its ranges read.

        Raises:
            EtcdError: no endpoint answered within the deadline, or etcd
                refused the transaction.
        """
        request = pb.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
        response = self._unary(lambda c: c.txn, request, "Txn", timeout)
        ranges = tuple(
            tuple(KeyValue.from_proto(kv) for kv in op.response_range.kvs)
            for op in response.responses
            if op.WhichOneof("response") == "response_range"
        )
        return TxnResult(bool(response.succeeded), int(response.header.revision), ranges)

    # -- leases ---------------------------------------------------------------

    def grant(self, ttl: timedelta | float, *, timeout: float | None = None) -> Lease:
        """Grant a lease of ``ttl`` (rounded up to whole seconds; etcd may raise it).

        Raises:
            ValueError: ``ttl`` is not positive.
            EtcdError: no endpoint answered within the deadline, or etcd
                refused.
        """
        seconds = max(1, int(-(-to_seconds(ttl, "ttl") // 1)))
        response = self._unary(
            lambda c: c.grant, pb.LeaseGrantRequest(TTL=seconds), "Grant", timeout
        )
        if response.error:
            raise EtcdError(f"etcd refused a lease of {seconds} s: {response.error}")
        return Lease(int(response.ID), int(response.TTL))

    def keep_alive(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Renew a lease once.

        Returns:
            Its TTL from now, in seconds; 0 when the lease no longer exists
            (it expired or was revoked).

        Raises:
            EtcdError: no endpoint answered within the deadline.
        """
        request = pb.LeaseKeepAliveRequest(ID=lease_id)

        def once(conn: _Endpoint, attempt_s: float) -> pb.LeaseKeepAliveResponse:
            # KeepAlive is a bidirectional stream; one request and its answer
            # on a stream of their own keep no state between renewals.
            call = conn.keepalive(iter((request,)), timeout=attempt_s)
            try:
                response: pb.LeaseKeepAliveResponse = next(call)
                return response
            except StopIteration as exc:
                raise EtcdError(f"{conn.endpoint} closed the keepalive stream") from exc
            finally:
                call.cancel()

        return int(self._attempts(once, "LeaseKeepAlive", timeout).TTL)

    def revoke(self, lease_id: int, *, timeout: float | None = None) -> None:
        """Revoke a lease and delete its keys (a lease already gone is no error).

        Raises:
            EtcdError: no endpoint answered within the deadline.
        """
        try:
            self._unary(lambda c: c.revoke, pb.LeaseRevokeRequest(ID=lease_id), "Revoke", timeout)
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise

    def time_to_live(self, lease_id: int, *, timeout: float | None = None) -> int:
        """A lease's remaining TTL in seconds (-1 or 0: it is gone).

        Raises:
            EtcdError: no endpoint answered within the deadline.
        """
        request = pb.LeaseTimeToLiveRequest(ID=lease_id)
        return int(self._unary(lambda c: c.ttl, request, "LeaseTimeToLive", timeout).TTL)

    # -- health -----------------------------------------------------------------

    def member_status(self, endpoint: str, *, timeout: float | None = None) -> MemberStatus:
        """Probe one endpoint (no failover): is it up, its version, is it the raft leader.

        Args:
            endpoint: one of :attr:`endpoints`.
            timeout: the probe's deadline in seconds.

        Returns:
            The endpoint's status; a failed probe is reported, not raised.

        Raises:
            ValueError: ``endpoint`` is not one of :attr:`endpoints`.
        """
        if endpoint not in self.endpoints:
            raise ValueError(f"{endpoint!r} is not one of this client's endpoints {self.endpoints}")
        began = time.monotonic()
        try:
            conn = self._conn(endpoint)
            response = conn.status(pb.StatusRequest(), timeout=timeout or self.timeout_s)
        except (grpc.RpcError, EtcdError) as exc:
            return MemberStatus(endpoint, False, error=_describe(exc))
        return MemberStatus(
            endpoint,
            True,
            version=response.version,
            is_leader=response.leader != 0 and response.leader == response.header.member_id,
            raft_term=int(response.raftTerm),
            latency_s=time.monotonic() - began,
        )

    # -- plumbing ---------------------------------------------------------------

    def _conn(self, endpoint: str) -> _Endpoint:
        with self._lock:
            if self._closed:
                raise EtcdError(f"{self!r} is closed")
            conn = self._conns.get(endpoint)
            if conn is None:
                conn = self._conns[endpoint] = _Endpoint(endpoint, self._tls)
            return conn

    def _unary(
        self, method: Callable[[_Endpoint], Any], request: Any, name: str, timeout: float | None
    ) -> Any:
        return self._attempts(lambda conn, s: method(conn)(request, timeout=s), name, timeout)

    def _attempts(
        self, attempt: Callable[[_Endpoint, float], R], name: str, timeout: float | None
    ) -> R:
        """Run ``attempt`` on one endpoint after another until one answers."""
        total = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + total
        count = len(self.endpoints)
        # Each endpoint gets a share of the deadline, so one stalled member
        # (SIGSTOPped, or cut from its peers) cannot use it all up.
        share = max(_MIN_ATTEMPT_S, total / min(count, 2))
        errors: list[str] = []
        start = self._current
        tried = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            index = (start + tried) % count
            endpoint = self.endpoints[index]
            tried += 1
            try:
                result = attempt(self._conn(endpoint), min(left, share))
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                errors.append(f"{endpoint}: {_describe(exc)}")
                if code not in _RETRY_CODES:
                    raise EtcdError(f"etcd {name} failed: {errors[-1]}") from exc
                if tried % count == 0:
                    # Every endpoint failed once: a short pause before the
                    # next round instead of spinning on refused connections.
                    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            self._current = index
            return result
        shown = "; ".join(errors[-count:]) or "no attempt fit in the deadline"
        raise EtcdError(
            f"etcd {name} got no answer within {total:g} s from {self.endpoints}: {shown}"
        )


def _describe(exc: BaseException) -> str:
    if not isinstance(exc, grpc.Call):
        return str(exc)
    code = exc.code()
    return f"{code.name if code is not None else 'UNKNOWN'}: {exc.details()}"
