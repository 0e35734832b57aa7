"""Manager end to end: real lighthouse, real manager servers, real Gloo, real processes."""

from __future__ import annotations

from typing import Any

import pytest

from ftdist.launch.ranks import run_ranks
from tests.integration.ft_training import train
from tests.integration.lighthouse_helpers import Lighthouses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("group_size", [1, 2])
def test_replicas_train_in_lockstep_and_end_bit_identical(lh: Lighthouses, group_size: int) -> None:
    # min_replicas=2: neither replica may run ahead alone.
    lighthouse = lh.server(min_replicas=2, join_timeout_ms=200).address()
    results = run_ranks(train, 2 * group_size, lighthouse, group_size, 8, timeout=100)
    assert_consistent(results, 8, complete=True)
    # init_sync: whichever replica was not the primary healed from it, at
    # step 0, so straight into its own tensors (nothing committed was there).
    received = [h for r in results for h in r["heals"] if h["role"] == "receive"]
    assert received
    # Both replica groups run on this host: the heal copied straight from the
    # source's memory, asked for over its local socket.
    assert {h["route"] for h in received} == {"direct"}, received
    assert [load for r in results for load in r["loads"]] == [(True, True)] * group_size


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "variant", ["baby-gloo", "pg-transport", "pure-ddp", "sync-quorum", "spares"]
)
def test_variants_train_and_end_bit_identical(lh: Lighthouses, variant: str) -> None:
    lighthouse = lh.server(min_replicas=2, join_timeout_ms=200).address()
    actions: dict[str, Any] = {}
    pg_kind, transport = "gloo", "http"
    if variant == "baby-gloo":
        pg_kind = "baby"
    elif variant == "pg-transport":
        transport = "pg"
    elif variant == "pure-ddp":
        actions = {"pure_ddp": True}
    elif variant == "sync-quorum":
        actions = {"manager_kwargs": {"use_async_quorum": False}}
    elif variant == "spares":
        from ftdist.manager import WorldSizeMode

        # One participant, one hot spare that contributes zeros.
        actions = {"manager_kwargs": {"world_size_mode": WorldSizeMode.FIXED_WITH_SPARES}}
    results = run_ranks(
        train,
        2,
        lighthouse,
        1,
        6,
        dict.fromkeys(range(2), actions),
        0,
        pg_kind,
        transport,
        timeout=100,
    )
    assert_consistent(results, 6, complete=True)
    assert [load for r in results for load in r["loads"]] == [(True, True)], results
    if variant == "spares":
        # min_replica_size=1: each committed step counted one participant.
        assert results[0]["batches"] == 6


def assert_consistent(results: list[dict[str, Any]], steps: int, complete: bool = False) -> None:
    """Every replica ends at ``steps`` with the same state; no step was lost.

    ``complete``: ``results`` come from every process that ever ran, so
    together they must have committed every step.
    """
    by_rank: dict[int, set[str]] = {}
    for r in results:
        assert r["step"] == steps, r
        # A heal lands in the replica's own tensors exactly when it had never
        # committed: a committed state is never overwritten by a transfer.
        for fresh, in_place in r.get("loads", []):
            assert in_place == fresh, (r["replica"], r["loads"], r["heals"])
        # A replica commits each step at most once, in order; a healed one
        # starts where it joined.
        assert r["committed"] == sorted(set(r["committed"])), r
        if r["committed"]:
            assert r["committed"] == list(range(r["committed"][0], steps)), r
        by_rank.setdefault(r["group_rank"], set()).add(r["hash"])
    for group_rank, hashes in by_rank.items():
        assert len(hashes) == 1, f"group rank {group_rank} diverged: {hashes}"
    if complete:
        covered = set().union(*(r["committed"] for r in results))
        assert covered == set(range(steps)), f"never committed: {set(range(steps)) - covered}"
    assert len({r["batches"] for r in results if r["group_rank"] == 0}) == 1
