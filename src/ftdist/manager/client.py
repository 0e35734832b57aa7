"""Client of a :class:`~ftdist.coordination.ManagerServer`, with torchft's method names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import grpc

from ftdist._auth import job_token, tls_files
from ftdist._durations import to_seconds
from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import torchft_pb2
from ftdist._rpc.auth import call_metadata, open_channel, unary_calls
from ftdist.errors import CoordinationError
from ftdist.manager.config import manager_rpc_client
from ftdist.manager.rule import QuorumResult


@dataclass
class ManagerQuorumResult(QuorumResult):
    """A :class:`QuorumResult` with ftdist's extensions.

    Attributes:
        divergence: why replicas at the same step hold different state ("" if
            they agree); the minority heals from the majority in this quorum.
        created_ns: when the lighthouse formed the quorum (ns since the epoch);
            with ``quorum_id`` it names the quorum uniquely, even across a
            lighthouse restart that starts ids over.
        group_heals: some group rank of this replica group heals: every rank
            takes part in the group's heal vote.
    """

    divergence: str = ""
    created_ns: int = 0
    group_heals: bool = False


class ManagerClientLike(Protocol):
    """What a :class:`~ftdist.manager.Manager` needs of its manager client.

    :class:`ManagerClient` talks to a real :class:`ManagerServer`;
    :class:`ftdist.testing.FakeManagerClient` answers from a script, so the
    Manager's commit, vote and retry logic can be tested without servers.
    """

    def _quorum(
        self,
        *,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: timedelta,
        commit_failures: int,
        init_sync: bool,
        fingerprint: dict[str, int] | None = None,
    ) -> ManagerQuorumResult:
        """Join this step's quorum; see :meth:`ManagerClient._quorum`.

        The Manager passes ``fingerprint`` only when it has one.
        """
        ...

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """Where a group rank serves its state; see :meth:`ManagerClient.checkpoint_metadata`."""
        ...

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """Vote on the step; see :meth:`ManagerClient.should_commit`."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...


class ManagerClient:
    """Talks to the replica group's ManagerServer.

    Args:
        addr: ``http://host:port`` or ``host:port`` (required; it has a
            default only so that ``unittest.mock.create_autospec`` mocks of
            this class can be called without arguments, as mocks of
            torchft's native class can).
        connect_timeout: how long to wait for the server to be reachable.
        token: the job token sent with every call (default
            ``FTDIST_JOB_TOKEN``, then ``FTDIST_JOB_TOKEN_FILE``).
        rpc_client: how calls travel on plaintext: ``"h2"`` (ftdist's own
            HTTP/2 client, from the calling thread, each call's timeout sent
            along) or ``"grpcio"``; default ``FTDIST_MANAGER_RPC_CLIENT``,
            then ``"h2"``. The grpcio channel is opened either way: it tells
            when the server is up.

    TLS follows ``FTDIST_TLS_CA`` (see :mod:`ftdist._auth`) and always goes
    through grpcio.

    Raises:
        ValueError: no address, a malformed address or token, or an unknown
            ``rpc_client``.
        OSError: a token or TLS file cannot be read.
        CoordinationError: the server is unreachable within ``connect_timeout``.
    """

    def __init__(
        self,
        addr: str = "",
        connect_timeout: timedelta = timedelta(seconds=60),
        token: str | None = None,
        *,
        rpc_client: str | None = None,
    ) -> None:
        if not addr:
            raise ValueError("ManagerClient needs the manager server's address, host:port")
        self.addr = addr
        self._metadata = call_metadata(job_token(token))
        transport = manager_rpc_client(rpc_client)
        tls = tls_files()
        self._channel = open_channel(addr, _rpc.client_channel_options(), tls)
        try:
            grpc.channel_ready_future(self._channel).result(
                timeout=to_seconds(connect_timeout, "connect_timeout")
            )
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise CoordinationError(
                f"manager server {addr} unreachable within {connect_timeout}"
            ) from None

        # A grpcio unary call from Python hands the request to gRPC core's
        # threads and waits on a completion queue: about 0.2 ms more per call
        # than writing it from this thread, and a step of a group of several
        # ranks makes two (bench/manager_round.py --group-size 2). The
        # manager server's handlers wait on their deadline, so it is sent.
        self._unary: Any = unary_calls(self._channel, addr, tls, transport, send_timeout=True)

        def rpc(name: str, req: Any, resp: Any) -> Any:
            return self._unary.unary_unary(
                f"/{_rpc.MANAGER_SERVICE}/{name}",
                request_serializer=req.SerializeToString,
                response_deserializer=resp.FromString,
            )

        self._quorum_rpc = rpc(
            "Quorum", torchft_pb2.ManagerQuorumRequest, torchft_pb2.ManagerQuorumResponse
        )
        self._metadata_rpc = rpc(
            "CheckpointMetadata",
            torchft_pb2.CheckpointMetadataRequest,
            torchft_pb2.CheckpointMetadataResponse,
        )
        self._commit_rpc = rpc(
            "ShouldCommit", torchft_pb2.ShouldCommitRequest, torchft_pb2.ShouldCommitResponse
        )
        self._kill_rpc = rpc("Kill", torchft_pb2.KillRequest, torchft_pb2.KillResponse)

    def _call(self, rpc: Any, request: Any, timeout: timedelta | float, what: str) -> Any:
        try:
            return rpc(request, timeout=to_seconds(timeout, "timeout"), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _rpc.map_rpc_error(exc, f"manager {what}") from exc

    def quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        init_sync: bool,
        commit_failures: int,
        timeout: timedelta,
        fingerprint: dict[str, int] | None = None,
    ) -> ManagerQuorumResult:
        """Join this step's quorum; returns this group rank's part of it.

        Raises:
            TimeoutError: no quorum within ``timeout``.
            RuntimeError: the server or lighthouse refused (message included).
        """
        response = self._call(
            self._quorum_rpc,
            torchft_pb2.ManagerQuorumRequest(
                group_rank=group_rank,
                step=step,
                checkpoint_metadata=checkpoint_metadata,
                shrink_only=shrink_only,
                init_sync=init_sync,
                commit_failures=commit_failures,
                fingerprint=json.dumps(fingerprint) if fingerprint else "",
            ),
            timeout,
            "quorum",
        )
        return ManagerQuorumResult(
            quorum_id=response.quorum_id,
            replica_rank=response.replica_rank,
            replica_world_size=response.replica_world_size,
            recover_src_manager_address=response.recover_src_manager_address,
            recover_src_replica_rank=response.recover_src_replica_rank
            if response.HasField("recover_src_replica_rank")
            else None,
            recover_dst_replica_ranks=list(response.recover_dst_replica_ranks),
            store_address=response.store_address,
            max_step=response.max_step,
            max_replica_rank=response.max_replica_rank
            if response.HasField("max_replica_rank")
            else None,
            max_world_size=response.max_world_size,
            heal=response.heal,
            commit_failures=response.commit_failures,
            replica_ids=list(response.replica_ids),
            divergence=response.divergence,
            created_ns=response.quorum_created_ns,
            group_heals=response.group_heals,
        )

    def _quorum(
        self,
        group_rank: int | None = None,
        step: int = 0,
        checkpoint_metadata: str = "",
        shrink_only: bool = False,
        timeout: timedelta = timedelta(seconds=60),
        commit_failures: int = 0,
        reconfigure_handle: str = "",
        init_sync: bool = True,
        *,
        rank: int | None = None,
        fingerprint: dict[str, int] | None = None,
    ) -> ManagerQuorumResult:
        """torchft's spelling of :meth:`quorum`, for either generation.

        The Manager calls this one, by keyword, as torchft's does (tests
        that mock the client script ``_quorum``). The early-2025 order
        ``(rank, step, checkpoint_metadata, shrink_only, timeout)`` is a
        prefix of today's ``(group_rank, ..., timeout, commit_failures,
        reconfigure_handle, init_sync)``; ``rank=`` is the early keyword for
        ``group_rank``. ftdist's process groups are reconfigured through the
        store, so ``reconfigure_handle`` is accepted and not needed;
        ``fingerprint`` is ftdist's (see :meth:`quorum`).

        Raises:
            TypeError: neither or both of ``group_rank`` and ``rank`` are given.
            TimeoutError: no quorum within ``timeout``.
            RuntimeError: the server or lighthouse refused.
        """
        return self.quorum(
            _one_rank(group_rank, rank), step, checkpoint_metadata, shrink_only, init_sync,
            commit_failures, timeout, fingerprint,
        )  # fmt: skip

    def checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """Where group rank ``rank`` of this replica group serves its state.

        Raises:
            RuntimeError: that rank has not joined a quorum yet.
        """
        return str(
            self._call(
                self._metadata_rpc,
                torchft_pb2.CheckpointMetadataRequest(rank=rank),
                timeout,
                "checkpoint_metadata",
            ).checkpoint_metadata
        )

    _checkpoint_metadata = checkpoint_metadata

    def should_commit(
        self,
        group_rank: int | None = None,
        step: int = 0,
        should_commit: bool = False,
        timeout: timedelta = timedelta(seconds=60),
        *,
        rank: int | None = None,
    ) -> bool:
        """Vote; returns True only if every group rank voted True on the same step.

        ``rank=`` is torchft's early-2025 keyword for ``group_rank``.

        Raises:
            TypeError: neither or both of ``group_rank`` and ``rank`` are given.
            TimeoutError: not every rank voted within ``timeout``.
        """
        group_rank = _one_rank(group_rank, rank)
        return bool(
            self._call(
                self._commit_rpc,
                torchft_pb2.ShouldCommitRequest(
                    should_commit=should_commit, group_rank=group_rank, step=step
                ),
                timeout,
                "should_commit",
            ).should_commit
        )

    def kill(self, msg: str, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Ask the server's process to exit.

        Raises:
            RuntimeError: the server could not be reached.
        """
        self._call(self._kill_rpc, torchft_pb2.KillRequest(msg=msg), timeout, "kill")

    def close(self) -> None:
        """Close the connections; calls in flight fail."""
        if self._unary is not self._channel:
            self._unary.close()
        self._channel.close()

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _one_rank(group_rank: int | None, rank: int | None) -> int:
    if (group_rank is None) == (rank is None):
        raise TypeError(
            f"give the group rank once, as group_rank= or (torchft's early name) rank=; got "
            f"group_rank={group_rank!r}, rank={rank!r}"
        )
    return int(group_rank if group_rank is not None else rank)  # type: ignore[arg-type]
