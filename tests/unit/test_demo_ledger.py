"""The demo's data ledger and torchft simulation (pure), its report rows, the sampler option."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ftdist.data.plan import plan_step, share
from ftdist.demo import DemoConfig
from ftdist.demo.events import EventLine, FinalEvent, StepEvent, TakeEvent
from ftdist.demo.ledger import (
    Sampling,
    build_ledger,
    ledger_lines,
    ledger_problem,
    simulate_torchft,
)
from ftdist.demo.report import build_report, render_text, verdict
from ftdist.demo.supervisor import ReplicaState, RunRecord

pytestmark = pytest.mark.timeout(60)

# 3 groups, 4 steps an epoch of 24 samples, micro-batches of 2 (3 per step).
EXACT = Sampling("exact", 24, 3, 6, 2, 4)


class Run:
    """A run's events, written as the demo's groups write them."""

    def __init__(self) -> None:
        self.lines: list[EventLine] = []
        self.t = 0.0

    def _add(self, group: int, event: Any, attempt: int = 0) -> None:
        self.lines.append(EventLine(group, attempt, event))

    def take(
        self, group: int, step: int, quorum: int, ids: list[int], participating: bool = True
    ) -> None:
        self.t += 1
        self._add(
            group,
            TakeEvent(
                t=self.t,
                step=step,
                quorum_id=quorum,
                epoch=EXACT.epoch_of(step),
                participating=participating,
                ids=ids,
            ),
        )

    def step(
        self, group: int, step: int, quorum: int, ok: bool, participants: int, part: bool = True
    ) -> None:
        self.t += 1
        self._add(
            group,
            StepEvent(
                t=self.t,
                step=step,
                ok=ok,
                loss=1.0,
                quorum_id=quorum,
                participants=participants,
                participating=part,
            ),
        )

    def exact_step(
        self, step: int, quorum: int, groups: list[int], ok: bool = True, logged: bool = True
    ) -> None:
        """``groups`` read ``step`` as the exact sampler plans it (unshuffled: id = position)."""
        for rank, group in enumerate(groups):
            plan = plan_step(
                step,
                dataset_len=EXACT.dataset_len,
                global_batch_size=EXACT.global_batch_size,
                micro_batch_size=2,
                participants=len(groups),
                participant_rank=rank,
            )
            self.take(group, step, quorum, [p for positions in plan.positions for p in positions])
        if logged:
            for group in groups:
                self.step(group, step, quorum, ok, len(groups))


def test_every_sample_once_through_a_failure_and_a_heal() -> None:
    run = Run()
    run.exact_step(0, 1, [0, 1, 2])
    # Group 2 dies during step 1: the attempt fails, and the step is read
    # again by the survivors in the next quorum.
    run.exact_step(1, 1, [0, 1, 2], ok=False)
    run.exact_step(1, 2, [0, 1])
    run.exact_step(2, 2, [0, 1])
    # It is back, healing: it reads nothing, and its stale step's line
    # names no quorum of step 0.
    run.take(2, 0, 3, [], participating=False)
    run.step(2, 0, 3, ok=True, participants=2, part=False)
    run.exact_step(3, 3, [0, 1])
    for step in (4, 5):
        run.exact_step(step, 4, [0, 1, 2])
    ledger = build_ledger(run.lines, EXACT, stop_step=6)
    assert ledger["steps"] == 6 and ledger["complete_epochs"] == 1
    first, second = ledger["epochs"]
    assert first == {
        "epoch": 0,
        "steps": 4,
        "complete": True,
        "expected": 24,
        "reads": 24,
        "consumed": 24,
        "twice": 0,
        "never": 0,
        "short": 0,
    }
    assert second["complete"] is False and second["expected"] == 12
    assert (second["consumed"], second["twice"], second["never"]) == (12, 0, 0)
    assert ledger["twice"] == ledger["never"] == ledger["unrecorded_steps"] == 0
    assert ledger_problem(ledger) is None
    # torchft's static shards: group 2's shard (2 of 6) lost at steps 1, 2, 3.
    sim = ledger["torchft"]
    assert sim["epochs"][0]["never"] == 6 and sim["epochs"][0]["shrunk_steps"] == 3
    assert sim["epochs"][0]["smallest_batch"] == 4
    assert sim["never"] == 6 and sim["lost"] == 6 and sim["shrunk_steps"] == 3
    assert "simulation" in sim["note"] and "recorded quorums" in sim["note"]
    json.dumps(ledger)


def test_a_group_killed_after_contributing_still_counts() -> None:
    run = Run()
    run.exact_step(0, 1, [0, 1, 2], logged=False)
    # Group 1 wrote its take and died before its step line; the others committed.
    for group in (0, 2):
        run.step(group, 0, 1, ok=True, participants=3)
    ledger = build_ledger(run.lines, Sampling("exact", 6, 3, 6, 2, 1), stop_step=1)
    assert ledger["epochs"][0]["consumed"] == 6 and ledger["epochs"][0]["never"] == 0
    assert ledger["unrecorded_steps"] == 0
    assert ledger["torchft"]["never"] == 0


def test_a_lone_commit_is_outlived_by_the_retry() -> None:
    """Group 2 finished the allreduce of step 1 and committed it as it hung; the
    others' allreduce failed, and they committed step 1 again without it."""
    run = Run()
    run.exact_step(0, 1, [0, 1, 2])
    run.exact_step(1, 1, [0, 1, 2], logged=False)
    run.step(2, 1, 1, ok=True, participants=3)
    for group in (0, 1):
        run.step(group, 1, 1, ok=False, participants=3)
    run.exact_step(1, 2, [0, 1])
    ledger = build_ledger(run.lines, Sampling("exact", 12, 3, 6, 2, 2), stop_step=2)
    (epoch,) = ledger["epochs"]
    assert (epoch["consumed"], epoch["twice"], epoch["never"]) == (12, 0, 0)
    assert ledger["split_commits"] == 1 and ledger_problem(ledger) is None
    assert ledger["torchft"]["never"] == 2  # group 2 was out of the commit that counts
    assert "committed by a lone group" in "\n".join(ledger_lines(ledger))


def test_a_take_says_who_counted_not_the_step_line() -> None:
    """A group that heals during a step (at the step everybody is at, as at the
    initial sync) says it took part once the heal is applied; its take says it
    contributed zeros."""
    run = Run()
    sampling = Sampling("torchft", 6, 3, 6, None, 1)
    for group in range(3):
        begin, end = share(6, 3, group)
        run.take(group, 0, 1, list(range(begin, end)), participating=group != 2)
        run.step(group, 0, 1, ok=True, participants=3)
    ledger = build_ledger(run.lines, sampling, stop_step=1)
    assert ledger["unrecorded_steps"] == 0
    assert ledger["epochs"][0]["never"] == 2 == ledger["torchft"]["never"]


def test_a_participant_without_a_take_is_flagged() -> None:
    run = Run()
    run.exact_step(0, 1, [0, 1])
    run.step(2, 0, 1, ok=True, participants=3)  # said it took part, recorded nothing
    ledger = build_ledger(run.lines, Sampling("exact", 6, 3, 6, 2, 1), stop_step=1)
    assert ledger["unrecorded_steps"] == 1
    assert "recorded no samples" in "\n".join(ledger_lines(ledger))


def test_twice_and_never_fail_an_exact_run() -> None:
    run = Run()
    sampling = Sampling("exact", 8, 2, 4, 2, 2)
    run.take(0, 0, 1, [0, 1])
    run.take(1, 0, 1, [2, 3])
    run.take(0, 1, 1, [4, 5])
    run.take(1, 1, 1, [5, 1])  # 5 and 1 twice; 6 and 7 never
    for step in (0, 1):
        for group in (0, 1):
            run.step(group, step, 1, ok=True, participants=2)
    ledger = build_ledger(run.lines, sampling, stop_step=2)
    (epoch,) = ledger["epochs"]
    assert (epoch["reads"], epoch["consumed"], epoch["twice"], epoch["never"]) == (8, 6, 2, 2)
    problem = ledger_problem(ledger)
    assert problem is not None and "2 samples read twice and 2 never read" in problem
    # torchft's sampler is lossy by design: its ledger does not fail a run.
    torchft = build_ledger(run.lines, Sampling("torchft", 8, 2, 4, None, 2), stop_step=2)
    assert torchft["never"] == 2 and ledger_problem(torchft) is None


def test_a_hole_before_the_cursor_fails_the_epoch_under_way() -> None:
    run = Run()
    run.take(0, 0, 1, [0, 1, 2])  # step 0 owns 6 samples; 3 were read
    run.step(0, 0, 1, ok=True, participants=1)
    ledger = build_ledger(run.lines, EXACT, stop_step=1)
    (epoch,) = ledger["epochs"]
    assert epoch["complete"] is False and epoch["never"] == 3 and epoch["short"] == 1
    problem = ledger_problem(ledger)
    assert problem is not None and "skipped before the cursor" in problem


def test_counting_stops_at_the_stop_step_and_at_a_gap() -> None:
    run = Run()
    for step in (0, 1, 3):
        run.exact_step(step, 1, [0, 1, 2])
    assert build_ledger(run.lines, EXACT, stop_step=None)["steps"] == 2
    assert build_ledger(run.lines, EXACT, stop_step=1)["steps"] == 1


def test_start_step_shifts_the_epochs() -> None:
    sampling = Sampling("exact", 12, 2, 6, 3, 2, start_step=1)
    run = Run()
    run.take(0, 0, 1, [], participating=True)  # the initial sync reads nothing
    run.step(0, 0, 1, ok=True, participants=2)
    run.step(1, 0, 1, ok=True, participants=2)
    for step, (a, b) in ((1, ([0, 1, 2], [3, 4, 5])), (2, ([6, 7, 8], [9, 10, 11]))):
        run.take(0, step, 1, a)
        run.take(1, step, 1, b)
        run.step(0, step, 1, ok=True, participants=2)
        run.step(1, step, 1, ok=True, participants=2)
    ledger = build_ledger(run.lines, sampling, stop_step=3)
    (epoch,) = ledger["epochs"]
    assert epoch["complete"] and epoch["consumed"] == 12 and epoch["never"] == 0
    assert sampling.epoch_of(1) == 0 and sampling.epoch_of(3) == 1
    assert "step 0 is the initial sync" in ledger_lines(ledger)[0]


def test_simulation_agrees_with_torchft_shards_read_for_real() -> None:
    """Static shards, read as the demo's torchft path reads them: the simulation's loss is
    exactly what was never read."""
    sampling = Sampling("torchft", 12, 3, 6, None, 2)
    quorum_groups = {0: [0, 1, 2], 1: [0, 2], 2: [1, 2], 3: [0, 1, 2]}
    run = Run()
    for step, groups in quorum_groups.items():
        index = step % sampling.steps_per_epoch
        for g in groups:
            begin, end = share(6, 3, g)
            ids = [index * 6 + i for i in range(begin, end)]
            run.take(g, step, 1, ids)
            run.step(g, step, 1, ok=True, participants=len(groups))
    ledger = build_ledger(run.lines, sampling, stop_step=4)
    assert [e["never"] for e in ledger["epochs"]] == [2, 2]
    assert [e["never"] for e in ledger["torchft"]["epochs"]] == [2, 2]
    assert ledger["torchft"]["shrunk_steps"] == 2


def test_simulation_of_a_short_last_step() -> None:
    sampling = Sampling("exact", 10, 3, 6, 2, 2)
    assert [sampling.step_size(s) for s in range(4)] == [6, 4, 6, 4]
    sim = simulate_torchft(sampling, {0: {0, 1, 2}, 1: {0, 1}}, steps=2)
    # The short step's 4 samples: shares 1, 1, 2; group 2's are lost.
    assert sim["epochs"][0]["never"] == 2 and sim["epochs"][0]["smallest_batch"] == 2


def _record(ledger: dict[str, Any] | None) -> RunRecord:
    finals = [FinalEvent(t=1.0, step=6, hash="aa", eval_loss=0.5, accuracy=0.8)] * 2
    record = RunRecord("failures", [ReplicaState(r, final=f) for r, f in enumerate(finals)])
    record.stop_step, record.started, record.ended = 6, 0.0, 10.0
    for step in range(6):
        record.steps[step] = {"t_s": step * 0.1, "participants": 2, "losses": {0: 1.0, 1: 1.2}}
    record.ledger = ledger
    return record


def test_report_rows_and_verdict() -> None:
    run = Run()
    for step in range(6):
        run.exact_step(step, 1, [0, 1, 2] if step % 2 else [0, 1])
    good = build_ledger(run.lines, EXACT, stop_step=6)
    report = build_report(_record(good), None, {})
    json.dumps(report)
    assert report["verdict"]["ok"] is True and report["run"]["ledger"] == good
    text = render_text(report)
    assert "data ledger (ExactSampler, global batch 6 in micro-batches of 2" in text
    assert "never read" in text and "so far" in text
    assert "a simulation from this run's recorded quorums" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("0 "))
    assert row.split()[:5] == ["0", "4/4", "24", "0", "0"]

    run.take(0, 2, 1, [0])  # a retried take with another sample: 0 read twice
    bad = build_ledger(run.lines, EXACT, stop_step=6)
    v = verdict(_record(bad))
    assert v["ok"] is False and "read twice" in v["reason"]
    assert "VERDICT: FAIL" in render_text(build_report(_record(bad), None, {}))
    assert verdict(_record(None))["ok"] is True  # DiLoCo keeps no ledger
    assert ledger_lines(None) == []


def test_comparison_covers_all_steps_too() -> None:
    main, base = _record(None), _record(None)
    base.name = "baseline"
    for step in range(6):
        base.steps[step]["losses"] = {0: 1.1, 1: 1.3}
    comparison = build_report(main, base, {})["comparison"]
    assert comparison["mean_abs_diff_all_steps"] == pytest.approx(0.1)
    assert comparison["mean_abs_diff_last_steps"] == pytest.approx(0.1)


# -- the option and the worker's side ------------------------------------------------------


def test_sampler_option_defaults_by_algorithm() -> None:
    assert DemoConfig().sampler == "exact"
    assert DemoConfig(sampler="torchft").sampler == "torchft"
    assert DemoConfig(algorithm="diloco").sampler == "torchft"
    with pytest.raises(ValueError, match="--sampler exact does not apply to --algorithm diloco"):
        DemoConfig(algorithm="diloco", sampler="exact")
    with pytest.raises(ValueError, match="--sampler 'lossy'"):
        DemoConfig(sampler="lossy")


def test_cli_sampler_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from ftdist.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--sampler", "nope"])
    assert "invalid choice" in capsys.readouterr().err
    assert main(["demo", "--algorithm", "diloco", "--sampler", "exact"]) == 2
    assert "does not apply to --algorithm diloco" in capsys.readouterr().err


def test_worker_sampling_matches_its_batches() -> None:
    from ftdist.demo.batches import START_STEP
    from ftdist.demo.worker import WorkerConfig, sampling

    cfg = WorkerConfig(lighthouse="h:1", events_dir="e", seed=0, replicas=3, run="r")
    exact = sampling(cfg)
    assert exact == Sampling("exact", 6144, 3, 96, 16, 64, START_STEP)
    # Two micro-batches per group and step: the survivors of a failure split evenly.
    assert exact.global_batch_size // exact.micro_batch_size == 2 * cfg.replicas  # type: ignore[operator]
    torchft = sampling(WorkerConfig(**{**cfg.__dict__, "sampler": "torchft"}))
    assert torchft == Sampling("torchft", 6144, 3, 96, None, 64)
    assert sampling(WorkerConfig(**{**cfg.__dict__, "algorithm": "diloco"})) is None


class _Manager:
    def __init__(self, step: int, participants: int = 2, rank: int | None = 0) -> None:
        self.step, self.participants, self.rank = step, participants, rank
        self.registered: dict[str, Any] = {}
        self.reduced: list[float] = []
        self.errors: list[Exception] = []

    def register_state_dict_fn(self, key: str, load: Any, state: Any) -> None:
        self.registered[key] = state

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int | None:
        return self.rank

    def is_participating(self) -> bool:
        return self.rank is not None

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> Any:
        self.reduced.append(float(tensor.item()))
        tensor += 1  # the other participant's micro-batch

        class _Done:
            def wait(self) -> None:
                pass

        return _Done()

    def errored(self) -> Exception | None:
        return None

    def report_error(self, error: Exception) -> None:
        self.errors.append(error)


def test_exact_batches_read_nothing_at_the_initial_sync_then_their_share() -> None:
    from ftdist.demo import task
    from ftdist.demo.batches import ExactBatches

    data = task.make_spirals(24, 0)
    manager = _Manager(step=0)
    batches = ExactBatches(data, manager, 6, 2, seed=3)
    reading = batches.read(manager, 0)
    assert reading.epoch == -1 and reading.ids == [] and len(reading.micro) == 1
    # A healing peer reads the sampler's state at step 0 (the init sync).
    (state,) = manager.registered.values()
    assert state()["start_step"] == 1
    manager.step = 2
    assert state()["position"] == 6
    manager.rank = 1  # of 2 participants: micro-batches 1 and 2 of the step's 3
    reading = batches.read(manager, 2)
    assert reading.epoch == 0 and len(reading.micro) == 2 and reading.scale == pytest.approx(2 / 6)
    assert reading.ids == batches.sampler.epoch_order(0)[8:12]
    # Every group joins the check of the step's micro-batches: 2 + the other's 1.
    batches.verify(reading)
    assert manager.reduced == [2.0] and manager.errors == []


class _DDP(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.synced = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield
        self.synced += 1


def test_backward_of_micro_batches_is_the_mean_gradient() -> None:
    from ftdist.demo.batches import Reading, backward

    torch.manual_seed(0)
    x, y = torch.randn(6, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    model = nn.Linear(2, 3)
    ddp = _DDP(model)
    micro = [(x[:2], y[:2]), (x[2:4], y[2:4]), (x[4:], y[4:])]
    loss = backward(ddp, Reading(1, 0, micro, list(range(6)), 1 / 6))
    assert ddp.synced == 2  # all but the last micro-batch under no_sync
    got = model.weight.grad.clone()  # type: ignore[union-attr]
    model.zero_grad()
    expected_loss = nn.functional.cross_entropy(model(x), y)
    expected_loss.backward()
    assert torch.allclose(got, model.weight.grad)  # type: ignore[arg-type]
    assert loss == pytest.approx(expected_loss.item())
    empty = backward(ddp, Reading(0, -1, [(x[:0], y[:0])], [], 0.0))
    assert empty != empty  # NaN: a group that read nothing has no loss
