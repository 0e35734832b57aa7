"""What an operator sees of a replicated lighthouse: three ``ftdist lighthouse
--etcd`` replicas on a real three-member etcd cluster, asked for their
``/status.json`` and ``/metrics`` over HTTP and through ``ftdist status`` as
a real process, before and after the leader is SIGKILLed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftdist.cli.status import render
from ftdist.etcd.local import LocalEtcdCluster
from ftdist.lighthouse.client import LighthouseClient
from ftdist.lighthouse.local import LocalLighthouseReplicas
from ftdist.lighthouse.status import render_metrics
from tests import _diagnostics
from tests.etcd_fixtures import etcd_cluster  # noqa: F401
from tests.integration.lighthouse_helpers import TIMEOUT, get_json, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("replicated-lighthouse")]

# The replica set and failover history are read from etcd every ~2 s; a
# loaded machine gets ten times that.
REFRESH_WAIT_S = 20.0
STATUS_CMD = [sys.executable, "-m", "ftdist", "status", "--timeout", str(TIMEOUT)]


@pytest.fixture
def replicas(
    etcd_cluster: LocalEtcdCluster,  # noqa: F811
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[LocalLighthouseReplicas]:
    """Three lighthouse replicas of one job, one of them leading."""
    log_dir = tmp_path / "lh"
    _diagnostics.watch_glob(log_dir, "lighthouse-*.log", "lighthouse replica log", limit=4000)
    job = request.node.name[:100]
    with LocalLighthouseReplicas(etcd_cluster.endpoint_arg, job, 3, log_dir=log_dir) as group:
        yield group


def _document(replicas: LocalLighthouseReplicas, i: int) -> dict[str, Any]:
    """Replica ``i``'s status document, from its dashboard."""
    document: dict[str, Any] = get_json(f"{replicas.dashboards[i]}/status.json")
    return document


def _name(replicas: LocalLighthouseReplicas, i: int) -> str:
    return replicas.addresses[i].removeprefix("http://")


def _settled(document: dict[str, Any], live: int, leader: str) -> bool:
    """Whether ``document``'s view from etcd shows ``live`` replicas, led by
    ``leader``, and every etcd endpoint healthy (the health thread's last
    round may predate the election)."""
    replication = document["replication"]
    return (
        len(replication["replicas"]) == live
        and (replication["leader"] or {}).get("name") == leader
        and {r["name"]: r["role"] for r in replication["replicas"]}.get(leader) == "leader"
        and bool(replication["failovers"])
        and bool(replication["etcd"])
        and all(m["ok"] for m in replication["etcd"])
    )


def _settled_document(replicas: LocalLighthouseReplicas, i: int, leader: int) -> dict[str, Any]:
    documents: list[dict[str, Any]] = []

    def settled() -> bool:
        documents.append(_document(replicas, i))
        return _settled(documents[-1], 3, _name(replicas, leader))

    wait_until(settled, REFRESH_WAIT_S, f"replica {i}'s status shows the replica set")
    return documents[-1]


def _metrics(replicas: LocalLighthouseReplicas, i: int) -> tuple[str, dict[str, float]]:
    """Replica ``i``'s ``/metrics`` body and its samples by name and labels."""
    with urllib.request.urlopen(f"{replicas.dashboards[i]}/metrics", timeout=TIMEOUT) as resp:
        body = resp.read().decode()
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return body, samples


def _status_cli(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*STATUS_CMD, *args], capture_output=True, text=True, timeout=3 * TIMEOUT
    )
    assert result.returncode == 0, result.stderr
    return result


def test_every_replica_documents_the_replica_set(
    replicas: LocalLighthouseReplicas,
    etcd_cluster: LocalEtcdCluster,  # noqa: F811
) -> None:
    leader = replicas.wait_leader()
    follower = (leader + 1) % 3
    names = [_name(replicas, i) for i in range(3)]
    roles = {name: "leader" if i == leader else "follower" for i, name in enumerate(names)}

    for i in (leader, follower):
        document = _settled_document(replicas, i, leader)
        replication = document["replication"]
        assert replication["job"] == replicas.job
        assert replication["name"] == names[i]
        assert replication["address"] == replicas.addresses[i]
        assert replication["role"] == ("leader" if i == leader else "follower")
        assert replication["serving"] is (i == leader)
        assert replication["serving_reason"]
        # Both name the same leader, with the way to its dashboard.
        assert replication["leader"]["name"] == names[leader]
        assert replication["leader"]["address"] == replicas.addresses[leader]
        assert replication["leader"]["dashboard"] == replicas.dashboards[leader]
        assert {r["name"]: r["role"] for r in replication["replicas"]} == roles
        assert {r["name"]: r["dashboard"] for r in replication["replicas"]} == dict(
            zip(names, replicas.dashboards, strict=True)
        )
        assert replication["failovers"][0]["leader"] == names[leader]
        assert replication["etcd_endpoints"] == etcd_cluster.endpoints
        assert [m["endpoint"] for m in replication["etcd"]] == etcd_cluster.endpoints
        assert sum(m["is_raft_leader"] for m in replication["etcd"]) == 1
        assert 0 < replication["lease"]["left_s"] <= replication["lease"]["ttl_s"]
        if i == follower:
            # Only the leader holds the quorum view.
            assert document["quorum"] is None and document["heartbeats"] == []

        body, samples = _metrics(replicas, i)
        for gauge in ("is_leader", "serving", "replicas", "failovers", "lease_left_seconds"):
            assert f"# TYPE ftdist_lighthouse_{gauge} gauge" in body
            assert f"# HELP ftdist_lighthouse_{gauge} " in body
        assert "# TYPE ftdist_lighthouse_etcd_up gauge" in body
        assert samples["ftdist_lighthouse_is_leader"] == (1 if i == leader else 0)
        assert samples["ftdist_lighthouse_serving"] == (1 if i == leader else 0)
        assert samples["ftdist_lighthouse_replicas"] == 3
        assert samples["ftdist_lighthouse_failovers"] >= 1
        assert 0 < samples["ftdist_lighthouse_lease_left_seconds"] <= 60
        for endpoint in etcd_cluster.endpoints:
            assert samples[f'ftdist_lighthouse_etcd_up{{endpoint="{endpoint}"}}'] == 1


def test_status_cli_asks_the_leader_and_prints_the_replicas(
    replicas: LocalLighthouseReplicas,
) -> None:
    leader = replicas.wait_leader()
    follower = (leader + 1) % 3
    _settled_document(replicas, follower, leader)
    # The output is the leader's document: its view of the replica set (read
    # from etcd every ~2 s) must be complete too.
    _settled_document(replicas, leader, leader)
    # A heartbeat only the leader holds: seen in the output, it proves the
    # quorum part is the leader's document although a follower answered.
    with LighthouseClient(replicas.addresses[leader], TIMEOUT) as client:
        client.heartbeat("trainer-a")
    follower_first = ",".join(replicas.addresses[(follower + k) % 3] for k in range(3))

    out = _status_cli(follower_first).stdout
    assert out.startswith(f"Lighthouse {replicas.addresses[leader]} (leader of job ")
    assert "trainer-a" in out.split("Heartbeats:", 1)[1]
    section = out.split("Replicas of job ", 1)[1]
    assert section.startswith(
        f"{replicas.job}: leader {_name(replicas, leader)} ({replicas.addresses[leader]})"
    )
    for i in range(3):
        role = "leader" if i == leader else "follower"
        [row] = [
            line.split()
            for line in section.splitlines()
            if line.split()[:1] == [_name(replicas, i)]
        ]
        assert row[:3] == [_name(replicas, i), role, replicas.addresses[i]], section
    assert "etcd: 3 endpoints, 3 ok" in section
    assert "Failovers: " in section and "lease TTL" in section

    document = json.loads(_status_cli(follower_first, "--json").stdout)
    assert document["replication"]["role"] == "leader"
    assert document["replication"]["name"] == _name(replicas, leader)
    assert [h["replica_id"] for h in document["heartbeats"]] == ["trainer-a"]

    # Given one follower, it prints that follower, which points at the leader.
    out = _status_cli(replicas.addresses[follower]).stdout
    assert out.startswith(f"Lighthouse {replicas.addresses[follower]} (follower of job ")
    assert f"Quorum: kept by the leader, {_name(replicas, leader)}" in out


def test_failover_is_recorded_and_shown(replicas: LocalLighthouseReplicas) -> None:
    old = replicas.wait_leader()
    replicas.signal(old, signal.SIGKILL)
    new = replicas.wait_leader(timeout=30, other_than=old)
    documents: list[dict[str, Any]] = []

    def recorded() -> bool:
        documents.append(_document(replicas, new))
        failovers = documents[-1]["replication"]["failovers"]
        return bool(failovers) and failovers[0]["leader"] == _name(replicas, new)

    wait_until(recorded, REFRESH_WAIT_S, "the new leader's status shows the failover")
    replication = documents[-1]["replication"]
    newest, *earlier = replication["failovers"]
    assert newest["previous"] == _name(replicas, old)
    assert newest["address"] == replicas.addresses[new]
    assert _name(replicas, old) in [f["leader"] for f in earlier]
    assert all(newest["time"] >= f["time"] for f in earlier)
    assert replication["role"] == "leader" and replication["serving"]

    # The killed replica's key goes with its lease; the metrics follow.
    wait_until(
        lambda: len(_document(replicas, new)["replication"]["replicas"]) == 2,
        REFRESH_WAIT_S,
        "the killed replica leaves the replica set",
    )
    _, samples = _metrics(replicas, new)
    assert samples["ftdist_lighthouse_is_leader"] == 1
    assert samples["ftdist_lighthouse_replicas"] == 2
    assert samples["ftdist_lighthouse_failovers"] >= 2

    # The dead replica listed first is passed over.
    dead_first = ",".join(replicas.addresses[(old + k) % 3] for k in range(3))
    out = _status_cli(dead_first).stdout
    assert out.startswith(f"Lighthouse {replicas.addresses[new]} (leader of job ")
    failovers = out.split("Failovers: ", 1)[1].splitlines()
    assert failovers[2].split()[-2:] == [_name(replicas, new), _name(replicas, old)], out


# -- rendering whatever a replica sends ------------------------------------------------


def _replication(**overrides: Any) -> dict[str, Any]:
    replication: dict[str, Any] = {
        "job": "j",
        "name": "h1:1",
        "address": "http://h1:1",
        "role": "candidate",
        "fencing_revision": None,
        "leading_for_s": None,
        "last_error": "etcd: connection refused",
        "etcd": [
            {
                "endpoint": 'http://e"1\\:2379',
                "ok": False,
                "version": "",
                "is_raft_leader": False,
                "latency_ms": 0.0,
                "error": "refused",
            }
        ],
        "replicas": [],
        "failovers": [{"time": "soon", "leader": None, "address": None, "previous": ""}],
        "leader": None,
        "serving": False,
        "serving_reason": "no leader",
        "lease": None,
        "etcd_endpoints": ['http://e"1\\:2379'],
    }
    replication.update(overrides)
    return replication


def test_render_a_candidate_without_leader_lease_or_healthy_etcd() -> None:
    text = render({"replication": _replication()}, "http://h1:1")
    assert "Lighthouse http://h1:1 (candidate of job j)" in text
    assert "Quorum: kept by the leader; none is elected right now" in text
    assert "Replicas of job j: no leader" in text
    assert "lease none; not serving: no leader" in text
    assert "Last etcd error: etcd: connection refused" in text
    assert "etcd: 1 endpoint, 0 ok" in text and "error: refused" in text
    assert "Failovers: 1 recorded" in text


def test_render_tolerates_a_malformed_replication_section() -> None:
    odd = _replication(
        replicas=[None, {"name": "\x1b[31mred"}], etcd=[], leader="x", failovers=None
    )
    text = render({"replication": odd}, "h1:1")
    assert "\x1b" not in text and "\\x1b[31mred" in text
    assert "(not probed yet)" in text and "Failovers: none recorded" in text
    assert render({"replication": "nonsense"}, "h1:1").startswith("Lighthouse h1:1\n")


def test_metrics_escape_endpoint_labels() -> None:
    document: dict[str, Any] = {
        "quorum_id": 0,
        "quorum": None,
        "num_heartbeating": 0,
        "waiting": [],
        "next_quorum": {"ready": False, "reason": ""},
        "num_subscribers": 0,
        "quorums_total": 0,
        "member_failures_total": 0,
        "quorum_latency_seconds": {"buckets": [["+Inf", 0]], "sum": 0.0, "count": 0},
    }
    assert "ftdist_lighthouse_is_leader" not in render_metrics(document)
    body = render_metrics({**document, "replication": _replication()})
    assert 'ftdist_lighthouse_etcd_up{endpoint="http://e\\"1\\\\:2379"} 0' in body
    assert "ftdist_lighthouse_lease_left_seconds 0\n" in body
    assert "ftdist_lighthouse_is_leader 0\n" in body
