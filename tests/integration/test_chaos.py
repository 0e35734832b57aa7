"""``ftdist chaos --short`` end to end: the CI version of the chaos suite.

Three replica groups of two ranks train for 30 s while a kill, a stop, a
kill of a heal source mid-transfer, a lighthouse restart and a partition
(only where network namespaces can be made: root) strike once each, in
that order. (``--short`` alone, 60 s and every kind, is the longer check;
this keeps CI's share of the suite small.) The suite runs as a subprocess, as ``make chaos`` runs
it, with a unique environment token, so the test can prove afterwards that
no process of it outlived it, and no namespace either.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ftdist.chaos import netns, schedule
from tests import _diagnostics
from tests._procs import processes_with

# One worker runs these in turn (make pytest: pytest-xdist, loadgroup):
# the chaos suite and the demos each load the whole machine, and a demo
# whose groups are starved by a concurrent chaos run never gets healthy
# enough to be struck.
pytestmark = pytest.mark.xdist_group("heavy")

NAMESPACES = netns.unavailable() is None
KINDS = [
    schedule.KILL,
    schedule.KILL_SOURCE,
    schedule.STOP,
    schedule.LIGHTHOUSE,
    schedule.CUT_LIGHTHOUSE,
]


def _namespaces_of(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    prefix = f"{netns.NS_PREFIX}{pid}-"
    return [line.split()[0] for line in out.stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_chaos_run_passes_with_every_kind_struck(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    env = {**os.environ, "FTDIST_CHAOS_TEST_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "chaos"
    # A file, not a pipe: what the suite printed is still there for the
    # failure report when it hangs (tests/_diagnostics.py).
    log = tmp_path / "chaos.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [
                *[sys.executable, "-m", "ftdist.cli", "chaos", "--short", "--duration", "30"],
                *["--gap", "2.5", "4", "--kinds", ",".join(KINDS), "--out", str(out)],
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    _diagnostics.watch(log, "ftdist chaos output")
    _diagnostics.watch_glob(out, "**/*.log", "chaos log")
    try:
        proc.wait(timeout=220)
        stdout = log.read_text(errors="replace")
    finally:
        _diagnostics.before_kill()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in processes_with(f"FTDIST_CHAOS_TEST_TOKEN={token}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 0, stdout[-6000:]
    assert "VERDICT: PASS" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["ok"], report["verdict"]
    assert report["divergence"]["ok"] and len(report["divergence"]["hashes"]) == 6
    assert report["hangs"] == [] and report["leaks"] == []
    assert report["unexpected_exits"] == []
    struck = {kind for kind, k in report["by_kind"].items() if k["struck"]}
    required = {schedule.KILL, schedule.STOP, schedule.KILL_SOURCE, schedule.LIGHTHOUSE}
    assert required <= struck, (struck, stdout[-4000:])
    if NAMESPACES:
        assert struck & set(schedule.PARTITIONS), struck
        assert report["partitions_skipped"] is None
        assert _namespaces_of(proc.pid) == [], "namespaces outlived the run"
    else:
        assert "partitions SKIPPED" in stdout
    mid = [r for r in report["injections"] if r["kind"] == schedule.KILL_SOURCE]
    assert any(r["outcome"] == "done" and "mid-heal" in r["detail"] for r in mid), mid
    # Trainers watch the suite's process and exit with it.
    deadline = time.monotonic() + 15
    while processes_with(f"FTDIST_CHAOS_TEST_TOKEN={token}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(f"FTDIST_CHAOS_TEST_TOKEN={token}") == []
