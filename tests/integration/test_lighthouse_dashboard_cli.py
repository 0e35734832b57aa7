"""The lighthouse dashboard (JSON, metrics, page, kill) over real HTTP, and the
``ftdist lighthouse`` command line as a real process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from ftdist import cli
from ftdist._rpc._proto import torchft_pb2
from ftdist._rpc.cq_server import CompletionQueueServer, RpcCall
from ftdist.errors import CoordinationError
from tests.integration.lighthouse_helpers import (
    TIMEOUT,
    Lighthouses,
    get_json,
    member_ids,
    pool,
    quorum_round,
)

pytestmark = pytest.mark.timeout(60)


class FakeManager:
    """A ManagerService that only records Kill calls."""

    def __init__(self) -> None:
        self.kills: list[str] = []
        self.server = CompletionQueueServer(
            "127.0.0.1:0",
            {"/torchft.ManagerService/Kill": self._kill},
            [],
            thread_name="test-fake-manager",
        )
        self.address = f"http://127.0.0.1:{self.server.start()}"

    def _kill(self, rpc: RpcCall, request: bytes) -> None:
        self.kills.append(torchft_pb2.KillRequest.FromString(request).msg)
        rpc.reply(torchft_pb2.KillResponse().SerializeToString())

    def close(self) -> None:
        self.server.stop(0.5)


def _post(url: str, token: str | None = None) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url, method="POST", data=b"")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            import json

            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        import json

        return error.code, json.loads(error.read())


# -- dashboard ------------------------------------------------------------------


def test_status_json_describes_quorum_members_and_heartbeats(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=2, http_port=0)
    client = lh.client(server)
    with pool(2) as executor:
        futures = [
            executor.submit(
                client.quorum,
                rid,
                TIMEOUT,
                address=f"http://mgr-{rid}:1",
                store_address=f"store-{rid}:2",
                step=step,
                world_size=4,
            )
            for rid, step in (("a", 7), ("b", 5))
        ]
        [f.result(TIMEOUT) for f in futures]
    client.heartbeat("idle")
    status = get_json(f"{server.dashboard_address()}/status.json")
    assert status["quorum_id"] == 1
    quorum = status["quorum"]
    assert quorum["quorum_id"] == 1 and quorum["num_members"] == 2 and quorum["max_step"] == 7
    assert quorum["age_s"] >= 0 and quorum["created"].endswith("+00:00")
    members = {m["replica_id"]: m for m in quorum["members"]}
    assert members["a"] | {"heartbeat_age_s": None} == {
        "replica_id": "a",
        "step": 7,
        "address": "http://mgr-a:1",
        "store_address": "store-a:2",
        "world_size": 4,
        "shrink_only": False,
        "commit_failures": 0,
        "recovering": False,
        "heartbeat_age_s": None,
    }
    assert members["b"]["recovering"] is True  # behind the max step
    assert {h["replica_id"] for h in status["heartbeats"]} == {"a", "b", "idle"}
    assert all(h["healthy"] and h["age_s"] >= 0 for h in status["heartbeats"])
    assert status["next_quorum"]["ready"] is False
    assert "need min_replicas 2" in status["next_quorum"]["reason"]
    assert status["settings"]["min_replicas"] == 2
    assert status["settings"]["kill_enabled"] is False


def test_metrics_are_prometheus_text(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1, http_port=0)
    client = lh.client(server)
    quorum_round(client, ["a"])
    quorum_round(client, ["a"])
    with urllib.request.urlopen(f"{server.dashboard_address()}/metrics", timeout=TIMEOUT) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    lines = text.splitlines()
    assert "ftdist_lighthouse_quorum_id 1" in lines
    assert "ftdist_lighthouse_quorum_members 1" in lines
    assert "ftdist_lighthouse_heartbeating_replicas 1" in lines
    assert "ftdist_lighthouse_quorums_total 2" in lines
    assert "# TYPE ftdist_lighthouse_quorum_latency_seconds histogram" in lines
    assert 'ftdist_lighthouse_quorum_latency_seconds_bucket{le="+Inf"} 2' in lines
    assert "ftdist_lighthouse_quorum_latency_seconds_count 2" in lines
    for line in lines:
        assert line.startswith("#") or re.fullmatch(
            r"[a-z_]+(\{(le|cause)=\"[^\"]+\"\})? [0-9.e+-]+", line
        ), line


def test_page_is_self_contained_with_test_hooks(lh: Lighthouses) -> None:
    server = lh.server(http_port=0)
    with urllib.request.urlopen(f"{server.dashboard_address()}/", timeout=TIMEOUT) as r:
        page = r.read().decode()
    for hook in (
        'id="quorum-id"',
        'id="next-reason"',
        'id="members"',
        'id="heartbeats"',
        'id="kill-token"',
        "data-replica-id",
        "recovering",
        "/status.json",
    ):
        assert hook in page
    assert "http://" not in page and "https://" not in page  # no CDN
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{server.dashboard_address()}/nope", timeout=TIMEOUT)
    assert info.value.code == 404


def test_kill_is_off_without_token(lh: Lighthouses) -> None:
    server = lh.server(http_port=0)
    code, body = _post(f"{server.dashboard_address()}/replica/a/kill", token="anything")
    assert code == 403 and "disabled" in str(body["error"])


def test_kill_with_token_calls_the_members_manager(lh: Lighthouses) -> None:
    manager = FakeManager()
    try:
        server = lh.server(min_replicas=1, http_port=0, kill_token="s3cret")
        client = lh.client(server)
        client.quorum("victim", TIMEOUT, address=manager.address)
        url = f"{server.dashboard_address()}/replica/victim/kill"
        assert _post(url)[0] == 401
        assert _post(url, token="wrong")[0] == 401
        assert manager.kills == []
        code, body = _post(f"{server.dashboard_address()}/replica/nobody/kill", token="s3cret")
        assert code == 404 and "not in the current quorum" in str(body["error"])
        code, body = _post(url, token="s3cret")
        assert (code, body) == (200, {"killed": "victim", "address": manager.address})
        assert manager.kills == ["killed from dashboard"]
    finally:
        manager.close()


def test_kill_reports_unreachable_manager(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1, http_port=0, kill_token="t")
    client = lh.client(server)
    client.quorum("victim", TIMEOUT, address="http://127.0.0.1:1")
    code, body = _post(f"{server.dashboard_address()}/replica/victim/kill", token="t")
    assert code == 502 and "failed to kill replica victim" in str(body["error"])


# -- command line --------------------------------------------------------------


def test_help_for_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["lighthouse", "--help"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 0
    out = capsys.readouterr().out
    assert "lighthouse" in out
    for flag in (
        "--bind",
        "--min-replicas",
        "--join-timeout-ms",
        "--quorum-tick-ms",
        "--heartbeat-timeout-ms",
        "--http-port",
        "--kill-token",
    ):
        assert flag in out


def test_cli_reports_missing_min_replicas() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTDIST_LIGHTHOUSE_")}
    result = subprocess.run(
        [sys.executable, "-m", "ftdist.cli", "lighthouse", "--bind", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    assert result.returncode == 2
    assert "min_replicas is required" in result.stderr


class LighthouseProcess:
    """``ftdist lighthouse`` as a child process."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ftdist.cli", "lighthouse", "--bind", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"serving on (http://\S+) \(dashboard: (\S+)\)", line)
        if match is None:
            self.proc.kill()
            raise AssertionError(
                f"unexpected first line {line!r}: {self.proc.stderr.read() if self.proc.stderr else ''}"
            )
        self.address, self.dashboard = match.group(1), match.group(2)

    def stop(self, sig: int) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=TIMEOUT)
        return self.proc.returncode, err


def test_cli_serves_and_stops_cleanly_on_sigterm(lh: Lighthouses) -> None:
    proc = LighthouseProcess("--min-replicas", "1", "--http-port", "0", "--quorum_tick_ms", "50")
    try:
        client = lh.client(proc.address)
        assert member_ids(client.quorum("a", TIMEOUT)) == ["a"]
        assert get_json(f"{proc.dashboard}/status.json")["quorum_id"] == 1
    finally:
        code, err = proc.stop(signal.SIGTERM)
    assert code == 0, err
    assert "Detected quorum change, bumping quorum_id to 1" in err
    assert "Received SIGTERM" in err


def test_cli_stops_on_sigint(lh: Lighthouses) -> None:
    proc = LighthouseProcess("--min-replicas", "1", "--http-port", "-1")
    code, err = proc.stop(signal.SIGINT)
    assert code == 0, err
    assert "Received SIGINT" in err


def test_quorum_in_flight_fails_when_lighthouse_process_dies(lh: Lighthouses) -> None:
    proc = LighthouseProcess("--min-replicas", "2", "--http-port", "-1")
    try:
        client = lh.client(proc.address)
        errors: list[BaseException] = []

        def ask() -> None:
            try:
                client.quorum("a", timeout=60)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=ask, name="test-quorum")
        thread.start()
        import time

        time.sleep(0.5)
        proc.proc.kill()
        thread.join(TIMEOUT)
        assert not thread.is_alive()
    finally:
        proc.stop(signal.SIGKILL)
    assert len(errors) == 1
    error = errors[0]
    assert isinstance(error, CoordinationError) and not isinstance(error, TimeoutError), error
    assert "unavailable" in str(error).lower()


def test_grpc_status_codes_survive_the_completion_queue_server() -> None:
    """The single-threaded server: unknown methods, handler crashes, streams."""

    def crash(rpc: RpcCall, request: bytes) -> None:
        raise ValueError("boom")

    def stream(rpc: RpcCall, request: bytes) -> None:
        for i in range(3):
            rpc.send(bytes([i]))
        rpc.abort(grpc.StatusCode.OK, "")

    server = CompletionQueueServer(
        "127.0.0.1:0", {"/t.S/Crash": crash, "/t.S/Stream": stream}, [], thread_name="test-cq"
    )
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary("/t.S/Crash")(b"", timeout=TIMEOUT)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "boom" in (info.value.details() or "")
            assert list(channel.unary_stream("/t.S/Stream")(b"", timeout=TIMEOUT)) == [
                b"\x00",
                b"\x01",
                b"\x02",
            ]
    finally:
        server.stop(0.5)


@pytest.mark.timeout(20)
def test_shutdown_does_not_wait_for_an_idle_keep_alive_dashboard_client() -> None:
    import socket as _socket

    from ftdist.coordination import LighthouseServer as _Server

    server = _Server(bind="127.0.0.1:0", min_replicas=1, http_port=0)
    address = server.dashboard_address()
    assert address is not None
    host, port = address.replace("http://", "").rstrip("/").rsplit(":", 1)
    conn = _socket.create_connection((host, int(port)))
    try:
        conn.sendall(b"GET /status.json HTTP/1.1\r\nHost: t\r\n\r\n")
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        server.shutdown()  # with the connection still open and idle
    finally:
        conn.close()
