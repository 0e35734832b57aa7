"""
Lighthouse client
=================

:class:`LighthouseClient` talks to any lighthouse that speaks
``torchft.LighthouseService`` (ftdist's or torchft's) with torchft's Python
API: ``quorum(...)`` and ``heartbeat(...)``, plus two ftdist extensions
(ftdist lighthouses only): the failure-news stream,
:meth:`LighthouseClient.subscribe`, and the status document,
:meth:`LighthouseClient.status`.

Connection handling:

* The constructor connects, backing off from 100 ms up to 10 s between
  attempts, and gives up after ``connect_timeout`` with
  :class:`~ftdist.errors.CoordinationError`.
* A call that finds the lighthouse unreachable before its request left (the
  lighthouse is restarting, say) reconnects with the same backoff for up to
  ``connect_timeout``, within the call's own ``timeout``, and then sends it.
* A call in flight when the lighthouse goes away fails at once with
  ``CoordinationError``; it is never resent, so a quorum request cannot hang
  on a dead server or be counted twice.
* A call that runs past its ``timeout`` raises
  :class:`~ftdist.errors.CoordinationTimeoutError`, a ``TimeoutError``, as
  torchft does; every other failure is a ``CoordinationError`` (a
  ``RuntimeError``) carrying the server's message.

The client is thread-safe: one instance can serve a heartbeat thread and a
quorum thread at once.

Every call carries the job token (:mod:`ftdist._auth`) when the process has
one; a lighthouse without a token ignores it, one with a token refuses calls
without it (``CoordinationError`` naming ``UNAUTHENTICATED``). The channel
uses TLS for an ``https://`` address or when ``FTDIST_TLS_CA`` is set.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import grpc

from ftdist._auth import job_token, tls_files
from ftdist._durations import to_seconds
from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import ftdist_pb2, torchft_pb2
from ftdist._rpc.auth import call_metadata, open_channel
from ftdist.errors import CoordinationError, CoordinationTimeoutError
from ftdist.lighthouse.types import LighthouseEvent, Quorum

__all__ = ["LighthouseClient", "LighthouseEventStream"]

_DEFAULT_HEARTBEAT_TIMEOUT = timedelta(seconds=5)
_DEFAULT_STATUS_TIMEOUT = timedelta(seconds=5)
# How often a connect wait looks whether its connection was renewed.
_RENEW_POLL_S = 0.25


class LighthouseEventStream:
    """An open failure-news stream; iterate it for :class:`LighthouseEvent`.

    The first event is always ``"subscribed"``. Iteration blocks until the next
    event, ends after :meth:`close` (from any thread), and raises
    :class:`~ftdist.errors.CoordinationError` if the lighthouse goes away.
    """

    def __init__(self, call: Any, what: str) -> None:
        self._call = call
        self._what = what
        self._closed = False

    def __iter__(self) -> Iterator[LighthouseEvent]:
        return self

    def __next__(self) -> LighthouseEvent:
        """Wait for the next event.

        Raises:
            StopIteration: after :meth:`close`.
            CoordinationError: if the stream broke (the lighthouse stopped).
        """
        try:
            message = next(self._call)
        except grpc.RpcError as exc:
            if self._closed:
                raise StopIteration from None
            raise _rpc.map_rpc_error(exc, self._what) from exc
        return LighthouseEvent.from_proto(message)

    def close(self) -> None:
        """End the stream; a blocked iteration stops. Idempotent."""
        self._closed = True
        self._call.cancel()

    def __enter__(self) -> LighthouseEventStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Connection:
    """One channel to the lighthouse and the calls made on it."""

    def __init__(self, addr: str, tls: Any, keepalive_s: float | None = None) -> None:
        # A channel of its own (no subchannel shared with other channels to
        # the same address), so that a renewed connection is really new.
        extra: dict[str, int] = {"grpc.use_local_subchannel_pool": 1}
        if keepalive_s is not None:
            ms = max(1, round(keepalive_s * 1000))
            extra.update(
                {
                    "grpc.keepalive_time_ms": ms,
                    "grpc.keepalive_timeout_ms": ms,
                    "grpc.keepalive_permit_without_calls": 1,
                    # An idle stream sends no data: keep pinging regardless.
                    "grpc.http2.max_pings_without_data": 0,
                }
            )
        options = [(k, v) for k, v in _rpc.client_channel_options() if k not in extra]
        self.channel = open_channel(addr, [*options, *extra.items()], tls)
        # When this connection last showed it works (connected, or answered).
        self.alive_at = float("-inf")
        self.quorum = self.channel.unary_unary(
            _rpc.LIGHTHOUSE_QUORUM,
            request_serializer=torchft_pb2.LighthouseQuorumRequest.SerializeToString,
            response_deserializer=torchft_pb2.LighthouseQuorumResponse.FromString,
        )
        self.heartbeat = self.channel.unary_unary(
            _rpc.LIGHTHOUSE_HEARTBEAT,
            request_serializer=torchft_pb2.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=torchft_pb2.LighthouseHeartbeatResponse.FromString,
        )
        self.subscribe = self.channel.unary_stream(
            _rpc.EVENTS_SUBSCRIBE,
            request_serializer=ftdist_pb2.SubscribeRequest.SerializeToString,
            response_deserializer=ftdist_pb2.LighthouseEvent.FromString,
        )
        self.status = self.channel.unary_unary(
            _rpc.EVENTS_STATUS,
            request_serializer=ftdist_pb2.StatusRequest.SerializeToString,
            response_deserializer=ftdist_pb2.StatusResponse.FromString,
        )
        self.leave = self.channel.unary_unary(
            _rpc.EVENTS_LEAVE,
            request_serializer=ftdist_pb2.LeaveRequest.SerializeToString,
            response_deserializer=ftdist_pb2.LeaveResponse.FromString,
        )


class LighthouseClient:
    """Client of a lighthouse.

    Args:
        addr: the lighthouse address, ``host:port`` or ``http://host:port``.
        connect_timeout: how long to keep trying to connect (a timedelta or
            seconds), now and after the lighthouse goes away.
        token: the job token sent with every call (default
            ``FTDIST_JOB_TOKEN``, then ``FTDIST_JOB_TOKEN_FILE``; none: no
            token is sent).
        tls_ca: the PEM file of certificates to trust; setting it (or
            ``FTDIST_TLS_CA``) makes the client use TLS.
        keepalive: ping the lighthouse this often (a timedelta or seconds),
            and drop the connection when a ping goes unanswered as long, so
            that a long call (the failure-news stream) across a partition
            fails and can be opened again instead of staying half-open;
            None: every 60 s (for ftdist's lighthouse; torchft's rejects
            frequent pings).

    Raises:
        ValueError: if the address, timeout or token is malformed.
        OSError: if a token or TLS file cannot be read.
        CoordinationError: if the lighthouse cannot be reached in time.
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta | float,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        keepalive: timedelta | float | None = None,
    ) -> None:
        self.addr = addr
        self.connect_timeout = (
            connect_timeout
            if isinstance(connect_timeout, timedelta)
            else timedelta(seconds=connect_timeout)
        )
        self._connect_s = to_seconds(connect_timeout, "connect_timeout")
        self._target = _rpc.grpc_target(addr)
        self._metadata = call_metadata(job_token(token))
        self._tls = tls_files(ca=tls_ca)
        self._keepalive_s = None if keepalive is None else to_seconds(keepalive, "keepalive")
        self._conn = _Connection(addr, self._tls, self._keepalive_s)
        self._lock = threading.Lock()  # one connect waiter at a time
        # Guards _conn and _closed; never held while waiting on the network,
        # so a renewal is not stuck behind a connect that waits.
        self._conn_lock = threading.Lock()
        self._closed = False
        # False after a call found the lighthouse unreachable: the next call
        # first reconnects, with backoff, for up to connect_timeout (the
        # lighthouse may be restarting). grpc's connectivity watcher is not
        # used for this: it races with channel.close() in grpcio.
        self._connected = False
        try:
            self._ensure_connected(self._connect_s, "connect")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection; later calls fail. Idempotent."""
        with self._conn_lock:
            self._closed = True
            conn = self._conn
        conn.channel.close()

    def renew_connection(self, silent_since: float | None = None) -> None:
        """Drop the current connection and open a new one for the next call.

        Called when a short call timed out: the lighthouse may sit behind a
        partition that has just been lifted. An established TCP connection
        whose packets vanished retransmits with exponential backoff, so it
        can stay silent for many seconds after the network is back; a new
        connection sends its SYN now. Calls still waiting on the old
        connection fail (``CoordinationError``) instead of waiting for it.

        Args:
            silent_since: renew only if the connection has shown no sign of
                life (a connect, an answer) since this ``time.monotonic()``
                instant; None renews in any case.
        """
        with self._conn_lock:
            if self._closed:
                return
            if silent_since is not None and self._conn.alive_at >= silent_since:
                # Another call got through meanwhile: the connection works
                # (closing it would cancel that call, a quorum it waits for).
                return
            old, self._conn = self._conn, _Connection(self.addr, self._tls, self._keepalive_s)
            self._connected = False
        # Closing a channel can block for a while (it cancels its calls):
        # never on the caller's path, which is a heartbeat or a quorum round.
        threading.Thread(
            target=old.channel.close, name="ftdist-lighthouse-close", daemon=True
        ).start()

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LighthouseClient(addr={self.addr!r}, connect_timeout={self.connect_timeout!r})"

    # -- calls ------------------------------------------------------------

    def quorum(
        self,
        replica_id: str,
        timeout: timedelta | float,
        address: str | None = "",
        store_address: str | None = "",
        step: int | None = 0,
        world_size: int | None = 0,
        shrink_only: bool | None = False,
        data: Mapping[Any, Any] | None = None,
        *,
        commit_failures: int = 0,
        reconfigure_handles: Sequence[str] = (),
    ) -> Quorum:
        """Join the next quorum and wait until it forms.

        Args:
            replica_id: this replica group's id (not empty).
            timeout: how long to wait (a timedelta or seconds).
            address: this replica group's ManagerServer address.
            store_address: this replica group's TCPStore address.
            step: the step this replica group is at (not negative).
            world_size: ranks in this replica group.
            shrink_only: ask that the quorum add no new member.
            data: JSON-serializable data shown to the other members (keys
                become strings, as with any JSON object).
            commit_failures: failed commits since the last success; > 0 makes
                the lighthouse issue a new quorum_id (ftdist extension of
                torchft's Python signature, which always sends 0).
            reconfigure_handles: process-group reconfigure handles, one per
                group rank (torchft wheel protocol).

        Returns:
            The first quorum formed that includes ``replica_id``.

        Raises:
            ValueError: if ``replica_id`` is empty or ``step`` negative.
            TypeError: if ``data`` is not JSON-serializable.
            CoordinationTimeoutError: if no quorum formed within ``timeout``.
            CoordinationError: if the lighthouse rejected the request, went
                away during the call or cannot be reached.
        """
        if not replica_id:
            raise ValueError("replica_id must not be empty.")
        step = step or 0
        if step < 0:
            raise ValueError(f"step ({step}) must not be negative.")
        timeout_s = to_seconds(timeout, "timeout")
        encoded = "" if data is None else json.dumps(data)
        request = torchft_pb2.LighthouseQuorumRequest(
            requester=torchft_pb2.QuorumMember(
                replica_id=replica_id,
                address=address or "",
                store_address=store_address or "",
                step=step,
                world_size=world_size or 0,
                shrink_only=bool(shrink_only),
                data=encoded,
                commit_failures=commit_failures,
                reconfigure_handles=list(reconfigure_handles),
            )
        )
        response = self._call("quorum", request, timeout_s, "Quorum")
        return Quorum.from_proto(response.quorum)

    def heartbeat(
        self, replica_id: str, timeout: timedelta | float = _DEFAULT_HEARTBEAT_TIMEOUT
    ) -> None:
        """Tell the lighthouse this replica group is alive.

        Args:
            replica_id: this replica group's id (not empty).
            timeout: how long to wait (a timedelta or seconds).

        Raises:
            ValueError: if ``replica_id`` is empty.
            CoordinationTimeoutError: if the call ran past ``timeout``.
            CoordinationError: if the lighthouse rejected it or is unreachable.
        """
        if not replica_id:
            raise ValueError("replica_id must not be empty.")
        timeout_s = to_seconds(timeout, "timeout")
        request = torchft_pb2.LighthouseHeartbeatRequest(replica_id=replica_id)
        began = time.monotonic()
        try:
            self._call("heartbeat", request, timeout_s, "Heartbeat")
        except CoordinationTimeoutError:
            # A heartbeat is answered at once by a live lighthouse: one that
            # timed out points at a dead connection (see renew_connection).
            self.renew_connection(silent_since=began)
            raise

    def subscribe(self, replica_id: str = "", listener: str = "") -> LighthouseEventStream:
        """Open the failure-news stream (ftdist lighthouses only).

        The lighthouse counts the stream's end as the death of ``replica_id``
        unless ``listener`` holds another stream open.

        Args:
            replica_id: the replica group listening.
            listener: which process of it listens, the same on every
                reconnect (``host:pid``); empty counts every stream of the
                replica group together.

        Returns:
            The stream; its first event is ``"subscribed"``. Close it when done.

        Raises:
            CoordinationError: if the lighthouse cannot be reached.
        """
        self._ensure_connected(self._connect_s, "Subscribe")
        call = self._conn.subscribe(
            ftdist_pb2.SubscribeRequest(replica_id=replica_id, listener=listener),
            metadata=self._metadata,
        )
        return LighthouseEventStream(call, f"event stream from lighthouse at {self.addr}")

    def leave(self, replica_id: str, timeout: timedelta | float = _DEFAULT_STATUS_TIMEOUT) -> bool:
        """Tell the lighthouse that ``replica_id`` leaves the job for good.

        Its peers' next quorum forms without waiting for it, and its
        connections closing are not reported as a failure. A lighthouse
        that does not know the call (torchft's) is not an error.

        Args:
            replica_id: the replica group's full id.
            timeout: how long to wait (a timedelta or seconds).

        Returns:
            True if the lighthouse took note, False if it does not serve
            ``Leave``.

        Raises:
            ValueError: if ``replica_id`` is empty.
            CoordinationTimeoutError: if the call ran past ``timeout``.
            CoordinationError: if the lighthouse is unreachable or refused.
        """
        if not replica_id:
            raise ValueError("replica_id must not be empty.")
        timeout_s = to_seconds(timeout, "timeout")
        try:
            self._call("leave", ftdist_pb2.LeaveRequest(replica_id=replica_id), timeout_s, "Leave")
        except CoordinationError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.Call) and cause.code() is grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise
        return True

    def status(self, timeout: timedelta | float = _DEFAULT_STATUS_TIMEOUT) -> dict[str, Any]:
        """Fetch the lighthouse's status document (ftdist lighthouses only).

        The document is the one the dashboard serves at ``/status.json``
        (:func:`ftdist.lighthouse.status.build_status`): the current
        quorum and its members, parked requests, heartbeat ages and why the
        next quorum is or is not ready. Newer lighthouses may add keys.

        Args:
            timeout: how long to wait (a timedelta or seconds).

        Returns:
            The document, parsed from JSON.

        Raises:
            ValueError: if ``timeout`` is not positive.
            TypeError: if ``timeout`` is neither a timedelta nor a number.
            CoordinationTimeoutError: if the call ran past ``timeout``.
            CoordinationError: if the lighthouse is unreachable, does not
                serve ``Status`` (torchft's lighthouse, an older ftdist), or
                answered with something that is not a JSON object.
        """
        timeout_s = to_seconds(timeout, "timeout")
        try:
            response = self._call("status", ftdist_pb2.StatusRequest(), timeout_s, "Status")
        except CoordinationError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.Call) and cause.code() is grpc.StatusCode.UNIMPLEMENTED:
                raise CoordinationError(
                    f"lighthouse at {self.addr} does not serve ftdist's Status call; it is "
                    "torchft's lighthouse or an older ftdist (use its dashboard instead)"
                ) from exc
            raise
        try:
            document = json.loads(response.status_json)
        except ValueError as exc:
            raise CoordinationError(
                f"lighthouse at {self.addr} sent a status that is not JSON: {exc}"
            ) from exc
        if not isinstance(document, dict):
            raise CoordinationError(
                f"lighthouse at {self.addr} sent a status that is not a JSON object "
                f"(got {type(document).__name__})"
            )
        return document

    # -- plumbing -----------------------------------------------------------

    def _ensure_connected(self, wait_s: float, what: str) -> None:
        if self._connected:
            return
        deadline = time.monotonic() + wait_s
        # One waiter at a time; the others find the channel connected after
        # it. Waiting for the lock counts against the caller's own timeout:
        # a heartbeat must not sit behind a quorum call's longer connect.
        if not self._lock.acquire(timeout=max(0.0, wait_s)):
            self._connect_failed(wait_s, what, None)
        try:
            while not self._connected:
                conn = self._conn
                ready = grpc.channel_ready_future(conn.channel)
                # Waited in slices: a renewed connection (renew_connection)
                # replaces the one waited on, and the wait moves to it.
                while True:
                    left = deadline - time.monotonic()
                    try:
                        ready.result(timeout=max(0.0, min(left, _RENEW_POLL_S)))
                        break
                    except grpc.FutureTimeoutError as exc:
                        if self._conn is not conn:
                            ready.cancel()
                            break
                        if left <= _RENEW_POLL_S:
                            ready.cancel()  # stops grpc's connectivity polling for it
                            self._connect_failed(wait_s, what, exc)
                    except ValueError as exc:  # the channel was closed
                        if self._conn is not conn:
                            break  # renewed meanwhile: wait for the new one
                        raise CoordinationError(f"client of {self.addr} is closed") from exc
                if self._conn is conn:
                    conn.alive_at = time.monotonic()
                    self._connected = True
        finally:
            self._lock.release()

    def _connect_failed(self, wait_s: float, what: str, cause: Exception | None) -> NoReturn:
        if wait_s < self._connect_s:
            raise CoordinationTimeoutError(
                f"{what} timed out after {wait_s:g} s while reconnecting to "
                f"lighthouse at {self.addr}"
            ) from cause
        raise CoordinationError(
            f"failed to connect to lighthouse at {self.addr} within "
            f"{self._connect_s:g} s; check the address and that the lighthouse "
            "is running, or raise connect_timeout"
        ) from cause

    def _call(self, name: str, request: Any, timeout_s: float, method: str) -> Any:
        what = f"{method} call to lighthouse at {self.addr}"
        deadline = time.monotonic() + timeout_s
        resent = False
        while True:
            remaining = max(0.001, deadline - time.monotonic())
            self._ensure_connected(min(self._connect_s, remaining), what)
            conn = self._conn
            try:
                response = getattr(conn, name)(
                    request,
                    timeout=max(0.001, deadline - time.monotonic()),
                    metadata=self._metadata,
                )
                conn.alive_at = time.monotonic()
                return response
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                if code is grpc.StatusCode.UNAVAILABLE:
                    self._connected = False
                    # The request never left (the lighthouse went away while
                    # the channel was idle): reconnect and send it once more.
                    # A call that was in flight is never resent.
                    details = exc.details() if isinstance(exc, grpc.Call) else ""
                    if not resent and (details or "").startswith("failed to connect"):
                        resent = True
                        continue
                raise _rpc.map_rpc_error(exc, what) from exc
            except ValueError as exc:  # the channel was closed
                raise CoordinationError(f"client of {self.addr} is closed") from exc
