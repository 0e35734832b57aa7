"""
The manager server
==================

One :class:`ManagerServer` runs per replica group, in group rank 0. It serves
torchft's ``torchft.ManagerService`` to every rank of the group:

- ``Quorum``: gathers one request per group rank, makes one lighthouse call
  for the whole group, and answers each rank with its part of the result
  (:func:`~ftdist.manager.rule.compute_quorum_results`).
- ``ShouldCommit``: an AND of every group rank's vote.
- ``CheckpointMetadata``: where a healing peer fetches a group rank's state.
- ``Kill``: exits the process.

It also heartbeats the lighthouse. Unlike torchft's server, a failed
lighthouse call is reported to every waiting rank at once (none is left to
wait for its own deadline). Group ranks at different steps (a heal that
reached only some of them) make the group report its oldest step, so the
whole group heals again; votes on different steps never commit. Replicas
whose consistency fingerprints disagree with the majority's
(:func:`~ftdist.manager.rule.find_divergence`) heal from it.

On plaintext every call is served on one thread, by ftdist's own HTTP/2
server (:mod:`ftdist._rpc.h2_server`): a call waiting for the rest of its
group is parked there (:mod:`~ftdist.manager.gathering`), not a blocked
thread. grpcio's thread-pool server, which handed each call to a thread
that then waited, cost about 0.37 ms more per round trip; it still serves
over TLS or with ``FTDIST_MANAGER_RPC_SERVER=grpcio``
(:mod:`ftdist._rpc.pool_server`, same handlers as the in-process calls).
Group rank 0 calls in process (:mod:`~ftdist.manager.local_client`) and
waits on its own thread. The lighthouse call runs on the thread of the
group's last rank to arrive: rank 0's own, or a worker when the last is a
remote rank parked on the HTTP/2 server.

With a job token (:mod:`ftdist._auth`) every call must carry it, ``Kill``
included; the others are answered UNAUTHENTICATED before any handler runs.
With ``FTDIST_TLS_CERT``/``FTDIST_TLS_KEY`` the port serves TLS.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import grpc

from ftdist._auth import job_token, tls_files, warn_if_open
from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import torchft_pb2
from ftdist._rpc._proto import torchft_pb2 as pb
from ftdist._rpc.auth import metadata_refusal, server_credentials
from ftdist._rpc.call import decode_request
from ftdist._rpc.h2_call import H2Call
from ftdist._rpc.h2_server import H2Server
from ftdist._rpc.pool_server import PoolServer
from ftdist.lighthouse.client import LighthouseClient
from ftdist.manager.config import manager_rpc_server
from ftdist.manager.gathering import Gathering, timeout_problem
from ftdist.manager.lighthouse_link import LighthouseLink, QuorumFailed
from ftdist.manager.local_client import LocalContext, LocalManagerClient
from ftdist.manager.rule import (
    compute_quorum_results,
    find_divergence,
    heal_requests,
)

logger = logging.getLogger(__name__)

# A quorum request's fingerprint travels to the lighthouse in the member's
# data, which the lighthouse caps at 64 KiB.
_MAX_FINGERPRINT_BYTES = 64 * 1024
# How often parked calls are checked against their deadlines. Clients give
# up at their own deadline (and reset the call); this frees the calls of
# clients that do not, and answers with what the round still lacks when the
# server's check comes first.
_EXPIRY_CHECK_S = 0.1
# Calls still parked at shutdown are answered UNAVAILABLE just before the stop;
# this grace lets those answers leave.
_STOP_GRACE_S = 0.2
_SHUTTING_DOWN = (grpc.StatusCode.UNAVAILABLE, "the manager server is shutting down")


_R = TypeVar("_R")


class ManagerServer:
    """Serves ``torchft.ManagerService`` for one replica group.

    Args:
        replica_id: the replica group's full id (with its uuid).
        lighthouse_addr: the lighthouse, ``host:port`` or ``http://host:port``.
        hostname: how peers reach this host.
        bind: listen address, e.g. ``"[::]:0"``.
        store_addr: the replica group's TCPStore, ``host:port``.
        world_size: ranks in the replica group.
        heartbeat_interval: between lighthouse heartbeats.
        connect_timeout: connecting to the lighthouse.
        quorum_retries: extra lighthouse quorum attempts after a failure.
        token: the job token every call must carry, also sent to the
            lighthouse (default ``FTDIST_JOB_TOKEN``, then
            ``FTDIST_JOB_TOKEN_FILE``; none: open).
        rpc_server: on plaintext, ``"h2"`` (ftdist's own HTTP/2 server) or
            ``"grpcio"`` (grpcio's thread-pool server); default
            ``FTDIST_MANAGER_RPC_SERVER``, then ``"h2"``. TLS always runs on grpcio's.

    Raises:
        ValueError: ``world_size < 1``, a malformed address or token, an
            unknown ``rpc_server``.
        CoordinationError: the lighthouse is unreachable within ``connect_timeout``.
        OSError: ``bind`` cannot be bound, or a token or TLS file cannot be read.
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta,
        connect_timeout: timedelta,
        quorum_retries: int = 0,
        token: str | None = None,
        *,
        rpc_server: str | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        server_kind = manager_rpc_server(rpc_server)
        token = job_token(token)
        credentials = server_credentials(tls_files())
        self._replica_id = replica_id
        self._hostname = hostname
        self._world_size = world_size
        lighthouse = LighthouseClient(lighthouse_addr, connect_timeout, token=token)
        self._lock = threading.Lock()
        self._quorum_round = Gathering("quorum", world_size)
        self._commit_round = Gathering("commit", world_size)
        self._metadata: dict[int, str] = {}
        self._stopped = threading.Event()
        self._port = 0
        self._link = LighthouseLink(
            lighthouse,
            replica_id,
            self.address,
            store_addr,
            world_size,
            heartbeat_interval.total_seconds(),
            quorum_retries,
        )
        # Runs a quorum round whose last arrival is a remote rank: the
        # lighthouse call blocks, and the server thread never may.
        self._rounds = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ftdist-mgr-round")
        try:
            self._server = self._start_server(bind, server_kind, credentials, token)
        except BaseException as exc:
            self._rounds.shutdown()
            self._link.close()
            if not isinstance(exc, OSError):
                raise
            why = f"cannot bind the manager server to {bind}: {exc}"
            raise (OSError(why) if exc.errno is None else OSError(exc.errno, why)) from exc
        self._port = self._server.port
        warn_if_open(token, "This manager server")

    def _start_server(
        self,
        bind: str,
        server_kind: str,
        credentials: grpc.ServerCredentials | None,
        token: str | None,
    ) -> H2Server | PoolServer:
        handlers: dict[str, Callable[[Any, bytes], None]] = {
            _rpc.MANAGER_QUORUM: self._on_quorum,
            _rpc.MANAGER_CHECKPOINT_METADATA: self._on_checkpoint_metadata,
            _rpc.MANAGER_SHOULD_COMMIT: self._on_should_commit,
            _rpc.MANAGER_KILL: self._on_kill,
        }
        server: H2Server | PoolServer
        if credentials is None and server_kind == "h2":
            auth = (
                None
                if token is None
                else functools.partial(metadata_refusal, token=token, what="this manager server")
            )
            server = H2Server(
                bind,
                handlers,
                max_request_bytes=_rpc.MAX_REQUEST_BYTES,
                tick=self._expire_parked,
                tick_period_s=_EXPIRY_CHECK_S,
                thread_name="ftdist-mgr-server",
                auth=auth,
            )
        else:
            # Over TLS, grpcio's thread pool: its calls wait on their own
            # threads (see _rpc/pool_server.py for why not its core).
            blocking = {
                "Quorum": (self._quorum, pb.ManagerQuorumRequest, pb.ManagerQuorumResponse),
                "CheckpointMetadata": (
                    self._checkpoint_metadata,
                    pb.CheckpointMetadataRequest,
                    pb.CheckpointMetadataResponse,
                ),
                "ShouldCommit": (
                    self._should_commit,
                    pb.ShouldCommitRequest,
                    pb.ShouldCommitResponse,
                ),
                "Kill": (self._kill, pb.KillRequest, pb.KillResponse),
            }
            server = PoolServer(
                bind,
                _rpc.MANAGER_SERVICE,
                blocking,
                _rpc.server_options(),
                max_workers=2 * self._world_size + 8,
                token=token,
                what="this manager server",
                credentials=credentials,
            )
        server.start()
        return server

    def local_client(self) -> LocalManagerClient:
        """A client for calls from this process (group rank 0): no network hop."""
        return LocalManagerClient(self)

    def address(self) -> str:
        """``http://hostname:port``."""
        host = f"[{self._hostname}]" if ":" in self._hostname else self._hostname
        return f"http://{host}:{self._port}"

    def report_heal(self, report: dict[str, Any]) -> None:
        """Pass a heal's progress or end to the lighthouse's history (blocks; see HealReporter).

        Raises:
            CoordinationError: the lighthouse is unreachable or refused.
        """
        self._link.report_heal(report)

    def shutdown(self, leaving: bool = False) -> None:
        """Stop serving and heartbeating; calls still waiting get UNAVAILABLE.

        Args:
            leaving: the replica group leaves the job: tell the lighthouse
                first (best effort), so that peers neither wait for it nor
                report it dead.
        """
        with self._lock:
            # Under the lock: no arrival lands in a round after this, and
            # no round completes with some ranks told yes and others no.
            first = not self._stopped.is_set()
            self._stopped.set()
            rounds = [self._quorum_round, self._commit_round]
            for pending in rounds:
                pending.error = _SHUTTING_DOWN
                pending.done.set()
        # Before leaving: no quorum request goes out after the lighthouse
        # heard that this group left.
        self._link.stop()
        if leaving and first:
            self._link.leave()
        for pending in rounds:
            # Before the stop below: the server runs both in order.
            self._answer_parked(pending, lambda current, request: current.error)
        self._server.stop(_STOP_GRACE_S)
        # Closing the client ends a lighthouse call in flight on the worker.
        self._link.close()
        self._rounds.shutdown(wait=True, cancel_futures=True)

    # -- Quorum -------------------------------------------------------------------
    def _quorum(
        self, request: torchft_pb2.ManagerQuorumRequest, context: LocalContext
    ) -> torchft_pb2.ManagerQuorumResponse:
        """Group rank 0's quorum call, in process: waits on the caller's thread.

        ``context`` is the in-process client's stand-in for a servicer
        context; its ``abort()`` raises.
        """
        remaining = context.time_remaining()
        problem = timeout_problem(remaining) or self._quorum_problem(request)
        if problem is not None:
            context.abort(*problem)
        current, last = self._arrive_quorum(request, float(remaining), None)
        if current is None:
            context.abort(*_SHUTTING_DOWN)
        if last:
            self._run_quorum(current)
        return self._await(current, request, remaining, context, self._quorum_outcome)

    def _on_quorum(self, call: H2Call, payload: bytes) -> None:
        """A remote rank's quorum call, on the server thread: parked until its round ends."""
        request = decode_request(call, torchft_pb2.ManagerQuorumRequest, payload)
        if request is None:
            return
        remaining = call.time_remaining()
        problem = timeout_problem(remaining) or self._quorum_problem(request)
        if problem is not None:
            call.abort(*problem)
            return
        current, last = self._arrive_quorum(request, float(remaining or 0.0), call)
        if current is None:
            call.abort(*_SHUTTING_DOWN)
        elif last:
            self._rounds.submit(self._run_quorum, current)

    def _quorum_problem(
        self, request: torchft_pb2.ManagerQuorumRequest
    ) -> tuple[grpc.StatusCode, str] | None:
        problem = self._rank_problem(request.group_rank)
        if problem is not None:
            return problem
        if request.step < 0:
            return grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step} is negative"
        wrong = _fingerprint_problem(request.fingerprint) if request.fingerprint else ""
        return (grpc.StatusCode.INVALID_ARGUMENT, wrong) if wrong else None

    def _arrive_quorum(
        self,
        request: torchft_pb2.ManagerQuorumRequest,
        remaining: float,
        call: H2Call | None,
    ) -> tuple[Gathering | None, bool]:
        """Count ``request`` in the open round; the round (None once shut
        down), and whether it was the last."""
        rank = request.group_rank
        with self._lock:
            if self._stopped.is_set():
                return None, False
            self._metadata[rank] = request.checkpoint_metadata
            current = self._quorum_round
            current.arrivals[rank] = request
            current.deadlines[rank] = time.monotonic() + remaining
            if call is not None:
                current.parked.append((rank, request, call))
            last = len(current.arrivals) == self._world_size
            if last:
                self._quorum_round = Gathering("quorum", self._world_size)
        return current, last

    def _quorum_outcome(
        self, current: Gathering, request: torchft_pb2.ManagerQuorumRequest
    ) -> torchft_pb2.ManagerQuorumResponse | tuple[grpc.StatusCode, str]:
        """One rank's answer from a finished round: its response, or an error status."""
        if current.error is not None:
            return current.error
        assert current.quorum is not None
        results = current.results.get(request.init_sync)
        if results is None:
            try:
                results = [
                    compute_quorum_results(
                        self._replica_id,
                        group_rank,
                        current.quorum.quorum_id,
                        current.quorum.participants,
                        request.init_sync,
                        current.diverged,
                    )
                    for group_rank in range(self._world_size)
                ]
            except LookupError as exc:
                results = exc
            current.results[request.init_sync] = results
        if isinstance(results, LookupError):
            return grpc.StatusCode.NOT_FOUND, str(results)
        result = results[request.group_rank]
        created = current.quorum.created
        return torchft_pb2.ManagerQuorumResponse(
            quorum_id=result.quorum_id,
            recover_src_manager_address=result.recover_src_manager_address,
            recover_src_replica_rank=result.recover_src_replica_rank,
            recover_dst_replica_ranks=result.recover_dst_replica_ranks,
            store_address=result.store_address,
            max_step=result.max_step,
            max_replica_rank=result.max_replica_rank,
            max_world_size=result.max_world_size,
            replica_rank=result.replica_rank,
            replica_world_size=result.replica_world_size,
            heal=result.heal,
            commit_failures=result.commit_failures,
            replica_ids=result.replica_ids,
            divergence=current.divergence,
            quorum_created_ns=created.seconds * 1_000_000_000 + created.nanos,
            group_heals=any(r.heal for r in results),
        )

    def _run_quorum(self, current: Gathering) -> None:
        """Ask the lighthouse for the group, on the last arrival's thread.

        The earliest deadline bounds the call, so that its failure reaches
        every waiting rank at the same moment.
        """
        try:
            timeout = min(current.deadlines.values()) - time.monotonic()
            current.quorum = quorum = self._link.group_quorum(current.arrivals, timeout)
            divergence = find_divergence(quorum.participants)
            if divergence is not None:
                current.divergence, current.diverged = divergence.report, divergence.minority
                logger.warning("[%s] %s", self._replica_id, divergence.report)
            current.diverged |= heal_requests(quorum.participants)
        except QuorumFailed as exc:
            current.error = (exc.code, str(exc))
        except Exception as exc:  # never leave ranks waiting on a bug
            logger.exception("quorum round failed")
            current.error = (grpc.StatusCode.INTERNAL, f"manager server error: {exc}")
        finally:
            if current.quorum is None and current.error is None:
                current.error = (grpc.StatusCode.INTERNAL, "the quorum round was interrupted")
            current.done.set()
            self._answer_parked(current, self._quorum_outcome)

    # -- parked calls -----------------------------------------------------------
    def _answer_parked(self, current: Gathering, outcome: Callable[[Gathering, Any], Any]) -> None:
        """Answer the round's remote calls, on the server thread (from any thread)."""
        # Read here, off the server thread: every append happened under the
        # lock before the round ended (later arrivals go to the next round,
        # or are refused once shut down), and a pruning tick only drops
        # answered calls. A group of one rank never wakes the server.
        if current.parked:
            self._server.call_soon(lambda: current.answer(outcome))

    def _expire_parked(self) -> None:
        """The server's tick: end parked calls whose deadline passed."""
        with self._lock:
            rounds = (self._quorum_round, self._commit_round)
        for current in rounds:
            current.expire()

    def _await(
        self,
        current: Gathering,
        request: Any,
        remaining: float,
        context: LocalContext,
        outcome: Callable[[Gathering, Any], _R | tuple[grpc.StatusCode, str]],
    ) -> _R:
        """Group rank 0's wait for its round, on its own thread; its answer (or abort)."""
        if not current.done.wait(remaining):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, current.incomplete())
        answer = outcome(current, request)
        if isinstance(answer, tuple):
            context.abort(*answer)
        return answer

    # -- the other RPCs ---------------------------------------------------------
    def _checkpoint_metadata(
        self, request: torchft_pb2.CheckpointMetadataRequest, context: LocalContext
    ) -> torchft_pb2.CheckpointMetadataResponse:
        """Where group rank ``request.rank`` serves its state, in process."""
        outcome = self._metadata_outcome(request)
        if isinstance(outcome, tuple):
            context.abort(*outcome)
        return outcome

    def _on_checkpoint_metadata(self, call: H2Call, payload: bytes) -> None:
        request = decode_request(call, torchft_pb2.CheckpointMetadataRequest, payload)
        if request is None:
            return
        outcome = self._metadata_outcome(request)
        if isinstance(outcome, tuple):
            call.abort(*outcome)
        else:
            call.reply(outcome.SerializeToString())

    def _metadata_outcome(
        self, request: torchft_pb2.CheckpointMetadataRequest
    ) -> torchft_pb2.CheckpointMetadataResponse | tuple[grpc.StatusCode, str]:
        with self._lock:
            metadata = self._metadata.get(request.rank)
        if metadata is None:
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank not found: group rank {request.rank} has not joined a quorum",
            )
        return torchft_pb2.CheckpointMetadataResponse(checkpoint_metadata=metadata)

    def _should_commit(
        self, request: torchft_pb2.ShouldCommitRequest, context: LocalContext
    ) -> torchft_pb2.ShouldCommitResponse:
        """Group rank 0's vote, in process: waits on the caller's thread."""
        remaining = context.time_remaining()
        problem = timeout_problem(remaining) or self._rank_problem(request.group_rank)
        if problem is not None:
            context.abort(*problem)
        current = self._vote(request, None)
        if current is None:
            context.abort(*_SHUTTING_DOWN)
        return self._await(current, request, remaining, context, self._commit_outcome)

    def _on_should_commit(self, call: H2Call, payload: bytes) -> None:
        """A remote rank's vote, on the server thread: parked until every rank voted."""
        request = decode_request(call, torchft_pb2.ShouldCommitRequest, payload)
        if request is None:
            return
        problem = timeout_problem(call.time_remaining()) or self._rank_problem(request.group_rank)
        if problem is not None:
            call.abort(*problem)
            return
        if self._vote(request, call) is None:
            call.abort(*_SHUTTING_DOWN)

    def _rank_problem(self, rank: int) -> tuple[grpc.StatusCode, str] | None:
        if 0 <= rank < self._world_size:
            return None
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"group_rank {rank} is outside [0, {self._world_size})",
        )

    def _vote(
        self, request: torchft_pb2.ShouldCommitRequest, call: H2Call | None
    ) -> Gathering | None:
        """Count one vote; the last one decides the round and answers the
        parked calls. None once shut down."""
        with self._lock:
            if self._stopped.is_set():
                return None
            current = self._commit_round
            current.arrivals[request.group_rank] = (request.should_commit, request.step)
            if call is not None:
                current.parked.append((request.group_rank, request, call))
            last = len(current.arrivals) == self._world_size
            if last:
                self._commit_round = Gathering("commit", self._world_size)
                votes = current.arrivals
                steps = {s for _, s in votes.values()}
                current.decision = all(v for v, _ in votes.values()) and len(steps) == 1
                if len(steps) > 1:
                    logger.error(
                        "[%s] group ranks voted on different steps %s: not committing",
                        self._replica_id,
                        {r: s for r, (_, s) in votes.items()},
                    )
                current.done.set()
        if last:
            self._answer_parked(current, self._commit_outcome)
        return current

    @staticmethod
    def _commit_outcome(
        current: Gathering, request: torchft_pb2.ShouldCommitRequest
    ) -> torchft_pb2.ShouldCommitResponse | tuple[grpc.StatusCode, str]:
        if current.error is not None:
            return current.error
        return torchft_pb2.ShouldCommitResponse(should_commit=current.decision)

    def _kill(
        self, request: torchft_pb2.KillRequest, context: LocalContext
    ) -> torchft_pb2.KillResponse:
        """Exit this process (after answering), in process."""
        self._die(request.msg)
        return torchft_pb2.KillResponse()

    def _on_kill(self, call: H2Call, payload: bytes) -> None:
        request = decode_request(call, torchft_pb2.KillRequest, payload)
        if request is None:
            return
        # Answer first, then exit: the caller learns the kill landed.
        call.reply(torchft_pb2.KillResponse().SerializeToString())
        self._die(request.msg)

    def _die(self, msg: str) -> None:
        logger.warning("[%s] killed: %s", self._replica_id, msg)
        threading.Timer(0.1, os._exit, args=(1,)).start()


def _fingerprint_problem(fingerprint: str) -> str:
    """What is wrong with a quorum request's fingerprint ("" if nothing)."""
    if len(fingerprint) > _MAX_FINGERPRINT_BYTES:
        return (
            f"fingerprint is {len(fingerprint)} characters; the limit is {_MAX_FINGERPRINT_BYTES}"
        )
    try:
        parsed = json.loads(fingerprint)
    except (ValueError, RecursionError):
        return "fingerprint is not JSON"
    return "" if isinstance(parsed, dict) else "fingerprint is not a JSON object"
