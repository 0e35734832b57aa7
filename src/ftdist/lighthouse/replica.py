"""
Lighthouse replica
==================

The etcd side of one replica of a replicated lighthouse. Two or three
replicas of a job's lighthouse run on different hosts; they elect one leader
through etcd and only the leader forms quorums (the server around it,
:class:`ftdist.lighthouse.server.LighthouseServer`, answers or forwards).

Keys, all under ``/ftdist/<job>/``:

* ``leader``: the leader's address, attached to its lease. Created by a
  transaction that requires it absent; its create revision is the leader's
  fencing token.
* ``quorum``: the last quorum id issued and its members. Written only when
  the id changes, by a transaction that requires the leader key to carry the
  writer's fencing token, and before any reply carries the new id: ids grow
  strictly across failovers and are never reused with other members.
* ``replicas/<name>``: each replica's addresses, attached to its lease (the
  replica set on the dashboard).
* ``failovers/<time>``: one record per election won (the history).

In steady state nothing is written: heartbeats, joins and steps stay in the
leader's memory, and a lease renewal is not a raft write.

Safety (:mod:`ftdist.lighthouse.leadership`): the leader answers only while
its lease, counted from the send time of its last confirmed renewal, has
``margin`` left, so a leader that cannot renew, or that wakes from a stop,
goes quiet before another can be elected; every write it makes is fenced.
A leader that stops (SIGTERM) revokes its lease, which deletes the leader key
at once, and a follower takes over within a poll.

One thread (``ftdist-lighthouse-etcd``) runs the election loop; another
(``ftdist-lighthouse-etcd-health``) probes the etcd members for the status
page, so a stalled member never delays a renewal.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftdist.errors import EtcdError
from ftdist.etcd.client import (
    EtcdClient,
    KeyValue,
    MemberStatus,
    create_revision_is,
    get_op,
    put_op,
)
from ftdist.lighthouse.config import ReplicationConfig
from ftdist.lighthouse.leadership import (
    Action,
    ElectionView,
    LeaseView,
    Verdict,
    next_step,
    serving_verdict,
)

__all__ = ["LighthouseReplica", "Takeover"]

logger = logging.getLogger("ftdist.lighthouse.replica")

_POLL_S = 0.1
# After a failed etcd call the loop pauses this long before the next one.
_RETRY_PAUSE_S = 0.1
_HEALTH_PERIOD_S = 2.0
_HEALTH_TIMEOUT_S = 0.5
_MAX_FAILOVERS_SHOWN = 20
_START_TIMEOUT_S = 5.0
_REVOKE_TIMEOUT_S = 0.5


@dataclass(frozen=True, slots=True)
class Takeover:
    """What a newly elected leader starts from.

    Attributes:
        fencing_revision: the create revision of its leader key.
        quorum_id: the last quorum id any leader issued (0: none).
        member_ids: that quorum's members in order, or None.
        previous_leader: the name of the leader before it ("" if unknown).
    """

    fencing_revision: int
    quorum_id: int
    member_ids: tuple[str, ...] | None
    previous_leader: str


def _margin_s(ttl_s: float) -> float:
    # Room for a reply already being sent when the deadline passes.
    return max(0.2, 0.1 * ttl_s)


def _decode(value: bytes) -> dict[str, Any]:
    try:
        document = json.loads(value)
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}


class LighthouseReplica:
    """Campaigns for, holds and fences the leadership of one job's lighthouse.

    Args:
        config: the replication settings.
        name: this replica's name, unique in the job (``host:port``).
        address: its gRPC address, where clients reach it.
        dashboard: its dashboard address, or None.
        on_elected: called (on the election thread) when it becomes leader.
        on_deposed: called (on the election thread) with the reason when it
            stops being leader.
        token: unused by etcd; kept out of etcd (never written there).

    Raises:
        ValueError: malformed etcd endpoints or TLS settings.
    """

    def __init__(
        self,
        config: ReplicationConfig,
        *,
        name: str,
        address: str,
        dashboard: str | None,
        on_elected: Callable[[Takeover], None],
        on_deposed: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.name = name
        self.address = address
        self.dashboard = dashboard
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._clock = clock
        self._wall_clock = wall_clock
        self._client = EtcdClient(
            config.etcd,
            timeout=1.0,
            ca=config.etcd_ca,
            cert=config.etcd_cert,
            key=config.etcd_key,
        )
        prefix = f"/ftdist/{config.job}/"
        self._prefix = prefix.encode()
        self._leader_key = f"{prefix}leader".encode()
        self._quorum_key = f"{prefix}quorum".encode()
        self._replica_key = f"{prefix}replicas/{name}".encode()
        self._failovers = f"{prefix}failovers/".encode()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Election state: written by the election thread under the lock.
        self._lease: LeaseView | None = None
        self._lease_id = 0
        self._is_leader = False
        self._fencing = 0
        self._leader: dict[str, Any] = {}
        self._leader_seen = False
        self._read_at: float | None = None
        self._leading_since: float | None = None
        self._last_error = ""
        self._pause_until = 0.0
        # Set by resign() on another thread; the election thread acts on it.
        self._resign_reason: str | None = None
        # Status, refreshed by the health thread.
        self._members: list[MemberStatus] = []
        self._replicas: list[dict[str, Any]] = []
        self._history: list[dict[str, Any]] = []
        self._threads: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Check that etcd answers, then start campaigning.

        Raises:
            EtcdError: no etcd endpoint answered within 5 s (the message
                names them).
        """
        try:
            self._client.range(self._leader_key, timeout=_START_TIMEOUT_S)
        except EtcdError as exc:
            self._client.close()
            raise EtcdError(
                f"the lighthouse cannot reach etcd at {','.join(self.config.etcd)}: {exc}; "
                "check --etcd (http(s)://host:port of each member) and that etcd is running"
            ) from exc
        for target, name in (
            (self._run, "ftdist-lighthouse-etcd"),
            (self._watch_health, "ftdist-lighthouse-etcd-health"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def hand_over(self) -> None:
        """Stop leading at once: stop campaigning and revoke the lease, which
        deletes the leader key, so a follower takes over within a poll.
        Idempotent; :meth:`stop` then joins the threads.
        """
        self._stop.set()
        with self._lock:
            lease_id, self._lease_id, self._lease = self._lease_id, 0, None
            self._is_leader = False
        # Revoked before the threads are joined: the handover must not wait
        # for an etcd call the election thread has in flight.
        if lease_id:
            try:
                self._client.revoke(lease_id, timeout=_REVOKE_TIMEOUT_S)
            except EtcdError as exc:
                logger.warning("Could not revoke the lease on stop (it expires by itself): %s", exc)

    def resign(self, reason: str) -> None:
        """Give up the leadership: the election thread revokes the lease
        (freeing the leader key) and campaigns again, within a renewal period.

        For a server that stopped serving as the leader: it must not stay
        the leader in etcd, where every follower keeps pointing at it.
        Thread-safe; ignored unless this replica leads.
        """
        with self._lock:
            if self._is_leader:
                self._resign_reason = reason

    def stop(self) -> None:
        """Hand over (:meth:`hand_over`), then join the threads and close the
        etcd client. Idempotent; never blocks for more than a few seconds.
        """
        self.hand_over()
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._threads.clear()
        self._client.close()

    # -- read by the server thread -------------------------------------------

    def verdict(self) -> Verdict:
        """Whether this replica may answer quorum requests now."""
        with self._lock:
            lease, is_leader = self._lease, self._is_leader
        return serving_verdict(self._clock(), lease, is_leader, _margin_s(self._ttl_s(lease)))

    @property
    def leader_address(self) -> str:
        """The leader's gRPC address as last read ("" while none is known)."""
        with self._lock:
            if self._is_leader:
                return self.address
            return str(self._leader.get("address", "")) if self._leader_seen else ""

    def persist_quorum(self, quorum_id: int, member_ids: tuple[str, ...]) -> str | None:
        """Record a new quorum in etcd, fenced by this replica's leadership.

        Called on the server thread before any reply carries ``quorum_id``.

        Returns:
            None once recorded; otherwise why not (the quorum must then not
            be issued).
        """
        verdict = self.verdict()
        if not verdict.ok:
            return verdict.reason
        with self._lock:
            fencing = self._fencing
        value = json.dumps(
            {
                "quorum_id": quorum_id,
                "members": list(member_ids),
                "leader": self.name,
                "time": self._wall_clock(),
            }
        ).encode()
        try:
            result = self._client.txn(
                [create_revision_is(self._leader_key, fencing)],
                [put_op(self._quorum_key, value)],
                timeout=max(0.05, min(1.0, verdict.left_s)),
            )
        except EtcdError as exc:
            return f"etcd did not record quorum {quorum_id}: {exc}"
        if not result.succeeded:
            self._depose("another replica holds the leader key (this one's writes are fenced)")
            return "another replica leads now; this replica's write was fenced"
        return None

    def status(self) -> dict[str, Any]:
        """The replica set as this replica sees it, for the status document."""
        now = self._clock()
        with self._lock:
            lease, is_leader = self._lease, self._is_leader
            leader = dict(self._leader) if self._leader_seen else {}
            document: dict[str, Any] = {
                "job": self.config.job,
                "name": self.name,
                "address": self.address,
                "role": "leader" if is_leader else "follower" if self._leader_seen else "candidate",
                "fencing_revision": self._fencing if is_leader else None,
                "leading_for_s": (
                    None if self._leading_since is None else round(now - self._leading_since, 3)
                ),
                "last_error": self._last_error,
                "etcd": [
                    {
                        "endpoint": m.endpoint,
                        "ok": m.ok,
                        "version": m.version,
                        "is_raft_leader": m.is_leader,
                        "latency_ms": round(m.latency_s * 1000, 2),
                        "error": m.error,
                    }
                    for m in self._members
                ],
                "replicas": list(self._replicas),
                "failovers": list(self._history),
            }
        if is_leader:
            leader = {"name": self.name, "address": self.address, "dashboard": self.dashboard}
        document["leader"] = leader or None
        verdict = serving_verdict(now, lease, is_leader, _margin_s(self._ttl_s(lease)))
        document["serving"] = verdict.ok
        document["serving_reason"] = verdict.reason
        document["lease"] = (
            None
            if lease is None
            else {
                "ttl_s": lease.ttl_s,
                "left_s": round(max(0.0, lease.renewed_at + lease.ttl_s - now), 3),
            }
        )
        document["etcd_endpoints"] = list(self.config.etcd)
        return document

    # -- the election loop -------------------------------------------------------

    def _ttl_s(self, lease: LeaseView | None) -> float:
        return lease.ttl_s if lease is not None else self.config.lease_ttl.total_seconds()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                resign, self._resign_reason = self._resign_reason, None
                resign = resign if self._is_leader else None
            if resign is not None:
                self._depose(resign)
                continue
            now = self._clock()
            with self._lock:
                lease = self._lease
                view = ElectionView(
                    lease=lease,
                    is_leader=self._is_leader,
                    leader_seen=self._leader_seen,
                    read_at=self._read_at,
                    poll_s=_POLL_S,
                    margin_s=_margin_s(self._ttl_s(lease)),
                )
            step = next_step(now, view)
            if step.action is Action.RESIGN:
                self._depose(step.reason)
                continue
            if now < self._pause_until:
                # After a failed call; a resignation above is never delayed.
                self._stop.wait(min(self._pause_until - now, _RETRY_PAUSE_S))
                continue
            if step.action is Action.WAIT:
                self._stop.wait(max(0.001, step.at - now))
                continue
            try:
                self._act(step.action, now)
            except EtcdError as exc:
                with self._lock:
                    self._last_error = str(exc)
                self._pause_until = self._clock() + _RETRY_PAUSE_S
                logger.debug("etcd call failed (%s): %s", step.action.value, exc)
            except Exception:  # a bug must not end the loop silently
                logger.exception("lighthouse election loop: %s failed", step.action.value)
                self._pause_until = self._clock() + _RETRY_PAUSE_S

    def _act(self, action: Action, now: float) -> None:
        if action is Action.GRANT:
            self._grant()
        elif action is Action.RENEW:
            self._renew()
        elif action is Action.CAMPAIGN:
            self._campaign()
        elif action is Action.WATCH:
            self._read_leader()

    def _left_s(self) -> float:
        with self._lock:
            lease = self._lease
        if lease is None:
            return 1.0
        return max(0.05, min(1.0, lease.renewed_at + lease.ttl_s - self._clock()))

    def _grant(self) -> None:
        with self._lock:
            old, self._lease_id, self._lease = self._lease_id, 0, None
        if old:
            try:
                self._client.revoke(old, timeout=_REVOKE_TIMEOUT_S)
            except EtcdError:
                pass  # it ran out anyway
        sent = self._clock()
        lease = self._client.grant(self.config.lease_ttl)
        self._client.put(self._replica_key, self._info(), lease=lease.id)
        with self._lock:
            self._lease_id = lease.id
            self._lease = LeaseView(float(lease.ttl_s), sent)
            self._last_error = ""
        logger.debug("Lease %x granted (%d s)", lease.id, lease.ttl_s)

    def _renew(self) -> None:
        with self._lock:
            lease_id = self._lease_id
            lease = self._lease
        if lease is None:
            return
        sent = self._clock()
        ttl = self._client.keep_alive(lease_id, timeout=self._left_s())
        if ttl <= 0:
            with self._lock:
                self._lease, self._lease_id = None, 0
            if self._is_leader:
                self._depose("the leader's lease expired in etcd")
            return
        with self._lock:
            if self._lease_id == lease_id:
                self._lease = LeaseView(float(ttl), sent)
                self._last_error = ""

    def _info(self) -> bytes:
        return json.dumps(
            {
                "name": self.name,
                "address": self.address,
                "dashboard": self.dashboard,
                "host": socket.gethostname(),
            }
        ).encode()

    def _campaign(self) -> None:
        with self._lock:
            lease_id = self._lease_id
            previous = str(self._leader.get("name", ""))
        if not lease_id:
            return
        record = json.dumps(
            {
                "time": self._wall_clock(),
                "leader": self.name,
                "address": self.address,
                "previous": previous,
            }
        ).encode()
        history_key = self._failovers + f"{time.time_ns():020d}-{self.name}".encode()
        result = self._client.txn(
            [create_revision_is(self._leader_key, 0)],
            [
                put_op(self._leader_key, self._info(), lease_id),
                put_op(history_key, record),
                get_op(self._quorum_key),
            ],
            [get_op(self._leader_key)],
            timeout=self._left_s(),
        )
        if result.succeeded:
            quorum = result.ranges[0][0] if result.ranges and result.ranges[0] else None
            self._elected(result.revision, quorum, previous)
            return
        holder = result.ranges[0][0] if result.ranges and result.ranges[0] else None
        if holder is not None and holder.lease == lease_id:
            # Our own earlier campaign won but its answer was lost.
            self._elected(holder.create_revision, self._client.get(self._quorum_key), previous)
            return
        self._saw_leader(holder)

    def _elected(self, fencing: int, quorum: KeyValue | None, previous: str) -> None:
        last = _decode(quorum.value) if quorum is not None else {}
        members = last.get("members")
        takeover = Takeover(
            fencing_revision=fencing,
            quorum_id=int(last.get("quorum_id", 0)),
            member_ids=tuple(str(m) for m in members) if isinstance(members, list) else None,
            previous_leader=previous,
        )
        with self._lock:
            self._is_leader = True
            self._fencing = fencing
            self._leader = {"name": self.name, "address": self.address}
            self._leader_seen = True
            self._read_at = self._clock()
            self._leading_since = self._clock()
        logger.info(
            "Lighthouse %s is the leader of job %s (fencing revision %d, last quorum %d)",
            self.name,
            self.config.job,
            fencing,
            takeover.quorum_id,
        )
        self._on_elected(takeover)

    def _saw_leader(self, holder: KeyValue | None) -> None:
        with self._lock:
            self._read_at = self._clock()
            self._leader_seen = holder is not None
            if holder is not None:
                leader = _decode(holder.value)
                if leader.get("name") != self._leader.get("name"):
                    logger.info(
                        "Lighthouse %s follows leader %s (%s)",
                        self.name,
                        leader.get("name"),
                        leader.get("address"),
                    )
                self._leader = leader

    def _read_leader(self) -> None:
        holder = self._client.get(self._leader_key, timeout=self._left_s())
        with self._lock:
            is_leader, fencing = self._is_leader, self._fencing
        if is_leader:
            if holder is None or holder.create_revision != fencing:
                self._depose("the leader key is gone or belongs to another replica")
                self._saw_leader(holder)
            else:
                with self._lock:
                    self._read_at = self._clock()
            return
        self._saw_leader(holder)

    def _depose(self, reason: str) -> None:
        with self._lock:
            was_leader = self._is_leader
            self._is_leader = False
            self._leading_since = None
            self._leader_seen = False
            self._read_at = None
            self._leader = {}
            lease_id, self._lease_id, self._lease = self._lease_id, 0, None
        if was_leader:
            logger.warning("Lighthouse %s stops leading: %s", self.name, reason)
            self._on_deposed(reason)
        if lease_id:
            # A new lease for the next campaign; revoking the old one frees
            # the leader key at once if it was still ours.
            try:
                self._client.revoke(lease_id, timeout=_REVOKE_TIMEOUT_S)
            except EtcdError:
                pass

    # -- status ----------------------------------------------------------------

    def _watch_health(self) -> None:
        while not self._stop.is_set():
            members = [
                self._client.member_status(e, timeout=_HEALTH_TIMEOUT_S) for e in self.config.etcd
            ]
            replicas: list[dict[str, Any]] | None = None
            history: list[dict[str, Any]] | None = None
            try:
                found = self._client.range(
                    self._replica_key.rsplit(b"/", 1)[0] + b"/", prefix=True, timeout=0.5
                )
                replicas = [_decode(kv.value) for kv in found]
                recent = self._client.range(
                    self._failovers,
                    prefix=True,
                    limit=_MAX_FAILOVERS_SHOWN,
                    newest_first=True,
                    timeout=0.5,
                )
                history = [_decode(kv.value) for kv in recent]
            except EtcdError as exc:
                logger.debug("status read from etcd failed: %s", exc)
            with self._lock:
                self._members = members
                if replicas is not None:
                    leader_name = self._leader.get("name") if self._leader_seen else None
                    for replica in replicas:
                        replica["role"] = (
                            "leader" if replica.get("name") == leader_name else "follower"
                        )
                    self._replicas = replicas
                if history is not None:
                    self._history = history
            self._stop.wait(_HEALTH_PERIOD_S)
