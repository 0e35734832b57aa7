"""
The manager's per-rank quorum rule
==================================

Given the quorum the lighthouse formed, what does each group rank of one
replica group do this step: its replica rank, whether it heals and from whom,
which peers it sends its state to, and which store its process group meets
on. A pure function of its inputs; :class:`~ftdist.coordination.ManagerServer`
does the I/O around it.

The rule (torchft's):

- members are ordered by ``replica_id``; a replica's rank is its position;
- members at the highest step are up to date; with ``init_sync`` at step 0
  everyone but one *primary* heals, so that all start from the same weights;
- recovering members are dealt round-robin over the up-to-date ones, offset
  by the group rank, so the group ranks of one replica group pull from
  different sources and the load spreads;
- the process group of group rank ``g`` meets on the store of the ``g``-th
  up-to-date member (modulo their count), spreading rendezvous load too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class MemberLike(Protocol):
    """What the rule reads of a quorum member."""

    @property
    def replica_id(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def store_address(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def commit_failures(self) -> int: ...


@dataclass
class QuorumResult:
    """One group rank's view of a quorum (torchft's ``QuorumResult`` fields).

    Attributes:
        quorum_id: the lighthouse's quorum id.
        replica_rank: this replica group's rank among the members.
        replica_world_size: number of members.
        recover_src_manager_address: manager to heal from ("" if not healing).
        recover_src_replica_rank: replica rank to heal from (None if not).
        recover_dst_replica_ranks: replica ranks this rank sends its state to.
        store_address: ``host:port`` of the store the process group meets on.
        max_step: the highest step among the members.
        max_replica_rank: rank among the up-to-date members (None if behind).
        max_world_size: number of up-to-date members.
        heal: whether this rank receives a checkpoint this step.
        commit_failures: the most failed commits any member reported.
        replica_ids: members' replica ids, by replica rank.
    """

    quorum_id: int = 0
    replica_rank: int = 0
    replica_world_size: int = 1
    recover_src_manager_address: str = ""
    recover_src_replica_rank: int | None = None
    recover_dst_replica_ranks: list[int] = field(default_factory=list)
    store_address: str = ""
    max_step: int = 0
    max_replica_rank: int | None = None
    max_world_size: int = 1
    heal: bool = False
    commit_failures: int = 0
    replica_ids: list[str] = field(default_factory=list)


def compute_quorum_results(
    replica_id: str, group_rank: int, quorum_id: int, members: Sequence[MemberLike], init_sync: bool
) -> QuorumResult:
    """Compute what group rank ``group_rank`` of ``replica_id`` does in this quorum.

    Raises:
        LookupError: ``replica_id`` is not a member of the quorum.
        ValueError: the quorum is empty or ``group_rank`` is negative.
    """
    if not members:
        raise ValueError("the quorum has no members")
    if group_rank < 0:
        raise ValueError(f"group_rank must be >= 0, got {group_rank}")
    ordered = sorted(members, key=lambda m: m.replica_id)
    ids = [m.replica_id for m in ordered]
    try:
        replica_rank = ids.index(replica_id)
    except ValueError:
        raise LookupError(f"replica {replica_id} is not a member of quorum {quorum_id}") from None

    max_step = max(m.step for m in ordered)
    up_to_date = [m for m in ordered if m.step == max_step]
    primary = up_to_date[group_rank % len(up_to_date)]
    # At step 0 with init_sync, everyone copies the primary's initial state.
    force = init_sync and max_step == 0
    recovering = [
        i
        for i, m in enumerate(ordered)
        if m.step != max_step or (force and m.replica_id != primary.replica_id)
    ]
    sources = [i for i in range(len(ordered)) if i not in set(recovering)]

    sends: dict[int, list[int]] = {}
    src: int | None = None
    for i, dst in enumerate(recovering):
        source = sources[(i + group_rank) % len(sources)]
        sends.setdefault(source, []).append(dst)
        if dst == replica_rank:
            src = source

    max_ids = [m.replica_id for m in up_to_date]
    return QuorumResult(
        quorum_id=quorum_id,
        replica_rank=replica_rank,
        replica_world_size=len(ordered),
        recover_src_manager_address=ordered[src].address if src is not None else "",
        recover_src_replica_rank=src,
        recover_dst_replica_ranks=sends.get(replica_rank, []),
        store_address=primary.store_address,
        max_step=max_step,
        max_replica_rank=max_ids.index(replica_id) if replica_id in max_ids else None,
        max_world_size=len(up_to_date),
        heal=src is not None,
        commit_failures=max(m.commit_failures for m in ordered),
        replica_ids=ids,
    )


class _HasData(Protocol):
    @property
    def replica_id(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def data(self) -> dict[str, Any] | None: ...


def find_divergence(members: Sequence[_HasData]) -> str | None:
    """Compare the state fingerprints members attached to their quorum requests.

    Members at the same step must hold the same state: for every group rank
    and every part they both fingerprinted, the values must match. Members
    attach fingerprints (in ``data["fingerprint"]``, by group rank, then part
    name) after a reconfigure, so this catches a heal that left a replica
    different (a stale learning rate, a missed buffer) at once, instead of
    letting replicas drift apart.

    Returns:
        None if all agree, else a message naming what differs and where.
    """
    by_step: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for m in members:
        fp = (m.data or {}).get("fingerprint") if isinstance(m.data, dict) else None
        if fp:
            by_step.setdefault(m.step, []).append((m.replica_id, fp))
    problems = []
    for step, reports in sorted(by_step.items()):
        if len(reports) < 2:
            continue
        for group_rank in sorted(set.intersection(*(set(fp) for _, fp in reports))):
            parts = set.intersection(*(set(fp[group_rank]) for _, fp in reports))
            for part in sorted(parts):
                values = {rid: fp[group_rank][part] for rid, fp in reports}
                if len(set(values.values())) > 1:
                    seen = ", ".join(f"{rid}: {v:#010x}" for rid, v in sorted(values.items()))
                    problems.append(f"'{part}' of group rank {group_rank} at step {step} ({seen})")
    if not problems:
        return None
    return "replica state diverged after recovery: " + "; ".join(problems)


def participation(
    result: QuorumResult,
    *,
    async_quorum: bool,
    allow_heal: bool,
    fixed_with_spares: bool,
    min_replica_size: int,
) -> tuple[int | None, int]:
    """This replica's rank among the step's participants, and their number.

    With an asynchronous quorum (or no healing) only the up-to-date replicas
    count: one that heals during the step contributes zeros. With spares,
    only the first ``min_replica_size`` of them take part; the others are
    hot spares.

    Returns:
        ``(participating_rank, participating_world_size)``; the rank is None
        when this replica does not take part.
    """
    if async_quorum or not allow_heal:
        rank, world = result.max_replica_rank, result.max_world_size
    else:
        rank, world = result.replica_rank, result.replica_world_size
    if fixed_with_spares:
        world = min(world, min_replica_size)
        if rank is not None and rank >= min_replica_size:
            rank = None
    return rank, world
