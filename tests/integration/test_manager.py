"""Manager end to end: real lighthouse, real manager servers, real Gloo, real processes."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ftdist.launch.ranks import RankContext, run_ranks
from tests.integration.ft_training import (
    batch,
    model_and_optim,
    one_rank_manager,
    replica_store,
    train,
)
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


def _load(model: Any, optim: Any, sd: dict[str, Any]) -> None:
    model.load_state_dict(sd["model"])
    optim.load_state_dict(sd["optim"])


def _train_then_shut_down(
    ctx: RankContext, lighthouse: str, transport: str
) -> tuple[list[str], dict[str, Any]]:
    """Train a few steps (one group heals the other at step 0) and shut down:
    the heals' roles, and weak references to what the training code held
    (returned with the cyclic collector off)."""
    import gc
    import weakref
    from datetime import timedelta

    from ftdist.checkpointing import PGTransport
    from ftdist.ddp import DistributedDataParallel
    from ftdist.optim import OptimizerWrapper
    from ftdist.process_group import ProcessGroupGloo

    own_store, port = replica_store(ctx, ctx.rank, 0, 0)
    model, optim = model_and_optim(seed=ctx.rank)
    timeout = timedelta(seconds=10)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = one_rank_manager(
        pg,
        lighthouse,
        port,
        f"replica{ctx.rank}",
        lambda sd: _load(model, optim, sd),
        lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        min_replica_size=2,
        connect_timeout=timeout,
        checkpoint_transport=PGTransport(pg, timeout) if transport == "pg" else None,
    )
    try:
        ddp = DistributedDataParallel(manager, model)
        opt = OptimizerWrapper(manager, optim)
        manager._logger.info("training")  # torchft's logger, cached on the Manager
        while manager.current_step() < 3:
            opt.zero_grad()
            ddp(batch(manager.current_step(), ctx.rank, 0)).sum().backward()
            opt.step()
        harness = ctx.store()
        harness.add("done", 1)
        deadline = time.monotonic() + 30
        while int(harness.add("done", 0)) < ctx.world_size and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        manager.shutdown()
        pg.shutdown()
        del own_store
    # The steps' own garbage (autograd's and torch DDP's cycles among them,
    # some reaching the Manager through its hooks) is young and goes in the
    # collector's frequent young-generation passes; what the collector must
    # not be needed for is the Manager itself, which lives long enough to be
    # in the oldest generation, collected rarely.
    gc.collect()
    gc.disable()
    return [t.role for t in manager.heal_timelines], {
        "manager": weakref.ref(manager),
        "weight": weakref.ref(next(model.parameters())),
        "momentum": weakref.ref(next(iter(optim.state.values()))["exp_avg"]),
    }


def _train_then_drop(ctx: RankContext, lighthouse: str, transport: str) -> dict[str, Any]:
    """What of the training is still alive once its function returned, with
    the cyclic collector off."""
    import gc

    collecting = gc.isenabled()
    try:
        heals, watched = _train_then_shut_down(ctx, lighthouse, transport)
        alive = [name for name, ref in watched.items() if ref() is not None]
    finally:
        if collecting:
            gc.enable()
    return {"heals": heals, "alive": alive}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["http", "pg"])
def test_a_shut_down_manager_frees_itself_and_the_model_without_the_collector(
    lh: Lighthouses, transport: str
) -> None:
    # Callbacks the Manager hands its parts (the round, the failure news,
    # torchft's logger) held it strongly: a cycle that kept a dropped Manager
    # and the model its state functions reach (a GPU's memory) until the
    # cyclic collector ran.
    lighthouse = lh.server(min_replicas=2, join_timeout_ms=200).address()
    results = run_ranks(_train_then_drop, 2, lighthouse, transport, timeout=80)
    assert sorted(role for r in results for role in r["heals"]) == ["receive", "send"], results
    assert [r["alive"] for r in results] == [[], []], results
