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
from collections.abc import Set as AbstractSet
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
    reconfigure_handles: list[str] = field(default_factory=list)

    # torchft's early-2025 names for three of the fields; settable too, since
    # early-2025 code builds results field by field.
    @property
    def max_rank(self) -> int | None:
        """``max_replica_rank``, by torchft's early name."""
        return self.max_replica_rank

    @max_rank.setter
    def max_rank(self, value: int | None) -> None:
        self.max_replica_rank = value

    @property
    def recover_src_rank(self) -> int | None:
        """``recover_src_replica_rank``, by torchft's early name."""
        return self.recover_src_replica_rank

    @recover_src_rank.setter
    def recover_src_rank(self, value: int | None) -> None:
        self.recover_src_replica_rank = value

    @property
    def recover_dst_ranks(self) -> list[int]:
        """``recover_dst_replica_ranks``, by torchft's early name."""
        return self.recover_dst_replica_ranks

    @recover_dst_ranks.setter
    def recover_dst_ranks(self, value: list[int]) -> None:
        self.recover_dst_replica_ranks = value


def compute_quorum_results(
    replica_id: str,
    group_rank: int,
    quorum_id: int,
    members: Sequence[MemberLike],
    init_sync: bool,
    diverged: AbstractSet[str] = frozenset(),
) -> QuorumResult:
    """Compute what group rank ``group_rank`` of ``replica_id`` does in this quorum.

    ``diverged`` names members at the max step whose state disagrees with
    the majority's (:func:`find_divergence`): they heal like members that
    are behind, from a member that is not diverged.

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
    up_to_date = [m for m in ordered if m.step == max_step and m.replica_id not in diverged]
    if not up_to_date:  # never: the majority is not diverged; stay safe anyway
        up_to_date = [m for m in ordered if m.step == max_step]
        diverged = frozenset()
    primary = up_to_date[group_rank % len(up_to_date)]
    # At step 0 with init_sync, everyone copies the primary's initial state.
    force = init_sync and max_step == 0
    recovering = [
        i
        for i, m in enumerate(ordered)
        if m.step != max_step
        or m.replica_id in diverged
        or (force and m.replica_id != primary.replica_id)
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


@dataclass(frozen=True)
class Divergence:
    """Replicas at the same step whose consistency parts disagree.

    Attributes:
        minority: the replica ids that must heal from the majority.
        report: what differs and where, for the log.
    """

    minority: frozenset[str]
    report: str


def _history(fp: dict[str, Any]) -> tuple[tuple[str, str, int], ...]:
    """A replica's fingerprints as one comparable value."""
    return tuple(
        sorted((str(g), str(p), int(v)) for g, parts in fp.items() for p, v in parts.items())
    )


def find_divergence(members: Sequence[_HasData]) -> Divergence | None:
    """Which replicas hold a different state than the majority at their step.

    Members attach fingerprints of their consistency parts (in
    ``data["fingerprint"]``, by group rank, then part name) after a
    reconfigure. Replicas at the same step must agree on every part they
    both report. Among those that do not, the largest set of identical
    histories wins; a tie goes to the set holding the replica id that sorts
    first. Everyone else is the minority: it heals from the majority, so
    that the job never stalls on a disagreement and two histories of the
    same step (replica groups that trained apart) become one.

    Returns:
        None if every step's reporters agree, else the minority and a report.
    """
    by_step: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for m in members:
        fp = m.data.get("fingerprint") if isinstance(m.data, dict) else None
        if isinstance(fp, dict) and fp:
            by_step.setdefault(m.step, []).append((m.replica_id, fp))
    minority: set[str] = set()
    problems = []
    for step, reports in sorted(by_step.items()):
        if len(reports) < 2:
            continue
        groups: dict[tuple[tuple[str, str, int], ...], list[str]] = {}
        for rid, fp in reports:
            groups.setdefault(_history(fp), []).append(rid)
        if len(groups) == 1:
            continue
        winner = min(groups.values(), key=lambda ids: (-len(ids), min(ids)))
        losers = sorted(rid for ids in groups.values() if ids is not winner for rid in ids)
        minority.update(losers)
        reports_by_id = dict(reports)
        differing: set[str] = set()
        for rid in losers:
            ref = reports_by_id[winner[0]]
            own = reports_by_id[rid]
            for g in set(ref) & set(own):
                differing.update(
                    f"'{p}' of group rank {g}"
                    for p in set(ref[g]) | set(own[g])
                    if ref[g].get(p) != own[g].get(p)
                )
        problems.append(
            f"at step {step}, {losers} differ from {sorted(winner)} in "
            f"{', '.join(sorted(differing)) or 'the parts they report'}"
        )
    if not minority:
        return None
    return Divergence(
        frozenset(minority),
        "replica state diverged: " + "; ".join(problems) + "; the minority heals from the majority",
    )


def heal_requests(members: Sequence[_HasData]) -> frozenset[str]:
    """Members that ask to heal whatever their step (``data["heal"]``).

    A replica group whose ranks ended up at different steps asks this: it
    reports its oldest rank's step, and every rank heals from a peer.
    """
    return frozenset(
        m.replica_id for m in members if isinstance(m.data, dict) and m.data.get("heal") is True
    )


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
