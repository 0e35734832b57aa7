"""``ftdist status`` against real lighthouses: the Status call, the client's
``status()``, the command in-process and as a real process, and its errors."""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from ftdist._rpc import common as _rpc
from ftdist._rpc.cq_server import CompletionQueueServer, RpcCall
from ftdist.cli import status as status_cli
from ftdist.cli.status import main, render
from ftdist.coordination import LighthouseServer
from ftdist.errors import CoordinationError
from tests.integration.lighthouse_helpers import (
    TIMEOUT,
    Lighthouses,
    pool,
    quorum_round,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

STATUS_CMD = [sys.executable, "-m", "ftdist.cli.status"]


@contextmanager
def quorum_with_a_straggler(lh: Lighthouses) -> Iterator[LighthouseServer]:
    """A lighthouse (min_replicas 2) whose quorum 1 is ``a`` at step 7 and ``b``
    at step 5 (recovering), with ``late`` parked for the next quorum and
    ``spare`` only heartbeating."""
    server = lh.server(min_replicas=2)
    client = lh.client(server)
    with pool(3) as executor:
        futures = [
            executor.submit(
                client.quorum,
                rid,
                TIMEOUT,
                address=f"http://mgr-{rid}:1",
                store_address=f"store-{rid}:2",
                step=step,
                world_size=ws,
            )
            for rid, step, ws in (("a", 7, 4), ("b", 5, 2))
        ]
        for future in futures:
            future.result(TIMEOUT)
        client.heartbeat("spare")
        straggler = executor.submit(client.quorum, "late", TIMEOUT, step=3)
        wait_until(
            lambda: any(w["replica_id"] == "late" for w in client.status(TIMEOUT)["waiting"]),
            what="the straggler to be parked",
        )
        try:
            yield server
        finally:
            # Ends the parked call (UNAVAILABLE) so the pool can join.
            server.shutdown()
            with pytest.raises(CoordinationError):
                straggler.result(TIMEOUT)


def _row(out: str, replica_id: str) -> list[str]:
    """The cells of the first table row that starts with ``replica_id``."""
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] == replica_id:
            return cells
    raise AssertionError(f"no row for {replica_id!r} in:\n{out}")


# -- the Status call and LighthouseClient.status -----------------------------


def test_client_status_is_the_dashboard_document(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1)
    client = lh.client(server)
    before = client.status(TIMEOUT)
    assert before["quorum_id"] == 0 and before["quorum"] is None
    assert before["settings"]["min_replicas"] == 1
    quorum_round(client, ["a"], step=3)
    after = client.status(TIMEOUT)
    assert after["quorum_id"] == 1
    assert [(m["replica_id"], m["step"]) for m in after["quorum"]["members"]] == [("a", 3)]
    assert after["quorums_total"] == 1


def test_status_call_rejects_a_malformed_request(lh: Lighthouses) -> None:
    server = lh.server()
    with grpc.insecure_channel(_rpc.grpc_target(server.address())) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(_rpc.EVENTS_STATUS)(b"\xff\xff", timeout=TIMEOUT)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "ftdist.StatusRequest" in (info.value.details() or "")


# -- the command, in-process ------------------------------------------------------


def test_status_prints_quorum_members_waiting_and_heartbeats(
    lh: Lighthouses, capsys: pytest.CaptureFixture[str]
) -> None:
    with quorum_with_a_straggler(lh) as server:
        assert main([server.address()]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Lighthouse {server.address()} (")
    assert re.search(r"^Quorum 1, formed \d+\.\d s ago .*; 2 members, max step 7$", out, re.M), out
    assert _row(out, "REPLICA") == ["REPLICA", "STEP", "WORLD", "STATE", "HEARTBEAT", "MANAGER"]
    assert _row(out, "a")[:4] == ["a", "7", "4", "ok"]
    assert _row(out, "a")[-1] == "http://mgr-a:1"
    assert _row(out, "b")[:4] == ["b", "5", "2", "recovering"]
    assert re.search(r"^Next quorum: not ready: .*need min_replicas 2", out, re.M), out
    assert "Waiting for the next quorum: 1 request" in out
    assert _row(out, "late")[:2] == ["late", "3"]
    assert re.search(r"^Heartbeats: 4 replica groups, 4 within the heartbeat timeout$", out, re.M)
    assert _row(out, "spare")[-1] == "ago"


def test_status_json_prints_the_document(
    lh: Lighthouses, capsys: pytest.CaptureFixture[str]
) -> None:
    with quorum_with_a_straggler(lh) as server:
        assert main([server.address(), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["quorum_id"] == 1
    members = {m["replica_id"]: m for m in document["quorum"]["members"]}
    assert (members["a"]["step"], members["b"]["recovering"]) == (7, True)
    assert [w["replica_id"] for w in document["waiting"]] == ["late"]


def test_registers_as_a_subcommand(lh: Lighthouses, capsys: pytest.CaptureFixture[str]) -> None:
    # As ftdist.cli.build_parser registers it.
    parser = argparse.ArgumentParser(prog="ftdist")
    status_cli.register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["status", "--help"])
    assert info.value.code == 0
    usage = capsys.readouterr().out
    assert all(flag in usage for flag in ("ADDR", "--timeout", "--json", "--watch")), usage
    server = lh.server()
    args = parser.parse_args(["status", server.address(), "--timeout", "2"])
    assert args.handler(args) == 0
    assert capsys.readouterr().out.startswith(f"Lighthouse {server.address()} (")


def test_address_from_the_environment(
    lh: Lighthouses, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = lh.server()
    monkeypatch.delenv("FTDIST_LIGHTHOUSE", raising=False)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", server.address().removeprefix("http://"))
    assert main([]) == 0
    assert "Quorum: none formed yet" in capsys.readouterr().out


def test_unreachable_lighthouse_is_one_line_naming_the_timeout_and_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A bound socket that never listens: connections to it are refused.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        assert main([address, "--timeout", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(
        f"ftdist status: error: cannot reach the lighthouse at {address} within 1 s"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bogus"], "address 'bogus' must be host:port or http://host:port"),
        (["https://h"], "address 'https://h' must be host:port"),
        ([], "no lighthouse address"),
    ],
)
def test_bad_or_missing_address_is_a_usage_error(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FTDIST_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ftdist status: error: ") and message in err, err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_bad_timeout_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["127.0.0.1:1", "--timeout", value])
    assert info.value.code == 2
    assert "argument --timeout" in capsys.readouterr().err


def test_lighthouse_without_status_call_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    # torchft's lighthouse serves only torchft.LighthouseService.
    def heartbeat(rpc: RpcCall, request: bytes) -> None:
        rpc.reply(b"")

    torchft_like = CompletionQueueServer(
        "127.0.0.1:0", {_rpc.LIGHTHOUSE_HEARTBEAT: heartbeat}, [], thread_name="test-torchft-lh"
    )
    port = torchft_like.start()
    try:
        assert main([f"127.0.0.1:{port}", "--timeout", str(TIMEOUT)]) == 1
    finally:
        torchft_like.stop(0.5)
    err = capsys.readouterr().err
    assert "does not serve ftdist's Status call" in err and err.count("\n") == 1, err


# -- the command as a real process ------------------------------------------------


def test_status_as_a_process(lh: Lighthouses) -> None:
    with quorum_with_a_straggler(lh) as server:
        result = subprocess.run(
            [*STATUS_CMD, server.address()], capture_output=True, text=True, timeout=TIMEOUT
        )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "Quorum 1," in result.stdout
    assert _row(result.stdout, "a")[:2] == ["a", "7"]
    assert _row(result.stdout, "b")[:2] == ["b", "5"]


def test_unreachable_lighthouse_as_a_process() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{closed.getsockname()[1]}"
        result = subprocess.run(
            [*STATUS_CMD, address, "--timeout", "0.5"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("ftdist status: error: cannot reach the lighthouse")
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


# As under nohup: SIGINT ignored, a disposition that survives exec. Set by a
# shell rather than a preexec_fn, which is unsafe in this threaded process.
_SIGINT_IGNORED = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]


class WatchProcess:
    """``ftdist status --watch`` as a child process, read line by line."""

    def __init__(self, *args: str, sigint_ignored: bool = False) -> None:
        self.proc = subprocess.Popen(
            [*(_SIGINT_IGNORED if sigint_ignored else []), *STATUS_CMD, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.seen: list[str] = []

    def read_until(self, pattern: str) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        # The process may have ended: say how, and what it wrote to stderr.
        try:
            code: int | None = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        err = ""
        if code is not None and self.proc.stderr is not None:
            err = self.proc.stderr.read()[-4000:]
        raise AssertionError(
            f"never printed {pattern!r} (exit code {code}): {''.join(self.seen[-40:])}\n"
            f"stderr: {err}"
        )

    def interrupt(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        out, err = self.proc.communicate(timeout=TIMEOUT)
        self.seen.append(out)
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=TIMEOUT)


def test_watch_redraws_until_ctrl_c(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1)
    client = lh.client(server)
    watch = WatchProcess(server.address(), "--watch", "0.1")
    try:
        watch.read_until(r"^Every 0\.1 s: ftdist status ")
        watch.read_until(r"^Quorum: none formed yet")
        quorum_round(client, ["a"], step=11)
        watch.read_until(r"^Quorum 1, ")
        row = watch.read_until(r"^  a ")
        assert row.split()[:3] == ["a", "11", "0"]
        code, err = watch.interrupt()
    finally:
        watch.kill()
    assert code == 0, err
    assert "Traceback" not in err
    assert "\x1b" not in "".join(watch.seen)  # no screen clearing into a pipe


def test_watch_json_prints_one_document_per_line(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1)
    watch = WatchProcess(server.address(), "--watch", "0.1", "--json")
    try:
        first = json.loads(watch.read_until(r"^\{"))
        second = json.loads(watch.read_until(r"^\{"))
        code, err = watch.interrupt()
    finally:
        watch.kill()
    assert code == 0, err
    assert first["quorum"] is None and second["uptime_s"] >= first["uptime_s"]


# -- rendering -------------------------------------------------------------------


def test_render_tolerates_missing_and_unknown_keys() -> None:
    assert render({}, "h:1").startswith("Lighthouse h:1\nQuorum: none formed yet\n")
    text = render(
        {
            "quorum": {"quorum_id": 2, "members": [{"replica_id": "x", "new": 1}]},
            "something_new": [1, 2],
        },
        "h:1",
    )
    assert "\nQuorum 2; 1 member\n" in text
    assert _row(text, "x") == ["x", "-", "-", "ok", "-", "-"]


def test_render_escapes_control_characters() -> None:
    evil = "r\x1b[2J\x07"
    text = render(
        {
            "quorum": {"quorum_id": 1, "members": [{"replica_id": evil, "step": 1}]},
            "heartbeats": [{"replica_id": evil, "age_s": 1.0, "healthy": False}],
        },
        "h:1",
    )
    assert "\x1b" not in text and "\x07" not in text
    assert "r\\x1b[2J\\x07" in text
    assert re.search(r"r\\x1b\[2J\\x07 +1\.0 s ago +expired", text), text


def test_render_durations() -> None:
    text = render(
        {"uptime_s": 3 * 3600 + 120, "quorum": {"quorum_id": 1, "age_s": 75.2, "members": []}},
        "h:1",
    )
    assert "up 3h 02m" in text and "formed 1m 15s ago" in text


def test_watch_ends_on_ctrl_c_even_when_started_with_sigint_ignored(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1)
    watch = WatchProcess(server.address(), "--watch", "0.1", "--json", sigint_ignored=True)
    try:
        json.loads(watch.read_until(r"^\{"))
        code, err = watch.interrupt()
        assert code == 0, err
        assert "Traceback" not in err
    finally:
        watch.kill()
