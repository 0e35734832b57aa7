"""
Healing
=======

A replica behind the quorum's max step receives the state of an up-to-date
peer; the peer serves it. :class:`Healer` does both sides for one rank, over
the Manager's checkpoint transport, and records each heal's phases (quorum
wait, process group reconfigure, state transfer, load) in a
:class:`HealTimeline`, so a slow recovery can be explained.

A healed replica checks that its consistency parts, once loaded, are what
its source had (:mod:`~ftdist.manager.fingerprint`); after a heal every
replica also reports its fingerprint with its next quorum request and the
manager server compares them (see
:func:`ftdist.manager.rule.find_divergence`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ftdist._gcpause import gc_paused
from ftdist.checkpointing import CheckpointTransport, TransferStats
from ftdist.checkpointing._checksum import SegmentSum
from ftdist.checkpointing._prefault import ReceiveReserve
from ftdist.errors import StateDivergenceError
from ftdist.manager.fingerprint import differing_parts, planned
from ftdist.manager.fingerprint import fingerprint as fingerprint  # where tests look
from ftdist.manager.fingerprint import fold_parts as fold_parts

if TYPE_CHECKING:
    from ftdist.manager.client import ManagerClientLike
    from ftdist.manager.rule import QuorumResult
    from ftdist.manager.state import ConsistencyParts, UserState

logger = logging.getLogger(__name__)

# Where the Manager's own counters travel in a heal's state (torchft's
# "torchft", renamed with the package).
MANAGER_STATE_KEY = "ftdist"

# Where a heal state carries the source's consistency plan; sources from
# before the plan sent their fingerprint itself, under "consistency".
PLAN_KEY = "consistency_plan"
FINGERPRINT_KEY = "consistency"

# Heal sources whose clients are kept open (a restarted peer has a new
# address; the oldest are closed beyond this many).
MAX_SOURCE_CLIENTS = 4
# A heal in flight tells the lighthouse how far its transfer is this often.
PROGRESS_PERIOD_S = 0.25
# How long a closing Manager waits for its last heal reports to go out (a
# heal that ends just before the job does is still on the dashboard).
REPORT_DRAIN_S = 2.0


@dataclass
class HealTimeline:
    """The phases of one heal, as seen by one rank.

    Attributes:
        step: the step healed to (the quorum's max step).
        quorum_id: the quorum in which it happened.
        role: ``"receive"`` (this rank healed) or ``"send"`` (it served).
        peers: the replica ranks on the other side.
        quorum_s: waiting for the quorum.
        reconfigure_s: rebuilding the process group (0 if unchanged).
        transfer_bytes: state bytes moved.
        transfer_s: time moving them.
        load_s: applying the received state (receive only).
        route: how the bytes travelled (receive only; see
            :attr:`~ftdist.checkpointing.TransferStats.route`), "" if unknown.
        reserved_bytes: fresh tensor bytes that landed in memory populated
            while the quorum formed (receive only; see
            :meth:`Healer.reserve_like`).
    """

    step: int
    quorum_id: int
    role: str
    peers: list[int]
    quorum_s: float = 0.0
    reconfigure_s: float = 0.0
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    load_s: float = 0.0
    route: str = ""
    reserved_bytes: int = 0

    @property
    def total_s(self) -> float:
        """Sum of the phases."""
        return self.quorum_s + self.reconfigure_s + self.transfer_s + self.load_s

    def report(self, phase: str, error: str = "") -> dict[str, Any]:
        """This timeline as a ``HealReport``'s fields, in ``phase`` (see
        :meth:`ftdist.lighthouse.client.LighthouseClient.report_heal`)."""
        return {
            "phase": phase,
            "step": self.step,
            "quorum_id": self.quorum_id,
            "quorum_s": self.quorum_s,
            "reconfigure_s": self.reconfigure_s,
            "transfer_s": self.transfer_s,
            "load_s": self.load_s,
            "transfer_bytes": self.transfer_bytes,
            "error": error[:200],
        }

    @property
    def transfer_gbps(self) -> float:
        """Transfer throughput in GB/s."""
        return self.transfer_bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0

    def summary(self) -> str:
        """One line for the log."""
        verb = "healed from" if self.role == "receive" else "served state to"
        return (
            f"{verb} replica rank(s) {self.peers} at step {self.step} (quorum "
            f"{self.quorum_id}): quorum {self.quorum_s * 1e3:.0f} ms, reconfigure "
            f"{self.reconfigure_s * 1e3:.0f} ms, transfer {self.transfer_bytes / 1e6:.1f} MB"
            f"{f' over {self.route}' if self.route else ''} in "
            f"{self.transfer_s * 1e3:.0f} ms ({self.transfer_gbps:.2f} GB/s), load "
            f"{self.load_s * 1e3:.0f} ms"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "step": self.step,
            "quorum_id": self.quorum_id,
            "role": self.role,
            "peers": self.peers,
            "quorum_s": self.quorum_s,
            "reconfigure_s": self.reconfigure_s,
            "transfer_bytes": self.transfer_bytes,
            "transfer_s": self.transfer_s,
            "load_s": self.load_s,
            "total_s": self.total_s,
            "route": self.route,
            "reserved_bytes": self.reserved_bytes,
        }


@gc_paused()
def heal_state(
    user_state: UserState, counters: dict[str, int], consistency: ConsistencyParts
) -> dict[str, Any]:
    """What a healing peer receives: the user state and the Manager's counters.

    Taken under the user state's read lock (see ``disallow_state_dict_read``).
    ``"consistency_plan"`` (how the receiver rebuilds this replica's
    fingerprint of the parts compared across replicas, see
    :func:`~ftdist.manager.fingerprint.plan`) is present only when such parts
    are registered.

    Raises:
        TimeoutError: reads stayed disallowed for the whole timeout.
    """
    state: dict[str, Any] = {"user": user_state.save(), MANAGER_STATE_KEY: counters}
    if consistency:
        state[PLAN_KEY] = consistency.plan(state["user"])
    return state


def manager_counters(state: dict[str, Any]) -> dict[str, int]:
    """The Manager's counters in a received state (torchft's key accepted too).

    Raises:
        KeyError: the state carries no counters.
    """
    counters = state.get(MANAGER_STATE_KEY)
    if counters is None:
        counters = state.get("torchft")
    if counters is None:
        raise KeyError(
            f"the received state has no Manager counters ({MANAGER_STATE_KEY!r}); "
            f"it has {sorted(state)}"
        )
    return dict(counters)


@dataclass
class Staged:
    """A state received while healing, to be applied together with its step.

    Attributes:
        state: the received state.
        step: the step it is of.
        timeline: the heal's phases so far.
        sums: the transport's word sums of the received tensors (see
            :attr:`~ftdist.checkpointing.TransferStats.tensor_sums`).
    """

    state: dict[str, Any]
    step: int
    timeline: HealTimeline
    sums: Mapping[tuple[int, int], SegmentSum] = field(default_factory=dict)


def _last_transfer(transport: CheckpointTransport[Any]) -> TransferStats:
    """The transport's last transfer; nothing moved if it keeps no record."""
    return transport.last_transfer or TransferStats(0, 0.0)


class Healer:
    """Serves this rank's state to recovering peers, or receives a peer's.

    Args:
        transport: moves the state (the Manager's checkpoint transport).
        timeout: bounds each transfer and metadata call.
        connect: opens a client to a heal source's manager server, given its
            address; clients are kept open (closing a gRPC channel blocks for
            about 200 ms, which would land on every heal).
        report: delivers a heal report to the lighthouse's history (group
            rank 0's manager server); received heals are reported as they go,
            from a thread of their own (:class:`HealReporter`).
        reserve_limit: the most memory :meth:`reserve_like` sets aside, in
            bytes (0: none; the Manager passes what
            ``FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB`` says).
    """

    def __init__(
        self,
        transport: CheckpointTransport[Any],
        timeout: timedelta,
        connect: Callable[[str], ManagerClientLike],
        report: Callable[[dict[str, Any]], None] | None = None,
        reserve_limit: int = 0,
    ) -> None:
        self.transport = transport
        self._timeout = timeout
        self._connect = connect
        self.reporter = HealReporter(report) if report is not None else None
        # Most recently used last; every restarted peer has a new address.
        self._sources: OrderedDict[str, ManagerClientLike] = OrderedDict()
        self._reserve_limit = reserve_limit

    def reserve_like(self, own: Callable[[], object]) -> ReceiveReserve | None:
        """Memory for a likely first heal's fresh tensors, populated from now
        on: as large as the CPU tensors of ``own()`` (this rank's state), at
        most ``FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB``. None where the
        transport cannot use it (not ftdist's), this host cannot populate
        memory ahead, or nothing is worth reserving; ``own`` is then not asked.

        Raises:
            OSError: the memory cannot be mapped.
        """
        usable = isinstance(self.transport, CheckpointTransport)
        if not usable or not ReceiveReserve.possible(self._reserve_limit):
            return None
        state = own()
        return None if state is None else ReceiveReserve.like(state, self._reserve_limit)

    def serve(
        self, quorum: QuorumResult, state: dict[str, Any], quorum_s: float, reconfigure_s: float
    ) -> HealTimeline:
        """Make ``state`` available to the quorum's recovering replicas.

        Raises:
            CheckpointError: the transfer failed (blocking transports).
        """
        dst = list(quorum.recover_dst_replica_ranks)
        timeline = HealTimeline(
            quorum.max_step, quorum.quorum_id, "send", dst, quorum_s, reconfigure_s
        )
        start = time.perf_counter()
        self.transport.send_checkpoint(dst, quorum.max_step, state, self._timeout)
        timeline.transfer_s = time.perf_counter() - start
        timeline.transfer_bytes = _last_transfer(self.transport).nbytes
        return timeline

    def receive(
        self,
        quorum: QuorumResult,
        group_rank: int,
        quorum_s: float,
        reconfigure_s: float,
        into: Callable[[], object] | None = None,
        reserve: ReceiveReserve | None = None,
    ) -> Staged:
        """Fetch the state of the quorum's max step from this rank's heal source.

        ``into`` returns this rank's own state, whose matching tensors the
        transfer overwrites in place (see
        :attr:`~ftdist.checkpointing.CheckpointTransport.receive_into`);
        the fresh ones are carved out of ``reserve`` while it has room
        (:meth:`reserve_like`).

        Returns:
            The received state, with the heal's timeline (its ``load_s`` is
            filled in by whoever loads the state).

        Raises:
            ValueError: the quorum names no heal source for this rank.
            CoordinationError: the source's manager server is unreachable.
            CheckpointError: the transfer failed, was corrupted, or was of
                another step.
        """
        src = quorum.recover_src_replica_rank
        if src is None:
            raise ValueError(f"quorum {quorum.quorum_id} names no heal source for this rank")
        timeline = HealTimeline(
            quorum.max_step, quorum.quorum_id, "receive", [src], quorum_s, reconfigure_s
        )
        self.tell(timeline, "transfer")
        start = time.perf_counter()
        try:
            client = self._source(quorum.recover_src_manager_address)
            metadata = client._checkpoint_metadata(group_rank, timeout=self._timeout)
            start = time.perf_counter()
            # Set for this receive only; a transport without the hooks ignores them.
            self.transport.receive_into = into
            self.transport.receive_reserve = reserve
            if self.reporter is not None:
                self.transport.progress = self._progress(timeline)
            try:
                state = self.transport.recv_checkpoint(
                    src, metadata, quorum.max_step, self._timeout
                )
            finally:
                self.transport.progress = None
                self.transport.receive_into = None
                self.transport.receive_reserve = None
        except Exception as exc:
            timeline.transfer_s = time.perf_counter() - start
            self.tell(timeline, "failed", repr(exc))
            raise
        timeline.transfer_s = time.perf_counter() - start
        stats = _last_transfer(self.transport)
        timeline.transfer_bytes, timeline.route = stats.nbytes, stats.route
        timeline.reserved_bytes = reserve.taken if reserve is not None else 0
        self.tell(timeline, "load")
        if not isinstance(state, dict):
            raise TypeError(f"the heal source sent a {type(state).__name__}, not a state dict")
        return Staged(state, quorum.max_step, timeline, stats.tensor_sums)

    def tell(
        self,
        timeline: HealTimeline | None,
        phase: str,
        error: str = "",
        bytes_done: int = 0,
        bytes_total: int = 0,
    ) -> None:
        """Report a received heal's ``phase`` (or its end: ``done``, ``failed``); None: nothing.

        During the transfer, ``bytes_done`` of ``bytes_total`` have arrived.
        """
        if self.reporter is not None and timeline is not None and timeline.role == "receive":
            report = timeline.report(phase, error)
            if bytes_total:
                report.update(bytes_done=bytes_done, transfer_bytes=bytes_total)
            self.reporter(report)

    def _progress(self, timeline: HealTimeline) -> Callable[[int, int], None]:
        """Reports a transfer's bytes so far, at most every :data:`PROGRESS_PERIOD_S`."""
        last = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] < PROGRESS_PERIOD_S or done >= total:
                return
            last[0] = now
            self.tell(timeline, "transfer", bytes_done=done, bytes_total=total)

        return progress

    def _source(self, address: str) -> ManagerClientLike:
        client = self._sources.pop(address, None)
        if client is None:
            client = self._connect(address)
        self._sources[address] = client
        while len(self._sources) > MAX_SOURCE_CLIENTS:
            _, old = self._sources.popitem(last=False)
            # Closing a gRPC channel can block ~200 ms: not on the heal path.
            threading.Thread(target=old.close, name="ftdist-close-source", daemon=True).start()
        return client

    def close(self) -> None:
        """Close the clients to heal sources and the reporter."""
        if self.reporter is not None:
            self.reporter.close()
        sources, self._sources = self._sources, OrderedDict()
        for client in sources.values():
            client.close()


class HealReporter:
    """Sends this group's heal reports to the lighthouse from a thread of its own.

    Calling it returns at once; a lighthouse that is down or does not serve
    the call (torchft's) costs a debug line. Reports made after
    :meth:`close` are dropped.

    Args:
        send: delivers one report (blocking; the manager server's
            :meth:`~ftdist.manager.server.ManagerServer.report_heal`).
    """

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self._send = send
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftdist-heal-report")

    def __call__(self, report: dict[str, Any]) -> None:
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self._pool.submit(self._deliver, report)

    def _deliver(self, report: dict[str, Any]) -> None:
        try:
            self._send(report)
        except Exception as exc:
            logger.debug("heal report not delivered: %s", exc)

    def close(self) -> None:
        """Deliver what is queued within :data:`REPORT_DRAIN_S`, then drop the rest."""
        with contextlib.suppress(RuntimeError):  # closed already
            drained = self._pool.submit(lambda: None)
            with contextlib.suppress(concurrent.futures.TimeoutError):
                drained.result(timeout=REPORT_DRAIN_S)
        self._pool.shutdown(wait=True, cancel_futures=True)  # in flight: its own timeout


@gc_paused()
def load_received(
    staged: Staged, user_state: UserState, consistency: ConsistencyParts
) -> StateDivergenceError | None:
    """Load the user part of a received state; check the consistency parts.

    The consistency parts must now be what the source had: a load function
    that skips something (a learning rate, say) would leave this replica
    silently different. What the source had is rebuilt before the load, from
    its plan and the sums of the bytes received (see
    :mod:`~ftdist.manager.fingerprint`).

    Returns:
        The divergence to record, or None.

    Raises:
        KeyError: the state lacks a registered key.
    """
    start = time.perf_counter()
    state = staged.state
    sent = state.get(FINGERPRINT_KEY)
    if PLAN_KEY in state and consistency:
        sent = planned(state[PLAN_KEY], state["user"], staged.sums)
    user_state.load(state["user"])
    error = None
    if isinstance(sent, dict) and consistency:
        differ = differing_parts(sent, consistency.fingerprint())
        if differ:
            error = StateDivergenceError(
                f"the state loaded while healing does not match the state received: {differ} "
                "differ; make load_state_dict restore everything state_dict returns"
            )
    staged.timeline.load_s = time.perf_counter() - start
    return error
