"""The job token and TLS through real servers and sockets: the lighthouse, the
manager server (in its own process, since its Kill exits), the dashboard's
kill action, the command line, a Manager job, and the one warning of a job
without a token."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import ftdist_pb2, torchft_pb2
from ftdist._rpc.cq_server import CompletionQueueServer, RpcCall
from ftdist.cli.status import main as status_main
from ftdist.errors import CoordinationError
from ftdist.launch.ranks import RankContext, Ranks, run_ranks
from ftdist.lighthouse.client import LighthouseClient
from ftdist.manager.client import ManagerClient
from ftdist.manager.server import ManagerServer
from tests.integration.lighthouse_helpers import TIMEOUT, Lighthouses, member_ids
from tests.integration.test_lighthouse_dashboard_cli import LighthouseProcess, _post

pytestmark = pytest.mark.timeout(90)

TOKEN = "job-s3cret"
T = timedelta(seconds=10)
GOOD = (("authorization", f"Bearer {TOKEN}"),)
BAD_METADATA: list[tuple[tuple[str, str], ...] | None] = [
    None,
    (("authorization", "Bearer wrong"),),
    (("authorization", TOKEN),),  # no Bearer scheme
    (("x-other", f"Bearer {TOKEN}"),),
]
NEEDS_TOKEN = "requires the job token: set FTDIST_JOB_TOKEN"


def _quorum_request(replica_id: str) -> bytes:
    member = torchft_pb2.QuorumMember(replica_id=replica_id, address="m:1", step=1)
    request: bytes = torchft_pb2.LighthouseQuorumRequest(requester=member).SerializeToString()
    return request


def _unary(
    channel: grpc.Channel, method: str, payload: bytes, metadata: Any, timeout: float = TIMEOUT
) -> tuple[grpc.StatusCode, str]:
    try:
        channel.unary_unary(method)(payload, timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _first_of_stream(
    channel: grpc.Channel, method: str, payload: bytes, metadata: Any
) -> tuple[grpc.StatusCode, str]:
    call = channel.unary_stream(method)(payload, timeout=TIMEOUT, metadata=metadata)
    try:
        next(iter(call))
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return exc.code(), exc.details() or ""
    finally:
        call.cancel()
    return grpc.StatusCode.OK, ""


# -- the lighthouse ------------------------------------------------------------------


def test_lighthouse_refuses_every_call_without_the_token_and_records_nothing(
    lh: Lighthouses,
) -> None:
    server = lh.server(min_replicas=1, token=TOKEN)
    heartbeat = torchft_pb2.LighthouseHeartbeatRequest(replica_id="intruder").SerializeToString()
    calls = [
        (_rpc.LIGHTHOUSE_QUORUM, _quorum_request("intruder")),
        (_rpc.LIGHTHOUSE_HEARTBEAT, heartbeat),
        (_rpc.EVENTS_STATUS, ftdist_pb2.StatusRequest().SerializeToString()),
        ("/no.Such/Method", b"garbage"),
    ]
    subscribe = ftdist_pb2.SubscribeRequest(replica_id="intruder").SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for metadata in BAD_METADATA:
            for method, payload in calls:
                code, details = _unary(channel, method, payload, metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (method, metadata, details)
                assert details.startswith("this lighthouse "), details
                if metadata is None or metadata[0][0] != "authorization":
                    assert NEEDS_TOKEN in details
                else:
                    assert "is not the job's token" in details
            code, details = _first_of_stream(channel, _rpc.EVENTS_SUBSCRIBE, subscribe, metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED, details
        # With the token the same calls go through.
        beat = torchft_pb2.LighthouseHeartbeatRequest(replica_id="a").SerializeToString()
        assert _unary(channel, _rpc.LIGHTHOUSE_HEARTBEAT, beat, GOOD)[0] == grpc.StatusCode.OK
        assert _first_of_stream(channel, _rpc.EVENTS_SUBSCRIBE, subscribe, GOOD)[0] == (
            grpc.StatusCode.OK
        )
    with LighthouseClient(server.address(), 10, token=TOKEN) as good:
        status = good.status()
        # The refused calls left no trace: no heartbeat, no parked request, no stream.
        assert [h["replica_id"] for h in status["heartbeats"]] == ["a"]
        assert status["waiting"] == [] and status["quorum"] is None
        assert member_ids(good.quorum("a", TIMEOUT)) == ["a"]
    with LighthouseClient(server.address(), 10) as anonymous:
        with pytest.raises(
            CoordinationError, match=f"UNAUTHENTICATED: this lighthouse {NEEDS_TOKEN}"
        ):
            anonymous.heartbeat("a")


def test_clients_read_the_token_from_the_environment(
    lh: Lighthouses, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = lh.server(min_replicas=1, token=TOKEN)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("FTDIST_JOB_TOKEN_FILE", str(token_file))
    assert member_ids(lh.client(server).quorum("a", TIMEOUT)) == ["a"]
    monkeypatch.setenv("FTDIST_JOB_TOKEN", "not-it")  # the variable wins over the file
    with pytest.raises(CoordinationError, match="is not the job's token"):
        lh.client(server).heartbeat("a")


# -- the manager server ---------------------------------------------------------------


def _serve_manager(ctx: RankContext, lighthouse: str, token: str) -> None:
    server = ManagerServer(
        "victim:uuid",
        lighthouse,
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
        token=token,
    )
    ctx.store().set("addr", server.address())
    time.sleep(60)


def test_manager_server_refuses_calls_without_the_token_and_kill_needs_it(
    lh: Lighthouses,
) -> None:
    lighthouse = lh.server(min_replicas=1, token=TOKEN).address()
    calls: list[tuple[str, Message]] = [
        (_rpc.MANAGER_QUORUM, torchft_pb2.ManagerQuorumRequest(group_rank=0, step=1)),
        (_rpc.MANAGER_SHOULD_COMMIT, torchft_pb2.ShouldCommitRequest(should_commit=True)),
        (_rpc.MANAGER_CHECKPOINT_METADATA, torchft_pb2.CheckpointMetadataRequest(rank=0)),
        (_rpc.MANAGER_KILL, torchft_pb2.KillRequest(msg="not you")),
    ]
    with Ranks(_serve_manager, 1, args=(lighthouse, TOKEN)) as ranks:
        store = RankContext(0, 1, "127.0.0.1", ranks.store_port, ranks._prefix).store()
        address = store.get("addr").decode()
        with grpc.insecure_channel(_rpc.grpc_target(address)) as channel:
            for metadata in BAD_METADATA:
                for method, request in calls:
                    code, details = _unary(channel, method, request.SerializeToString(), metadata)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (method, details)
                    assert details.startswith("this manager server "), details
        # The refused Kill did nothing: the server answers a full round.
        with ManagerClient(address, T, token=TOKEN) as client:
            result = client.quorum(0, 4, "meta", False, True, 0, T)
            assert result.replica_ids == ["victim:uuid"] and result.max_step == 4
            assert client.checkpoint_metadata(0, T) == "meta"
            assert client.should_commit(0, 4, True, T) is True
        with ManagerClient(address, T) as anonymous:
            with pytest.raises(CoordinationError, match="this manager server requires"):
                anonymous.kill("no token")
        with ManagerClient(address, T, token=TOKEN) as client:
            client.kill("with the token")
        outcome = ranks.join(timeout=20)[0]
    assert outcome.exitcode == 1


# -- the dashboard ---------------------------------------------------------------------


class _TokenManager:
    """A ManagerService that records Kill calls and needs the job token."""

    def __init__(self) -> None:
        from ftdist._rpc.auth import metadata_refusal

        self.kills: list[str] = []
        self.server = CompletionQueueServer(
            "127.0.0.1:0",
            {_rpc.MANAGER_KILL: self._kill},
            [],
            thread_name="test-fake-manager",
            auth=lambda md: metadata_refusal(md, TOKEN, "this manager server"),
        )
        self.address = f"http://127.0.0.1:{self.server.start()}"

    def _kill(self, rpc: RpcCall, request: bytes) -> None:
        self.kills.append(torchft_pb2.KillRequest.FromString(request).msg)
        rpc.reply(torchft_pb2.KillResponse().SerializeToString())

    def close(self) -> None:
        self.server.stop(0.5)


@pytest.mark.parametrize("kill_token", [None, "kill-only"])
def test_the_job_token_enables_and_authorizes_the_dashboards_kill(
    lh: Lighthouses, kill_token: str | None
) -> None:
    manager = _TokenManager()
    try:
        server = lh.server(min_replicas=1, http_port=0, token=TOKEN, kill_token=kill_token)
        with LighthouseClient(server.address(), 10, token=TOKEN) as client:
            client.quorum("victim", TIMEOUT, address=manager.address)
            assert client.status()["settings"]["kill_enabled"] is True
        url = f"{server.dashboard_address()}/replica/victim/kill"
        code, body = _post(url)
        assert code == 401 and "requires the job token" in str(body["error"])
        assert _post(url, token="wrong")[0] == 401
        assert manager.kills == []
        # The lighthouse presents the job token to the manager (which needs it).
        assert _post(url, token=TOKEN)[0] == 200
        if kill_token is not None:  # the kill token keeps working
            assert _post(url, token=kill_token)[0] == 200
        assert manager.kills == ["killed from dashboard"] * (1 if kill_token is None else 2)
    finally:
        manager.close()


# -- TLS -----------------------------------------------------------------------------------


def _self_signed(tmp: Path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("neither the cryptography package nor the openssl command is available")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=ftdist-test",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


def test_tls_for_the_lighthouse_the_manager_server_and_the_status_command(
    lh: Lighthouses,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cert, key = _self_signed(tmp_path)
    # A short heartbeat timeout: "a" below must not hold the manager's quorum back.
    server = lh.server(
        min_replicas=1, heartbeat_timeout_ms=300, token=TOKEN, tls_cert=cert, tls_key=key
    )
    # A plaintext client never gets through the TLS handshake.
    with pytest.raises(CoordinationError, match="failed to connect"):
        LighthouseClient(server.address(), 1.5, token=TOKEN)
    with LighthouseClient(server.address(), 10, token=TOKEN, tls_ca=cert) as client:
        assert member_ids(client.quorum("a", TIMEOUT)) == ["a"]
    https = server.address().replace("http://", "https://")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    assert status_main([https, "--tls-ca", cert, "--token-file", str(token_file), "--json"]) == 0
    assert '"quorum_id": 1' in capsys.readouterr().out

    # Every process of a job reads the same variables: the manager server
    # serves TLS, its lighthouse client and the manager client use it.
    monkeypatch.setenv("FTDIST_TLS_CERT", cert)
    monkeypatch.setenv("FTDIST_TLS_KEY", key)
    monkeypatch.setenv("FTDIST_TLS_CA", cert)
    monkeypatch.setenv("FTDIST_JOB_TOKEN", TOKEN)
    manager = ManagerServer(
        "rep:uuid",
        server.address(),
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
    )
    try:
        with ManagerClient(manager.address(), T) as client:
            result = client.quorum(0, 2, "", False, True, 0, T)
        assert result.replica_ids == ["rep:uuid"]
        monkeypatch.delenv("FTDIST_TLS_CA")
        with pytest.raises(CoordinationError, match="unreachable"):
            ManagerClient(manager.address(), timedelta(seconds=1.5))
    finally:
        manager.shutdown()


# -- the command line --------------------------------------------------------------------


def test_cli_lighthouse_and_status_take_a_token_file(
    lh: Lighthouses, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc = LighthouseProcess(
        "--min-replicas", "1", "--http-port", "-1", "--token-file", str(token_file)
    )
    try:
        with LighthouseClient(proc.address, 10, token=TOKEN) as client:
            assert member_ids(client.quorum("a", TIMEOUT)) == ["a"]
        assert status_main([proc.address, "--token-file", str(token_file), "--json"]) == 0
        assert '"quorum_id": 1' in capsys.readouterr().out
        assert status_main([proc.address]) == 1
        err = capsys.readouterr().err
        assert f"UNAUTHENTICATED: this lighthouse {NEEDS_TOKEN}" in err, err
    finally:
        code, err = proc.stop(signal.SIGTERM)
    assert code == 0, err
    assert "without a job token" not in err


_OPEN_JOB = """
import logging, sys
from datetime import timedelta
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from ftdist.coordination import LighthouseServer
from ftdist.manager.client import ManagerClient
from ftdist.manager.server import ManagerServer
first = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_port=-1)
second = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_port=-1)
manager = ManagerServer("r", first.address(), "127.0.0.1", "127.0.0.1:0", "127.0.0.1:1", 1,
                        timedelta(seconds=1), timedelta(seconds=10))
ManagerClient(manager.address(), timedelta(seconds=10)).close()
manager.shutdown(); second.shutdown(); first.shutdown()
"""


def test_a_job_without_a_token_warns_exactly_once() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTDIST_JOB_", "FTDIST_TLS_"))}
    result = subprocess.run(
        [sys.executable, "-c", _OPEN_JOB], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "without a job token" in line]
    assert len(warnings) == 1, result.stderr
    assert "This lighthouse runs without a job token" in warnings[0]
    assert "FTDIST_JOB_TOKEN" in warnings[0] and "stop it" in warnings[0]


# -- a Manager job with the token -------------------------------------------------------------


def _train_with_token(ctx: RankContext, lighthouse: str, token: str, steps: int) -> dict[str, Any]:
    os.environ["FTDIST_JOB_TOKEN"] = token
    import torch

    from ftdist.ddp import DistributedDataParallel
    from ftdist.manager import Manager
    from ftdist.optim import OptimizerWrapper
    from ftdist.process_group import ProcessGroupGloo

    torch.manual_seed(ctx.rank)  # different weights: init_sync heals one from the other
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["m"])
        optim.load_state_dict(sd["o"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=T),
        load_state_dict=load_state_dict,
        state_dict=lambda: {"m": model.state_dict(), "o": optim.state_dict()},
        min_replica_size=1,
        replica_id=f"replica{ctx.rank}",
        lighthouse_addr=lighthouse,
        rank=0,
        world_size=1,  # the Manager hosts its own store, bound to 127.0.0.1
        hostname="127.0.0.1",
        timeout=T,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=T,
    )
    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, optim)
    try:
        while manager.current_step() < steps:
            opt.zero_grad()
            ddp(torch.ones(2, 4) * (manager.current_step() + 1)).sum().backward()
            opt.step()
        weights = [round(float(v), 6) for v in model.weight.flatten()]
        return {"step": manager.current_step(), "weights": weights}
    finally:
        manager.shutdown()


@pytest.mark.timeout(120)
def test_a_manager_job_runs_with_the_token(lh: Lighthouses) -> None:
    lighthouse = lh.server(min_replicas=2, join_timeout_ms=200, token=TOKEN).address()
    results = run_ranks(_train_with_token, 2, lighthouse, TOKEN, 3, timeout=100)
    assert [r["step"] for r in results] == [3, 3]
    assert results[0]["weights"] == results[1]["weights"]


def test_cli_reports_an_unreadable_token_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ftdist import cli

    missing = str(tmp_path / "missing")
    assert cli.main(["lighthouse", "--min-replicas", "1", "--token-file", missing]) == 2
    assert status_main(["127.0.0.1:1", "--token-file", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("No such file") == 2, err


# -- the replica group's own store --------------------------------------------------------


def _listening_hosts(port: int) -> set[str]:
    """The local addresses listening on ``port``, from /proc/net/tcp{,6}."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                host_hex, port_hex = local.split(":")
                if state != "0A" or int(port_hex, 16) != port:
                    continue
                raw = bytes.fromhex(host_hex)
                # The kernel prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                found.add(str(ipaddress.ip_address(raw)))
    return found


def test_a_replica_groups_own_store_listens_only_where_peers_reach_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ftdist.process_group._store import host_store

    monkeypatch.delenv("FTDIST_STORE_BIND", raising=False)
    local = host_store("127.0.0.1", T)
    assert _listening_hosts(local.port) == {"127.0.0.1"}
    local.set("k", "v")
    assert local.get("k") == b"v"
    monkeypatch.setenv("FTDIST_STORE_BIND", "0.0.0.0")
    everywhere = host_store("127.0.0.1", T)
    assert _listening_hosts(everywhere.port) & {"0.0.0.0", "::"}
    del local, everywhere


def test_a_groups_reconfigure_handle_store_follows_the_same_bind_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # get_reconfigure_handle() starts a store of its own: it must listen where
    # FTDIST_STORE_BIND says, as a replica group's store does (one policy).
    import json

    from ftdist.process_group import ProcessGroupGloo

    monkeypatch.setenv("FTDIST_STORE_BIND", "127.0.0.1")
    pg = ProcessGroupGloo(timeout=T)
    try:
        port = int(json.loads(pg.get_reconfigure_handle())["store"].rsplit(":", 1)[1])
        assert _listening_hosts(port) == {"127.0.0.1"}
    finally:
        pg.shutdown()
