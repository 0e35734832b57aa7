"""
Every sample exactly once
=========================

:class:`ExactSampler` gives each rank of each replica group its samples for
the current step so that, whatever fails, every sample of an epoch is trained
on exactly once and every step's global batch is the one configured.
torchft's :class:`~ftdist.data.DistributedSampler` shards statically instead:
the shard of a group that is down is not read, and the global batch shrinks
with every group out (docs/data.md compares the two).

The plan is :mod:`ftdist.data.plan`'s pure rule, computed alike by every rank
from the Manager's committed step and the step's quorum; no communication.
The loop reads its micro-batches after ``zero_grad()`` (which starts the
quorum) and scales the summed loss::

    optimizer.zero_grad()
    plan = sampler.plan()                         # waits for the step's quorum
    batches = sampler.micro_batches(plan)
    for i, indices in enumerate(batches):
        x, y = collate([dataset[j] for j in indices])
        with ddp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
            (loss_fn(ddp(x), y, reduction="sum") * plan.loss_scale()).backward()
    sampler.verify(plan)                          # every micro-batch of the step was trained
    optimizer.step()                              # the cursor moves only if it commits

A group with fewer participants takes more micro-batches (gradient
accumulation): the global batch and the gradient's scale stay the same.
:meth:`ExactSampler.micro_batches` always returns at least one list, empty
when the group has nothing to read (healing, or more groups than
micro-batches), so that its backward still joins the step's allreduce.

The sampler registers its settings with the Manager: a healing group
receives them with the model, and replicas whose settings differ are caught
by the consistency check. The cursor itself needs no state of its own: it is
a function of the Manager's step, which moves only on commit and with a heal
at the vote; save :meth:`ExactSampler.state_dict` next to the model and
``manager.state_dict()`` to restart from disk at the exact position.

A step that fails (a group died mid-step) does not commit, so its positions
are issued again at the next step, split over the groups of the new quorum:
the dead group's micro-batches are taken over by the survivors, in an order
every group computes alike; nothing is dropped or read twice.

Groups commit or not on their own votes, so a group whose step fails while
it lives on (an error its code reported, a heal that could not load) would
leave its micro-batches out of a step the others commit. :meth:`ExactSampler.verify`
closes that gap: one small allreduce sums how many of the step's
micro-batches the groups trained (a group that failed contributes zeros), and
if the sum falls short every group records an error, so that no group
commits and the whole step is issued again.

With an asynchronous quorum and ``init_sync`` (the Manager's defaults), step
0 copies one group's initial state to every other, which trains nothing that
step: the sampler then starts its epochs at step 1 (``start_step``), and step
0 reads nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Sized
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed

from ftdist.data.plan import Cursor, StepPlan, cursor_at, plan_step
from ftdist.errors import DataCoverageError

if TYPE_CHECKING:
    from ftdist.manager import Manager

__all__ = ["ExactSampler"]

_SETTINGS = (
    "dataset_len",
    "global_batch_size",
    "micro_batch_size",
    "seed",
    "shuffle",
    "start_step",
)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


class ExactSampler:
    """Every sample exactly once per epoch, a constant global batch, under failures.

    Args:
        dataset: the dataset (anything with ``len``) or its length.
        manager: the replica group's Manager (its step is the cursor, its
            quorum splits the step).
        global_batch_size: samples per step over every participating group.
        micro_batch_size: samples per micro-batch, the unit groups share out
            (default ``global_batch_size``: one group reads the whole step);
            must divide ``global_batch_size``. More micro-batches than groups
            keeps every group busy.
        seed: seeds each epoch's permutation (epoch ``e``: ``seed + e``).
        shuffle: permute each epoch (False: dataset order).
        group_rank: this rank in its replica group (default: the Manager's).
        group_world_size: ranks in the replica group (default: the Manager's).
        start_step: the Manager step at which epoch 0 begins (a sampler added
            to a job that already trained); default 0, or 1 with an
            asynchronous quorum and ``init_sync`` (step 0 only copies the
            initial state).
        key: the name under which the sampler registers its settings with
            the Manager (two samplers of one Manager need two keys).

    Raises:
        TypeError: a size that is not an int, or a dataset without ``len``.
        ValueError: a size out of range, or ``micro_batch_size`` not dividing
            ``global_batch_size``; ``key`` already registered.
    """

    def __init__(
        self,
        dataset: Sized | int,
        manager: Manager,
        *,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        start_step: int | None = None,
        key: str = "ftdist.exact_sampler",
    ) -> None:
        if isinstance(dataset, int) and not isinstance(dataset, bool):
            length = dataset
        elif isinstance(dataset, Sized):
            length = len(dataset)
        else:
            raise TypeError(f"dataset must have a length (or be one), got {type(dataset).__name__}")
        self.dataset_len = _positive("dataset length", length)
        self.global_batch_size = _positive("global_batch_size", global_batch_size)
        self.micro_batch_size = _positive(
            "micro_batch_size", global_batch_size if micro_batch_size is None else micro_batch_size
        )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide global_batch_size "
                f"({self.global_batch_size}): each step is cut into whole micro-batches"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if start_step is None:
            # Under an async quorum, init_sync heals every group but one at
            # step 0: they train nothing, so step 0 cannot read a whole step.
            initial_sync = getattr(manager, "_use_async_quorum", False) and getattr(
                manager, "_init_sync", False
            )
            start_step = 1 if initial_sync else 0
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be a non-negative int, got {start_step!r}")
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.start_step = start_step
        config = getattr(manager, "_config", None)
        self.group_rank = group_rank if group_rank is not None else getattr(config, "group_rank", 0)
        self.group_world_size = (
            group_world_size
            if group_world_size is not None
            else getattr(config, "group_world_size", 1)
        )
        if not 0 <= self.group_rank < self.group_world_size:
            raise ValueError(
                f"group_rank must be in [0, {self.group_world_size}), got {self.group_rank}"
            )
        self._manager = manager
        self._lock = threading.Lock()
        self._order: tuple[int, torch.Tensor] | None = None
        manager.register_state_dict_fn(key, self._load_healed, self.state_dict)
        register_consistency = getattr(manager, "register_consistency_fn", None)
        if register_consistency is not None:
            # Replicas that would read different samples at the same step
            # (another seed, batch or dataset) disagree here and heal.
            register_consistency(key, self._settings)

    # -- the current step ----------------------------------------------------------------

    def plan(self) -> StepPlan:
        """This rank's plan for the step being trained.

        Waits for the step's quorum (the participants decide the split).

        Returns:
            The plan of :func:`ftdist.data.plan.plan_step`.
        """
        manager = self._manager
        participants = manager.num_participants()
        rank = manager.participating_rank()
        if rank is not None and not manager.is_participating():
            rank = None  # healing under an async quorum: it contributes zeros
        step = manager.current_step()
        if step < self.start_step:
            # Before the epochs begin (the initial sync): nothing to read.
            return StepPlan(step, -1, 0, 0, (), (0, 0), (), max(1, participants), rank, 1)
        return plan_step(
            step,
            dataset_len=self.dataset_len,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            participants=max(1, participants),
            participant_rank=rank,
            group_rank=self.group_rank,
            group_world_size=self.group_world_size,
            start_step=self.start_step,
        )

    def micro_batches(self, plan: StepPlan | None = None) -> list[list[int]]:
        """This rank's dataset indices for the step, one list per micro-batch.

        Args:
            plan: a plan from :meth:`plan` (default: a new one).

        Returns:
            At least one list; ``[[]]`` when the group reads nothing this step
            (run one empty backward so that the allreduce is joined).
        """
        plan = self.plan() if plan is None else plan
        order = self._epoch_order(plan.epoch)
        batches = [[int(order[p]) for p in positions] for positions in plan.positions]
        return batches or [[]]

    def verify(self, plan: StepPlan) -> bool:
        """Check that every micro-batch of the step was trained; if not,
        make the step fail everywhere so that it is issued again whole.

        Call it after the step's micro-batches (their backward) and before
        ``optimizer.step()``. It runs one allreduce of one number over the
        replica groups: how many of the step's micro-batches each took. A
        group whose step failed (its error makes it contribute zeros), or
        one that heals without training, counts none; if the total falls
        short, every group records an error and votes no.

        Args:
            plan: this step's plan, from :meth:`plan`.

        Returns:
            True when the count was whole (or the step has nothing to read);
            False when the step was made to fail.
        """
        manager = self._manager
        # Every group joins the allreduce, whatever its plan: a collective
        # that some groups skip would pair the wrong calls.
        taken = plan.taken[1] - plan.taken[0] if plan.participant_rank is not None else 0
        count = torch.tensor([float(taken)])
        manager.allreduce(count, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        expected = len(plan.micro_batches)
        if plan.participant_rank is None:
            # A group that heals (its plan is for the step it leaves) or
            # waits as a spare judges nothing; the participants do.
            return True
        if manager.errored() is not None:
            return False  # this step fails anyway (and the count said so to the others)
        if int(count.item()) == expected:
            return True
        manager.report_error(
            DataCoverageError(
                f"step {plan.step}: the replica groups trained {int(count.item())} of its "
                f"{expected} micro-batches (a group's step failed, or it heals without "
                "training); the step is issued again"
            )
        )
        return False

    @property
    def cursor(self) -> Cursor:
        """Where the next step reads: the epoch and the first uncommitted position."""
        step = max(self._manager.current_step(), self.start_step)
        return cursor_at(step, self.dataset_len, self.global_batch_size, self.start_step)

    def epoch_order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s ordering of the dataset's indices (for ledgers and tests)."""
        return [int(i) for i in self._epoch_order(epoch)]

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The settings, and the cursor at the Manager's current step.

        Save it with the model and ``manager.state_dict()``; the cursor is
        recorded for people and checks, the step is what moves it.
        """
        cursor = self.cursor
        return {**self._settings(), "epoch": cursor.epoch, "position": cursor.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the settings a checkpoint recorded (seed, start step, shuffle).

        Raises:
            ValueError: the checkpoint's dataset length or batch sizes differ
                from this sampler's: the positions would not line up (restart
                with the same ones), or its recorded cursor disagrees with
                the Manager's step (load ``manager.state_dict()`` first).
            KeyError: a setting is missing.
        """
        for name in ("dataset_len", "global_batch_size", "micro_batch_size"):
            if int(state_dict[name]) != getattr(self, name):
                raise ValueError(
                    f"the checkpoint's sampler has {name}={state_dict[name]}, this one "
                    f"{getattr(self, name)}: its positions would not line up; create the "
                    f"sampler with {name}={state_dict[name]}"
                )
        with self._lock:
            self.seed = int(state_dict["seed"])
            self.shuffle = bool(state_dict["shuffle"])
            self.start_step = int(state_dict["start_step"])
            self._order = None
        if "epoch" in state_dict and "position" in state_dict:
            cursor = self.cursor
            recorded = (int(state_dict["epoch"]), int(state_dict["position"]))
            if (cursor.epoch, cursor.position) != recorded:
                raise ValueError(
                    f"the checkpoint's sampler stood at epoch {recorded[0]} position "
                    f"{recorded[1]}, but the Manager's step {self._manager.current_step()} "
                    f"puts it at epoch {cursor.epoch} position {cursor.position}: load "
                    "manager.state_dict() from the same checkpoint first"
                )

    def _load_healed(self, state_dict: dict[str, Any]) -> None:
        # At a heal the step arrives with the state; the cursor follows it.
        self.load_state_dict({k: v for k, v in state_dict.items() if k in _SETTINGS})

    def _settings(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SETTINGS}

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        with self._lock:
            if self._order is not None and self._order[0] == epoch:
                return self._order[1]
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.dataset_len, generator=generator)
            else:
                order = torch.arange(self.dataset_len)
            self._order = (epoch, order)
            return order
