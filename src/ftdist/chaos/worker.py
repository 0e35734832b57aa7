"""
One trainer of the chaos suite
==============================

:func:`rank_main` is the body of one trainer process: group rank ``r`` of
replica group ``g``, training the demo's spiral classifier
(:mod:`ftdist.demo.task`) with ftdist's ``DistributedDataParallel``,
``OptimizerWrapper`` and ``DistributedSampler`` under a
:class:`~ftdist.manager.Manager`, as a user's script would. Group rank
``r`` of every group forms one data-parallel world (the replicated
dimension of HSDP): each group rank holds its own part of the state.

What it adds to the demo's worker:

* it enters its group's network namespace first
  (:mod:`ftdist.chaos.netns`), so partitions cut real sockets;
* group rank 0 hosts the group's store ("torchrun's"); the others find
  its port in the run's control store;
* the state carries ballast (random bytes, seeded per process) so that a
  heal's transfer lasts long enough to be struck in the middle;
* its checkpoint transport logs each heal as it starts (``heal_start``,
  naming the source's address), which is how the supervisor sees a heal
  in progress;
* it records the quorum of every step it commits
  (:class:`~ftdist.chaos.quorums.CommitLog`), for the quorum-id check.

Events (:mod:`ftdist.demo.events`: JSON lines, flushed per line) go to
the events file of its global rank and attempt, as in the demo: ``up``,
``step``, ``heal_start``, ``serve``, ``heal``, ``final``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftdist.chaos import schedule
from ftdist.checkpointing import CheckpointTransport
from ftdist.demo import task
from ftdist.demo.events import (
    EventLog,
    FinalEvent,
    HealStartEvent,
    ServeEvent,
    UpEvent,
    events_path,
)
from ftdist.demo.worker import (
    DONE_KEY,
    STOP_KEY,
    UP_KEY,
    _Batches,
    _leave_together,
    _output_to,
    train_ddp,
)
from ftdist.launch.ranks import RankContext
from ftdist.process_group._store import host_store

START_WAIT_S = 90.0
STORE_WAIT = timedelta(seconds=30)

__all__ = ["DONE_KEY", "STOP_KEY", "ChaosWorkerConfig", "rank_main"]


@dataclass(frozen=True)
class ChaosWorkerConfig:
    """What every trainer of one chaos run shares.

    Attributes:
        lighthouse: the lighthouse address.
        events_dir: where each process appends its events file.
        seed: data, sampling, weight and ballast seed.
        groups: replica groups.
        group_size: ranks per replica group.
        run: a name unique to this run, prefixed to replica ids.
        control_host: where the run's control store is reached.
        hosts: each group's address (what its peers dial).
        namespaces: each group's network namespace; empty to stay in this one.
        step_interval_s: least wall time per step.
        ballast_mb: MiB of extra state per trainer (moved by every heal).
        quorums_dir: where each process records the quorum of each commit
            (:mod:`ftdist.chaos.quorums`); "" for nowhere.
        timeout_s: the Manager's collective and transfer timeout.
        quorum_timeout_s: the Manager's quorum timeout.
        connect_timeout_s: the Manager's connect timeout.
        batch_size: samples per trainer per step.
        lr: AdamW learning rate.
        train_size: training points.
        eval_size: held-out points.
    """

    lighthouse: str
    events_dir: str
    seed: int
    groups: int
    group_size: int
    run: str
    control_host: str = "127.0.0.1"
    hosts: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    step_interval_s: float = 0.2
    ballast_mb: float = 32.0
    quorums_dir: str = ""
    timeout_s: float = schedule.COLLECTIVE_TIMEOUT_S
    quorum_timeout_s: float = 15.0
    connect_timeout_s: float = 5.0
    batch_size: int = 32
    lr: float = 5e-3
    train_size: int = 6000
    eval_size: int = 2000

    @property
    def world_size(self) -> int:
        """Trainer processes in all."""
        return self.groups * self.group_size


class ObservedTransport(CheckpointTransport[Any]):
    """A checkpoint transport that logs each heal as it starts.

    Everything is done by ``inner``; ``recv_checkpoint`` first logs a
    ``heal_start`` event naming the source (its checkpoint address), and
    ``send_checkpoint`` a ``serve`` event. ``last_transfer`` follows the
    inner transport's (the heal timelines read it).
    """

    def __init__(self, inner: Any, log: EventLog) -> None:
        self._inner = inner
        self._log = log

    def metadata(self) -> str:
        """The inner transport's metadata."""
        return str(self._inner.metadata())

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        """Log, then serve through the inner transport.

        Raises:
            CheckpointError: the inner transport's.
        """
        self._log.write(ServeEvent(step=step, dst=list(dst_ranks)))
        try:
            self._inner.send_checkpoint(dst_ranks, step, state_dict, timeout)
        finally:
            self.last_transfer = self._inner.last_transfer

    def disallow_checkpoint(self) -> None:
        """The inner transport's."""
        self._inner.disallow_checkpoint()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Log the heal's start, then receive through the inner transport.

        Raises:
            CheckpointError: the inner transport's.
            TimeoutError: the inner transport's.
        """
        self._log.write(HealStartEvent(step=step, src_rank=src_rank, source=metadata))
        try:
            return self._inner.recv_checkpoint(src_rank, metadata, step, timeout)
        finally:
            self.last_transfer = self._inner.last_transfer

    def shutdown(self, wait: bool = True) -> None:
        """The inner transport's."""
        self._inner.shutdown(wait)


def _group_store(
    control: Any, host: str, group: int, rank: int, attempt: int
) -> tuple[dist.TCPStore | None, int]:
    key = f"group{group}/attempt{attempt}/store_port"
    if rank == 0:
        # On the group's address only: peers reach it there, nobody else.
        own = host_store(host, STORE_WAIT)
        control.set(key, str(own.port))
        return own, int(own.port)
    return None, int(control.get(key))


def final_hash(model: nn.Module, optim: torch.optim.Optimizer, ballast: torch.Tensor) -> str:
    """SHA-256 over the weights, the optimizer state and the ballast."""
    h = hashlib.sha256(task.state_hash(model, optim).encode())
    h.update(ballast.numpy().tobytes())
    return h.hexdigest()


def rank_main(ctx: RankContext, cfg: ChaosWorkerConfig, attempt: int) -> None:
    """Train as trainer ``ctx.rank`` until the supervisor's stop step.

    ``attempt`` counts the group's previous processes: a restart starts
    from fresh random weights and ballast, as a real one would, and heals.

    Raises:
        OSError: the namespace or the events file cannot be entered or written.
    """
    group, rank = divmod(ctx.rank, cfg.group_size)
    if cfg.namespaces:
        from ftdist.chaos.netns import INNER_IFNAME, enter

        enter(cfg.namespaces[group])
        # Gloo binds where the host name resolves (loopback here): point it
        # at the namespace's link instead.
        os.environ["GLOO_SOCKET_IFNAME"] = INNER_IFNAME
    host = cfg.hosts[group] if cfg.hosts else "127.0.0.1"
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ftdist.checkpointing import HTTPTransport
    from ftdist.manager import Manager
    from ftdist.process_group import ProcessGroupGloo

    path = events_path(cfg.events_dir, ctx.rank, attempt)
    _output_to(path[: -len(".jsonl")] + ".log")
    torch.set_num_threads(1)
    # Written by the training and the quorum threads (the transport's events).
    log: EventLog
    if cfg.quorums_dir:
        from ftdist.chaos.quorums import CommitLog

        log = commits = CommitLog(path, events_path(cfg.quorums_dir, ctx.rank, attempt))
    else:
        log, commits = EventLog(path), None
    tcp = dist.TCPStore(
        cfg.control_host,
        ctx.store_port,
        is_master=False,
        wait_for_workers=False,
        timeout=STORE_WAIT,
    )
    control = dist.PrefixStore(ctx.prefix, tcp)
    own_store, port = _group_store(control, host, group, rank, attempt)
    train = task.make_spirals(cfg.train_size, cfg.seed)
    held_out = task.make_spirals(cfg.eval_size, cfg.seed + 1)
    batches = _Batches(train, group, cfg.groups, cfg.batch_size, cfg.seed, rank, cfg.group_size)
    process_seed = cfg.seed * 1000 + group * 100 + rank * 10 + attempt
    model = task.make_model(seed=process_seed)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    ballast = torch.randn(
        int(cfg.ballast_mb * 2**20) // 4, generator=torch.Generator().manual_seed(process_seed)
    )

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])
        ballast.copy_(sd["ballast"])

    timeout = timedelta(seconds=cfg.timeout_s)
    transport = ObservedTransport(HTTPTransport(timeout, hostname=host), log)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=lambda: {
            "model": model.state_dict(),
            "optim": optim.state_dict(),
            "ballast": ballast,
        },
        min_replica_size=1,
        replica_id=f"{cfg.run}group{group}",
        lighthouse_addr=cfg.lighthouse,
        rank=rank,
        world_size=cfg.group_size,
        store_addr=host,
        store_port=port,
        hostname=host,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
        connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
        checkpoint_transport=transport,
    )
    if commits is not None:
        commits.manager = manager
    log.write(
        UpEvent(
            pid=os.getpid(),
            attempt=attempt,
            group=group,
            rank=rank,
            checkpoint=transport.metadata(),
            replica_id=manager.replica_id(),
        )
    )
    if attempt == 0:
        # Start together: the first quorum then holds every group.
        control.add(UP_KEY, 1)
        deadline = time.monotonic() + START_WAIT_S
        while int(control.add(UP_KEY, 0)) < cfg.world_size and time.monotonic() < deadline:
            time.sleep(0.02)
    try:
        train_ddp(manager, model, optim, batches, control, log, cfg.step_interval_s)
        eval_loss, accuracy = task.evaluate(model, held_out)
        log.write(
            FinalEvent(
                step=manager.current_step(),
                hash=final_hash(model, optim, ballast),
                eval_loss=eval_loss,
                accuracy=accuracy,
            )
        )
        _leave_together(manager, control, cfg.world_size)
    finally:
        manager.shutdown(wait=False)
        pg.shutdown()
        log.close()
        del own_store
