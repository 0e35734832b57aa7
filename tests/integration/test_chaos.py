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

import subprocess
from pathlib import Path

import pytest

from ftdist.chaos import netns, schedule
from tests.integration.chaos_runs import run_chaos

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
    run = run_chaos(
        ["--short", "--duration", "30", "--gap", "2.5", "4", "--kinds", ",".join(KINDS)],
        tmp_path,
        timeout_s=220,
    )
    stdout = run.stdout
    assert run.returncode == 0, stdout[-6000:]
    assert "VERDICT: PASS" in stdout
    report = run.report()
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
        assert _namespaces_of(run.pid) == [], "namespaces outlived the run"
    else:
        assert "partitions SKIPPED" in stdout
    mid = [r for r in report["injections"] if r["kind"] == schedule.KILL_SOURCE]
    assert any(r["outcome"] == "done" and "mid-heal" in r["detail"] for r in mid), mid
    # Trainers watch the suite's process and exit with it.
    assert run.leftovers() == []
