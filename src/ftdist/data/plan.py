"""
Exact data plan
===============

The pure rule behind :class:`~ftdist.data.exact.ExactSampler`: which samples
a rank reads at a step, given only the committed step, the dataset's size,
the batch sizes, the step's quorum and the rank's place in it. Every rank of
every replica group computes the same plan without communicating; nothing
here reads a clock, a socket or a random source.

The rule:

* An **epoch** is one ordering of the dataset's positions (a seeded
  permutation, applied by the sampler), the same whatever the number of
  replica groups. It takes ``ceil(N / G)`` steps for ``N`` samples and a
  global batch ``G``; the last one is short when ``G`` does not divide ``N``
  (a short step, never dropped).
* The **cursor** is a function of the committed step: step ``s`` (counted
  from ``start_step``) owns positions ``[c, c + G)`` of epoch
  ``s // steps_per_epoch``, ``c = (s % steps_per_epoch) * G``. The Manager's
  step moves only on commit and moves with a heal at the vote, so the cursor
  does too: a step that does not commit re-issues the same positions, and a
  healed group or a job restarted from a checkpoint resumes at the exact
  position.
* A step's range is cut into **micro-batches** of ``m`` positions (the last
  one shorter in a short step). Participant ``p`` of ``P`` takes micro-batches
  ``[floor(p*M/P), floor((p+1)*M/P))`` of the ``M``; a group that is not
  participating (healing, a spare) takes none. Inside a group, its ``R``
  ranks split each micro-batch the same way.
* The **loss scale** makes the reduced gradient the mean over the step's
  samples whatever ``P``: a rank multiplies the *sum* of its samples' losses
  by ``P * R / size`` when the Manager averages over the participants and
  the group averages over its ranks (``AVG`` both), dividing by whichever of
  ``P`` and ``R`` is summed instead.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Cursor",
    "StepPlan",
    "cursor_at",
    "plan_step",
    "share",
    "steps_per_epoch",
]


def steps_per_epoch(dataset_len: int, global_batch_size: int) -> int:
    """Steps in one epoch: ``ceil(dataset_len / global_batch_size)``."""
    return -(-dataset_len // global_batch_size)


def share(count: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``parts`` of ``count`` items, as ``[begin, end)``.

    The parts cover ``range(count)`` in order without overlap and differ in
    size by at most one.
    """
    return (index * count) // parts, ((index + 1) * count) // parts


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where the data stands: the next step reads from here.

    Attributes:
        epoch: the epoch (0-based; its ordering is seeded with ``seed + epoch``).
        position: the first position of the epoch's ordering not yet committed.
    """

    epoch: int
    position: int


def cursor_at(step: int, dataset_len: int, global_batch_size: int, start_step: int = 0) -> Cursor:
    """The cursor at committed step ``step``.

    Raises:
        ValueError: ``step`` is before ``start_step``.
    """
    if step < start_step:
        raise ValueError(f"step {step} is before the sampler's start_step {start_step}")
    epoch, index = divmod(step - start_step, steps_per_epoch(dataset_len, global_batch_size))
    return Cursor(epoch, index * global_batch_size)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one rank reads at one step.

    Attributes:
        step: the Manager's step this plan is for.
        epoch: the epoch the step belongs to.
        start: the first position of the step's range in the epoch's ordering.
        end: one past its last position.
        micro_batches: every micro-batch of the step, as ``[begin, end)``
            position ranges.
        taken: the micro-batches this replica group takes, ``[first, last)``
            indices into :attr:`micro_batches` (empty when it does not
            participate).
        positions: this rank's positions, one tuple per micro-batch its
            group takes (a rank's part of a micro-batch may be empty).
        participants: replica groups taking part in the step.
        participant_rank: this group's rank among them, or None.
        group_world_size: ranks in this replica group.
    """

    step: int
    epoch: int
    start: int
    end: int
    micro_batches: tuple[tuple[int, int], ...]
    taken: tuple[int, int]
    positions: tuple[tuple[int, ...], ...]
    participants: int
    participant_rank: int | None
    group_world_size: int

    @property
    def size(self) -> int:
        """Samples in the step (the global batch, less in an epoch's short last step)."""
        return self.end - self.start

    @property
    def num_samples(self) -> int:
        """Samples this rank reads at the step."""
        return sum(len(p) for p in self.positions)

    def loss_scale(self, replica_reduce: str = "avg", group_reduce: str = "avg") -> float:
        """The factor for the sum of this rank's per-sample losses.

        With it the gradient after every reduction is the mean over the
        step's samples, whatever the number of participants.

        Args:
            replica_reduce: how the Manager reduces over replica groups:
                ``"avg"`` (``manager.allreduce``'s and ftdist DDP's default)
                or ``"sum"``.
            group_reduce: how the replica group reduces over its own ranks:
                ``"avg"`` (torch DDP, FSDP), ``"sum"``, or ``"none"`` when each
                rank holds its own part of the model (the same as ``"sum"``).

        Returns:
            The factor; 0.0 for a step with no sample (never happens in a
            valid plan).

        Raises:
            ValueError: an unknown reduction.
        """
        for name, value in (("replica_reduce", replica_reduce), ("group_reduce", group_reduce)):
            if value not in ("avg", "sum", "none"):
                raise ValueError(f"{name} must be 'avg', 'sum' or 'none', got {value!r}")
        if self.size == 0:
            return 0.0
        factor = 1.0 / self.size
        if replica_reduce == "avg":
            factor *= max(1, self.participants)
        if group_reduce == "avg":
            factor *= self.group_world_size
        return factor


def plan_step(
    step: int,
    *,
    dataset_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    participants: int,
    participant_rank: int | None,
    group_rank: int = 0,
    group_world_size: int = 1,
    start_step: int = 0,
) -> StepPlan:
    """Plan one rank's reading of step ``step``.

    Args:
        step: the Manager's committed step count (the step being trained).
        dataset_len: samples in the dataset.
        global_batch_size: samples per step, over every participant.
        micro_batch_size: samples per micro-batch; divides
            ``global_batch_size``.
        participants: replica groups taking part in the step's quorum.
        participant_rank: this group's rank among them, or None when it does
            not participate (it then reads nothing).
        group_rank: this rank inside its replica group.
        group_world_size: ranks in the replica group.
        start_step: the step at which epoch 0 began.

    Returns:
        The plan.

    Raises:
        ValueError: a size or rank out of range.
    """
    if dataset_len < 1:
        raise ValueError(f"dataset_len must be at least 1, got {dataset_len}")
    if global_batch_size < 1 or micro_batch_size < 1:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) and micro_batch_size "
            f"({micro_batch_size}) must be at least 1"
        )
    if global_batch_size % micro_batch_size:
        raise ValueError(
            f"micro_batch_size ({micro_batch_size}) must divide global_batch_size "
            f"({global_batch_size})"
        )
    if not 0 <= group_rank < group_world_size:
        raise ValueError(f"group_rank must be in [0, {group_world_size}), got {group_rank}")
    if participant_rank is not None and not 0 <= participant_rank < participants:
        raise ValueError(
            f"participant_rank must be in [0, {participants}) or None, got {participant_rank}"
        )
    cursor = cursor_at(step, dataset_len, global_batch_size, start_step)
    start = cursor.position
    end = min(start + global_batch_size, dataset_len)
    micro_batches = tuple(
        (begin, min(begin + micro_batch_size, end)) for begin in range(start, end, micro_batch_size)
    )
    if participant_rank is None:
        taken = (0, 0)
    else:
        taken = share(len(micro_batches), participants, participant_rank)
    positions = []
    for begin, stop in micro_batches[taken[0] : taken[1]]:
        lo, hi = share(stop - begin, group_world_size, group_rank)
        positions.append(tuple(range(begin + lo, begin + hi)))
    return StepPlan(
        step=step,
        epoch=cursor.epoch,
        start=start,
        end=end,
        micro_batches=micro_batches,
        taken=taken,
        positions=tuple(positions),
        participants=participants,
        participant_rank=participant_rank,
        group_world_size=group_world_size,
    )
