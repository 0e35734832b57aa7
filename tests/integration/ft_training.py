"""A small fault-tolerant training loop run by the Manager tests, in real processes.

Process ``i`` of a harness run is group rank ``i % group_size`` of replica
group ``i // group_size``. Each replica group hosts its own TCPStore (its
"torchrun" store) in group rank 0 and publishes the port in the harness
store. Every replica starts from different random weights; ``init_sync``
heals them all from one primary at step 0.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftdist.launch.ranks import RankContext
from tests.integration.lighthouse_helpers import wait_for_heartbeats, wait_for_quorum_request


def model_and_optim(seed: int, batchnorm: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    if batchnorm:
        # Running statistics follow each replica's own data: they differ
        # between replicas, legitimately.
        model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
    else:
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def state_hash(model: nn.Module, optim: torch.optim.Optimizer, buffers: bool = True) -> str:
    """SHA-256 of the weights (and buffers) and the optimizer state."""
    h = hashlib.sha256()
    tensors = model.state_dict().values() if buffers else model.parameters()
    for t in list(tensors):
        h.update(t.detach().numpy().tobytes())
    for st in optim.state_dict()["state"].values():
        for v in st.values():
            h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()[:16]


def batch(step: int, replica: int, group_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + replica * 10 + group_rank)
    return torch.randn(16, 8, generator=g)


def _die_while_serving(ctx: RankContext, manager: Any) -> None:
    """SIGKILL this process while a peer streams its state (first server only)."""
    import threading

    def watch() -> None:
        lock = manager._checkpoint_transport._checkpoint_lock
        while True:
            if lock._readers > 0:
                if int(ctx.store().add("served_death", 1)) == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                return
            time.sleep(0.0005)

    threading.Thread(target=watch, daemon=True).start()


def replica_store(
    ctx: RankContext, replica: int, group_rank: int, attempt: int
) -> tuple[dist.TCPStore | None, int]:
    """The replica group's own store: group rank 0 hosts it (a new one per attempt)."""
    harness = ctx.store()
    key = f"replica{replica}/attempt{attempt}/store_port"
    if group_rank == 0:
        own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        harness.set(key, str(own.port))
        return own, own.port
    return None, int(harness.get(key))


def one_rank_manager(
    pg: Any,
    lighthouse: str,
    store_port: int,
    replica_id: str,
    load_state_dict: Any = None,
    state_dict: Any = None,
    **kwargs: Any,
) -> Any:
    """A Manager for a replica group of one rank on this host, whose store
    listens at ``store_port``; ``kwargs`` add to or override the defaults
    (``min_replica_size=1``, a 10 s timeout)."""
    from ftdist.manager import Manager

    settings: dict[str, Any] = {"min_replica_size": 1, "timeout": timedelta(seconds=10), **kwargs}
    return Manager(
        pg,
        load_state_dict,
        state_dict,
        replica_id=replica_id,
        lighthouse_addr=lighthouse,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store_port,
        hostname="127.0.0.1",
        **settings,
    )


def train(
    ctx: RankContext,
    lighthouse: str,
    group_size: int,
    steps: int,
    actions_by_rank: dict[int, dict[str, Any]] | None = None,
    attempt: int = 0,
    pg_kind: str = "gloo",
    transport: str = "http",
) -> dict[str, Any]:
    """Train until ``steps`` steps are committed; return what the test checks.

    ``actions_by_rank[rank]``: ``{"die_at_step": n}`` SIGKILLs this process once the manager
    reaches step n or later (a rank that joined late may heal past n), mid-allreduce when
    ``"mid_allreduce"`` is set;
    ``{"die_during_heal": True}`` SIGKILLs it while it receives a heal;
    ``{"hold_until_rejoin_at": n}`` waits at step n until a replacement is up
    (the ``rejoined`` counter) and another group's quorum request waits at the
    lighthouse (unless ``"hold_for_request"`` is False: a pause, not a hold);
    ``{"later_holds": {step: count}}`` holds again at each step until ``count``
    replacements are up;
    ``{"lazy_mb": n}`` keeps an n MiB tensor in the state that, like an
    optimizer's momentum, exists only once the replica has committed a step
    (a fresh replacement lacks it until its heal brings it).
    """
    from ftdist.checkpointing import PGTransport
    from ftdist.ddp import DistributedDataParallel
    from ftdist.manager import Manager
    from ftdist.optim import OptimizerWrapper
    from ftdist.process_group import ProcessGroupBabyGloo, ProcessGroupGloo

    actions = (actions_by_rank or {}).get(ctx.rank, {})
    if os.environ.get("FTDIST_LOG"):
        import logging

        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s r{ctx.rank} %(name)s: %(message)s"
        )
    replica, group_rank = divmod(ctx.rank, group_size)
    own_store, port = replica_store(ctx, replica, group_rank, attempt)
    model, optim = model_and_optim(
        seed=actions.get("seed", 100 * replica + 7 * attempt + group_rank),
        batchnorm=actions.get("batchnorm", False),
    )
    timeout = timedelta(seconds=actions.get("timeout_s", 10))
    commit_times: list[float] = []
    corrupted: list[bool] = []
    errors: list[str] = []
    held: list[bool] = []
    served_before = 0
    pg = ProcessGroupGloo(timeout=timeout) if pg_kind == "gloo" else ProcessGroupBabyGloo(timeout)

    ballast = torch.zeros(int(actions.get("ballast_mb", 0) * 2**20) // 4)
    lazy: dict[str, torch.Tensor] = {}
    lazy_numel = int(actions.get("lazy_mb", 0) * 2**20) // 4

    # Per load: (this replica had never committed, the heal was received
    # straight into its own tensors); the Manager's step moves after the load.
    loads: list[tuple[bool, bool]] = []

    def load(sd: dict[str, Any]) -> None:
        if actions.get("die_during_heal"):
            os.kill(os.getpid(), signal.SIGKILL)
        mine = model.state_dict()
        in_place = all(v.data_ptr() == mine[k].data_ptr() for k, v in sd["model"].items())
        loads.append((manager.current_step() == 0, in_place))
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])
        ballast.copy_(sd["ballast"])
        lazy.clear()
        lazy.update(sd["lazy"])
        if actions.get("stale_lr_on_heal"):
            # The classic bug: a load function that forgets the schedule.
            optim.param_groups[0]["lr"] = 0.5

    committed: list[int] = []
    quorums: list[tuple[int, int, list[str]]] = []
    manager = Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=lambda: {
            "model": model.state_dict(),
            "optim": optim.state_dict(),
            "ballast": ballast,
            "lazy": lazy,
        },
        min_replica_size=1,
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
        checkpoint_transport=PGTransport(pg, timeout) if transport == "pg" else None,
        max_retries=actions.get("max_retries"),
        init_sync=actions.get("init_sync", True),
        **actions.get("manager_kwargs", {}),
    )
    if attempt > 0:
        ctx.store().add("rejoined", 1)  # a replacement is up: held survivors go on
    elif not wait_for_heartbeats(lighthouse, ctx.world_size // group_size):
        # Start together: a group that starts late on a loaded machine misses
        # the first quorums (min_replica_size=1 lets the others go on), and a
        # victim that dies before it joins leaves nobody to heal from, so its
        # replacement starts a second run from step 0.
        raise TimeoutError("not every replica group heartbeats the lighthouse")
    if actions.get("die_while_serving"):
        _die_while_serving(ctx, manager)
    if actions.get("pure_ddp"):
        from ftdist.ddp import PureDistributedDataParallel

        ddp: nn.Module = PureDistributedDataParallel(manager, model)
    else:
        ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, optim)
    loss_fn = nn.MSELoss()
    attempts = 0
    later_holds = {int(k): v for k, v in actions.get("later_holds", {}).items()}

    def hold(step: int, rejoined: int) -> None:
        # Wait (not training) until a replacement started and asks for a
        # quorum, so that a loaded machine cannot let this survivor finish
        # alone first.
        harness, deadline = ctx.store(), time.monotonic() + 60
        while int(harness.add("rejoined", 0)) < rejoined and time.monotonic() < deadline:
            time.sleep(0.02)
        if actions.get("hold_for_request", True) and not wait_for_quorum_request(
            lighthouse, f"replica{replica}:"
        ):
            raise TimeoutError(f"held at step {step}: no other group asked for a quorum")

    try:
        stop_at = actions.get("stop_at", steps)
        while manager.current_step() < stop_at:
            attempts += 1
            step = manager.current_step()
            if actions.get("hold_until_rejoin_at") == step and not held:
                held.append(True)
                served_before = len(manager.heal_timelines)
                ctx.store().add("holding", 1)  # tests may wait for this before a restart
                hold(step, 1)
            if step in later_holds:
                hold(step, later_holds.pop(step))
            die = actions.get("die_at_step")
            die_now = die is not None and step >= die
            if die_now and not actions.get("mid_allreduce"):
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            x = batch(step, replica, group_rank)
            loss = loss_fn(ddp(x), x.sum(dim=1, keepdim=True))
            if die_now and actions.get("mid_allreduce"):
                manager.wait_quorum()
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            before = manager.current_step()
            error = manager.errored()
            opt.step()
            if manager.current_step() == before:
                error = error or manager.errored()
                errors.append(str(error).splitlines()[0] if error else "vote failed")
            if manager.current_step() > before:
                # The step that committed (a heal applied at the vote jumps
                # the counter to the source's step first).
                committed.append(manager.current_step() - 1)
                commit_times.append(time.time())
                if lazy_numel:
                    # Steps of its own after a heal, like a momentum buffer.
                    lazy.setdefault("buf", torch.arange(lazy_numel, dtype=torch.float32)).add_(1)
                # Under which quorum: one id must never name two memberships.
                quorums.append(
                    (committed[-1], manager.quorum_id(), list(manager._membership.members))
                )
                # Only a heal served to the replacement (after the hold)
                # counts, not the initial step-0 sync.
                served = any(t.role == "send" for t in manager.heal_timelines[served_before:])
                if actions.get("corrupt_at_step") == committed[-1] and not corrupted:
                    # Silent corruption (a bit flip, say): the next
                    # fingerprint comparison must show this replica apart.
                    corrupted.append(True)
                    with torch.no_grad():
                        next(model.parameters()).add_(1e-3)
                if actions.get("corrupt_after_heal") and held and served and not corrupted:
                    # Silent corruption right after serving a heal: the next
                    # quorum's fingerprint comparison must catch it.
                    corrupted.append(True)
                    with torch.no_grad():
                        next(model.parameters()).add_(1e-3)
            if actions.get("step_sleep_s"):
                time.sleep(actions["step_sleep_s"])
        # Leave together: a replica that exits while a peer still finishes its
        # last allreduce would look like a failure to that peer.
        harness = ctx.store()
        harness.add(f"done/{steps}", 1)
        deadline = time.monotonic() + 60
        while int(harness.add(f"done/{steps}", 0)) < actions.get("finishers", ctx.world_size):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return {
            "replica": replica,
            "group_rank": group_rank,
            "hash": state_hash(model, optim, buffers=not actions.get("batchnorm")),
            "step": manager.current_step(),
            "batches": manager.batches_committed(),
            "committed": committed,
            "quorums": quorums,
            "attempts": attempts,
            "commit_times": commit_times,
            "errors": errors,
            "heals": [t.as_dict() for t in manager.heal_timelines],
            "loads": loads,
            "lazy": hashlib.sha256(lazy["buf"].numpy().tobytes()).hexdigest() if lazy else None,
        }
    finally:
        manager.shutdown()
        pg.shutdown()
        del own_store


def assert_one_membership_per_quorum_id(results: list[dict[str, Any]]) -> None:
    """No quorum id named two memberships, over every trainer's recorded commits."""
    seen: dict[int, tuple[str, ...]] = {}
    for result in results:
        for step, quorum_id, members in result["quorums"]:
            key = tuple(members)
            assert seen.setdefault(quorum_id, key) == key, (
                f"quorum {quorum_id} named two memberships: {seen[quorum_id]} and {key} "
                f"(step {step})"
            )
