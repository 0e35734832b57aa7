"""The manager's per-rank quorum rule, including torchft's test vectors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ftdist.manager.rule import compute_quorum_results


@dataclass
class M:
    replica_id: str
    step: int
    commit_failures: int = 0

    @property
    def address(self) -> str:
        return f"addr_{self.replica_id[-1]}"

    @property
    def store_address(self) -> str:
        return f"store_{self.replica_id[-1]}"


def _members(steps: list[int]) -> list[M]:
    return [M(f"replica_{i}", s) for i, s in enumerate(steps)]


def test_init_sync_at_step_zero_heals_everyone_from_the_primary() -> None:
    members = _members([0, 0])
    r0 = compute_quorum_results("replica_0", 0, 1, members, init_sync=True)
    r1 = compute_quorum_results("replica_1", 0, 1, members, init_sync=True)
    assert r0.recover_dst_replica_ranks == [1] and not r0.heal
    assert r1.heal and r1.recover_src_replica_rank == 0
    assert r1.recover_src_manager_address == "addr_0"
    # Group rank 1's primary is replica_1: the roles flip.
    g1 = compute_quorum_results("replica_1", 1, 1, members, init_sync=True)
    assert g1.recover_dst_replica_ranks == [0] and not g1.heal
    assert g1.store_address == "store_1"
    # A healing replica at step 0 may still have a max_replica_rank.
    assert r1.max_replica_rank == 1


def test_mixed_steps_vector() -> None:
    members = _members([0, 1, 0, 1, 0])
    r0 = compute_quorum_results("replica_0", 0, 1, members, init_sync=True)
    assert r0.heal and r0.recover_src_replica_rank == 1
    assert r0.recover_src_manager_address == "addr_1"
    assert compute_quorum_results("replica_1", 0, 1, members, True).recover_dst_replica_ranks == [
        0,
        4,
    ]
    assert compute_quorum_results("replica_3", 0, 1, members, True).recover_dst_replica_ranks == [2]
    assert compute_quorum_results("replica_1", 1, 1, members, True).recover_dst_replica_ranks == [2]
    r = compute_quorum_results("replica_2", 0, 1, members, True)
    assert (r.max_step, r.max_world_size, r.max_replica_rank) == (1, 2, None)
    assert r.replica_ids == [m.replica_id for m in members]


def test_no_init_sync_means_nobody_heals_at_step_zero() -> None:
    members = _members([0, 0])
    for rid in ("replica_0", "replica_1"):
        r = compute_quorum_results(rid, 0, 1, members, init_sync=False)
        assert not r.heal and r.recover_dst_replica_ranks == []
    r = compute_quorum_results("replica_1", 0, 1, _members([1, 0]), init_sync=False)
    assert r.heal and r.recover_src_replica_rank == 0


def test_members_are_ordered_and_commit_failures_are_the_max() -> None:
    members = [M("b", 3, commit_failures=2), M("a", 3), M("c", 3, commit_failures=1)]
    r = compute_quorum_results("b", 0, 7, members, init_sync=True)
    assert (r.replica_rank, r.replica_world_size, r.quorum_id) == (1, 3, 7)
    assert r.replica_ids == ["a", "b", "c"]
    assert r.commit_failures == 2


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("group_rank", [0, 1, 2])
def test_every_recovering_member_has_exactly_one_source(n: int, group_rank: int) -> None:
    steps = [(i * 7) % 3 for i in range(n)]
    members = _members(steps)
    results = [compute_quorum_results(m.replica_id, group_rank, 1, members, True) for m in members]
    for i, r in enumerate(results):
        behind = steps[i] != max(steps) or (max(steps) == 0 and r.store_address != f"store_{i}")
        assert r.heal == behind
        if r.heal:
            src = results[r.recover_src_replica_rank]  # type: ignore[index]
            assert not src.heal and i in src.recover_dst_replica_ranks
    sent = sorted(d for r in results for d in r.recover_dst_replica_ranks)
    assert sent == [i for i, r in enumerate(results) if r.heal]


def test_errors() -> None:
    with pytest.raises(LookupError, match="replica x is not a member of quorum 3"):
        compute_quorum_results("x", 0, 3, _members([0]), True)
    with pytest.raises(ValueError, match="no members"):
        compute_quorum_results("x", 0, 3, [], True)
