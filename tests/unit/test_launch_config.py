"""MultiprocessConfig, FaultTolerance, the backend helpers and the `ftdist run` command line."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest

from ftdist.cli import build_parser
from ftdist.cli.run import _check
from ftdist.launch.config import (
    DEFAULT_PORT,
    MISSING,
    FaultTolerance,
    MultiprocessConfig,
    get_unused_port,
    is_missing,
)


def test_fields_and_defaults_are_ml_starters() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(MultiprocessConfig)}
    assert fields == {
        "rank": -1,
        "local_rank": -1,
        "world_size": "???",
        "local_world_size": "???",
        "master_addr": "127.0.0.1",
        "master_port": "???",
        "init_method": "env://",
        "model_parallelism": 1,
        "pipeline_parallelism": 1,
        "backend": None,
        "model_parallel_backend": None,
        "pipeline_parallel_backend": None,
        "data_parallel_backend": None,
        "launch_method": "forkserver",
    }
    assert MISSING == "???" and DEFAULT_PORT == 29500


def test_resolve_fills_what_is_missing() -> None:
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 1
    cfg = MultiprocessConfig()
    assert is_missing(cfg, "world_size") and is_missing(cfg, "master_port")
    MultiprocessConfig.resolve(cfg)
    assert cfg.world_size == devices
    assert cfg.local_world_size == min(devices, cfg.world_size)
    assert isinstance(cfg.master_port, int) and 0 < cfg.master_port < 65536
    assert not is_missing(cfg, "master_port")

    cfg = MultiprocessConfig(world_size=4, master_port=1234, local_world_size=2)
    MultiprocessConfig.resolve(cfg)
    assert (cfg.world_size, cfg.local_world_size, cfg.master_port) == (4, 2, 1234)


@pytest.mark.parametrize(
    "changes,error,words",
    [
        ({"world_size": 0}, ValueError, "world_size"),
        ({"world_size": "4"}, TypeError, "world_size"),
        ({"model_parallelism": 0}, ValueError, "model_parallelism"),
        ({"launch_method": "thread"}, ValueError, "launch_method"),
        ({"init_method": "localhost:1"}, ValueError, "init_method"),
        ({"master_port": 70000}, ValueError, "master_port"),
        ({"backend": 3}, TypeError, "backend"),
        ({"master_addr": ""}, TypeError, "master_addr"),
    ],
)
def test_resolve_refuses_bad_fields(
    changes: dict[str, Any], error: type[Exception], words: str
) -> None:
    cfg = dataclasses.replace(MultiprocessConfig(world_size=2, master_port=1), **changes)
    with pytest.raises(error, match=words):
        MultiprocessConfig.resolve(cfg)


def test_get_unused_port_prefers_the_default_when_free() -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        busy = taken.getsockname()[1]
        other = get_unused_port(busy)
        assert other != busy and 0 < other < 65536
    free = get_unused_port()
    assert get_unused_port(free) == free


def test_fault_tolerance_checks_and_reads_the_lighthouse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTDIST_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    assert FaultTolerance().lighthouse_address() is None
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://b:2")
    assert FaultTolerance().lighthouse_address() == "http://b:2"
    monkeypatch.setenv("FTDIST_LIGHTHOUSE", "http://a:1")
    assert FaultTolerance().lighthouse_address() == "http://a:1"
    assert FaultTolerance(lighthouse="http://c:3").lighthouse_address() == "http://c:3"
    # Deliberately seconds, not the annotated timedelta: __post_init__ converts them.
    assert FaultTolerance(timeout=5).timeout == timedelta(seconds=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_restarts"):
        FaultTolerance(max_restarts=-1)
    with pytest.raises(ValueError, match="min_replica_size"):
        FaultTolerance(min_replica_size=0)
    with pytest.raises(TypeError, match="timeout"):
        FaultTolerance(timeout="5s")  # type: ignore[arg-type]


def test_backend_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ftdist.launch import default_backend, get_distributed_backend, set_distributed_backend

    monkeypatch.setenv("TORCH_DISTRIBUTED_BACKEND", "unset-below")
    monkeypatch.delenv("TORCH_DISTRIBUTED_BACKEND")
    assert default_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    assert get_distributed_backend() == default_backend()
    set_distributed_backend("gloo")
    assert get_distributed_backend() == "gloo"
    with pytest.raises(TypeError):
        set_distributed_backend("")


def test_all_to_all_without_torch_distributed_is_the_identity() -> None:
    import torch

    from ftdist.launch import all_to_all

    x = torch.arange(6.0, requires_grad=True)
    y = all_to_all(x, None)
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(y, x) and torch.equal(x.grad, torch.ones(6))
    with pytest.raises(ValueError, match="not initialized"):
        all_to_all(x, object())
    with pytest.raises(TypeError):
        all_to_all([1, 2], None)


@pytest.mark.timeout(60)
def test_importing_the_launcher_does_not_import_torch() -> None:
    code = (
        "import sys, ftdist.launch, ftdist.launch.config, ftdist.cli.run; "
        "ftdist.launch.MultiprocessConfig(world_size=2); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    ).stdout.strip()
    assert out == "[]"


def _run_args(*argv: str) -> object:
    return build_parser().parse_args(["run", *argv])


def test_run_command_line_takes_torchruns_flags() -> None:
    args = _run_args(
        "--nproc_per_node", "4", "--replica-groups", "2", "--max-restarts", "3",
        "--standalone", "train.py", "--steps", "5",
    )  # fmt: skip
    assert _check(args) is None  # type: ignore[arg-type]
    assert (args.nproc_per_node, args.replica_groups, args.max_restarts) == (4, 2, 3)  # type: ignore[attr-defined]
    assert args.script == "train.py" and args.script_args == ["--steps", "5"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--nnodes", "2", "t.py"], "nnodes"),
        (["--nproc-per-node", "3", "--replica-groups", "2", "t.py"], "divide"),
        (["--nproc-per-node", "2", "--replica-groups", "2", "--master-port", "5", "t.py"], "one"),
        (["--max-restarts", "-1", "t.py"], "max-restarts"),
    ],
)
def test_run_command_line_refuses_bad_flags(argv: list[str], words: str) -> None:
    problem = _check(_run_args(*argv))  # type: ignore[arg-type]
    assert problem is not None and words in problem


def _noop() -> None:
    pass


@pytest.mark.parametrize(
    "cfg,kwargs,error,words",
    [
        (
            {"world_size": 2, "master_port": 1234},
            {"fault_tolerant": True},
            ValueError,
            "master_port",
        ),
        ({"world_size": 2}, {"fault_tolerant": True, "rank_offset": 1}, ValueError, "rank_offset"),
        ({"world_size": 4}, {"rank_offset": 2}, ValueError, "master_port"),
        ({"world_size": 4, "local_world_size": 3}, {"rank_offset": 2}, ValueError, "does not fit"),
        ({"world_size": 2}, {"fault_tolerant": "yes"}, TypeError, "fault_tolerant"),
        ({"world_size": 2}, {"rank_offset": -1}, ValueError, "rank_offset"),
        ({"world_size": 2, "init_method": "tcp://h"}, {}, ValueError, "port"),
    ],
)
def test_launch_misuse_raises_before_any_process_starts(
    cfg: dict[str, Any], kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    from ftdist.launch import launch_subprocesses

    offset = kwargs.pop("rank_offset", 0)
    with pytest.raises(error, match=words):
        launch_subprocesses(
            _noop, MultiprocessConfig(backend="gloo", **cfg), None, offset, **kwargs
        )
    with pytest.raises(TypeError, match="cfg"):
        launch_subprocesses(_noop, {"world_size": 2})
    with pytest.raises(TypeError, match="callable"):
        launch_subprocesses(3, MultiprocessConfig(world_size=2))
