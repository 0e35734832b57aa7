"""torchft's import surface, both generations: top-level names, the native
module's names, console script, coordination docs and the small modules."""

from __future__ import annotations

import logging
import multiprocessing
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ftdist
import ftdist.coordination
import ftdist.http
import ftdist.multiprocessing_dummy_context as dummy_context
import ftdist.otel
import ftdist.utils
import ftdist.work
from ftdist.multiprocessing import _MonitoredPipe

ROOT = Path(__file__).resolve().parents[2]

# (name, module, attribute): the union of both torchft generations' __init__.
TOP_LEVEL = [
    ("DistributedDataParallel", "ftdist.ddp", "DistributedDataParallel"),
    ("DistributedSampler", "ftdist.data", "DistributedSampler"),
    ("Manager", "ftdist.manager.manager", "Manager"),
    ("Optimizer", "ftdist.optim", "OptimizerWrapper"),
    ("ProcessGroupGloo", "ftdist.process_group", "ProcessGroupGloo"),
    ("ProcessGroupNCCL", "ftdist.process_group", "ProcessGroupNCCL"),
    ("ProcessGroupBabyNCCL", "ftdist.process_group", "ProcessGroupBabyNCCL"),
    ("ProcessGroupXCCL", "ftdist.process_group", "ProcessGroupXCCL"),
    ("ProcessGroupBabyXCCL", "ftdist.process_group", "ProcessGroupBabyXCCL"),
]


@pytest.mark.parametrize(("name", "module", "attribute"), TOP_LEVEL)
def test_top_level_names_are_the_real_classes(name: str, module: str, attribute: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from ftdist import {name}", namespace)
    real = getattr(__import__(module, fromlist=[attribute]), attribute)
    assert namespace[name] is real
    assert getattr(ftdist, name) is real
    assert name in dir(ftdist) and name in ftdist.__all__


def test_unknown_top_level_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'ProcessGroupMPI'"):
        _ = ftdist.ProcessGroupMPI
    assert "importlib" not in dir(ftdist)


@pytest.mark.timeout(60)
def test_import_ftdist_and_the_native_module_names_stay_free_of_torch() -> None:
    code = (
        "import sys, ftdist, ftdist._torchft, ftdist._ftdist; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    ).stdout.strip()
    assert out == "[]"


NATIVE_NAMES = [
    "LighthouseServer",
    "LighthouseClient",
    "ManagerServer",
    "ManagerClient",
    "Quorum",
    "QuorumMember",
    "Timestamp",
    "QuorumResult",
    "lighthouse_main",
]


@pytest.mark.parametrize("name", NATIVE_NAMES)
def test_both_spellings_of_the_native_module_hold_the_same_objects(name: str) -> None:
    import ftdist._ftdist
    import ftdist._torchft

    assert getattr(ftdist._torchft, name) is getattr(ftdist._ftdist, name)
    if hasattr(ftdist.coordination, name):
        assert getattr(ftdist.coordination, name) is getattr(ftdist._torchft, name)


def test_quorum_result_builds_empty_and_takes_assignments() -> None:
    from ftdist._torchft import QuorumResult

    result = QuorumResult()
    result.quorum_id, result.heal, result.recover_dst_replica_ranks = 3, True, [1]
    assert (result.quorum_id, result.heal, result.recover_dst_replica_ranks) == (3, True, [1])
    assert (result.replica_world_size, result.max_world_size, result.max_step) == (1, 1, 0)


@pytest.mark.parametrize(
    "name",
    [
        "LighthouseClient",
        "LighthouseServer",
        "ManagerClient",
        "ManagerServer",
        "Quorum",
        "QuorumMember",
    ],
)
def test_coordination_classes_document_their_arguments(name: str) -> None:
    assert name in ftdist.coordination.__all__
    assert "Args:" in str(getattr(ftdist.coordination, name).__doc__)


def test_console_script_is_torchfts_lighthouse_with_its_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '\nftdist_lighthouse = "ftdist._torchft:lighthouse_main"\n' in pyproject
    from ftdist._torchft import lighthouse_main

    with pytest.raises(SystemExit) as exit_info:
        lighthouse_main(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--min_replicas", "--join_timeout_ms", "--quorum_tick_ms", "--bind"):
        assert flag in usage
    with pytest.raises(SystemExit):
        lighthouse_main(["--min_replicas", "not-a-number"])


def test_dummy_work_is_one_class_under_both_paths() -> None:
    import ftdist.process_group as fpg

    assert ftdist.work._DummyWork is fpg._DummyWork is fpg.CompletedWork
    t = torch.ones(2)
    work = ftdist.work._DummyWork(t)
    assert work.wait() is True and work.result_ is t
    assert work.get_future() is work.future_ and work.future_.value() is t
    seen: list[object] = []
    work.get_future().then(lambda f: seen.append(f.value()))
    assert seen == [t]  # a completed future runs callbacks at once


# -- ftdist.multiprocessing ----------------------------------------------------


def test_monitored_pipe_times_out_raises_sent_errors_and_sees_eof() -> None:
    local, remote = multiprocessing.Pipe()
    pipe = _MonitoredPipe(local)
    with pytest.raises(TimeoutError, match=r"pipe.recv\(\) timed out after 0.0 seconds"):
        pipe.recv(0.0)
    remote.send(ValueError("from the peer"))
    remote.send({"k": 1})
    with pytest.raises(ValueError, match="from the peer"):
        pipe.recv(5)
    from datetime import timedelta

    assert pipe.recv(timedelta(seconds=5)) == {"k": 1}
    pipe.send("ping")
    assert remote.recv() == "ping"
    remote.close()
    with pytest.raises(EOFError):
        pipe.recv(5)
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for _ in range(1000):  # the first sends may still fit the socket buffer
            pipe.send(b"x" * 65536)
    assert not pipe.closed()
    pipe.close()
    assert pipe.closed()


def test_dummy_context_runs_processes_as_threads() -> None:
    ctx = dummy_context.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=queue.put, args=(7,), daemon=True)
    proc.start()
    proc.join(5)
    assert queue.get(timeout=5) == 7
    a, b = ctx.Pipe()
    a.send(1)
    assert b.recv() == 1
    event = ctx.Event()
    event.set()
    assert event.is_set()
    with ctx.Condition(ctx.RLock()):
        pass
    assert ctx.Semaphore(2).acquire(timeout=1) and ctx.BoundedSemaphore().acquire(timeout=1)


def test_ipv6_http_server_settings() -> None:
    assert ftdist.http._IPv6HTTPServer.address_family == socket.AF_INET6
    assert ftdist.http._IPv6HTTPServer.request_queue_size == 1024


def test_accelerator_helpers_without_an_accelerator() -> None:
    if torch.cuda.is_available() or torch.xpu.is_available():
        pytest.skip("checks the CPU-only behaviour")
    with ftdist.utils.get_stream_context(None):
        pass
    ftdist.utils.synchronize()
    with pytest.raises(RuntimeError, match="needs a CUDA or XPU device"):
        ftdist.utils.record_event()


# -- ftdist.otel ---------------------------------------------------------------------


def test_otel_setup_is_a_no_op_unless_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FTDIST_USE_OTEL", "TORCHFT_USE_OTEL"):
        monkeypatch.delenv(name, raising=False)
    logger = logging.getLogger("ftdist_test_otel_off")
    ftdist.otel.setup_logger(logger.name)
    assert not ftdist.otel.enabled() and logger.handlers == []
    monkeypatch.setenv("TORCHFT_USE_OTEL", "false")
    assert not ftdist.otel.enabled()
    monkeypatch.setenv("TORCHFT_USE_OTEL", "true")
    assert ftdist.otel.enabled()


def test_otel_exports_when_switched_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.sdk")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    monkeypatch.setenv("FTDIST_USE_OTEL", "1")
    attributes = tmp_path / "attrs.json"
    attributes.write_text('{"ftdist_test_otel_on": {"service.name": "trainer"}}')
    monkeypatch.setenv("FTDIST_OTEL_RESOURCE_ATTRIBUTES_JSON", str(attributes))
    # Nothing listens there: the exporter must not be reached (nothing is logged).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    logger = logging.getLogger("ftdist_test_otel_on")
    try:
        ftdist.otel.setup_logger(logger.name)
        ftdist.otel.setup_logger(logger.name)  # once per name
        assert len(logger.handlers) == 1
    finally:
        ftdist.otel.shutdown()
    assert logger.handlers == []
