"""Manager settings: argument > environment (FTDIST_*, then TORCHFT_*) > default."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from ftdist.manager.config import ManagerConfig


def test_defaults() -> None:
    s = ManagerConfig.resolve(env={})
    assert (s.timeout, s.quorum_timeout, s.connect_timeout) == (timedelta(seconds=60),) * 3
    assert (s.group_rank, s.group_world_size, s.port, s.quorum_retries) == (0, 1, 0, 0)
    assert s.lighthouse_addr is None and s.store_addr is None
    assert s.heartbeat_interval == timedelta(milliseconds=100)
    assert s.reserve == 1 << 30


def test_environment_beats_default_and_argument_beats_environment() -> None:
    env = {
        "TORCHFT_TIMEOUT_SEC": "7",
        "FTDIST_QUORUM_TIMEOUT_SEC": "9",
        "TORCHFT_QUORUM_TIMEOUT_SEC": "1",
        "TORCHFT_LIGHTHOUSE": "http://lh:1",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "5",
        "TORCHFT_MANAGER_PORT": "1234",
        "FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB": "0",
    }
    s = ManagerConfig.resolve(env=env)
    assert s.timeout == timedelta(seconds=7)  # TORCHFT_ name accepted
    assert s.quorum_timeout == timedelta(seconds=9)  # FTDIST_ name wins
    assert (s.lighthouse_addr, s.group_rank, s.group_world_size) == ("http://lh:1", 1, 2)
    assert (s.store_addr, s.store_port, s.port, s.reserve) == ("h", 5, 1234, 0)
    s = ManagerConfig.resolve(timeout=timedelta(seconds=3), rank=0, lighthouse_addr="x:1", env=env)
    assert (s.timeout, s.group_rank, s.lighthouse_addr) == (timedelta(seconds=3), 0, "x:1")


@pytest.mark.parametrize(
    ("kwargs", "env", "exc", "needle"),
    [
        ({"timeout": "60"}, {}, TypeError, "timeout must be a datetime.timedelta"),
        ({"timeout": timedelta(0)}, {}, ValueError, "timeout must be positive"),
        ({}, {"FTDIST_TIMEOUT_SEC": "soon"}, ValueError, "TIMEOUT_SEC='soon'"),
        ({"rank": 2, "world_size": 2}, {}, ValueError, r"rank must be in \[0, 2\)"),
        ({"world_size": 0}, {}, ValueError, "world_size must be >= 1"),
        ({"world_size": 2}, {}, ValueError, "needs a shared store"),
        ({"store_addr": "h"}, {}, ValueError, "store_addr and store_port go together"),
        ({}, {"RANK": "x"}, ValueError, "RANK='x' is not an integer"),
        ({"rank": True}, {}, TypeError, "rank must be an int"),
        ({}, {"FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB": "1G"}, ValueError, "MB='1G'"),
    ],
)
def test_bad_settings_name_the_value(
    kwargs: dict[str, Any], env: dict[str, str], exc: type[Exception], needle: str
) -> None:
    with pytest.raises(exc, match=needle):
        ManagerConfig.resolve(env=env, **kwargs)


def test_manager_rpc_client_choice() -> None:
    from ftdist.manager.config import manager_rpc_client

    assert manager_rpc_client(environ={}) == "h2"
    env = {"FTDIST_MANAGER_RPC_CLIENT": " GRPCIO "}
    assert manager_rpc_client(environ=env) == "grpcio"
    assert manager_rpc_client("h2", environ=env) == "h2"
    with pytest.raises(ValueError, match=r"rpc_client \('tonic'\).*FTDIST_MANAGER_RPC_CLIENT"):
        manager_rpc_client(environ={"FTDIST_MANAGER_RPC_CLIENT": "tonic"})


def test_manager_rpc_server_choice() -> None:
    from ftdist.manager.config import manager_rpc_server

    assert manager_rpc_server(environ={}) == "h2"
    env = {"FTDIST_MANAGER_RPC_SERVER": " GRPCIO "}
    assert manager_rpc_server(environ=env) == "grpcio"
    assert manager_rpc_server("h2", environ=env) == "h2"
    with pytest.raises(ValueError, match=r"rpc_server \('tonic'\).*FTDIST_MANAGER_RPC_SERVER"):
        manager_rpc_server(environ={"FTDIST_MANAGER_RPC_SERVER": "tonic"})
