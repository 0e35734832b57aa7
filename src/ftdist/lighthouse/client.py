"""
Lighthouse client
=================

:class:`LighthouseClient` talks to any lighthouse that speaks
``torchft.LighthouseService`` (ftdist's or torchft's) with torchft's Python
API: ``quorum(...)`` and ``heartbeat(...)``, plus two ftdist extensions
(ftdist lighthouses only): the failure-news stream,
:meth:`LighthouseClient.subscribe`, and the status document,
:meth:`LighthouseClient.status`.

Connection handling, one address:

* The constructor connects, backing off from 100 ms up to 10 s between
  attempts, and gives up after ``connect_timeout`` with
  :class:`~ftdist.errors.CoordinationError`.
* A call that finds the lighthouse unreachable before its request left (the
  lighthouse is restarting, say) reconnects with the same backoff for up to
  ``connect_timeout``, within the call's own ``timeout``, and then sends it.
* A call in flight when the lighthouse goes away fails at once with
  ``CoordinationError``; it is never resent, so a quorum request cannot hang
  on a dead server or be counted twice.
* The one address may be a replica of a replicated lighthouse (behind one
  DNS name, or torchft-style configuration), which forwards calls to its
  leader. A call it answers unserved while no leader is elected, or with the
  failure of a leader that died during the call, is sent again after a pause
  growing from 50 ms to 200 ms, within the call's ``timeout``: a failover
  costs such a client a wait, not a failed quorum.
* A call that runs past its ``timeout`` raises
  :class:`~ftdist.errors.CoordinationTimeoutError`, a ``TimeoutError``, as
  torchft does; every other failure is a ``CoordinationError`` (a
  ``RuntimeError``) carrying the server's message.

Several addresses, comma-separated (``http://h1:29510,http://h2:29510``),
are the replicas of a replicated lighthouse, of which only the elected
leader forms quorums. Every call carries ``ftdist-follow-leader`` metadata,
so that a follower answers "not the leader" and names the leader instead of
forwarding the call; the client then moves there itself:

* The constructor connects to every replica at once, starts with the first
  that is up, and gives up after ``connect_timeout``.
* A call goes to the current replica. "Not the leader" sends it at once to
  the leader named (added to the replicas if listed under another name);
  while no leader is named (an election), to the next replica after a
  pause growing from 50 ms to 200 ms. An unreachable replica, or one shutting
  down, sends it at once to the next one.
* A call in flight when its replica dies or steps down is sent again to
  the new leader: a failover does not fail a quorum or heartbeat, hence a
  step (nothing is counted twice: the old leader's state went with its
  leadership).
* A call never runs past its ``timeout`` (``CoordinationTimeoutError``) and
  fails with ``CoordinationError`` once no replica was reachable for
  ``connect_timeout``.
* The failure-news stream follows the leader until its first event; one
  that breaks later raises as with one address, the client having moved to
  the replica the break pointed at, so the next :meth:`~LighthouseClient.subscribe`
  goes there.
* The current replica is shared by every thread using the client; each move
  is logged (``ftdist.lighthouse.client``, INFO).

The client is thread-safe: one instance can serve a heartbeat thread and a
quorum thread at once.

Every call carries the job token (:mod:`ftdist._auth`) when the process has
one; a lighthouse without a token ignores it, one with a token refuses calls
without it (``CoordinationError`` naming ``UNAUTHENTICATED``). The channel
uses TLS for an ``https://`` address or when ``FTDIST_TLS_CA`` is set. On
plaintext the unary calls (quorum, heartbeat, status, leave, heal reports)
go on ftdist's own HTTP/2 client (:mod:`ftdist._rpc.h2_client`), made from
the calling thread; ``FTDIST_LIGHTHOUSE_RPC_CLIENT=grpcio`` (or
``rpc_client="grpcio"``) sends them through grpcio, as TLS always does.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import grpc

from ftdist._auth import job_token, tls_files
from ftdist._durations import to_seconds
from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import ftdist_pb2, torchft_pb2
from ftdist._rpc.auth import call_metadata
from ftdist.errors import CoordinationError, CoordinationTimeoutError
from ftdist.lighthouse.config import lighthouse_rpc_client
from ftdist.lighthouse.connection import Connection
from ftdist.lighthouse.event_stream import LighthouseEventStream
from ftdist.lighthouse.following import (
    MOST_PAUSE_S,
    MOST_REPLICAS,
    Replica,
    Search,
    describe,
    leader_hint,
    parse_addresses,
)
from ftdist.lighthouse.types import Quorum

__all__ = ["LighthouseClient", "LighthouseEventStream", "parse_addresses"]

logger = logging.getLogger(__name__)

_DEFAULT_HEARTBEAT_TIMEOUT = timedelta(seconds=5)
_DEFAULT_STATUS_TIMEOUT = timedelta(seconds=5)
_HEAL_REPORT_FIELDS = frozenset(ftdist_pb2.HealReport.DESCRIPTOR.fields_by_name) - {"replica_id"}
# How often a connect wait looks whether its connection was renewed.
_RENEW_POLL_S = 0.25
# Pause before resending a call that never left while the channel reconnects.
_RESEND_PAUSE_S = 0.02
# First pause before resending a call that a replica answered unserved while
# no leader was elected; it doubles up to MOST_PAUSE_S.
_ELECTION_PAUSE_S = 0.05


class LighthouseClient:
    """Client of a lighthouse.

    Args:
        addr: the lighthouse address, ``host:port`` or ``http://host:port``;
            several, comma-separated, for the replicas of a replicated
            lighthouse (see the module's documentation).
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
        rpc_client: how unary calls go on plaintext: ``"h2"`` (on
            :mod:`ftdist._rpc.h2_client`, from the calling thread) or
            ``"grpcio"``; default ``FTDIST_LIGHTHOUSE_RPC_CLIENT``, then
            ``"h2"``. TLS always goes through grpcio.

    Raises:
        ValueError: if the address, timeout or token is malformed (an
            address list: an entry empty, malformed or given twice), or
            ``rpc_client`` is neither ``h2`` nor ``grpcio``.
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
        rpc_client: str | None = None,
    ) -> None:
        self.addr = addr
        self._rpc_client = lighthouse_rpc_client(rpc_client)
        self.connect_timeout = (
            connect_timeout
            if isinstance(connect_timeout, timedelta)
            else timedelta(seconds=connect_timeout)
        )
        self._connect_s = to_seconds(connect_timeout, "connect_timeout")
        addresses = parse_addresses(addr)
        self._replicated = len(addresses) > 1
        self._metadata = call_metadata(job_token(token))
        if self._replicated:
            self._metadata = (*(self._metadata or ()), (_rpc.FOLLOW_LEADER_METADATA, "1"))
        self._tls = tls_files(ca=tls_ca)
        self._keepalive_s = None if keepalive is None else to_seconds(keepalive, "keepalive")
        # One address is used as given, as it always was.
        self._replicas = [Replica(a) for a in addresses] if self._replicated else [Replica(addr)]
        self._current = self._replicas[0]
        if not self._replicated:
            self._current.conn = Connection(addr, self._tls, self._keepalive_s, self._rpc_client)
        self._lock = threading.Lock()  # one connect waiter at a time
        # Guards _replicas, _current, each replica's conn and _closed; never
        # held while waiting on the network, so a renewal is not stuck
        # behind a connect that waits.
        self._conn_lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()  # ends the pauses of an election wait
        # False after a call found the lighthouse unreachable: the next call
        # first reconnects, with backoff, for up to connect_timeout (the
        # lighthouse may be restarting). grpc's connectivity watcher is not
        # used for this: it races with channel.close() in grpcio.
        self._connected = False
        try:
            if self._replicated:
                self._connect_any()
            else:
                self._ensure_connected(self._connect_s, "connect")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection; later calls fail. Idempotent."""
        with self._conn_lock:
            self._closed = True
            conns = [r.conn for r in self._replicas if r.conn is not None]
        self._closing.set()
        for conn in conns:
            conn.close()

    def renew_connection(self, silent_since: float | None = None) -> None:
        """Drop the current connection and open a new one for the next call.

        Called when a short call timed out: the lighthouse may sit behind a
        partition that has just been lifted. An established TCP connection
        whose packets vanished retransmits with exponential backoff, so it
        can stay silent for many seconds after the network is back; a new
        connection sends its SYN now. Calls still waiting on the old
        connection fail (``CoordinationError``) instead of waiting for it.

        With several replicas, the current replica's connection is renewed.

        Args:
            silent_since: renew only if the connection has shown no sign of
                life (a connect, an answer) since this ``time.monotonic()``
                instant; None renews in any case.
        """
        with self._conn_lock:
            replica, old = self._current, self._current.conn
            if self._closed or old is None:
                return
            if silent_since is not None and old.alive_at >= silent_since:
                # Another call got through meanwhile: the connection works
                # (closing it would cancel that call, a quorum it waits for).
                return
            replica.conn = Connection(replica.addr, self._tls, self._keepalive_s, self._rpc_client)
            self._connected = False
        # Closing a channel can block for a while (it cancels its calls):
        # never on the caller's path, which is a heartbeat or a quorum round.
        threading.Thread(target=old.close, name="ftdist-lighthouse-close", daemon=True).start()

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
            CoordinationError: if the lighthouse cannot be reached (with
                several replicas: when the stream is read).
        """
        request = ftdist_pb2.SubscribeRequest(replica_id=replica_id, listener=listener)
        what = f"event stream from lighthouse at {self.addr}"
        if not self._replicated:
            self._ensure_connected(self._connect_s, "Subscribe")
            call = self._conn_of(self._current).subscribe(request, metadata=self._metadata)
            return LighthouseEventStream(call, what)
        search = Search("event stream from", math.inf, None)
        replica = self._current
        conn = self._conn_of(replica)
        call = conn.subscribe(request, metadata=self._metadata)

        def follow(exc: grpc.RpcError, reopen: bool) -> Any:
            nonlocal replica, conn
            if not reopen:
                self._move_after(replica, conn, exc, search)
                return None
            if search.deadline == math.inf:  # reopening is connecting: connect_timeout
                search.deadline = time.monotonic() + self._connect_s
            self._recover(search, replica, conn, exc)
            replica = self._current
            conn = self._conn_of(replica)
            return conn.subscribe(request, metadata=self._metadata)

        return LighthouseEventStream(call, what, follow)

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
        request = ftdist_pb2.LeaveRequest(replica_id=replica_id)
        return self._call_if_served("leave", request, to_seconds(timeout, "timeout"), "Leave")

    def _call_if_served(self, name: str, request: Any, timeout_s: float, method: str) -> bool:
        """:meth:`_call`; False when the lighthouse does not serve ``method`` (torchft's)."""
        try:
            self._call(name, request, timeout_s, method)
        except CoordinationError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.Call) and cause.code() is grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise
        return True

    def report_heal(
        self,
        replica_id: str,
        report: Mapping[str, Any],
        timeout: timedelta | float = _DEFAULT_STATUS_TIMEOUT,
    ) -> bool:
        """Report a heal's progress or end to the lighthouse's history.

        Args:
            replica_id: the healing replica group's full id.
            report: the :class:`~ftdist._rpc._proto.ftdist_pb2.HealReport`
                fields (``phase``, ``step``, ``quorum_s``, ...); others are
                ignored.
            timeout: how long to wait (a timedelta or seconds).

        Returns:
            True if the lighthouse took note, False if it does not serve
            ``ReportHeal`` (torchft's).

        Raises:
            ValueError: if ``replica_id`` is empty.
            CoordinationTimeoutError: if the call ran past ``timeout``.
            CoordinationError: if the lighthouse is unreachable or refused.
        """
        if not replica_id:
            raise ValueError("replica_id must not be empty.")
        fields = {k: v for k, v in report.items() if k in _HEAL_REPORT_FIELDS}
        request = ftdist_pb2.HealReport(replica_id=replica_id, **fields)
        return self._call_if_served(
            "report_heal", request, to_seconds(timeout, "timeout"), "ReportHeal"
        )

    def status(self, timeout: timedelta | float = _DEFAULT_STATUS_TIMEOUT) -> dict[str, Any]:
        """Fetch the lighthouse's status document (ftdist lighthouses only).

        The document is the one the dashboard serves at ``/status.json``
        (:func:`ftdist.lighthouse.status.build_status`): the current
        quorum and its members, parked requests, heartbeat ages and why the
        next quorum is or is not ready. Newer lighthouses may add keys.
        With several replicas, the current one is asked, then the others
        (a follower may answer itself or name the leader).

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
                conn = self._conn_of(self._current)
                ready = grpc.channel_ready_future(conn.channel)
                # Waited in slices: a renewed connection (renew_connection)
                # replaces the one waited on, and the wait moves to it.
                while True:
                    left = deadline - time.monotonic()
                    try:
                        ready.result(timeout=max(0.0, min(left, _RENEW_POLL_S)))
                        break
                    except grpc.FutureTimeoutError as exc:
                        if self._current.conn is not conn:
                            ready.cancel()
                            break
                        if left <= _RENEW_POLL_S:
                            ready.cancel()  # stops grpc's connectivity polling for it
                            self._connect_failed(wait_s, what, exc)
                    except ValueError as exc:  # the channel was closed
                        if self._current.conn is not conn:
                            break  # renewed meanwhile: wait for the new one
                        raise CoordinationError(f"client of {self.addr} is closed") from exc
                if self._current.conn is conn:
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
        if self._replicated:
            return self._call_replicated(name, request, timeout_s, method)
        what = f"{method} call to lighthouse at {self.addr}"
        deadline = time.monotonic() + timeout_s
        election_pause_s = _ELECTION_PAUSE_S
        while True:
            remaining = max(0.001, deadline - time.monotonic())
            self._ensure_connected(min(self._connect_s, remaining), what)
            conn = self._conn_of(self._current)
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
                    # the channel was idle): reconnect and send it again while
                    # time is left. A call that was in flight is never resent.
                    # Not just once: grpc's Python side caches connectivity in
                    # a poller thread, which under load still says READY for
                    # a moment after the channel went down, so the reconnect
                    # wait can pass at once and the resend fail the same way.
                    details = (exc.details() if isinstance(exc, grpc.Call) else "") or ""
                    left = deadline - time.monotonic()
                    if details.startswith("failed to connect") and left > 0:
                        time.sleep(min(_RESEND_PAUSE_S, left))
                        continue
                    # One address that is a replica of a replicated lighthouse
                    # (behind one DNS name, say): it forwards the call, and
                    # answers it unserved during an election, or with the
                    # failure of a leader that died with the call parked. As
                    # with several addresses, the call goes again, to the
                    # leader to come; nothing was counted (a dead leader's
                    # state went with its leadership).
                    if details.startswith((_rpc.NO_LEADER_YET, _rpc.FORWARDED_PREFIX)) and left > 0:
                        time.sleep(min(election_pause_s, left))
                        election_pause_s = min(2 * election_pause_s, MOST_PAUSE_S)
                        continue
                raise _rpc.map_rpc_error(exc, what) from exc
            except ValueError as exc:  # the channel was closed
                raise CoordinationError(f"client of {self.addr} is closed") from exc

    def _conn_of(self, replica: Replica) -> Connection:
        with self._conn_lock:
            if self._closed:
                raise CoordinationError(f"client of {self.addr} is closed")
            if replica.conn is None:  # a replica is connected when first used
                replica.conn = Connection(
                    replica.addr, self._tls, self._keepalive_s, self._rpc_client
                )
            return replica.conn

    # -- several replicas: following the leader -------------------------------

    def _connect_any(self) -> None:
        # All replicas at once: a dead one must not hold up the others.
        arrived = threading.Event()
        waits = []
        for replica in self._replicas:
            ready = grpc.channel_ready_future(self._conn_of(replica).channel)
            ready.add_done_callback(lambda _: arrived.set())
            waits.append((replica, ready))
        deadline = time.monotonic() + self._connect_s
        try:
            while True:
                up = [r for r, ready in waits if ready.done() and not ready.cancelled()]
                if up:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CoordinationError(
                        f"failed to connect to any lighthouse replica of {self.addr} within "
                        f"{self._connect_s:g} s; check the addresses and that the lighthouse "
                        "is running, or raise connect_timeout"
                    )
                arrived.wait(left)
        finally:
            for _, ready in waits:
                ready.cancel()  # stops grpc's connectivity polling for it
        # The leader is not known before a call asks: the first listed of
        # those up is as good a guess as any. The other channels stay open
        # for the moves to come (and closing one right after its connectivity
        # watch was cancelled races with grpc's polling thread).
        with self._conn_lock:
            self._current = up[0]
            chosen = up[0].conn
        if chosen is not None:
            chosen.alive_at = time.monotonic()

    def _call_replicated(self, name: str, request: Any, timeout_s: float, method: str) -> Any:
        search = Search(f"{method} call to", time.monotonic() + timeout_s, timeout_s)
        while True:
            replica = self._current
            conn = self._conn_of(replica)
            try:
                response = getattr(conn, name)(
                    request,
                    timeout=max(0.001, search.deadline - time.monotonic()),
                    metadata=self._metadata,
                )
            except grpc.RpcError as exc:
                self._recover(search, replica, conn, exc)
                continue
            except ValueError as exc:  # the channel was closed
                if self._closed or replica.conn is conn:
                    raise CoordinationError(f"client of {self.addr} is closed") from exc
                continue  # renewed before the call left: send it on the new one
            conn.alive_at = time.monotonic()
            return response

    def _recover(
        self, search: Search, replica: Replica, conn: Connection, exc: grpc.RpcError
    ) -> None:
        """After ``exc`` from ``replica``: move on and return when to try again, or raise."""
        how = self._move_after(replica, conn, exc, search)
        if how is None:
            raise _rpc.map_rpc_error(exc, f"{search.what} lighthouse at {replica.addr}") from exc
        now = time.monotonic()
        search.last = f"{replica.addr}: {describe(exc)}"
        if how == "unreachable":
            if search.unreachable_since is None:
                search.unreachable_since = now
        else:
            search.unreachable_since = None
            conn.alive_at = now
        limit = search.deadline
        if search.unreachable_since is not None:
            limit = min(limit, search.unreachable_since + self._connect_s)
        search.hops += 1
        # Moves go at once, but a round of replicas that all failed (or told
        # each other's names) means waiting, as does an election.
        if how != "election" and search.hops < len(self._replicas) and now < limit:
            return
        self._closing.wait(max(0.0, min(search.pause_s, limit - now)))
        search.pause_s = min(2 * search.pause_s, MOST_PAUSE_S)
        search.hops = 0
        search.pauses += 1
        if time.monotonic() < limit:
            return
        if search.timeout_s is not None and limit == search.deadline:
            # The tail is torchft's wording for a timeout (see map_rpc_error).
            raise CoordinationTimeoutError(
                f"{search.what} lighthouse at {self.addr} timed out after "
                f"{search.timeout_s:g} s without reaching its leader (last: {search.last}) "
                '(status: Cancelled, message: "Timeout expired")'
            ) from exc
        raise CoordinationError(
            f"{search.what} lighthouse at {self.addr} failed: no replica "
            f"{'reachable' if how == 'unreachable' else 'led'} for {self._connect_s:g} s "
            f"(last: {search.last}); check the addresses and that the lighthouse is running, "
            "or raise connect_timeout"
        ) from exc

    def _move_after(
        self, replica: Replica, conn: Connection, exc: grpc.RpcError, search: Search
    ) -> str | None:
        """Move the client away from ``replica`` after ``exc`` if it calls for that.

        Returns:
            Why: "redirect" (to the leader named), "election" (none named),
            "unreachable" (or stopped during the call), "renewed" (the
            connection was renewed under the call; stay), or None: ``exc``
            is the call's own failure.
        """
        # Rounds of a long wait are logged once: each pause would log again.
        quiet = search.pauses > 0
        hint = leader_hint(exc)
        if hint is not None:
            leader = self._replica_named(hint, replica) if hint else None
            if leader is None or leader is replica:
                self._move(
                    replica,
                    self._next_of(replica),
                    "it is not the leader and names none (an election?)",
                    quiet,
                )
                return "election"
            self._move(replica, leader, "it is not the leader and names that one", False)
            return "redirect"
        code = exc.code() if isinstance(exc, grpc.Call) else None
        if code is grpc.StatusCode.CANCELLED and not self._closed and replica.conn is not conn:
            return "renewed"
        # A lighthouse cancels a call only when it stops with the call in
        # flight (grpc's server stop): as good as unreachable.
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) and not self._closed:
            self._move(replica, self._next_of(replica), f"unavailable: {describe(exc)}", quiet)
            return "unreachable"
        return None

    def _move(self, old: Replica, new: Replica, why: str, quiet: bool) -> None:
        with self._conn_lock:
            # Another thread may have moved on from the same failure already.
            if self._current is not old or new is old:
                return
            self._current = new
        logger.log(
            logging.DEBUG if quiet else logging.INFO,
            "lighthouse client of %s: moving from replica %s to %s: %s",
            self.addr,
            old.addr,
            new.addr,
            why,
        )

    def _next_of(self, replica: Replica) -> Replica:
        with self._conn_lock:
            return self._replicas[(self._replicas.index(replica) + 1) % len(self._replicas)]

    def _replica_named(self, hint: str, informer: Replica) -> Replica | None:
        try:
            target = _rpc.grpc_target(hint)
        except ValueError:
            logger.warning("lighthouse replica %s names a malformed leader %r", informer.addr, hint)
            return None
        with self._conn_lock:
            for replica in self._replicas:
                if replica.target == target:
                    return replica
            if len(self._replicas) >= MOST_REPLICAS:
                return None
            # A replica reached under another name than the one listed; it
            # is reached the same way as the replica that named it.
            tls = informer.addr.startswith("https://")
            replica = Replica(("https://" if tls else "http://") + target)
            self._replicas.append(replica)
            return replica
