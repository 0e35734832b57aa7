"""Trainers for the exact-data tests (``test_exact_data.py``), in real processes.

Process ``i`` of a harness run is group rank ``i % group_size`` of replica
group ``i // group_size``; each replica group hosts its own TCPStore in group
rank 0 (as in ``ft_training``). Every rank trains with a real Manager, a
``ProcessGroupGloo``, a real lighthouse and an :class:`~ftdist.data.ExactSampler`,
reduces its gradient with ``manager.allreduce(..., SUM)`` and scales its
summed loss by ``plan.loss_scale("sum", ...)``, and steps plain SGD only when
``should_commit()`` says so.

Two models, each a single flat parameter vector ``theta``:

* ``"coords"``: ``theta`` has one coordinate per sample and sample ``i``'s
  loss is ``theta[i]``; with a power-of-two global batch ``G`` and ``lr = G``
  every sum is exact in any order, so one epoch from 0 ends at exactly -1
  everywhere (a sample read twice gives -2, one never read 0).
* ``"mlp"``: a small float32 tanh MLP on fixed data (:func:`mlp_loss`); the
  test checks its trajectory against a failure-free run within a derived
  rounding bound, so each commit records the weights and gradients.

Every committed step is written to a ledger file (one JSON line, one
``write``) right after ``should_commit()`` returns True, so a process killed
later leaves its lines. A process that kills itself writes a ``killed`` line
first, naming where.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftdist.launch.ranks import RankContext
from tests.integration.ft_training import replica_store
from tests.integration.lighthouse_helpers import wait_for_heartbeats, wait_for_quorum_request

# Where a rank may kill itself during a step (the heal's two sides are
# separate actions: ``die_during_heal`` and ``die_while_serving``).
KILL_POINTS = ("before_forward", "between_micro_batches", "after_allreduce")

MLP_IN, MLP_HIDDEN = 8, 16
MLP_PARAMS = MLP_HIDDEN * MLP_IN + MLP_HIDDEN + MLP_HIDDEN + 1


@dataclass(frozen=True)
class Job:
    """What every rank of a run trains.

    Attributes:
        model: ``"coords"`` or ``"mlp"``.
        dataset_len: samples in the dataset.
        global_batch_size: samples per step.
        micro_batch_size: samples per micro-batch.
        steps: steps to commit (``dataset_len / global_batch_size`` for one epoch).
        lr: plain SGD's learning rate.
        ledger: folder of the ledger files.
        async_quorum: the Manager's ``use_async_quorum``.
        init_sync: the Manager's ``init_sync``.
        group_reduce: how a replica group's ranks combine (``"sum"`` for one
            rank; ``"none"`` when each rank keeps its own vector).
        seed: the sampler's seed.
    """

    model: str
    dataset_len: int
    global_batch_size: int
    micro_batch_size: int
    steps: int
    lr: float
    ledger: str
    async_quorum: bool = False
    init_sync: bool = True
    group_reduce: str = "sum"
    seed: int = 0


# -- the models (the test recomputes the MLP's gradients with these) ----------------------------


def mlp_data(n: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed float32 inputs ``(n, 8)`` and targets ``(n, 1)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, MLP_IN, generator=g)
    a = torch.randn(MLP_IN, 1, generator=g)
    y = torch.sin(x @ a) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def mlp_init(seed: int = 99) -> torch.Tensor:
    """The MLP's initial flat float32 weights (the same in every replica)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(MLP_PARAMS, generator=g) * 0.3


def mlp_loss(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum over the rows of the squared error of ``tanh(x W1' + b1) W2' + b2``."""
    h = MLP_HIDDEN * MLP_IN
    w1 = theta[:h].view(MLP_HIDDEN, MLP_IN)
    b1 = theta[h : h + MLP_HIDDEN]
    w2 = theta[h + MLP_HIDDEN : h + 2 * MLP_HIDDEN].view(1, MLP_HIDDEN)
    b2 = theta[h + 2 * MLP_HIDDEN :]
    out = torch.tanh(x @ w1.T + b1) @ w2.T + b2
    return ((out - y) ** 2).sum()


def coords_loss(theta: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Sample ``i``'s loss is ``theta[i]``: its gradient is 1 at ``i`` and 0 elsewhere."""
    return theta[torch.tensor(ids, dtype=torch.long)].sum()


def accumulated_grad(
    theta: torch.Tensor, batches: list[list[int]], scale: float, data: Any
) -> torch.Tensor:
    """The gradient a rank accumulates over ``batches`` (one backward each), as the trainer does."""
    leaf = theta.detach().clone().requires_grad_(True)
    for ids in batches:
        _loss(leaf, ids, data, scale).backward()
    assert leaf.grad is not None
    return leaf.grad


def _loss(theta: torch.Tensor, ids: list[int], data: Any, scale: float) -> torch.Tensor:
    if data is None:
        return coords_loss(theta, ids) * scale
    x, y = data
    index = torch.tensor(ids, dtype=torch.long)
    return mlp_loss(theta, x[index], y[index]) * scale


# -- the trainer -------------------------------------------------------------------------------


class _Ledger:
    """This process's ledger file: one JSON line per ``write`` (a kill leaves whole lines)."""

    def __init__(self, folder: str, replica: int, group_rank: int, attempt: int) -> None:
        path = os.path.join(folder, f"r{replica}g{group_rank}a{attempt}.jsonl")
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._base = {"replica": replica, "group_rank": group_rank, "attempt": attempt}

    def write(self, **fields: Any) -> None:
        line = {**self._base, **fields, "time": round(time.time(), 3)}
        os.write(self._fd, (json.dumps(line) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def _die_while_serving(
    ctx: RankContext, manager: Any, ledger: _Ledger, stop: threading.Event
) -> None:
    """SIGKILL this process while a peer streams its state (the first server of the run only)."""

    def watch() -> None:
        lock = manager._checkpoint_transport._checkpoint_lock
        while not stop.is_set():
            if lock.readers > 0:
                if int(ctx.store().add("served_death", 1)) == 1:
                    ledger.write(killed="while_serving", step=manager.current_step())
                    os.kill(os.getpid(), signal.SIGKILL)
                return
            time.sleep(0.0005)

    threading.Thread(target=watch, name="die-while-serving", daemon=True).start()


def exact_train(
    ctx: RankContext,
    lighthouse: str,
    group_size: int,
    job: Job,
    actions_by_rank: dict[int, dict[str, Any]] | None = None,
    attempt: int = 0,
) -> dict[str, Any]:
    """Train ``job.steps`` committed steps with an ExactSampler; return what the test checks.

    ``actions_by_rank[rank]``:
    ``{"kill": point, "kill_at_step": n}`` SIGKILLs this process at ``point``
    (one of :data:`KILL_POINTS`) of the first step at or after ``n``;
    ``{"die_during_heal": True}`` SIGKILLs it when it loads a received state;
    ``{"die_while_serving": True}`` SIGKILLs it while a peer streams its
    state, from step 1 on (the run's first such server only);
    ``{"hold": {step: count}}`` waits at ``step`` (or the first step past
    it) until ``count`` replacements
    are up (the ``rejoined`` counter) and another group's quorum request
    waits at the lighthouse, so that a loaded machine cannot let the
    survivors finish before a replacement joins;
    ``{"ballast_mb": n}`` adds ``n`` MiB to the healed state (a longer transfer).
    """
    from ftdist.data import ExactSampler
    from ftdist.data.plan import plan_step
    from ftdist.manager import Manager
    from ftdist.process_group import ProcessGroupGloo

    torch.set_num_threads(1)  # the same kernels, in the same order, in every process
    actions = (actions_by_rank or {}).get(ctx.rank, {})
    replica, group_rank = divmod(ctx.rank, group_size)
    own_store, port = replica_store(ctx, replica, group_rank, attempt)
    ledger = _Ledger(job.ledger, replica, group_rank, attempt)
    data = mlp_data(job.dataset_len) if job.model == "mlp" else None
    initial = mlp_init() if data is not None else torch.zeros(job.dataset_len)
    theta = torch.nn.Parameter(initial.clone())
    optim = torch.optim.SGD([theta], lr=job.lr)
    ballast = torch.zeros(int(actions.get("ballast_mb", 0) * 2**20) // 4)
    timeout = timedelta(seconds=10)
    pg = ProcessGroupGloo(timeout=timeout)

    def load(sd: dict[str, Any]) -> None:
        if actions.get("die_during_heal"):
            ledger.write(killed="during_heal", step=manager.current_step())
            os.kill(os.getpid(), signal.SIGKILL)
        with torch.no_grad():
            theta.copy_(sd["theta"])
        optim.load_state_dict(sd["optim"])
        ballast.copy_(sd["ballast"])

    manager = Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=lambda: {
            "theta": theta.detach(),
            "optim": optim.state_dict(),
            "ballast": ballast,
        },
        min_replica_size=1,
        use_async_quorum=job.async_quorum,
        init_sync=job.init_sync,
        replica_id=f"replica{replica}",
        lighthouse_addr=lighthouse,
        rank=group_rank,
        world_size=group_size,
        store_addr="127.0.0.1",
        store_port=port,
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
    )
    sampler = ExactSampler(
        job.dataset_len,
        manager,
        global_batch_size=job.global_batch_size,
        micro_batch_size=job.micro_batch_size,
        seed=job.seed,
    )
    stop = threading.Event()
    holds = {int(k): int(v) for k, v in actions.get("hold", {}).items()}
    armed = False
    records: list[dict[str, Any]] = []
    failed: list[tuple[int, str]] = []

    def kill_here(point: str, step: int, **where: Any) -> None:
        if actions.get("kill") == point and step >= actions["kill_at_step"]:
            ledger.write(killed=point, step=step, **where)
            os.kill(os.getpid(), signal.SIGKILL)

    def hold(step: int, rejoined: int) -> None:
        harness, deadline = ctx.store(), time.monotonic() + 60
        while int(harness.add("rejoined", 0)) < rejoined:
            if time.monotonic() > deadline:
                raise TimeoutError(f"held at step {step}: replacement {rejoined} never came up")
            time.sleep(0.02)
        if not wait_for_quorum_request(lighthouse, f"replica{replica}:"):
            raise TimeoutError(f"held at step {step}: no other group asked for a quorum")

    if attempt > 0:
        ctx.store().add("rejoined", 1)  # a replacement is up: held survivors go on
    elif not wait_for_heartbeats(lighthouse, ctx.world_size // group_size):
        raise TimeoutError("not every replica group heartbeats the lighthouse")
    try:
        # Under an async quorum with init_sync, step 0 is the initial sync
        # and reads nothing: the data's steps begin at sampler.start_step.
        while manager.current_step() < job.steps + sampler.start_step:
            step = manager.current_step()
            for at in sorted(s for s in holds if s <= step):
                hold(step, holds.pop(at))
            if actions.get("die_while_serving") and not armed and step >= 1:
                # Not at step 0, whose init_sync serves too (and is over by
                # step 1: serving ends at should_commit).
                armed = True
                _die_while_serving(ctx, manager, ledger, stop)
            optim.zero_grad()
            try:
                manager.start_quorum()
            except (ValueError, TypeError):
                raise
            except Exception as exc:  # the synchronous quorum raises; the next step retries
                # Where the group rank that hosts the group's ManagerServer
                # killed itself before this one had its quorum, this one can
                # never have one: it dies at the same point, before its forward.
                kill_here("before_forward", step, quorum_failed=str(exc).splitlines()[0])
                failed.append((step, f"quorum: {exc}".splitlines()[0]))
                ledger.write(failed=failed[-1][1], step=step)
                if len(failed) > 30:
                    raise RuntimeError(f"too many failed steps: {failed}") from exc
                continue
            plan = sampler.plan()
            batches = sampler.micro_batches(plan)
            kill_here("before_forward", plan.step, participants=plan.participants)
            scale = plan.loss_scale("sum", job.group_reduce)
            for i, ids in enumerate(batches):
                if i == 1:
                    kill_here("between_micro_batches", plan.step, micro_batches=len(batches))
                _loss(theta, ids, data, scale).backward()
            assert theta.grad is not None
            local = theta.grad.detach().clone()
            manager.allreduce(theta.grad, reduce_op=dist.ReduceOp.SUM).wait()
            kill_here("after_allreduce", plan.step)
            # Every micro-batch trained, or the step fails everywhere.
            sampler.verify(plan)
            if not manager.should_commit():
                error = manager.errored()
                failed.append((step, str(error).splitlines()[0] if error else "vote failed"))
                ledger.write(failed=failed[-1][1], step=step)
                if len(failed) > 30:
                    raise RuntimeError(f"too many failed steps: {failed}")
                continue
            committed = manager.current_step() - 1
            if committed < sampler.start_step:
                optim.step()  # the initial sync step: a zero gradient
                continue
            whole = plan_step(
                committed,
                dataset_len=job.dataset_len,
                global_batch_size=job.global_batch_size,
                micro_batch_size=job.micro_batch_size,
                participants=1,
                participant_rank=0,
                start_step=sampler.start_step,
            )
            order = sampler.epoch_order(whole.epoch)
            share = [i for ids in batches for i in ids]
            ledger.write(
                step=committed - sampler.start_step,
                epoch=whole.epoch,
                ids=order[whole.start : whole.end],
                share=share,
                participants=plan.participants,
                participant_rank=plan.participant_rank,
                planned_step=plan.step,
            )
            if plan.participant_rank is not None and plan.step != committed:
                raise AssertionError(
                    f"replica {replica} read step {plan.step}'s samples {share} but committed "
                    f"step {committed}"
                )
            optim.step()
            if data is not None:
                records.append(
                    {
                        "step": committed,
                        "participants": plan.participants,
                        "participant_rank": plan.participant_rank,
                        "ids": order[whole.start : whole.end],
                        "batches": batches,
                        "local": local.tolist(),
                        "grad": theta.grad.tolist(),
                        "theta": theta.detach().tolist(),
                    }
                )
        # Leave together: one that exits while a peer still finishes its
        # last allreduce would look like a failure to that peer.
        harness = ctx.store()
        harness.add("done", 1)
        deadline = time.monotonic() + 60
        while int(harness.add("done", 0)) < ctx.world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        return {
            "replica": replica,
            "group_rank": group_rank,
            "attempt": attempt,
            "step": manager.current_step() - sampler.start_step,  # the data's steps
            "theta": theta.detach().tolist(),
            "failed": failed,
            "heals": [t.as_dict() for t in manager.heal_timelines],
            "records": records,
        }
    finally:
        stop.set()
        manager.shutdown()
        pg.shutdown()
        ledger.close()
        del own_store
