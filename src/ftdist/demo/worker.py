"""
One replica group of the demo
=============================

:func:`replica_main` is the body of a replica-group process: a one-rank
replica group that trains the spiral classifier with ftdist's
``DistributedDataParallel`` and ``OptimizerWrapper`` under a
:class:`~ftdist.manager.Manager`, exactly as a user's training script would.
Its data comes from ftdist's ``ExactSampler`` (every sample once per epoch,
a constant global batch: the step's micro-batches are split over the step's
quorum) or, with ``sampler="torchft"`` and always under DiLoCo, from
torchft's ``DistributedSampler`` (a static shard per group).

It talks to the supervisor through two channels that survive its own
SIGKILL: it appends events (``up``, ``take``, ``step``, ``heal``, ``final``;
:mod:`ftdist.demo.events`) to its own events file, a flushed JSON line
each, and it reads ``stop_step`` from the run's TCPStore. Every replica
stops at that same committed step and reports the SHA-256 of its weights
and optimizer state there. The ``take`` lines (the samples of each step,
written before the backward) are the data ledger (:mod:`ftdist.demo.ledger`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftdist.data.plan import steps_per_epoch
from ftdist.demo import task
from ftdist.demo.batches import START_STEP, ExactBatches, Reading, ShardBatches, backward
from ftdist.demo.events import (
    EventLog,
    FinalEvent,
    HealEvent,
    StepEvent,
    TakeEvent,
    UpEvent,
    events_path,
)
from ftdist.demo.ledger import Sampling
from ftdist.launch.ranks import RankContext

STOP_KEY = "stop_step"
DONE_KEY = "done"
UP_KEY = "up"
START_WAIT_S = 60.0
# Finished replicas wait this long for the others (a straggler needs a quorum
# round, a heal and its failed last step, bounded by the 5 s step timeout).
FINISH_WAIT_S = 40.0
FINISH_ROUND_EVERY_S = 1.0
FINISH_ROUND_TIMEOUT = timedelta(seconds=3)
# DiLoCo's outer learning rate (Nesterov momentum 0.9, as in the paper).
OUTER_LR = 0.7
SAMPLERS = ("exact", "torchft")
# The chaos suite's trainers read torchft's way under this name.
_Batches = ShardBatches


@dataclass(frozen=True)
class WorkerConfig:
    """What every replica process of one run shares.

    Attributes:
        lighthouse: the lighthouse address.
        events_dir: where each process appends its events file.
        seed: data, sampling and initial-weight seed.
        replicas: number of replica groups (the sampler's shard count).
        run: a name unique to this run, prefixed to replica ids.
        step_interval_s: least wall time per step; 0 runs flat out.
        batch_size: samples per replica per step with every group in (the
            exact sampler's global batch is ``batch_size * replicas``).
        lr: AdamW learning rate.
        train_size: training points (a multiple of the global batch: every
            step of an epoch is whole).
        eval_size: held-out points.
        timeout_s: collective and transfer timeout of the Manager.
        algorithm: ``"ddp"`` or ``"diloco"`` (one demo step is then one
            sync of ``sync_every`` inner steps).
        sync_every: DiLoCo's inner steps per sync.
        sampler: ``"exact"`` (:class:`~ftdist.data.ExactSampler`) or
            ``"torchft"`` (:class:`~ftdist.data.DistributedSampler`);
            DiLoCo always reads torchft's way (docs/demo.md says why).
        micro_batch_size: the exact sampler's micro-batch: two per group
            and step with every group in, so that the survivors of a
            failure split a step evenly.
        init_replica: every first process starts from this replica group's
            initial weights instead of its own (the baseline: the weights
            the failure run's job began with, so that the two runs differ
            by the failures alone); None: each its own.
    """

    lighthouse: str
    events_dir: str
    seed: int
    replicas: int
    run: str
    step_interval_s: float = 0.0
    batch_size: int = 32
    lr: float = 5e-3
    train_size: int = 6144
    eval_size: int = 2000
    timeout_s: float = 5.0
    algorithm: str = "ddp"
    sync_every: int = 10
    sampler: str = "exact"
    micro_batch_size: int = 16
    init_replica: int | None = None


def sampling(cfg: WorkerConfig) -> Sampling | None:
    """How the run's groups read their data, for the ledger; None under DiLoCo.

    DiLoCo's inner steps read between the Manager's steps, which the ledger
    counts in; its run has no ledger.
    """
    if cfg.algorithm != "ddp":
        return None
    global_batch = cfg.batch_size * cfg.replicas
    if cfg.sampler == "exact":
        return Sampling(
            sampler="exact",
            dataset_len=cfg.train_size,
            groups=cfg.replicas,
            global_batch_size=global_batch,
            micro_batch_size=cfg.micro_batch_size,
            steps_per_epoch=steps_per_epoch(cfg.train_size, global_batch),
            start_step=START_STEP,
        )
    # ShardBatches' epoch: the group's drop_last shard in whole batches.
    return Sampling(
        sampler="torchft",
        dataset_len=cfg.train_size,
        groups=cfg.replicas,
        global_batch_size=global_batch,
        micro_batch_size=None,
        steps_per_epoch=max(1, (cfg.train_size // cfg.replicas) // cfg.batch_size),
    )


def _output_to(path: str) -> None:
    # Warnings of a replica under fire (Gloo's "connection reset by peer", the
    # Manager's recorded errors, C++ warnings) belong in its own log, not
    # across the supervisor's live view; fd-level so C++ output goes too.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        force=True,
        format="%(asctime)s %(name)s: %(message)s",
    )


def _leave_together(manager: Any, control: Any, replicas: int) -> None:
    """Stay until every replica group reached the stop step, then leave.

    A replica that exits while a peer still finishes its last step would
    look like a failure to that peer. And a replica left out of the last
    quorum (it was late) is behind the stop step, parked in a quorum that
    needs a majority: the finished ones join a quorum round now and then,
    without stepping, so that it can form and the straggler heals to the
    stop step from their memory.
    """
    control.add(DONE_KEY, 1)
    deadline = time.monotonic() + FINISH_WAIT_S
    last_round = time.monotonic()
    while int(control.add(DONE_KEY, 0)) < replicas and time.monotonic() < deadline:
        if time.monotonic() - last_round >= FINISH_ROUND_EVERY_S:
            try:
                manager.start_quorum(timeout=FINISH_ROUND_TIMEOUT)
                manager.wait_quorum()
            except Exception:  # a round that nobody else joins times out: fine
                pass
            last_round = time.monotonic()
        time.sleep(0.05)


def _load(model: nn.Module, optim: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    model.load_state_dict(sd["model"])
    optim.load_state_dict(sd["optim"])


def replica_main(ctx: RankContext, cfg: WorkerConfig, attempt: int) -> None:
    """Train as replica group ``ctx.rank`` until the supervisor's stop step.

    ``attempt`` counts the processes this replica group had before (0 for
    the first): a restart starts from fresh random weights, as a real one
    would, and must heal.

    Raises:
        RuntimeError: the Manager gave up (too many failed commits).
    """
    # Ctrl-C reaches the whole process group; the supervisor decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ftdist.manager import Manager
    from ftdist.process_group import ProcessGroupGloo

    replica = ctx.rank
    path = events_path(cfg.events_dir, replica, attempt)
    _output_to(path[: -len(".jsonl")] + ".log")
    torch.set_num_threads(1)
    log = EventLog(path)
    control = ctx.store(timedelta(seconds=30))
    train = task.make_spirals(cfg.train_size, cfg.seed)
    held_out = task.make_spirals(cfg.eval_size, cfg.seed + 1)
    # Each process starts from its own random weights: only the live heal
    # (init_sync at step 0, recovery later) makes the replicas agree. The
    # baseline's start from those its failure run began with.
    init = replica if cfg.init_replica is None or attempt else cfg.init_replica
    model = task.make_model(seed=cfg.seed * 1000 + init * 10 + attempt)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    own_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=cfg.timeout_s)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        load_state_dict=lambda sd: _load(model, optim, sd),
        state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        min_replica_size=1,
        replica_id=f"{cfg.run}replica{replica}",
        lighthouse_addr=cfg.lighthouse,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=own_store.port,
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        # DiLoCo needs a heal applied before it takes its pseudo-gradients.
        use_async_quorum=cfg.algorithm != "diloco",
    )
    batches: ShardBatches | ExactBatches
    if cfg.algorithm == "ddp" and cfg.sampler == "exact":
        # Before the first quorum: the sampler registers its settings with
        # the Manager (a healing group receives them, a differing one heals).
        batches = ExactBatches(
            train, manager, cfg.batch_size * cfg.replicas, cfg.micro_batch_size, cfg.seed
        )
    else:
        ddp = cfg.algorithm == "ddp"
        batches = ShardBatches(train, replica, cfg.replicas, cfg.batch_size, cfg.seed, ledger=ddp)
    log.write(UpEvent(pid=os.getpid(), attempt=attempt, replica_id=manager.replica_id()))
    if attempt == 0:
        # Start together, as a job does: the first quorum then holds every
        # replica group instead of whichever process the machine ran first.
        control.add(UP_KEY, 1)
        deadline = time.monotonic() + START_WAIT_S
        while int(control.add(UP_KEY, 0)) < cfg.replicas and time.monotonic() < deadline:
            time.sleep(0.02)
    try:
        if cfg.algorithm == "diloco":
            assert isinstance(batches, ShardBatches)
            digest, what = _train_diloco(cfg, manager, model, optim, batches, control, log)
        else:
            train_ddp(manager, model, optim, batches, control, log, cfg.step_interval_s)
            digest, what = task.state_hash(model, optim), "weights and optimizer state"
        eval_loss, accuracy = task.evaluate(model, held_out)
        log.write(
            FinalEvent(
                step=manager.current_step(),
                hash=digest,
                what=what,
                eval_loss=eval_loss,
                accuracy=accuracy,
            )
        )
        _leave_together(manager, control, cfg.replicas)
    finally:
        manager.shutdown(wait=False)
        pg.shutdown()
        log.close()
        del own_store


def _emit_step(
    log: EventLog, manager: Any, step: int, committed: bool, loss: float, timelines: list[Any]
) -> None:
    error = manager.errored()
    log.write(
        StepEvent(
            step=step,
            ok=committed,
            loss=loss,
            quorum_id=manager.quorum_id(),
            participants=manager.num_participants(),
            participating=manager.is_participating(),
            error=str(error).splitlines()[0] if error and not committed else None,
        )
    )
    for timeline in timelines:
        log.write(HealEvent(**timeline.as_dict()))


def log_step(
    log: EventLog, manager: Any, step: int, loss: torch.Tensor | float, heals_seen: int
) -> int:
    """Log a finished step (and the heals since ``heals_seen``) as events.

    Returns:
        How many heal timelines have been logged now.
    """
    timelines = manager.heal_timelines[heals_seen:]
    _emit_step(log, manager, step, manager.current_step() > step, float(loss), timelines)
    return heals_seen + len(timelines)


def _take(log: EventLog, manager: Any, reading: Reading) -> None:
    """Record the step's samples before the backward can contribute them.

    A group killed after its gradient reached the step's allreduce (and
    before its ``step`` line) has still written this: the ledger counts its
    samples when the step commits.
    """
    # First: it waits for the step's quorum, whose id is then the step's.
    # A healing group's gradient is zeros.
    participating = manager.is_participating()
    log.write(
        TakeEvent(
            step=reading.step,
            quorum_id=manager.quorum_id(),
            epoch=reading.epoch,
            participating=participating,
            ids=reading.ids,
        )
    )


def _read_stop(control: Any, stop: int | None) -> int | None:
    if stop is None and control.check([STOP_KEY]):
        return int(control.get(STOP_KEY))  # set once per run: read it once
    return stop


def train_ddp(
    manager: Any,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    batches: ShardBatches | ExactBatches,
    control: Any,
    log: EventLog,
    step_interval_s: float,
) -> None:
    """Train with one allreduce of the gradients per step until the stop step.

    Each step takes at least ``step_interval_s``; each is logged to ``log``
    (:func:`log_step`), with its samples first when ``batches.ledger``, and
    checked (``batches.verify``) before it commits. The stop step is read
    from ``control`` (``STOP_KEY``).
    """
    from ftdist.ddp import DistributedDataParallel
    from ftdist.optim import OptimizerWrapper

    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, optim)
    heals_seen = 0
    stop: int | None = None
    while True:
        began = time.monotonic()
        step = manager.current_step()
        stop = _read_stop(control, stop)
        if stop is not None and step >= stop:
            break
        opt.zero_grad()
        reading = batches.read(manager, step)
        if batches.ledger and reading.epoch >= 0:
            _take(log, manager, reading)
        loss = backward(ddp, reading)
        batches.verify(reading)
        opt.step()
        heals_seen = log_step(log, manager, step, loss, heals_seen)
        spare = step_interval_s - (time.monotonic() - began)
        if spare > 0:
            time.sleep(spare)


def _train_diloco(
    cfg: WorkerConfig,
    manager: Any,
    model: nn.Module,
    inner: torch.optim.Optimizer,
    batches: ShardBatches,
    control: Any,
    log: EventLog,
) -> tuple[str, str]:
    """DiLoCo: ``sync_every`` local AdamW steps per demo step, then a sync.

    Each sync is one demo step (one Manager step); its loss is the mean of
    the inner steps' losses. A replica that heals takes the data of the
    step it heals to, as the DDP loop does.

    Returns:
        The hash of the global state at the stop step, and what it covers.
    """
    from ftdist.local_sgd import DiLoCo

    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=0.9, nesterov=True)
    diloco = DiLoCo(manager, model, inner, outer, sync_every=cfg.sync_every)
    heals_seen = 0
    stop: int | None = None
    losses: list[float] = []
    interval = cfg.step_interval_s / cfg.sync_every
    with diloco:
        while True:
            began = time.monotonic()
            step, local = manager.current_step(), diloco._local_step
            if local == 0:
                stop = _read_stop(control, stop)
                if stop is not None and step >= stop:
                    break
            x, y = batches(step * cfg.sync_every + local)
            inner.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
            inner.step()  # the last inner step of a period also syncs
            if diloco._local_step == 0:
                timelines = manager.heal_timelines[heals_seen:]
                heals_seen += len(timelines)
                healed = [t.step for t in timelines if t.role == "receive"]
                sync_step = healed[-1] if healed else step
                committed = manager.current_step() == sync_step + 1
                _emit_step(log, manager, sync_step, committed, sum(losses) / len(losses), timelines)
                losses = []
            spare = interval - (time.monotonic() - began)
            if spare > 0:
                time.sleep(spare)
    digest = task.weights_hash(diloco.original_parameters, outer)
    return digest, "global weights and outer optimizer state"
