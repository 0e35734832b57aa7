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

Calls are few (a handful per rank per step), so each call is served on a
thread of a pool and simply waits for its round to finish.

With a job token (:mod:`ftdist._auth`) every call must carry it, ``Kill``
included; the others are answered UNAUTHENTICATED before any handler runs.
With ``FTDIST_TLS_CERT``/``FTDIST_TLS_KEY`` the port serves TLS.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import grpc

from ftdist._auth import job_token, tls_files, warn_if_open
from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import torchft_pb2
from ftdist._rpc.auth import TokenInterceptor, server_credentials
from ftdist.errors import CoordinationTimeoutError
from ftdist.lighthouse.client import LighthouseClient
from ftdist.lighthouse.partition import REPORT_KEY
from ftdist.lighthouse.quorum import QUORUM_ID_KEY
from ftdist.lighthouse.types import Quorum
from ftdist.manager.local_client import LocalManagerClient
from ftdist.manager.reachability import unreachable_peers
from ftdist.manager.rule import compute_quorum_results, find_divergence, heal_requests

logger = logging.getLogger(__name__)

# A quorum request's fingerprint travels to the lighthouse in the member's
# data, which the lighthouse caps at 64 KiB.
_MAX_FINGERPRINT_BYTES = 64 * 1024
# A call's longest wait in a handler: a week (timeouts are seconds to hours).
_MAX_CALL_S = 7 * 24 * 3600.0
# While this group reports unreachable peers, it probes them again this
# often as it waits to be let back into a quorum.
REPROBE_S = 1.0
# Leaving must not hold up a process that is exiting.
_LEAVE_TIMEOUT_S = 2.0
# A heal report is news for the dashboard, never worth waiting for.
_REPORT_TIMEOUT_S = 2.0


@dataclass
class _Round:
    """One gathering of every group rank (a quorum or a commit vote)."""

    arrivals: dict[int, Any] = field(default_factory=dict)
    deadlines: dict[int, float] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    quorum: Quorum | None = None
    divergence: str = ""
    diverged: frozenset[str] = frozenset()
    decision: bool = False
    error: tuple[grpc.StatusCode, str] | None = None


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

    Raises:
        ValueError: ``world_size < 1``, a malformed address or token.
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
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        token = job_token(token)
        credentials = server_credentials(tls_files())
        self._replica_id = replica_id
        self._hostname = hostname
        self._store_addr = store_addr
        self._world_size = world_size
        self._heartbeat_s = heartbeat_interval.total_seconds()
        self._quorum_retries = quorum_retries
        self._lighthouse = LighthouseClient(lighthouse_addr, connect_timeout, token=token)
        self._lock = threading.Lock()
        self._quorum_round = _Round()
        self._commit_round = _Round()
        self._metadata: dict[int, str] = {}
        self._stopped = threading.Event()
        # The other members of the last quorum (replica id to manager
        # address), and those of them this group last found unreachable.
        self._peers: dict[str, str] = {}
        self._unreachable: dict[str, str] = {}
        # The highest quorum id this group used, told to the lighthouse: one
        # that restarted goes on above it instead of giving out ids again.
        self._quorum_id_seen = 0

        self._pool = ThreadPoolExecutor(
            max_workers=2 * world_size + 8, thread_name_prefix="ftdist-mgr"
        )
        self._server = grpc.server(
            self._pool,
            options=_rpc.server_options(),
            interceptors=[TokenInterceptor(token, "this manager server")] if token else None,
        )
        handlers = {
            "Quorum": grpc.unary_unary_rpc_method_handler(
                self._quorum,
                torchft_pb2.ManagerQuorumRequest.FromString,
                torchft_pb2.ManagerQuorumResponse.SerializeToString,
            ),
            "CheckpointMetadata": grpc.unary_unary_rpc_method_handler(
                self._checkpoint_metadata,
                torchft_pb2.CheckpointMetadataRequest.FromString,
                torchft_pb2.CheckpointMetadataResponse.SerializeToString,
            ),
            "ShouldCommit": grpc.unary_unary_rpc_method_handler(
                self._should_commit,
                torchft_pb2.ShouldCommitRequest.FromString,
                torchft_pb2.ShouldCommitResponse.SerializeToString,
            ),
            "Kill": grpc.unary_unary_rpc_method_handler(
                self._kill,
                torchft_pb2.KillRequest.FromString,
                torchft_pb2.KillResponse.SerializeToString,
            ),
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_rpc.MANAGER_SERVICE, handlers),)
        )
        if credentials is None:
            self._port = self._server.add_insecure_port(bind)
        else:
            self._port = self._server.add_secure_port(bind, credentials)
        if not self._port:
            raise OSError(f"cannot bind the manager server to {bind}")
        self._server.start()
        warn_if_open(token, "This manager server")
        # When this group last reached the lighthouse (a quorum request or a
        # heartbeat); read by the heartbeat thread.
        self._last_contact = 0.0
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name="ftdist-mgr-heartbeat", daemon=True
        )
        self._heartbeat.start()

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
        self._lighthouse.report_heal(self._replica_id, report, timeout=_REPORT_TIMEOUT_S)

    def shutdown(self, leaving: bool = False) -> None:
        """Stop serving and heartbeating; calls still waiting get UNAVAILABLE.

        Args:
            leaving: the replica group leaves the job: tell the lighthouse
                first (best effort), so that peers neither wait for it nor
                report it dead.
        """
        if leaving and not self._stopped.is_set():
            try:
                self._lighthouse.leave(self._replica_id, timeout=_LEAVE_TIMEOUT_S)
            except Exception as exc:
                logger.info(
                    "[%s] could not tell the lighthouse it leaves: %s", self._replica_id, exc
                )
        self._stopped.set()
        with self._lock:
            rounds = [self._quorum_round, self._commit_round]
        for pending in rounds:
            if not pending.done.is_set():
                pending.error = (grpc.StatusCode.UNAVAILABLE, "the manager server is shutting down")
                pending.done.set()
        self._server.stop(grace=None).wait(5)
        self._pool.shutdown(wait=True)
        self._heartbeat.join(timeout=5)
        self._lighthouse.close()

    def _heartbeat_loop(self) -> None:
        while not self._stopped.wait(self._heartbeat_s):
            # A quorum request counts as a heartbeat at the lighthouse: while
            # the group steps, most beats would say what it already knows
            # (each blocking call costs ~1 ms of CPU next to the training).
            if time.monotonic() - self._last_contact < self._heartbeat_s:
                continue
            self._last_contact = time.monotonic()
            try:
                self._lighthouse.heartbeat(
                    self._replica_id, timeout=max(1.0, self._heartbeat_s * 10)
                )
            except Exception as exc:  # keep trying: the lighthouse may be restarting
                if not self._stopped.is_set():
                    logger.warning("[%s] lighthouse heartbeat failed: %s", self._replica_id, exc)

    # -- Quorum -------------------------------------------------------------------
    def _quorum(
        self, request: torchft_pb2.ManagerQuorumRequest, context: grpc.ServicerContext
    ) -> torchft_pb2.ManagerQuorumResponse:
        remaining = _remaining(context)
        rank = request.group_rank
        if not 0 <= rank < self._world_size:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"group_rank {rank} is outside [0, {self._world_size})",
            )
        if request.step < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step} is negative")
        if request.fingerprint:
            problem = _fingerprint_problem(request.fingerprint)
            if problem:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        with self._lock:
            self._metadata[rank] = request.checkpoint_metadata
            current = self._quorum_round
            current.arrivals[rank] = request
            current.deadlines[rank] = time.monotonic() + remaining
            last = len(current.arrivals) == self._world_size
            if last:
                self._quorum_round = _Round()
        if last:
            # The last rank to arrive runs the round on its own handler
            # thread. The earliest deadline bounds the lighthouse call, so
            # that its failure reaches every waiting rank at the same moment.
            self._run_quorum(current, min(current.deadlines.values()) - time.monotonic())
        if not current.done.wait(remaining):
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"quorum did not complete: {len(current.arrivals)} of "
                f"{self._world_size} group ranks arrived",
            )
        if current.error is not None:
            context.abort(*current.error)
        assert current.quorum is not None
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
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        result = results[rank]
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

    def _run_quorum(self, current: _Round, timeout: float) -> None:
        requests: dict[int, torchft_pb2.ManagerQuorumRequest] = current.arrivals
        try:
            steps = {r: q.step for r, q in requests.items()}
            step = min(steps.values())
            if len(set(steps.values())) > 1:
                # A heal that reached some group ranks and not others (its
                # source died mid-transfer) leaves the ranks apart. The group
                # is as old as its oldest rank: reporting that step makes the
                # whole group heal again, from a peer at the quorum's max step.
                logger.warning(
                    "[%s] group ranks are at different steps %s: reporting step %d so the "
                    "group heals",
                    self._replica_id,
                    dict(sorted(steps.items())),
                    step,
                )
            fingerprints = {
                str(r): json.loads(q.fingerprint) for r, q in requests.items() if q.fingerprint
            }
            data: dict[str, Any] = {"fingerprint": fingerprints} if fingerprints else {}
            if self._quorum_id_seen:
                data[QUORUM_ID_KEY] = self._quorum_id_seen
            if len(set(steps.values())) > 1:
                # Ask to heal even from peers at the reported step: a rank
                # ahead of it must come back to the group's state.
                data["heal"] = True
            commit_failures = max(q.commit_failures for q in requests.values())
            if commit_failures > 0 or self._unreachable:
                # A failed step may be a partition between replica groups:
                # say which peers this group cannot reach (see reachability).
                self._probe_peers()
            deadline = time.monotonic() + timeout
            for attempt in range(self._quorum_retries + 1):
                try:
                    current.quorum = quorum = self._ask_lighthouse(
                        step,
                        data,
                        shrink_only=any(q.shrink_only for q in requests.values()),
                        commit_failures=commit_failures,
                        deadline=deadline,
                    )
                    self._quorum_id_seen = max(self._quorum_id_seen, quorum.quorum_id)
                    break
                except Exception as exc:
                    if attempt == self._quorum_retries or time.monotonic() >= deadline:
                        code = (
                            grpc.StatusCode.DEADLINE_EXCEEDED
                            if isinstance(exc, TimeoutError)
                            else grpc.StatusCode.UNAVAILABLE
                        )
                        current.error = (
                            code,
                            f"lighthouse quorum failed after {attempt + 1} attempt(s): {exc}",
                        )
                        return
                    time.sleep(min(0.1 * (attempt + 1), max(0.0, deadline - time.monotonic())))
            assert current.quorum is not None
            self._peers = {
                m.replica_id: m.address
                for m in current.quorum.participants
                if m.replica_id != self._replica_id
            }
            divergence = find_divergence(current.quorum.participants)
            if divergence is not None:
                current.divergence, current.diverged = divergence.report, divergence.minority
                logger.warning("[%s] %s", self._replica_id, divergence.report)
            current.diverged |= heal_requests(current.quorum.participants)
        except Exception as exc:  # never leave ranks waiting on a bug
            logger.exception("quorum round failed")
            current.error = (grpc.StatusCode.INTERNAL, f"manager server error: {exc}")
        finally:
            current.done.set()

    def _probe_peers(self) -> None:
        before = self._unreachable
        self._unreachable = unreachable_peers(self._peers)
        if self._unreachable != before:
            if self._unreachable:
                logger.warning(
                    "[%s] cannot reach replica group(s) %s: reporting them to the lighthouse",
                    self._replica_id,
                    ", ".join(sorted(self._unreachable)),
                )
            else:
                logger.info("[%s] every peer is reachable again", self._replica_id)

    def _ask_lighthouse(
        self,
        step: int,
        data: dict[str, Any],
        *,
        shrink_only: bool,
        commit_failures: int,
        deadline: float,
    ) -> Quorum:
        """One quorum request; while it reports unreachable peers, probe again.

        A group that reports peers it cannot reach is likely the one left out
        (:mod:`ftdist.lighthouse.partition`), and its parked request keeps it
        out for as long as that request stands. So it asks in slices of
        :data:`REPROBE_S`, probing between them, and asks anew, without the
        report, as soon as its peers answer again: it rejoins within a slice
        of the partition's end.
        """
        while True:
            request_data = dict(data)
            if self._unreachable:
                request_data[REPORT_KEY] = dict(self._unreachable)
            remaining = deadline - time.monotonic()
            slice_s = min(remaining, REPROBE_S) if self._unreachable else remaining
            self._last_contact = time.monotonic()
            try:
                return self._lighthouse.quorum(
                    self._replica_id,
                    timeout=max(0.01, slice_s),
                    address=self.address(),
                    store_address=self._store_addr,
                    step=step,
                    world_size=self._world_size,
                    shrink_only=shrink_only,
                    data=request_data or None,
                    commit_failures=commit_failures,
                )
            except CoordinationTimeoutError:
                if slice_s >= remaining or self._stopped.is_set():
                    raise
            self._probe_peers()

    # -- the other RPCs ---------------------------------------------------------
    def _checkpoint_metadata(
        self, request: torchft_pb2.CheckpointMetadataRequest, context: grpc.ServicerContext
    ) -> torchft_pb2.CheckpointMetadataResponse:
        with self._lock:
            metadata = self._metadata.get(request.rank)
        if metadata is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank not found: group rank {request.rank} has not joined a quorum",
            )
        return torchft_pb2.CheckpointMetadataResponse(checkpoint_metadata=metadata)

    def _should_commit(
        self, request: torchft_pb2.ShouldCommitRequest, context: grpc.ServicerContext
    ) -> torchft_pb2.ShouldCommitResponse:
        remaining = _remaining(context)
        rank = request.group_rank
        if not 0 <= rank < self._world_size:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"group_rank {rank} is outside [0, {self._world_size})",
            )
        with self._lock:
            current = self._commit_round
            current.arrivals[rank] = (request.should_commit, request.step)
            if len(current.arrivals) == self._world_size:
                self._commit_round = _Round()
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
        if not current.done.wait(remaining):
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"commit vote incomplete: {len(current.arrivals)} of "
                f"{self._world_size} group ranks voted",
            )
        if current.error is not None:
            context.abort(*current.error)
        return torchft_pb2.ShouldCommitResponse(should_commit=current.decision)

    def _kill(
        self, request: torchft_pb2.KillRequest, context: grpc.ServicerContext
    ) -> torchft_pb2.KillResponse:
        logger.warning("[%s] killed: %s", self._replica_id, request.msg)
        # Answer first, then exit: the caller learns the kill landed.
        threading.Timer(0.1, os._exit, args=(1,)).start()
        return torchft_pb2.KillResponse()


def _remaining(context: grpc.ServicerContext) -> float:
    """The call's seconds left; a call without a deadline is refused.

    Both handlers wait for the group's other ranks, so a call must say how
    long. grpcio reports a call sent without one as centuries left, which
    ``Event.wait`` cannot take ("timestamp out of range for platform time_t").
    """
    remaining = context.time_remaining()
    if remaining is None or remaining > _MAX_CALL_S:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "missing timeout: send the call with a deadline (gRPC's grpc-timeout) "
            f"of at most {_MAX_CALL_S:.0f} s",
        )
    return float(remaining)


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
