"""
The data ledger
===============

Which samples a run trained on, counted from what its replica groups wrote:
before each step's backward a group appends a ``take`` event with the
dataset indices it reads (:class:`~ftdist.demo.events.TakeEvent`), and after
the step a ``step`` event that says whether it committed. :func:`build_ledger`
joins the two: a step's samples are those of the groups that took part in
the quorum in which the step committed. A take is written before the
group's gradient can reach the allreduce, so a group killed after
contributing (before its ``step`` line) is still counted; a take of an
attempt that did not commit (another quorum) is not. A step committed in two
quorums (a lone group committed it as its peers' allreduce failed, and they
committed it again) counts once, in the later quorum: the lone group heals
to that history.

Per data epoch the ledger counts the samples consumed, those read twice and
those never read (in a completed epoch; in the epoch under way, those
skipped before the cursor). Next to it, :func:`simulate_torchft` replays the
run's recorded quorums with torchft's static shards: each group owns a fixed
part of every step's batch, and a group not taking part in a committed step
(dead, hung, healing) loses its part for the epoch. That column is a
simulation, not a run.

Pure: no clock, no file, no process; :mod:`ftdist.demo.run` reads the events.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ftdist.data.plan import share
from ftdist.demo.events import EventLine, StepEvent, TakeEvent

__all__ = [
    "Sampling",
    "build_ledger",
    "ledger_lines",
    "ledger_problem",
    "simulate_torchft",
]

SIMULATION_NOTE = (
    "torchft's sampler: a simulation from this run's recorded quorums (each group a static "
    "shard of every step's batch; a group out of a committed step loses its shard), not a run"
)


@dataclass(frozen=True)
class Sampling:
    """How a run reads its data: what the ledger counts against.

    Attributes:
        sampler: ``"exact"`` (:class:`~ftdist.data.ExactSampler`) or
            ``"torchft"`` (:class:`~ftdist.data.DistributedSampler`).
        dataset_len: training samples.
        groups: replica groups of the job.
        global_batch_size: samples per step with every group in.
        micro_batch_size: the exact sampler's unit of sharing (None for torchft).
        steps_per_epoch: steps that make one data epoch.
        start_step: the Manager step at which epoch 0 begins (steps before
            it read nothing).
    """

    sampler: str
    dataset_len: int
    groups: int
    global_batch_size: int
    micro_batch_size: int | None
    steps_per_epoch: int
    start_step: int = 0

    def epoch_of(self, step: int) -> int:
        """The epoch step ``step`` reads in."""
        return (step - self.start_step) // self.steps_per_epoch

    def step_size(self, step: int) -> int:
        """Samples step ``step`` owns (an epoch's last step may be short)."""
        start = ((step - self.start_step) % self.steps_per_epoch) * self.global_batch_size
        return max(0, min(self.global_batch_size, self.dataset_len - start))

    def epoch_size(self, steps: int) -> int:
        """Samples the first ``steps`` steps of an epoch own."""
        return sum(self.step_size(self.start_step + s) for s in range(steps))


def _commits(lines: Iterable[EventLine]) -> tuple[dict[int, int], dict[int, set[int]], int]:
    """The quorum each step committed in, the groups that said they took part, and
    how many steps more than one quorum committed."""
    seen: dict[int, dict[int, set[int]]] = {}
    for line in lines:
        event = line.event
        # A healing group's line names its step before the heal: only a
        # participant's commit says which quorum a step committed in.
        if isinstance(event, StepEvent) and event.ok and event.participating:
            seen.setdefault(event.step, {}).setdefault(event.quorum_id, set()).add(line.process)
    # A commit is not atomic across groups: a group can commit a step whose
    # allreduce failed for the others (it was hung as it finished), which
    # then commit the step again in a later quorum. The later commit is the
    # job's history: the lone group is behind or outvoted when it returns,
    # and heals to it.
    quorums = {step: max(by_quorum) for step, by_quorum in seen.items()}
    groups = {step: seen[step][q] for step, q in quorums.items()}
    split = sum(1 for by_quorum in seen.values() if len(by_quorum) > 1)
    return quorums, groups, split


def _shares(
    lines: Iterable[EventLine], quorums: dict[int, int]
) -> tuple[dict[int, dict[int, list[int]]], dict[int, set[int]]]:
    """Per committed step, each contributing group's samples, and every group
    that recorded a take (contributing or healing) in the step's quorum."""
    out: dict[int, dict[int, list[int]]] = {}
    recorded: dict[int, set[int]] = {}
    for line in lines:
        event = line.event
        if not isinstance(event, TakeEvent) or event.quorum_id != quorums.get(event.step):
            continue
        recorded.setdefault(event.step, set()).add(line.process)
        if event.participating:
            # A retry of the step in the same quorum reads the same samples:
            # one share per group and step.
            out.setdefault(event.step, {})[line.process] = event.ids
    return out, recorded


def simulate_torchft(
    sampling: Sampling, participants: dict[int, set[int]], steps: int
) -> dict[str, Any]:
    """What torchft's static shards would have lost under the run's quorums.

    Group ``g`` of ``G`` owns part ``g`` of every step's batch
    (:func:`ftdist.data.plan.share`); a group missing from a committed step
    never reads its part in that epoch, and the step's global batch shrinks.
    Nothing is read twice under this model.

    Args:
        sampling: the run's sampling (epoch length, batch, groups).
        participants: per committed step, the groups that took part.
        steps: committed steps (``0 .. steps - 1``; those before the
            sampling's ``start_step`` read nothing).

    Returns:
        Per epoch the samples never read (so far, in the epoch under way) and
        the steps whose global batch shrank, and the totals.
    """
    epochs: list[dict[str, Any]] = []
    reading = max(0, steps - sampling.start_step)
    for epoch in range(-(-reading // sampling.steps_per_epoch)):
        first = sampling.start_step + epoch * sampling.steps_per_epoch
        last = min(steps, first + sampling.steps_per_epoch)
        lost = shrunk = 0
        smallest: int | None = None
        for step in range(first, last):
            size = sampling.step_size(step)
            took = participants.get(step, set())
            missing = sum(
                end - begin
                for g in range(sampling.groups)
                if g not in took
                for begin, end in [share(size, sampling.groups, g)]
            )
            lost += missing
            shrunk += missing > 0
            smallest = size - missing if smallest is None else min(smallest, size - missing)
        epochs.append(
            {
                "epoch": epoch,
                "complete": last - first == sampling.steps_per_epoch,
                "steps": last - first,
                "never": lost,
                "shrunk_steps": shrunk,
                "smallest_batch": smallest,
            }
        )
    return {
        "note": SIMULATION_NOTE,
        "epochs": epochs,
        "never": sum(e["never"] for e in epochs if e["complete"]),
        "lost": sum(e["never"] for e in epochs),
        "shrunk_steps": sum(e["shrunk_steps"] for e in epochs),
        "smallest_batch": min(
            (e["smallest_batch"] for e in epochs if e["smallest_batch"] is not None), default=None
        ),
    }


def build_ledger(
    lines: list[EventLine], sampling: Sampling, stop_step: int | None
) -> dict[str, Any]:
    """Count what a run read, per epoch, and what torchft's sampler would have lost.

    Args:
        lines: every event of the run, of every process (old attempts too:
            a killed process's takes count when its step committed).
        sampling: how the run read its data.
        stop_step: the step every group stopped at; None counts every
            committed step seen.

    Returns:
        The ledger: ``sampling``, ``steps`` (committed steps counted, from
        step 0), ``epochs`` (per epoch: committed
        ``steps``, whether ``complete``, samples ``expected`` by those
        steps, ``reads``, distinct samples ``consumed``, samples read
        ``twice`` or more, samples ``never`` read (in an epoch under way:
        skipped before the cursor), steps read ``short``), ``twice``,
        ``never``, ``unrecorded_steps`` (committed steps a participant's
        take is missing for), ``split_commits`` (steps committed in more
        than one quorum: the latest counts) and ``torchft``
        (:func:`simulate_torchft`).
    """
    quorums, said, split = _commits(lines)
    shares, recorded = _shares(lines, quorums)
    # The steps commit in order: the first one missing ends what can be counted.
    steps = sampling.start_step
    while steps in quorums and (stop_step is None or steps < stop_step):
        steps += 1
    per_epoch: dict[int, Counter[int]] = {}
    short: Counter[int] = Counter()
    participants: dict[int, set[int]] = {}
    unrecorded = 0
    for step in range(sampling.start_step, steps):
        took = shares.get(step, {})
        # A take says whether the group's gradient counted; its step line
        # does not (a group that healed during the step says it took part).
        # A group that committed as a participant without any take is
        # assumed to have taken part, and counted as unrecorded.
        missing = said.get(step, set()) - recorded.get(step, set())
        participants[step] = set(took) | missing
        unrecorded += bool(missing)
        epoch = sampling.epoch_of(step)
        counts = per_epoch.setdefault(epoch, Counter())
        reads = 0
        for ids in took.values():
            counts.update(ids)
            reads += len(ids)
        short[epoch] += reads < sampling.step_size(step)
    epochs = []
    reading = max(0, steps - sampling.start_step)
    for epoch in range(-(-reading // sampling.steps_per_epoch)):
        counts = per_epoch.get(epoch, Counter())
        in_epoch = min(sampling.steps_per_epoch, reading - epoch * sampling.steps_per_epoch)
        expected = sampling.epoch_size(in_epoch)
        epochs.append(
            {
                "epoch": epoch,
                "steps": in_epoch,
                "complete": in_epoch == sampling.steps_per_epoch,
                "expected": expected,
                "reads": sum(counts.values()),
                "consumed": len(counts),
                "twice": sum(1 for n in counts.values() if n > 1),
                "never": max(0, expected - len(counts)),
                "short": short[epoch],
            }
        )
    return {
        "sampling": asdict(sampling),
        "steps": steps,
        "epochs": epochs,
        "complete_epochs": sum(1 for e in epochs if e["complete"]),
        "twice": sum(e["twice"] for e in epochs),
        "never": sum(e["never"] for e in epochs),
        "unrecorded_steps": unrecorded,
        "split_commits": split,
        "torchft": simulate_torchft(sampling, participants, steps),
    }


def ledger_problem(ledger: dict[str, Any] | None) -> str | None:
    """What an exact-sampler run's ledger shows wrong, or None.

    A sample read twice in any epoch, or one not read in a completed epoch
    (or, in the epoch under way, skipped before the cursor), fails the
    verdict. torchft's sampler is lossy by design: its ledger only informs.
    """
    if ledger is None or ledger["sampling"]["sampler"] != "exact":
        return None
    for e in ledger["epochs"]:
        if e["twice"] or e["never"]:
            where = "never read" if e["complete"] else "skipped before the cursor"
            unrecorded = (
                f"; {ledger['unrecorded_steps']} committed steps lack a participant's take"
                if ledger["unrecorded_steps"]
                else ""
            )
            return (
                f"the exact sampler's ledger: epoch {e['epoch']} has {e['twice']} samples read "
                f"twice and {e['never']} {where} (of {e['expected']}){unrecorded}"
            )
    return None


def ledger_lines(ledger: dict[str, Any] | None) -> list[str]:
    """The report's table of the ledger, next to torchft's simulated losses."""
    if ledger is None:
        return []
    s = ledger["sampling"]
    if s["sampler"] == "exact":
        how = (
            f"ExactSampler, global batch {s['global_batch_size']} in micro-batches of "
            f"{s['micro_batch_size']}"
        )
    else:
        how = f"torchft's DistributedSampler, {s['global_batch_size'] // s['groups']} per group"
    start = (
        f", from step {s['start_step']} (step 0 is the initial sync)" if s.get("start_step") else ""
    )
    lines = [
        f"data ledger ({how}; {s['dataset_len']} samples, {s['steps_per_epoch']} steps an "
        f"epoch{start}; counted from the samples each group recorded for each committed step):",
        "  epoch   steps      read  twice  never read  |  torchft's sampler*: never read  "
        "steps shrunk  smallest batch",
    ]
    simulated = {e["epoch"]: e for e in ledger["torchft"]["epochs"]}
    for e in ledger["epochs"]:
        sim = simulated[e["epoch"]]
        never = f"{e['never']}" if e["complete"] else f"{e['never']} so far"
        lines.append(
            f"  {e['epoch']:<5} {e['steps']:>3}/{s['steps_per_epoch']:<4} {e['consumed']:>7}  "
            f"{e['twice']:>5}  {never:>10}  |  {sim['never']:>28}  {sim['shrunk_steps']:>12}  "
            f"{sim['smallest_batch'] if sim['smallest_batch'] is not None else '-':>14}"
        )
    if ledger["unrecorded_steps"]:
        lines.append(
            f"  {ledger['unrecorded_steps']} committed steps have a participant that "
            "recorded no samples for them"
        )
    if ledger.get("split_commits"):
        lines.append(
            f"  {ledger['split_commits']} steps were committed by a lone group whose peers "
            "failed the step and committed it again; the lone group healed, the retry counts"
        )
    lines.append(f"  * {ledger['torchft']['note']}")
    return lines
