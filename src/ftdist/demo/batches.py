"""
What a replica group reads
==========================

The demo's two ways to feed a step, both a function of the Manager's step
so that a group that heals to step ``s`` reads step ``s``'s data:

* :class:`ExactBatches`: ftdist's :class:`~ftdist.data.ExactSampler`, the
  default. Every sample once per epoch and a constant global batch: the
  step's micro-batches are split over the step's quorum, and a step that
  does not commit is read again.
* :class:`ShardBatches`: torchft's :class:`~ftdist.data.DistributedSampler`,
  a static shard per group (``--sampler torchft``, DiLoCo, and the chaos
  suite's trainers).

:func:`backward` runs a step's micro-batches (a :class:`Reading`) through
DDP with the loss each sampler needs.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
from torch import nn

from ftdist.data import ExactSampler, StepPlan

__all__ = ["START_STEP", "ExactBatches", "Reading", "ShardBatches", "backward"]

# The exact sampler's epoch 0 begins here; step 0 is the initial sync.
START_STEP = 1


class Reading(NamedTuple):
    """What a group reads at a step.

    Attributes:
        step: the Manager's step it reads for.
        epoch: the data epoch (-1: a step before the exact sampler's
            start, the initial sync, which reads nothing).
        micro: the micro-batches, ``(x, y)`` each (at least one).
        ids: the dataset indices of all of them, in order.
        scale: the factor of the summed loss (the exact sampler's); None
            for the mean loss of one batch (torchft's sampler).
        plan: the exact sampler's plan of the step (None for torchft's).
    """

    step: int
    epoch: int
    micro: list[tuple[torch.Tensor, torch.Tensor]]
    ids: list[int]
    scale: float | None
    plan: StepPlan | None = None


class ShardBatches:
    """The batch of each step, from torchft's sampler, as a function of the step.

    A replica that heals to step s continues with step s's batch, so where the
    data stands is part of the committed state without being saved. Group
    rank ``group_rank`` of a replica group of ``group_size`` ranks reads its
    own shard (the chaos suite's groups have several ranks). With ``ledger``
    the loop records each step's samples (``take`` events).
    """

    def __init__(
        self,
        data: Any,
        replica: int,
        replicas: int,
        batch_size: int,
        seed: int,
        group_rank: int = 0,
        group_size: int = 1,
        ledger: bool = False,
    ) -> None:
        from ftdist.data import DistributedSampler

        self._data = data
        self._batch_size = batch_size
        self.ledger = ledger
        self._sampler = DistributedSampler(
            data,
            replica_rank=replica,
            num_replica_groups=replicas,
            group_rank=group_rank,
            num_replicas=group_size,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        self._per_epoch = max(1, len(self._sampler) // batch_size)
        self._epoch = -1
        self._order: list[int] = []

    def rows(self, step: int) -> list[int]:
        """The dataset indices of step ``step``'s batch."""
        epoch, index = divmod(step, self._per_epoch)
        if epoch != self._epoch:
            self._sampler.set_epoch(epoch)
            self._order = list(iter(self._sampler))
            self._epoch = epoch
        return self._order[index * self._batch_size : (index + 1) * self._batch_size]

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._data.tensors
        rows = self.rows(step)
        return x[rows], y[rows]

    def read(self, manager: Any, step: int) -> Reading:
        """Step ``step``'s one batch, whatever the quorum."""
        rows = self.rows(step)
        x, y = self._data.tensors
        return Reading(step, step // self._per_epoch, [(x[rows], y[rows])], rows, None)

    def verify(self, reading: Reading) -> None:
        """Nothing to check: a static shard is read whatever the others do."""


class ExactBatches:
    """The step's micro-batches from ftdist's :class:`~ftdist.data.ExactSampler`.

    The sampler's cursor is the Manager's committed step: a step that does
    not commit is read again, split over the next quorum, and a group that
    heals reads from the step it healed to.

    Step 0 reads nothing: the data starts at step :data:`START_STEP`. At
    step 0 every group but the first heals from it (``init_sync``) while
    counting among the step's participants: micro-batches given to them
    would be lost to a step that commits.
    """

    ledger = True

    def __init__(
        self, data: Any, manager: Any, global_batch_size: int, micro_batch_size: int, seed: int
    ) -> None:
        self._data = data
        self.sampler = ExactSampler(
            data,
            manager,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            seed=seed,
            group_rank=0,
            group_world_size=1,
            # Explicit, not the sampler's default for this Manager: the
            # ledger counts the epochs from it (ftdist.demo.worker.sampling).
            start_step=START_STEP,
        )

    def read(self, manager: Any, step: int) -> Reading:
        """This group's micro-batches of the step (waits for the step's quorum)."""
        plan = self.sampler.plan()
        batches = self.sampler.micro_batches(plan)
        x, y = self._data.tensors
        micro = []
        for ids in batches:
            index = torch.tensor(ids, dtype=torch.long)
            micro.append((x[index], y[index]))
        ids = [i for batch in batches for i in batch]
        return Reading(plan.step, plan.epoch, micro, ids, plan.loss_scale(), plan)

    def verify(self, reading: Reading) -> None:
        """Fail the step everywhere unless every micro-batch of it was trained.

        One allreduce of the micro-batches the groups took
        (:meth:`ftdist.data.ExactSampler.verify`), after the backward and
        before ``optimizer.step()``; every group joins it at every step.
        """
        assert reading.plan is not None, "a reading of ExactBatches has its plan"
        self.sampler.verify(reading.plan)


def backward(ddp: Any, reading: Reading) -> float:
    """Forward and backward over the step's micro-batches; the loss per sample.

    All but the last micro-batch accumulate under ``no_sync()``: the group
    joins the step's allreduce once. The exact sampler's summed loss is
    scaled so that the reduced gradient is the mean over the step's samples
    whatever the number of participants; a group with nothing to read runs
    its empty micro-batch all the same (its zeros join the allreduce) and
    reports no loss (NaN).
    """
    if reading.scale is None:
        ((x, y),) = reading.micro
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        return loss.item()
    total, count, last = 0.0, 0, len(reading.micro) - 1
    for i, (x, y) in enumerate(reading.micro):
        with ddp.no_sync() if i < last else contextlib.nullcontext():
            summed = nn.functional.cross_entropy(ddp(x), y, reduction="sum")
            (summed * reading.scale).backward()
        total += summed.item()
        count += len(y)
    return total / count if count else float("nan")
