"""LocalSGD and DiLoCo in real processes, checked bit for bit against the reference.

Two replica groups of one rank each train with a real lighthouse, Manager and
Gloo; each records its sync attempts. ``tests/local_sgd_reference.py``
replays the recorded membership history in one process and must arrive at
exactly the same global state (global weights and outer optimizer state)
and local weights as every process that finished.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftdist.launch.ranks import RankContext, Ranks, run_ranks
from tests import _diagnostics
from tests.integration.lighthouse_helpers import Lighthouses
from tests.integration.local_sgd_training import as_tensors, read_lineages, train
from tests.local_sgd_reference import Config, Lineage, simulate


def _assert_equal(real: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(real, torch.Tensor), where
        assert real.dtype == expected.dtype and torch.equal(real, expected), (
            f"{where}: differs by up to {(real - expected).abs().max().item():.3g}"
        )
    elif isinstance(expected, dict):
        assert set(real) == {str(k) for k in expected}, (where, set(real), set(expected))
        for k, v in expected.items():
            _assert_equal(real[str(k)], v, f"{where}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(real) == len(expected), where
        for i, (a, b) in enumerate(zip(real, expected, strict=True)):
            _assert_equal(a, b, f"{where}[{i}]")
    else:
        assert real == expected, (where, real, expected)


def _check_against_reference(
    cfg: Config, out: Path, finals: list[dict[str, Any]]
) -> dict[tuple[int, int], Lineage]:
    lineages = read_lineages(str(out), cfg)
    simulated = simulate(cfg, lineages)
    for final in finals:
        lin = simulated[(final["replica"], final["attempt"])]
        assert lin.step == final["step"], (lin.step, final["step"])
        _assert_equal(as_tensors(final["model"]), lin.model.state_dict(), "local weights")
        if cfg.algorithm == "diloco":
            expected = [{"backup": backup, "outer": outer} for backup, outer in lin.global_state()]
            _assert_equal(as_tensors(final["global"]), expected, "global state")
    return simulated


def _run(
    lighthouse: str, out: Path, cfg: Config, steps: int, actions: list[list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Run two replica groups; ``actions[r][a]`` are replica r's actions in attempt a.

    A replica that dies is restarted with its next attempt's actions.
    """
    out.mkdir(exist_ok=True)
    _diagnostics.watch_glob(out, "*.jsonl", "sync records")
    _diagnostics.watch_glob(out, "*.log", "log (FTDIST_LOG=1)")
    args = (lighthouse, str(out), asdict(cfg), steps)
    attempts = [0] * len(actions)
    first = {str(r): a[0] for r, a in enumerate(actions)}
    with Ranks(train, len(actions), args=(*args, first)) as ranks:
        deadline = time.monotonic() + 150
        while True:
            assert time.monotonic() < deadline, "the run did not finish"
            done = True
            for r in range(len(actions)):
                code = ranks.exitcode(r)
                if code is None:
                    done = False
                elif code == -9 and attempts[r] + 1 < len(actions[r]):
                    attempts[r] += 1
                    ranks.restart(r, *args, {str(r): actions[r][attempts[r]]}, attempts[r])
                    done = False
            if done:
                break
            time.sleep(0.05)
        outcomes = ranks.join(timeout=10)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    return [o.value for o in outcomes]


DILOCO = Config("diloco", n_fragments=2, sync_every=4, delay=1, alpha=0.5, inner="adamw")
LOCALSGD = Config("localsgd", n_fragments=1, sync_every=3, delay=0, alpha=0.0, inner="adamw")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("cfg", "extra"),
    [(DILOCO, {"bucketize": True}), (LOCALSGD, {}), (DILOCO, {"quantize": True})],
    ids=["streaming-diloco", "localsgd", "streaming-diloco-int8"],
)
def test_without_failures_bit_identical_to_the_reference(
    lh: Lighthouses, tmp_path: Path, cfg: Config, extra: dict[str, Any]
) -> None:
    server = lh.server(min_replicas=2, join_timeout_ms=30_000, heartbeat_timeout_ms=5_000)
    out = tmp_path / "events"
    finals = _run(server.address(), out, cfg, 6, [[extra], [extra]])
    assert all(f["step"] == 6 for f in finals)
    if extra.get("quantize"):
        # Quantized pseudo-gradients: not the reference's numbers, but every
        # replica still holds the same global state, close to the reference's.
        simulated = simulate(cfg, read_lineages(str(out), cfg))
        real = as_tensors(finals[0]["global"])
        for f, (backup, _) in enumerate(simulated[(0, 0)].global_state()):
            for name, expected in backup.items():
                got = real[f]["backup"][name]
                assert not torch.equal(got, expected)  # the int8 path did run
                torch.testing.assert_close(got, expected, rtol=0.05, atol=0.01)
    else:
        simulated = _check_against_reference(cfg, out, finals)
    for lin in simulated.values():
        assert [r.participants for r in lin.records] == [2] * 6
        assert all(r.committed and not r.healed for r in lin.records)
    if cfg.algorithm == "diloco":
        # The same global state everywhere; local weights differ by design.
        assert finals[0]["global"] == finals[1]["global"]
        assert finals[0]["model"] != finals[1]["model"]
        assert finals[0]["consistency_keys"] == [
            "StreamingDiLoCoFragment_0",
            "StreamingDiLoCoFragment_1",
        ]
    else:
        assert finals[0]["model"] == finals[1]["model"]


def quantized_body(ctx: RankContext) -> list[list[float]]:
    from ftdist.collectives import allreduce_quantized
    from ftdist.process_group import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
    pg.configure(ctx.addr("q"), ctx.rank, ctx.world_size)
    try:
        out = []
        for mode, op in itertools.product(("int8", "bf16"), (dist.ReduceOp.SUM, dist.ReduceOp.AVG)):
            tensors = [_quantized_input(ctx.rank, 0), _quantized_input(ctx.rank, 1)]
            allreduce_quantized(tensors, op, pg, mode=mode).wait()
            out += [t.reshape(-1).tolist() for t in tensors]
        return out
    finally:
        pg.shutdown()


def _quantized_input(rank: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 10 + i)
    return torch.randn(300 if i == 0 else 7, generator=g) * (1000.0 if i else 1.0)


@pytest.mark.timeout(90)
def test_quantized_allreduce_over_gloo_agrees_everywhere_within_the_bound() -> None:
    world = 3
    results = run_ranks(quantized_body, world, timeout=60)
    for other in results[1:]:
        assert other == results[0]  # bit-identical on every rank
    got = iter(results[0])
    for mode, op in itertools.product(("int8", "bf16"), ("sum", "avg")):
        for i in range(2):
            inputs = [_quantized_input(r, i).double() for r in range(world)]
            exact = sum(inputs)
            bound: torch.Tensor | float
            if mode == "int8":
                bound = sum(x.abs().max() / 254 for x in inputs)  # one block per tensor here
            else:
                bound = sum(x.abs() for x in inputs) * 2**-8
            bound = bound + sum(x.abs() for x in inputs) * 2**-21
            divisor = world if op == "avg" else 1
            value = torch.tensor(next(got), dtype=torch.float64)
            assert bool(((value - exact / divisor).abs() <= bound / divisor).all()), (mode, op, i)


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_groups_killed_before_during_and_after_a_sync_match_the_reference(
    lh: Lighthouses, tmp_path: Path
) -> None:
    """Replica 1 is SIGKILLed three times: between two syncs, with its
    average in flight, and right after a committed sync. Each restart heals
    the global state from replica 0 and takes over its local weights; the
    replay of the recorded membership must match every survivor bit for bit."""
    server = lh.server(min_replicas=1, join_timeout_ms=30_000, heartbeat_timeout_ms=5_000)
    cfg = Config("diloco", n_fragments=2, sync_every=4, delay=1, alpha=0.5, inner="sgd")
    # The survivor waits at these steps for the next restart, so that it
    # cannot finish alone; each restart heals at its first sync.
    survivor = {"hold": {"4": 1, "8": 2, "12": 3}}
    victim = [
        {"die": ["before", 2]},
        {"die": ["during", 6]},
        {"die": ["after", 10]},
        {},
    ]
    out = tmp_path / "events"
    finals = _run(server.address(), out, cfg, 14, [[survivor], victim])
    simulated = _check_against_reference(cfg, out, finals)
    assert finals[0]["global"] == finals[1]["global"]
    assert [f["attempt"] for f in finals] == [0, 3]
    for (replica, attempt), lin in simulated.items():
        heals = [r for r in lin.records if r.healed]
        if attempt == 0:
            # A consistency check that found the global state different
            # would have healed a replica that never restarted.
            assert heals == [], (replica, heals)
        else:
            # A restart heals at its first sync, from step 0 to the others' step.
            assert lin.records[0].healed and lin.records[0].step_before == 0
            assert lin.records[0].step > 0
    survivor_records = simulated[(0, 0)].records
    # The survivor went on alone while the victim was down...
    assert any(r.participants == 1 and r.committed for r in survivor_records)
    # ...and the victim's fragments of its restarts counted: some syncs with both.
    assert sum(r.participants == 2 and r.committed for r in survivor_records) >= 3
    assert os.path.exists(out / "r1.a3.jsonl")


@pytest.mark.timeout(120)
def test_localsgd_group_killed_and_restarted_ends_with_the_same_weights(
    lh: Lighthouses, tmp_path: Path
) -> None:
    """torchft's LocalSGD recovery test: a killed group restarts, heals at its
    first sync and, from then on, every sync leaves both groups identical."""
    server = lh.server(min_replicas=1, join_timeout_ms=30_000, heartbeat_timeout_ms=5_000)
    cfg = Config("localsgd", n_fragments=1, sync_every=3, delay=0, alpha=0.0, inner="adamw")
    out = tmp_path / "events"
    finals = _run(
        server.address(), out, cfg, 7, [[{"hold": {"4": 1}}], [{"die": ["before", 2]}, {}]]
    )
    assert [f["attempt"] for f in finals] == [0, 1]
    assert finals[0]["model"] == finals[1]["model"]
    restart = next(lin for lin in read_lineages(str(out), cfg) if lin.attempt == 1)
    assert restart.records[0].healed and restart.records[0].step > 0


def _train_and_drop(ctx: RankContext, lighthouse: str, kind: str) -> list[str]:
    """Train with LocalSGD or DiLoCo, shut down, drop: what a collection leaves alive."""
    import gc
    import weakref

    from ftdist.local_sgd import DiLoCo, LocalSGD
    from ftdist.process_group import ProcessGroupGloo
    from tests.integration.ft_training import one_rank_manager

    def run() -> dict[str, weakref.ref[Any]]:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        model = torch.nn.Linear(8, 8)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
        manager = one_rank_manager(
            pg, lighthouse, store.port, f"{kind}{ctx.rank}", use_async_quorum=False
        )
        try:
            if kind == "localsgd":
                wrapper: Any = LocalSGD(manager, model, inner, sync_every=2)
            else:
                outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
                wrapper = DiLoCo(manager, [model], inner, outer, sync_every=2)
            with wrapper:
                for _ in range(4):
                    inner.zero_grad()
                    model(torch.randn(4, 8)).sum().backward()
                    inner.step()
            assert manager.current_step() == 2
        finally:
            manager.shutdown()
            pg.shutdown()
        return {"manager": weakref.ref(manager), "weight": weakref.ref(model.weight)}

    watched = run()
    gc.collect()
    return [name for name, ref in watched.items() if ref() is not None]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["localsgd", "diloco"])
def test_a_dropped_manager_and_model_are_freed_after_local_sgd(lh: Lighthouses, kind: str) -> None:
    # The state LocalSGD and DiLoCo register with the Manager was kept in a
    # module-level map keyed weakly by the Manager, whose entries reached
    # their own key: the Manager and the model stayed for the life of the
    # process, whatever the collector did.
    lighthouse = lh.server(min_replicas=1).address()
    (alive,) = run_ranks(_train_and_drop, 1, lighthouse, kind, timeout=80)
    assert alive == [], f"still alive after shutdown and a collection: {alive}"
