"""``ftdist demo`` end to end: real lighthouse, real replica processes, real failures.

The demo runs as a subprocess, as a user runs it. Each run carries a unique
environment token, so the test can prove afterwards that no process of the
demo (fork server, replica groups) outlived it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import _diagnostics
from tests._browser import Chromium, find_chromium
from tests._procs import processes_with
from tests.integration.lighthouse_helpers import Lighthouses, get_json

# One worker runs these in turn (make pytest: pytest-xdist, loadgroup):
# the chaos suite and the demos each load the whole machine, and a demo
# whose groups are starved by a concurrent chaos run never gets healthy
# enough to be struck.
pytestmark = pytest.mark.xdist_group("heavy")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_exact_ledger(ledger: dict[str, Any], complete_epochs: int = 0) -> None:
    """The exact sampler's ledger: each sample once per completed epoch, nothing read
    twice, and in the epoch under way nothing skipped before the cursor."""
    assert ledger["sampling"]["sampler"] == "exact", ledger["sampling"]
    assert ledger["complete_epochs"] >= complete_epochs, ledger["epochs"]
    n = ledger["sampling"]["dataset_len"]
    for epoch in ledger["epochs"]:
        assert epoch["twice"] == 0 and epoch["never"] == 0, epoch
        assert epoch["consumed"] == epoch["reads"] == epoch["expected"], epoch
        assert epoch["short"] == 0, epoch
        if epoch["complete"]:
            assert epoch["consumed"] == n, epoch
    assert ledger["unrecorded_steps"] == 0, ledger


class DemoProcess:
    def __init__(self, args: list[str], out: Path) -> None:
        self.token = f"FTDIST_DEMO_TEST_TOKEN={uuid.uuid4().hex}"
        key, value = self.token.split("=")
        env = {**os.environ, key: value, "PYTHONUNBUFFERED": "1"}
        self.out = out
        # A file, not a pipe: what the demo printed is still there for the
        # failure report when it hangs (tests/_diagnostics.py).
        self.log = out.with_name(f"{out.name}.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ftdist.cli", "demo", "--out", str(out), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        _diagnostics.watch(self.log, f"ftdist demo {' '.join(args)}: output")
        _diagnostics.watch_glob(out / "events", "**/*.log", "demo event log")

    def finish(self, timeout: float) -> tuple[int, str]:
        self.proc.wait(timeout=timeout)
        return self.proc.returncode, self.log.read_text(errors="replace")

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = json.loads((self.out / "report.json").read_text())
        return report

    def kill_all(self) -> None:
        _diagnostics.before_kill()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        for pid in processes_with(self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def assert_nothing_left(self) -> None:
        # Ranks watch the demo process through a pidfd and exit with it.
        deadline = time.monotonic() + 15
        while processes_with(self.token) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_with(self.token) == [], "demo processes outlived the demo"


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Any]:
    started: list[DemoProcess] = []

    def start(*args: str) -> DemoProcess:
        d = DemoProcess(list(args), tmp_path / f"out{len(started)}")
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill_all()


def _screenshot_after_a_heal(run: DemoProcess) -> Path:
    """Once the demo's dashboard shows a heal, save a screenshot next to its report."""
    deadline = time.monotonic() + 120
    url = None
    while url is None:
        assert run.proc.poll() is None and time.monotonic() < deadline, run.log.read_text()
        found = re.search(r"dashboard:  (http://\S+)/", run.log.read_text(errors="replace"))
        url = found.group(1) if found else None
        time.sleep(0.2)
    while True:
        assert run.proc.poll() is None and time.monotonic() < deadline, "no heal during the run"
        try:
            events = get_json(f"{url}/status.json")["history"]["events"]
        except OSError:
            events = []
        if any(e["kind"] == "heal" and e["step"] > 1 for e in events):
            break
        time.sleep(0.3)
    shot = run.out / "dashboard-history.png"
    Chromium(str(find_chromium())).screenshot(f"{url}/", shot, size=(1280, 1600))
    return shot


@pytest.mark.timeout(240)
def test_ci_demo_run_with_failures(demo: Any) -> None:
    """What CI runs: `ftdist demo --duration 20 --kill-every 5`."""
    run = demo("--duration", "20", "--kill-every", "5")
    shot = _screenshot_after_a_heal(run) if find_chromium() else None
    code, stdout = run.finish(timeout=200)
    assert code == 0, stdout
    assert "VERDICT: PASS" in stdout
    assert "dashboard:  http://127.0.0.1:" in stdout
    report = run.report()
    verdict = report["verdict"]
    assert verdict["ok"] is True, verdict
    assert len(verdict["hashes"]) == 3 and len(set(verdict["hashes"].values())) == 1
    assert set(verdict["steps"].values()) == {report["run"]["stop_step"]}
    for digest in verdict["hashes"].values():
        assert digest in stdout

    main = report["run"]
    kinds = [i["kind"] for i in main["injections"]]
    assert "kill" in kinds and "stop" in kinds, kinds
    for injection in main["injections"]:
        # Every victim came back, and the survivors never waited for it.
        assert injection["back_s"] is not None, injection
        assert injection["survivors_s"] is not None, injection
    victims = {i["replica"] for i in main["injections"] if i["kind"] == "kill"}
    for replica in main["replicas"]:
        if replica["replica"] in victims:
            assert replica["processes"] >= 2
    recoveries = [h for h in main["heals"] if h["role"] == "receive" and h["step"] > 1]
    assert len(recoveries) >= len(main["injections"])
    assert all(h["transfer_bytes"] > 0 for h in recoveries)
    assert main["unexpected_exits"] == []
    assert main["steps_committed"] == main["stop_step"]
    assert main["loss"]["last"] < main["loss"]["first"] - 0.2, main["loss"]
    # The exact sampler (the default): every sample of the completed epochs
    # once, through the failures; torchft's static shards would have lost
    # the shards of the groups out of a step (simulated from the quorums).
    assert_exact_ledger(main["ledger"], complete_epochs=1)
    simulated = main["ledger"]["torchft"]
    assert simulated["shrunk_steps"] > 0 and simulated["lost"] > 0, simulated
    assert "data ledger (ExactSampler" in stdout
    assert "a simulation from this run's recorded quorums" in stdout

    # The lighthouse's history: the failures injected (a victim killed again
    # before it joined a quorum is no member's failure; a stop may outlast
    # the heartbeat timeout or not), every recovery a heal its manager
    # reported; a dashboard screenshot taken during the run is linked from
    # the report.
    history = report["lighthouse_history"]
    failed = [e for e in history["events"] if e["kind"] == "failure" and e["cause"] != "left"]
    assert 1 <= len(failed) <= len(main["injections"]), history["events"]
    assert len([e for e in history["events"] if e["kind"] == "heal"]) >= len(recoveries)
    if shot is not None:
        assert report["dashboard_screenshots"] == [str(shot)]
        assert f"dashboard screenshot: {shot}" in stdout
        assert shot.read_bytes().startswith(PNG_MAGIC)

    png = (run.out / "report.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000
    assert str(run.out / "report.json") in stdout and str(run.out / "report.png") in stdout
    logs = list((run.out / "events" / "run").glob("replica*.attempt*.log"))
    assert len(logs) == 3 + sum(r["processes"] - 1 for r in main["replicas"])
    run.assert_nothing_left()


@pytest.mark.timeout(180)
def test_ctrl_c_stops_everything_and_still_reports(demo: Any) -> None:
    run = demo("--duration", "120", "--kill-every", "60", "--plain")
    events = run.out / "events" / "run"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        files = list(events.glob("replica*.jsonl")) if events.exists() else []
        if len(files) == 3 and all(f.read_text().count('"kind": "step"') >= 5 for f in files):
            break
        assert run.proc.poll() is None, run.finish(5)[1]
        time.sleep(0.2)
    else:
        pytest.fail("the replicas never started stepping")
    # A terminal sends SIGINT to the whole foreground process group.
    os.killpg(run.proc.pid, signal.SIGINT)
    code, stdout = run.finish(timeout=60)
    assert code == 130, stdout
    assert "Ctrl-C" in stdout
    report = run.report()
    assert report["interrupted"] is True and report["run"]["interrupted"] is True
    # The graceful path still brought every replica to the same step.
    assert report["verdict"]["ok"] is True, report["verdict"]
    assert (run.out / "report.png").read_bytes().startswith(PNG_MAGIC)
    run.assert_nothing_left()


@pytest.mark.timeout(180)
def test_baseline_on_an_existing_lighthouse(demo: Any, lh: Lighthouses) -> None:
    server = lh.server(heartbeat_timeout_ms=2000, join_timeout_ms=100)
    run = demo(
        "--no-failures",
        "--baseline",
        "--replicas",
        "2",
        "--duration",
        "6",
        "--lighthouse",
        server.address(),
    )
    code, stdout = run.finish(timeout=150)
    assert code == 0, stdout
    assert f"lighthouse: {server.address()} (joined" in stdout
    report = run.report()
    assert report["run"]["failures_injected"]["total"] == 0
    base = report["baseline"]
    assert base is not None and base["verdict"]["ok"] is True
    assert base["stop_step"] == report["run"]["stop_step"]
    comparison = report["comparison"]
    # Every step but step 0, the initial sync, which reads nothing.
    assert comparison["steps_compared"] == report["run"]["stop_step"] - 1
    assert comparison["mean_abs_diff_all_steps"] is not None
    assert "baseline without failures" in stdout
    # Too short for a whole epoch: what was read is exactly what lies before the cursor.
    assert_exact_ledger(report["run"]["ledger"])
    assert_exact_ledger(base["ledger"])
    run.assert_nothing_left()


@pytest.mark.timeout(60)
def test_unreachable_lighthouse_fails_before_starting_replicas(demo: Any) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = demo("--lighthouse", f"127.0.0.1:{port}", "--duration", "5")
    code, stdout = run.finish(timeout=50)
    assert code == 2, stdout
    assert f"127.0.0.1:{port}" in stdout and "Traceback" not in stdout
    assert not (run.out / "events" / "run").exists()
    run.assert_nothing_left()


@pytest.mark.timeout(120)
def test_no_replica_outlives_a_killed_demo(demo: Any) -> None:
    """Even SIGKILL of the demo itself (no cleanup runs) leaves no trainer behind."""
    run = demo("--duration", "60", "--no-failures", "--plain")
    events = run.out / "events" / "run"
    deadline = time.monotonic() + 60
    while not (events.exists() and len(list(events.glob("replica*.jsonl"))) == 3):
        assert time.monotonic() < deadline, "the replicas never started"
        assert run.proc.poll() is None, run.finish(5)[1]
        time.sleep(0.2)
    assert len(processes_with(run.token)) >= 4  # demo, fork server, 3 replicas
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.communicate(timeout=10)
    run.assert_nothing_left()


@pytest.mark.timeout(120)
def test_a_replica_late_for_the_last_steps_still_ends_identical(
    tmp_path: Path, lh: Lighthouses
) -> None:
    """A replica hung while the others reach the stop step heals to it afterwards.

    The others finish while it is stopped; they keep joining quorum rounds
    (without stepping) until it is back, so that its majority quorum forms
    and it heals to the stop step instead of waiting forever.
    """
    from ftdist.demo.worker import STOP_KEY, WorkerConfig, replica_main
    from ftdist.launch.ranks import Ranks

    server = lh.server(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=100)
    events = tmp_path / "events"
    events.mkdir()
    cfg = WorkerConfig(
        lighthouse=server.address(),
        events_dir=str(events),
        seed=1,
        replicas=3,
        run="late-",
        step_interval_s=0.05,
    )
    stop = 40

    def last_step(replica: int) -> int:
        text = (events / f"replica{replica}.attempt0.jsonl").read_text()
        steps = [json.loads(line) for line in text.splitlines() if '"step"' in line]
        return max((e["step"] for e in steps if e["kind"] == "step" and e["ok"]), default=-1)

    with Ranks(replica_main, 3, args=(cfg, 0)) as ranks:
        ranks.parent_store().set(STOP_KEY, str(stop))
        deadline = time.monotonic() + 60
        while (
            not all((events / f"replica{r}.attempt0.jsonl").exists() for r in range(3))
            or last_step(2) < 10
        ):
            assert time.monotonic() < deadline, "replica 2 never reached step 10"
            time.sleep(0.05)
        ranks.signal(2, signal.SIGSTOP)
        while last_step(0) < stop - 1 or last_step(1) < stop - 1:
            assert time.monotonic() < deadline, "the others never reached the stop step"
            time.sleep(0.05)
        time.sleep(1.0)  # they are waiting for it now
        ranks.signal(2, signal.SIGCONT)
        outcomes = ranks.join(timeout=60)
    assert all(o.ok for o in outcomes), [o.error or o.exitcode for o in outcomes]
    finals = []
    for r in range(3):
        lines = (events / f"replica{r}.attempt0.jsonl").read_text().splitlines()
        finals += [json.loads(line) for line in lines if '"final"' in line]
    assert [f["step"] for f in finals] == [stop] * 3
    assert len({f["hash"] for f in finals}) == 1
    heals = [
        json.loads(line)
        for line in (events / "replica2.attempt0.jsonl").read_text().splitlines()
        if '"heal"' in line
    ]
    assert any(h["role"] == "receive" and h["step"] == stop for h in heals), heals
    from ftdist.demo.events import EventReader
    from ftdist.demo.ledger import build_ledger
    from ftdist.demo.worker import sampling

    how = sampling(cfg)
    assert how is not None
    ledger = build_ledger(EventReader(str(events)).read(), how, stop)
    assert ledger["steps"] == stop
    assert_exact_ledger(ledger)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replicated_lighthouse_fails_over_and_the_job_ends_identical(demo: Any) -> None:
    """`ftdist demo --replicated-lighthouse`: three lighthouse replicas on a local
    etcd, the leader killed mid-run; every group commits again and ends identical."""
    from ftdist.etcd.local import find_etcd_binary
    from tests.etcd_fixtures import NO_ETCD

    if find_etcd_binary() is None:
        pytest.skip(NO_ETCD)
    run = demo("--replicated-lighthouse", "--duration", "40", "--plain")
    _diagnostics.watch_glob(run.out / "lighthouse", "**/*.log", "demo lighthouse log", limit=4000)
    code, stdout = run.finish(timeout=270)
    assert code == 0, stdout
    assert "VERDICT: PASS" in stdout and "lighthouse failovers" in stdout
    report = run.report()
    verdict = report["verdict"]
    assert verdict["ok"] is True, verdict
    assert len(verdict["hashes"]) == 3 and len(set(verdict["hashes"].values())) == 1
    assert set(verdict["steps"].values()) == {report["run"]["stop_step"]}

    replicated = report["replicated_lighthouse"]
    assert len(replicated["replicas"]) == 3
    assert report["lighthouse"] == ",".join(replicated["replicas"])
    main = report["run"]
    failovers = main["failovers"]
    assert failovers, stdout
    assert main["failures_injected"]["leader"] == len(failovers)
    for f in failovers:
        assert f["error"] is None, f
        assert f["new_leader"] is not None and f["new_leader"] != f["old_leader"], f
        # Every group committed again, and the row's wait is the worst group's.
        assert all(s is not None and s > 0 for s in f["resumed_s"]), f
        assert f["waited_s"] == max(f["resumed_s"]) and f["elected_s"] is not None
        assert f["restarted_s"] is not None, "the killed replica came back"
        new_log = run.out / "lighthouse" / f"lighthouse-{f['new_leader']}.log"
        assert "is the leader of job" in new_log.read_text(), new_log
    assert main["unexpected_exits"] == []
    assert main["steps_committed"] == main["stop_step"]
    # A lighthouse failover loses no sample either.
    assert_exact_ledger(main["ledger"], complete_epochs=1)
    for i in range(3):
        assert (run.out / "lighthouse" / f"lighthouse-{i}.log").exists()
        assert (run.out / "lighthouse" / "etcd" / f"m{i}.log").exists()
    assert (run.out / "report.png").read_bytes().startswith(PNG_MAGIC)
    # The etcd members and the lighthouse replicas ended with the demo.
    run.assert_nothing_left()
