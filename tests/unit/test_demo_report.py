"""The demo's verdict, report, view and option checks (no processes)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from ftdist.demo import DemoConfig
from ftdist.demo.events import FinalEvent
from ftdist.demo.report import build_report, loss_curve, render_text, verdict
from ftdist.demo.supervisor import ReplicaState, RunRecord
from ftdist.demo.view import LiveView, progress_bar, table_rows

pytestmark = pytest.mark.timeout(60)


def _final(step: int, digest: str) -> FinalEvent:
    return FinalEvent(t=1.0, step=step, hash=digest, eval_loss=0.5, accuracy=0.8)


def _record(finals: list[FinalEvent | None], name: str = "failures") -> RunRecord:
    record = RunRecord(name, [ReplicaState(r, final=f) for r, f in enumerate(finals)])
    record.stop_step = 10
    record.started, record.ended = 100.0, 130.0
    for step in range(10):
        record.steps[step] = {
            "t_s": step * 0.1,
            "participants": 2,
            "losses": {0: 2.0 - step * 0.1, 1: 2.2 - step * 0.1},
        }
    return record


def test_identical_hashes_pass() -> None:
    v = verdict(_record([_final(10, "ab" * 32), _final(10, "ab" * 32)]))
    assert v["ok"] is True
    assert "bit-identical" in v["reason"] and "step 10" in v["reason"]
    assert v["hashes"] == {"replica0": "ab" * 32, "replica1": "ab" * 32}


@pytest.mark.parametrize(
    ("finals", "reason"),
    [
        ([_final(10, "aa"), _final(10, "bb")], "weights differ at step 10"),
        ([_final(10, "aa"), None], "no final state from replica1"),
        ([_final(10, "aa"), _final(11, "aa")], "different steps"),
    ],
)
def test_mismatches_fail_loudly(finals: list[FinalEvent | None], reason: str) -> None:
    record = _record(finals)
    v = verdict(record)
    assert v["ok"] is False and reason in v["reason"]
    text = render_text(build_report(record, None, {}))
    assert "VERDICT: FAIL" in text and reason in text and "!!!!" in text


def test_a_replica_dying_on_its_own_fails_the_verdict() -> None:
    record = _record([_final(10, "aa"), _final(10, "aa")])
    record.unexpected_exits.append(
        {"replica": 1, "attempt": 0, "exitcode": 1, "t_s": 3.0, "error": "RuntimeError: boom"}
    )
    v = verdict(record)
    assert v["ok"] is False and "replica1 (exit code 1)" in v["reason"]


def test_loss_curve_averages_participants() -> None:
    curve = loss_curve(_record([None, None]))
    assert [p["step"] for p in curve] == list(range(10))
    assert curve[0]["loss"] == pytest.approx(2.1)
    assert curve[9]["loss"] == pytest.approx(1.2)


def test_report_with_baseline_compares_and_serializes() -> None:
    main = _record([_final(10, "aa"), _final(10, "aa")])
    main.injections.append(
        {
            "index": 0,
            "kind": "kill",
            "replica": 1,
            "due_s": 1.0,
            "t_s": 1.2,
            "pid": 5,
            "step": 3,
            "attempt": 0,
            "hold_s": 0.0,
            "back_s": 1.5,
        }
    )
    base = _record([_final(10, "cc"), _final(10, "cc")], "baseline")
    report = build_report(main, base, {"options": {"seed": 0}})
    json.dumps(report)  # the report is written as JSON
    assert report["verdict"]["ok"] is True
    assert report["run"]["failures_injected"] == {"total": 1, "kill": 1, "stop": 0, "leader": 0}
    assert report["comparison"]["steps_compared"] == 10
    assert report["comparison"]["mean_abs_diff_last_steps"] == pytest.approx(0.0)
    text = render_text(report)
    assert "baseline without failures" in text and "1.50 s" in text
    assert "VERDICT: PASS" in text


def test_progress_bar_clamps() -> None:
    assert progress_bar(-1, 10) == "[----------]   0%"
    assert progress_bar(0.5, 10) == "[#####-----]  50%"
    assert progress_bar(7, 10) == "[##########] 100%"


class _FakeSupervisor:
    def __init__(self) -> None:
        self.replicas = [
            ReplicaState(
                0,
                pid=11,
                state="training",
                step=5,
                quorum_id=3,
                participants=2,
                loss=0.25,
                failures=1,
                heals=2,
            ),
            ReplicaState(1, pid=12, state="killed", step=4),
        ]
        self.record = RunRecord("failures", self.replicas)
        self.duration_s = 10.0
        self.phase = "training"

    def elapsed(self) -> float:
        return 5.0

    def train_elapsed(self) -> float:
        return 5.0

    def max_step(self) -> int:
        return 5


def test_table_and_plain_output() -> None:
    sup = _FakeSupervisor()
    rows = table_rows(sup)  # type: ignore[arg-type]
    assert rows[0].split() == [
        "replica",
        "pid",
        "state",
        "step",
        "quorum",
        "particip.",
        "loss",
        "failures",
        "heals",
    ]
    assert rows[1].split() == ["replica0", "11", "training", "5", "3", "2/2", "0.250", "1", "2"]
    assert rows[2].split()[:4] == ["replica1", "12", "killed", "4"]
    out = io.StringIO()
    view = LiveView(out, interactive=False)
    view.event("[   1.0s] SIGKILL replica1")
    view.tick(sup)  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert lines[0] == "[   1.0s] SIGKILL replica1"
    assert "replica1 killed step 4" in lines[1] and "50%" in lines[1]
    assert "\x1b" not in out.getvalue()


def test_terminal_view_redraws_in_place() -> None:
    sup = _FakeSupervisor()
    out = io.StringIO()
    view = LiveView(out, interactive=True)
    view.event("an event")
    view.tick(sup)  # type: ignore[arg-type]
    first = out.getvalue()
    view.tick(sup)  # type: ignore[arg-type]
    second = out.getvalue()[len(first) :]
    height = first.count("\n")
    assert second.startswith(f"\x1b[{height}F\x1b[J")
    assert "an event" in first and "\x1b[32mtraining" in first


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replicas": 1}, "--replicas 1: failures need at least 2"),
        ({"replicas": 0, "failures": False}, "--replicas 0"),
        ({"replicas": 2.5}, "replicas must be an int"),
        ({"duration_s": 0}, "--duration 0"),
        ({"kill_every_s": -5}, "--kill-every -5"),
        ({"lighthouse": "nohostport"}, "--lighthouse 'nohostport'"),
        ({"out": ""}, "--out"),
    ],
)
def test_bad_options_name_the_value(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        DemoConfig(**kwargs)  # type: ignore[arg-type]


def test_one_replica_without_failures_is_fine() -> None:
    assert DemoConfig(replicas=1, failures=False).replicas == 1


def test_cli_rejects_bad_options_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    from ftdist.cli import main

    assert main(["demo", "--replicas", "1"]) == 2
    assert "use --replicas 2 or more, or --no-failures" in capsys.readouterr().err


def test_reader_keeps_partial_lines_and_reads_the_attempt(tmp_path: Any) -> None:
    from ftdist.demo.events import EventReader, UnknownEvent, UpEvent

    reader = EventReader(str(tmp_path))
    a = tmp_path / "replica1.attempt2.jsonl"
    a.write_text(
        '{"kind": "up", "t": 2.0, "pid": 7, "attempt": 2, "replica_id": "r1"}\n'
        '{"kind": "noise", "t"'
    )
    (tmp_path / "replica0.attempt0.jsonl").write_text(
        '{"kind": "up", "t": 1.0, "pid": 5, "attempt": 0, "replica_id": "r0", "extra": 1}\n'
    )
    (tmp_path / "replica0.attemptX.jsonl").write_text('{"kind": "up", "t": 0.0}\n')
    assert reader.read() == [
        (0, 0, UpEvent(t=1.0, pid=5, attempt=0, replica_id="r0")),
        (1, 2, UpEvent(t=2.0, pid=7, attempt=2, replica_id="r1")),
    ]
    assert reader.read() == []
    with a.open("a") as f:
        f.write(': 3.0}\nnot json\n[1, 2]\n{"kind": "step", "t": 4.0, "step": 1}\n')
    # The fragment completed; the rest is not an event (a step lacks its fields).
    assert reader.read() == [(1, 2, UnknownEvent("noise", 3.0))]


def test_events_read_as_they_were_written(tmp_path: Any) -> None:
    from ftdist.demo.events import (
        EventLog,
        EventReader,
        FinalEvent,
        HealEvent,
        HealStartEvent,
        ServeEvent,
        StepEvent,
        TakeEvent,
        UpEvent,
        events_path,
    )

    written = [
        UpEvent(t=1.0, pid=5, attempt=1, replica_id="r", group=0, rank=1, checkpoint="http://x"),
        StepEvent(
            t=2.0, step=3, ok=False, loss=0.5, quorum_id=2, participants=2, participating=True,
            error="boom",
        ),
        TakeEvent(t=2.5, step=4, quorum_id=2, epoch=0, participating=True, ids=[7, 3, 5]),
        HealStartEvent(t=3.0, step=4, src_rank=0, source="http://y"),
        ServeEvent(t=3.5, step=4, dst=[1]),
        HealEvent(
            t=4.0, step=4, quorum_id=3, role="receive", peers=[0], quorum_s=0.1,
            reconfigure_s=0.0, transfer_bytes=10, transfer_s=0.2, load_s=0.01, total_s=0.31,
        ),
        FinalEvent(t=5.0, step=9, hash="ab", eval_loss=0.4, accuracy=0.9),
    ]  # fmt: skip
    log = EventLog(events_path(str(tmp_path), 1, 1))
    for event in written:
        log.write(event)
    log.close()
    assert [line.event for line in EventReader(str(tmp_path)).read()] == written
    lines = (tmp_path / "replica1.attempt1.jsonl").read_text().splitlines()
    assert json.loads(lines[1])["error"] == "boom"
    assert "what" not in json.loads(lines[-1])  # a field of the demo's writer only
    assert json.loads(lines[-1]) == {
        "kind": "final", "t": 5.0, "step": 9, "hash": "ab", "eval_loss": 0.4, "accuracy": 0.9,
    }  # fmt: skip


def test_clip_counts_visible_characters() -> None:
    from ftdist.demo.view import clip

    assert clip("short", 10) == "short"
    colored = "\x1b[32mtraining \x1b[0m rest"
    assert clip(colored, 40) == colored
    assert clip("x" * 50, 10) == "x" * 9 + "~"
    assert clip("\x1b[31m" + "y" * 30 + "\x1b[0m", 10) == "y" * 9 + "~"


def test_terminal_view_clips_to_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr("shutil.get_terminal_size", lambda *a, **k: os.terminal_size((40, 24)))
    sup = _FakeSupervisor()
    out = io.StringIO()
    view = LiveView(out, interactive=True)
    view.event("e" * 200)
    view.tick(sup)  # type: ignore[arg-type]
    import re

    rows = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue()).splitlines()
    assert rows and all(len(r) <= 39 for r in rows), rows


def test_old_events_are_cleared_but_foreign_files_refuse(tmp_path: Any) -> None:
    from ftdist.demo.run import clear_events

    run = tmp_path / "events" / "run"
    run.mkdir(parents=True)
    (run / "replica0.attempt0.jsonl").write_text("{}\n")
    (run / "replica0.attempt0.log").write_text("log\n")
    clear_events(str(run))
    assert list(run.iterdir()) == []
    (run / "thesis.tex").write_text("precious")
    with pytest.raises(ValueError, match=r"thesis\.tex"):
        clear_events(str(run))
    assert (run / "thesis.tex").read_text() == "precious"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"duration_s": float("inf")}, "--duration inf"),
        ({"duration_s": 0.5}, "--duration 0.5"),
        ({"kill_every_s": 1e-6}, "--kill-every 1e-06"),
        ({"seed": -1}, "--seed -1"),
        ({"seed": 2**40}, "--seed"),
    ],
)
def test_out_of_range_options(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DemoConfig(**kwargs)  # type: ignore[arg-type]


def test_out_must_not_be_a_file(tmp_path: Any) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        DemoConfig(out=str(f))


def test_interrupted_report_says_so() -> None:
    record = _record([_final(10, "aa"), None])
    record.interrupted = True
    text = render_text(build_report(record, None, {"interrupted": True}))
    assert "VERDICT: INTERRUPTED" in text and "VERDICT: FAIL" not in text
