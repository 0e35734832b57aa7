"""
A replica group's link to the lighthouse
========================================

The manager server speaks to the lighthouse for its whole replica group, and
this is everything it says there:

- the group's quorum request, one per round, made of every group rank's
  request (:meth:`LighthouseLink.group_quorum`): the oldest rank's step, the
  ranks' fingerprints, the last quorum id the group used, a request to heal
  when the ranks' steps differ; retried as configured;
- which peers the group cannot reach after a failed step, probed again
  while it waits to be let back into a quorum
  (:mod:`~ftdist.manager.reachability`, :mod:`ftdist.lighthouse.partition`);
- heartbeats, skipped while quorum requests already say the group lives;
- leaving the job, and heal reports for the lighthouse's history.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from ftdist._rpc._proto import torchft_pb2
from ftdist.errors import CoordinationTimeoutError
from ftdist.lighthouse.client import LighthouseClient
from ftdist.lighthouse.partition import REPORT_KEY
from ftdist.lighthouse.quorum import QUORUM_ID_KEY
from ftdist.lighthouse.types import Quorum
from ftdist.manager.reachability import unreachable_peers

__all__ = ["REPROBE_S", "LighthouseLink", "QuorumFailed"]

logger = logging.getLogger(__name__)

# While this group reports unreachable peers, it probes them again this
# often as it waits to be let back into a quorum.
REPROBE_S = 1.0
# Leaving must not hold up a process that is exiting.
_LEAVE_TIMEOUT_S = 2.0
# A heal report is news for the dashboard, never worth waiting for.
_REPORT_TIMEOUT_S = 2.0


class QuorumFailed(Exception):
    """The group's quorum request failed for good: the status every waiting
    group rank is answered with.

    Attributes:
        code: DEADLINE_EXCEEDED when the lighthouse gave no quorum in time,
            else UNAVAILABLE.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class LighthouseLink:
    """What one replica group's manager server says to the lighthouse.

    Args:
        client: a connected lighthouse client; closed by :meth:`close`.
        replica_id: the replica group's full id.
        manager_address: this group's manager server address, as peers
            reach it (read at each quorum request).
        store_addr: the replica group's store, ``host:port``.
        world_size: ranks in the replica group.
        heartbeat_interval_s: between heartbeats.
        quorum_retries: extra quorum attempts after a failure.
    """

    def __init__(
        self,
        client: LighthouseClient,
        replica_id: str,
        manager_address: Callable[[], str],
        store_addr: str,
        world_size: int,
        heartbeat_interval_s: float,
        quorum_retries: int,
    ) -> None:
        self._client = client
        self._replica_id = replica_id
        self._manager_address = manager_address
        self._store_addr = store_addr
        self._world_size = world_size
        self._heartbeat_s = heartbeat_interval_s
        self._quorum_retries = quorum_retries
        self._stopped = threading.Event()
        # The other members of the last quorum (replica id to manager
        # address), and those of them this group last found unreachable.
        self._peers: dict[str, str] = {}
        self._unreachable: dict[str, str] = {}
        # The highest quorum id this group used, told to the lighthouse: one
        # that restarted goes on above it instead of giving out ids again.
        self._quorum_id_seen = 0
        # When this group last reached the lighthouse (a quorum request or a
        # heartbeat); read by the heartbeat thread.
        self._last_contact = 0.0
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name="ftdist-mgr-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def group_quorum(
        self, requests: Mapping[int, torchft_pb2.ManagerQuorumRequest], timeout: float
    ) -> Quorum:
        """The quorum for the group whose ranks asked with ``requests``.

        Args:
            requests: every group rank's request, by group rank.
            timeout: seconds for every attempt together.

        Raises:
            QuorumFailed: no quorum after every attempt, or ``timeout`` passed.
        """
        steps = {r: q.step for r, q in requests.items()}
        step = min(steps.values())
        if len(set(steps.values())) > 1:
            # A heal that reached some group ranks and not others (its
            # source died mid-transfer) leaves the ranks apart. The group
            # is as old as its oldest rank: reporting that step makes the
            # whole group heal again, from a peer at the quorum's max step.
            logger.warning(
                "[%s] group ranks are at different steps %s: reporting step %d so the group heals",
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
        shrink_only = any(q.shrink_only for q in requests.values())
        for attempt in range(self._quorum_retries + 1):
            try:
                quorum = self._ask(
                    step,
                    data,
                    shrink_only=shrink_only,
                    commit_failures=commit_failures,
                    deadline=deadline,
                )
                break
            except Exception as exc:
                last = attempt == self._quorum_retries or time.monotonic() >= deadline
                if last or self._stopped.is_set():
                    code = (
                        grpc.StatusCode.DEADLINE_EXCEEDED
                        if isinstance(exc, TimeoutError)
                        else grpc.StatusCode.UNAVAILABLE
                    )
                    raise QuorumFailed(
                        code, f"lighthouse quorum failed after {attempt + 1} attempt(s): {exc}"
                    ) from exc
                time.sleep(min(0.1 * (attempt + 1), max(0.0, deadline - time.monotonic())))
        self._quorum_id_seen = max(self._quorum_id_seen, quorum.quorum_id)
        self._peers = {
            m.replica_id: m.address for m in quorum.participants if m.replica_id != self._replica_id
        }
        return quorum

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

    def _ask(
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
                return self._client.quorum(
                    self._replica_id,
                    timeout=max(0.01, slice_s),
                    address=self._manager_address(),
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

    def _heartbeat_loop(self) -> None:
        while not self._stopped.wait(self._heartbeat_s):
            # A quorum request counts as a heartbeat at the lighthouse: while
            # the group steps, most beats would say what it already knows
            # (each blocking call costs ~1 ms of CPU next to the training).
            if time.monotonic() - self._last_contact < self._heartbeat_s:
                continue
            self._last_contact = time.monotonic()
            try:
                self._client.heartbeat(self._replica_id, timeout=max(1.0, self._heartbeat_s * 10))
            except Exception as exc:  # keep trying: the lighthouse may be restarting
                if not self._stopped.is_set():
                    logger.warning("[%s] lighthouse heartbeat failed: %s", self._replica_id, exc)

    def report_heal(self, report: dict[str, Any]) -> None:
        """Pass a heal's progress or end to the lighthouse's history (blocks).

        Raises:
            CoordinationError: the lighthouse is unreachable or refused.
        """
        self._client.report_heal(self._replica_id, report, timeout=_REPORT_TIMEOUT_S)

    def leave(self) -> None:
        """Tell the lighthouse the group leaves the job (best effort, a few seconds at most)."""
        try:
            self._client.leave(self._replica_id, timeout=_LEAVE_TIMEOUT_S)
        except Exception as exc:
            logger.info("[%s] could not tell the lighthouse it leaves: %s", self._replica_id, exc)

    def stop(self) -> None:
        """Stop heartbeating and retrying (a quorum request in flight goes on
        until :meth:`close` or its deadline)."""
        self._stopped.set()

    def close(self) -> None:
        """Stop, close the client (a call in flight ends at once) and join
        the heartbeat thread."""
        self._stopped.set()
        self._client.close()
        self._heartbeat.join(timeout=5)
