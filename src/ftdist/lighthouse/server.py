"""
Lighthouse server
=================

The one server a fault-tolerant job shares. Every replica group heartbeats it
and, at each step, asks it which replica groups train together (the quorum).

:class:`LighthouseServer` serves, on one gRPC port:

* ``torchft.LighthouseService`` (``Quorum``, ``Heartbeat``), wire-compatible
  with torchft, so torchft managers can use it and ftdist managers can use
  torchft's lighthouse;
* ``ftdist.LighthouseEvents`` (``Subscribe``, ``Leave``): a stream of
  failure news, and a clean exit that is not news of a failure. When
  a member of the current quorum stops heartbeating, every subscriber hears it
  within one quorum tick of the heartbeat timeout, without waiting for its
  next quorum call. torchft clients never call it. Its ``Status`` call returns
  the dashboard's status document (``ftdist status``), so a terminal needs
  only the gRPC address, not the dashboard port.

and, on a second port, the dashboard of :mod:`ftdist.lighthouse.dashboard`.

Deviation from torchft: torchft serves gRPC and the dashboard on the same port;
here the dashboard has its own port (``http_port``), on either gRPC server
(grpcio's owns its listening socket, and the two ports stay the same whichever
server runs).

The gRPC callbacks, the periodic tick and the engine
(:mod:`ftdist.lighthouse.engine`) all run on one thread named
``ftdist-lighthouse`` (:mod:`ftdist._rpc.h2_server`; :mod:`ftdist._rpc.cq_server` over TLS), so the state
needs no locks; the dashboard's threads read it by scheduling work there. The constructor returns once the server is serving, and
:meth:`LighthouseServer.shutdown` stops and joins everything it started.
Requests that fail validation get ``INVALID_ARGUMENT`` naming the field, and
never disturb the other clients.

With a job token (:mod:`ftdist._auth`) every call must carry it; one that
does not is answered ``UNAUTHENTICATED`` before its request is read. Caps in
the config bound what any client can make the lighthouse hold (replica ids,
parked requests per id, event streams, field sizes); past one the call gets
``RESOURCE_EXHAUSTED`` and nothing is recorded.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import grpc

from ftdist._advertise import advertised_host
from ftdist._auth import tls_files, warn_if_open
from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import ftdist_pb2, torchft_pb2
from ftdist._rpc.auth import call_metadata, metadata_refusal, server_credentials
from ftdist._rpc.call import RpcServer, ServerCall, decode_request
from ftdist._rpc.cq_server import CompletionQueueServer
from ftdist._rpc.h2_server import H2Server
from ftdist._rpc.kill import kill_manager
from ftdist.lighthouse.config import LighthouseConfig, resolve_lighthouse_config
from ftdist.lighthouse.dashboard import DashboardServer
from ftdist.lighthouse.engine import FormedQuorum, LighthouseEngine
from ftdist.lighthouse.forward import LeaderForwarder
from ftdist.lighthouse.history import JobHistory, merge_failovers, record_heal_report
from ftdist.lighthouse.limits import MAX_FIELD_BYTES, check_member, too_long
from ftdist.lighthouse.quorum import QuorumConfig
from ftdist.lighthouse.replica import LighthouseReplica, Takeover
from ftdist.lighthouse.status import build_status
from ftdist.lighthouse.streams import STREAM_GRACE_S

__all__ = ["LighthouseServer"]

logger = logging.getLogger("ftdist.lighthouse.server")

_SHUTDOWN_GRACE_S = 1.0
# A subscriber this far behind has its stream ended rather than grow memory
# without bound; it can subscribe again.
_MAX_PENDING_EVENTS = 256
_CLOSING = "lighthouse is shutting down; retry against its replacement"


def _split_bind(bind: str) -> tuple[str, int]:
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    try:
        return host, int(port)
    except ValueError as exc:
        raise ValueError(f"bind ({bind!r}) must end in :port.") from exc


class _EventStream:
    """A subscriber's stream, as the engine sees it."""

    __slots__ = ("engine", "rpc")

    def __init__(self, rpc: ServerCall, engine: LighthouseEngine) -> None:
        self.rpc = rpc
        self.engine = engine

    def send(self, payload: bytes) -> None:
        if self.rpc.pending_messages >= _MAX_PENDING_EVENTS:
            self.engine.unsubscribe(self)
            self.rpc.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "event stream fell behind; subscribe again"
            )
            return
        self.rpc.send(payload)

    def close(self) -> None:
        self.rpc.abort(grpc.StatusCode.UNAVAILABLE, _CLOSING)


class LighthouseServer:
    """A lighthouse serving on a background thread until :meth:`shutdown`.

    Args:
        bind: gRPC listen address, ``host:port``; ``[::]:0`` or
            ``127.0.0.1:0`` picks a free port.
        min_replicas: fewest replica groups a new (non-fast) quorum needs.
        join_timeout_ms: how long a ready quorum waits for heartbeating
            stragglers (default 100 ms, torchft's Python default).
        quorum_tick_ms: period of the background evaluation (default 100 ms).
        heartbeat_timeout_ms: silence after which a replica group is dead
            (default 5000 ms).
        http_port: dashboard port on the bind host; 0 picks a free port
            (default), a negative value turns the dashboard off.
        kill_token: a secret that enables the dashboard's kill action
            (the job token enables and authorizes it too).
        token: the job token every call must carry (default
            ``FTDIST_JOB_TOKEN``, then ``FTDIST_JOB_TOKEN_FILE``; none: open).
        tls_cert: PEM certificate chain to serve gRPC over TLS (default
            ``FTDIST_TLS_CERT``).
        tls_key: its private key (default ``FTDIST_TLS_KEY``).
        config: a complete config instead of the arguments above.

    The timeouts also accept a ``timedelta``. Settings left as None come from
    ``FTDIST_LIGHTHOUSE_*`` environment variables, then the defaults
    (:mod:`ftdist.lighthouse.config`).

    Raises:
        ValueError: if a setting is invalid.
        OSError: if the gRPC or HTTP port cannot be bound, or a token or TLS
            file cannot be read.
    """

    def __init__(
        self,
        bind: str | None = None,
        min_replicas: int | None = None,
        join_timeout_ms: int | timedelta | None = None,
        quorum_tick_ms: int | timedelta | None = None,
        heartbeat_timeout_ms: int | timedelta | None = None,
        *,
        http_port: int | None = None,
        kill_token: str | None = None,
        token: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        config: LighthouseConfig | None = None,
    ) -> None:
        if config is None:
            config = resolve_lighthouse_config(
                bind=bind,
                min_replicas=min_replicas,
                join_timeout_ms=join_timeout_ms,
                quorum_tick_ms=quorum_tick_ms,
                heartbeat_timeout_ms=heartbeat_timeout_ms,
                http_port=http_port,
                kill_token=kill_token,
                token=token,
                tls_cert=tls_cert,
                tls_key=tls_key,
            )
        self.config = config
        self._host, _ = _split_bind(config.bind)
        # One history for the server's life: a replica's takeovers replace
        # the engine, not what the dashboard shows.
        self._history = JobHistory()
        self._engine = self._new_engine()
        # Replicated (config.replication): only the leader answers; _leading
        # is set on this server's thread once the engine holds the takeover.
        self._replica: LighthouseReplica | None = None
        self._leading = False
        self._forwarder = LeaderForwarder(call_metadata(config.token))
        self._server = self._rpc_server(config)
        # Quorum calls parked since the last tick, not yet watched for
        # cancellation (see _tick).
        self._unwatched: list[tuple[ServerCall, object]] = []
        self._shutdown_lock = threading.Lock()
        self._closed = False
        self._port = self._server.start()
        warn_if_open(config.token, "This lighthouse")
        self._dashboard: DashboardServer | None = None
        if config.http_port is not None:
            try:
                self._dashboard = DashboardServer(
                    host=self._host,
                    port=config.http_port,
                    status=self._status,
                    kill=self._kill,
                    kill_token=config.kill_token,
                    job_token=config.token,
                )
            except BaseException:
                self.shutdown()
                raise
        if config.replication is not None:
            try:
                self._replica = LighthouseReplica(
                    config.replication,
                    name=f"{self._public_host()}:{self._port}",
                    address=self.address(),
                    dashboard=self.dashboard_address(),
                    on_elected=lambda t: self._server.call_soon(lambda: self._take_over(t)),
                    on_deposed=lambda r: self._server.call_soon(lambda: self._step_down(r)),
                )
                self._replica.start()
            except BaseException:
                self._replica = None
                self.shutdown()
                raise
        logger.info(
            "Lighthouse listening on %s (dashboard %s)",
            self.address(),
            self.dashboard_address() or "off",
        )

    # -- public API -------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound gRPC port."""
        return self._port

    def address(self) -> str:
        """The address clients should use, ``http://host:port``.

        For a wildcard bind (``[::]``, ``0.0.0.0``) the host is this machine's
        hostname, as torchft does; otherwise it is the bind host.

        Returns:
            The address.
        """
        return f"http://{self._public_host()}:{self._port}"

    def dashboard_address(self) -> str | None:
        """The dashboard's ``http://host:port``, or None when it is off.

        Returns:
            The address or None.
        """
        if self._dashboard is None:
            return None
        return f"http://{self._public_host()}:{self._dashboard.port}"

    def _rpc_server(self, config: LighthouseConfig) -> RpcServer:
        handlers = {
            _rpc.LIGHTHOUSE_QUORUM: self._handle_quorum,
            _rpc.LIGHTHOUSE_HEARTBEAT: self._handle_heartbeat,
            _rpc.EVENTS_SUBSCRIBE: self._handle_subscribe,
            _rpc.EVENTS_STATUS: self._handle_status,
            _rpc.EVENTS_LEAVE: self._handle_leave,
            _rpc.EVENTS_REPORT_HEAL: self._handle_report_heal,
        }
        auth = (
            None
            if config.token is None
            else functools.partial(metadata_refusal, token=config.token, what="this lighthouse")
        )
        credentials = server_credentials(tls_files(config.tls_cert, config.tls_key, environ={}))
        if credentials is None and config.rpc_server == "h2":
            return H2Server(
                config.bind,
                dict(handlers),
                max_request_bytes=_rpc.MAX_REQUEST_BYTES,
                tick=self._tick,
                tick_period_s=config.quorum_tick.total_seconds(),
                thread_name="ftdist-lighthouse",
                auth=auth,
            )
        # TLS is served by grpcio's core; so is plaintext when asked for.
        return CompletionQueueServer(
            config.bind,
            dict(handlers),
            _rpc.server_options(),
            tick=self._tick,
            tick_period_s=config.quorum_tick.total_seconds(),
            thread_name="ftdist-lighthouse",
            auth=auth,
            credentials=credentials,
        )

    def shutdown(self) -> None:
        """Stop serving and join every thread. Idempotent.

        Parked quorum calls fail with UNAVAILABLE ("lighthouse is shutting
        down"), event streams end the same way, then both ports close.
        """
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        if self._replica is not None:
            # First: revoking the lease hands the leadership over at once,
            # and the requests parked here go to the next leader now rather
            # than when this server has finished closing.
            self._replica.hand_over()
            self._server.call_soon(lambda: self._step_down("this replica is shutting down"))
            self._replica.stop()
        if self._dashboard is not None:
            self._dashboard.close()
        self._server.call_soon(self._engine.close)
        self._server.stop(_SHUTDOWN_GRACE_S)
        self._forwarder.close()
        logger.info("Lighthouse on port %d stopped", self._port)

    def __enter__(self) -> LighthouseServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _public_host(self) -> str:
        host = self._host
        if host in ("", "::", "0.0.0.0"):
            host = advertised_host()
        return f"[{host}]" if ":" in host else host

    # -- dashboard hooks (called from the dashboard's threads) -------------

    def _status(self) -> dict[str, Any]:
        return dict(self._server.run(self._status_document))

    def _status_document(self) -> dict[str, Any]:
        document = build_status(self._engine, self.config)
        if self._replica is not None:
            replication = self._replica.status()
            document["replication"] = replication
            merge_failovers(document["history"], replication["failovers"])
        return document

    def _kill(self, replica_id: str) -> str:
        engine = self._engine

        def find() -> str | None:
            current = engine.current
            if current is None:
                return None
            for member in current.quorum.participants:
                if member.replica_id == replica_id:
                    return str(member.address)
            return None

        address = self._server.run(find)
        if address is None:
            raise LookupError(f"replica {replica_id!r} is not in the current quorum")
        logger.warning("Killing replica %s (manager %s) from the dashboard", replica_id, address)
        kill_manager(
            address, "killed from dashboard", timeout=timedelta(seconds=10), token=self.config.token
        )
        return str(address)

    # -- RPC handlers (on the server thread) ----------------------------------

    def _handle_quorum(self, rpc: ServerCall, request: bytes) -> None:
        if self._elsewhere(rpc, request, forward=True):
            return
        message = decode_request(rpc, torchft_pb2.LighthouseQuorumRequest, request)
        if message is None:
            return
        if not message.HasField("requester"):
            rpc.abort(grpc.StatusCode.INVALID_ARGUMENT, "missing requester")
            return
        problem = check_member(message.requester, self.config.max_data_bytes)
        if problem is not None:
            rpc.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            return
        replica_id = message.requester.replica_id
        if self._engine.parked(replica_id) >= self.config.max_parked_per_replica:
            rpc.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.config.max_parked_per_replica} quorum requests of {replica_id!r} "
                "are already waiting; cancel one before asking again",
            )
            return
        if not self._admit(rpc, replica_id):
            return

        def deliver(formed: FormedQuorum | None) -> None:
            if formed is None:
                if self._replica is not None and not self._closed:
                    self._not_leader(rpc, "it stopped leading")
                else:
                    rpc.abort(grpc.StatusCode.UNAVAILABLE, _CLOSING)
            elif self._replica is not None and not self._replica.verdict().ok:
                # Formed, but the lease may have run out meanwhile.
                self._not_leader(rpc, self._replica.verdict().reason)
            else:
                rpc.reply(formed.response)

        ticket = self._engine.join(message.requester, deliver)
        if not rpc.done:
            self._unwatched.append((rpc, ticket))

    def _tick(self) -> None:
        # Watching a call for cancellation costs a gRPC operation and an event.
        # Most parked calls are answered within milliseconds, so only those
        # still parked at a tick are watched: a client that went away is
        # withdrawn within one quorum tick (torchft never withdraws it).
        engine = self._engine
        parked, self._unwatched = self._unwatched, []
        for rpc, ticket in parked:
            if rpc.cancelled:
                # Gone before the tick: the HTTP/2 server learns of a closed
                # connection without being asked to watch the call.
                engine.withdraw(ticket)
            elif not rpc.done:
                rpc.on_cancel(functools.partial(engine.withdraw, ticket))
        if self._may_judge():
            engine.tick()

    def _may_judge(self) -> bool:
        """Whether this lighthouse may decide who is dead (and say so).

        A replica that is not a serving leader must not: one woken from a
        stop finds every heartbeat stale and would report every member
        failed before its election thread sees the lease gone (the chaos
        suite saw trainers abort their groups on it). It steps down here.
        """
        if self._replica is None:
            return True
        if not self._leading:
            return False
        verdict = self._replica.verdict()
        if not verdict.ok:
            self._step_down(verdict.reason)
            # A renewal still in flight may yet be confirmed, and the replica
            # would stay the leader in etcd while this server no longer
            # serves: every follower would point at it for good. It hands
            # the leadership back instead; an election follows.
            self._replica.resign(verdict.reason)
            return False
        return True

    def _check_lost_streams(self) -> None:
        if self._may_judge():
            self._engine.check_lost_streams()

    def _handle_heartbeat(self, rpc: ServerCall, request: bytes) -> None:
        if self._elsewhere(rpc, request, forward=True):
            return
        message = decode_request(rpc, torchft_pb2.LighthouseHeartbeatRequest, request)
        if message is None:
            return
        replica_id = message.replica_id
        if not replica_id:
            rpc.abort(grpc.StatusCode.INVALID_ARGUMENT, "replica_id must not be empty")
            return
        if len(replica_id) > MAX_FIELD_BYTES // 4 and len(replica_id.encode()) > MAX_FIELD_BYTES:
            rpc.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replica_id is longer than {MAX_FIELD_BYTES} bytes",
            )
            return
        if not self._admit(rpc, replica_id):
            return
        self._engine.heartbeat(replica_id)
        rpc.reply(b"")

    def _admit(self, rpc: ServerCall, replica_id: str) -> bool:
        if self._engine.admit(replica_id):
            return True
        rpc.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the lighthouse already tracks {self.config.max_replica_ids} replica ids "
            "(max_replica_ids), none expired; a new one is refused",
        )
        return False

    def _handle_subscribe(self, rpc: ServerCall, request: bytes) -> None:
        if self._elsewhere(rpc, request, forward=False):
            return
        message = decode_request(rpc, ftdist_pb2.SubscribeRequest, request)
        if message is None:
            return
        if too_long(message.replica_id, MAX_FIELD_BYTES):
            rpc.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replica_id is longer than {MAX_FIELD_BYTES} bytes",
            )
            return
        if self._engine.num_subscribers >= self.config.max_subscribers:
            rpc.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.config.max_subscribers} event streams are open (max_subscribers)",
            )
            return
        logger.debug("Event subscriber %r joined", message.replica_id)
        engine = self._engine
        stream = _EventStream(rpc, engine)
        replica_id = message.replica_id
        listener = message.listener[:MAX_FIELD_BYTES]

        def cancelled() -> None:
            engine.unsubscribe(stream)
            engine.stream_closed(replica_id, listener)
            if replica_id:
                # A process that died closes its streams at once: report it
                # right after the reconnect grace, not at the next tick.
                self._server.call_later(STREAM_GRACE_S + 0.005, self._check_lost_streams)

        rpc.on_cancel(cancelled)
        engine.subscribe(stream)
        engine.stream_opened(replica_id, listener)

    def _handle_status(self, rpc: ServerCall, request: bytes) -> None:
        if decode_request(rpc, ftdist_pb2.StatusRequest, request) is None:
            return
        # Handlers run on the server thread, which is the engine's loop, as
        # build_status requires.
        document = self._status_document()
        response = ftdist_pb2.StatusResponse(status_json=json.dumps(document))
        rpc.reply(response.SerializeToString())

    def _handle_leave(self, rpc: ServerCall, request: bytes) -> None:
        if self._elsewhere(rpc, request, forward=True):
            return
        message = decode_request(rpc, ftdist_pb2.LeaveRequest, request)
        if message is None:
            return
        replica_id = message.replica_id
        if not replica_id or too_long(replica_id, MAX_FIELD_BYTES):
            rpc.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replica_id must be 1 to {MAX_FIELD_BYTES} bytes",
            )
            return
        self._engine.leave(replica_id)
        rpc.reply(ftdist_pb2.LeaveResponse().SerializeToString())

    def _handle_report_heal(self, rpc: ServerCall, request: bytes) -> None:
        if self._elsewhere(rpc, request, forward=False):
            return
        report = decode_request(rpc, ftdist_pb2.HealReport, request)
        if report is None:
            return
        problem = record_heal_report(self._history, time.time(), report)
        if problem is not None:
            rpc.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            return
        rpc.reply(ftdist_pb2.HealReportResponse().SerializeToString())

    # -- replication (on the server thread) ---------------------------------

    def _new_engine(self) -> LighthouseEngine:
        config = self.config
        return LighthouseEngine(
            QuorumConfig(
                min_replicas=config.min_replicas,
                join_timeout_s=config.join_timeout.total_seconds(),
                heartbeat_timeout_s=config.heartbeat_timeout.total_seconds(),
            ),
            max_replica_ids=config.max_replica_ids,
            history=self._history,
        )

    def _take_over(self, takeover: Takeover) -> None:
        replica, replication = self._replica, self.config.replication
        if replica is None or replication is None or self._closed:
            return
        old, self._engine = self._engine, self._new_engine()
        old.close()
        engine = self._engine
        engine.persist = replica.persist_quorum
        engine.restore(
            takeover.quorum_id,
            takeover.member_ids,
            engine.now() + replication.takeover_grace.total_seconds(),
        )
        self._leading = True

    def _step_down(self, reason: str) -> None:
        if not self._leading:
            return
        self._leading = False
        old, self._engine = self._engine, self._new_engine()
        # Parked requests are answered "not the leader" (see deliver).
        old.close()
        logger.warning("Lighthouse stopped forming quorums: %s", reason)

    def _elsewhere(self, rpc: ServerCall, request: bytes, *, forward: bool) -> bool:
        """Whether a call is not this replica's to answer; it is then
        answered "not the leader" (ftdist clients move) or forwarded.
        """
        replica = self._replica
        if replica is None:
            return False
        if self._leading:
            verdict = replica.verdict()
            if verdict.ok:
                return False
            self._not_leader(rpc, verdict.reason)
            return True
        if forward and rpc.metadata_value(_rpc.FOLLOW_LEADER_METADATA) is None:
            self._forward(rpc, request)
        else:
            self._not_leader(rpc, "it follows")
        return True

    def _not_leader(self, rpc: ServerCall, why: str) -> None:
        leader = "" if self._replica is None else self._replica.leader_address
        rpc.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{_rpc.NOT_LEADER_PREFIX}: this lighthouse replica does not form quorums ({why}); "
            f"the leader is {leader or 'not elected yet'}",
            ((_rpc.LEADER_METADATA, leader),),
        )

    def _forward(self, rpc: ServerCall, request: bytes) -> None:
        leader = "" if self._replica is None else self._replica.leader_address
        if not leader or leader == self.address():
            rpc.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{_rpc.NO_LEADER_YET}; retry in a moment",
            )
            return
        self._forwarder.forward(rpc, request, leader, self._server.call_soon)
