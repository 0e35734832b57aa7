"""Lighthouse settings: precedence, validation, address parsing."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ftdist._rpc.common import grpc_target
from ftdist.lighthouse.config import (
    CLI_DEFAULTS,
    lighthouse_rpc_client,
    resolve_lighthouse_config,
)


def test_explicit_beats_environment_beats_default() -> None:
    env = {
        "FTDIST_LIGHTHOUSE_MIN_REPLICAS": "3",
        "FTDIST_LIGHTHOUSE_JOIN_TIMEOUT_MS": "2500",
        "FTDIST_LIGHTHOUSE_KILL_TOKEN": "from-env",
    }
    config = resolve_lighthouse_config(environ=env, min_replicas=5)
    assert config.min_replicas == 5
    assert config.join_timeout == timedelta(milliseconds=2500)
    assert config.kill_token == "from-env"
    assert config.quorum_tick == timedelta(milliseconds=100)
    assert config.heartbeat_timeout == timedelta(seconds=5)
    assert config.bind == "[::]:29510"
    assert config.http_port == 0


def test_api_and_cli_defaults_differ_like_torchft() -> None:
    api = resolve_lighthouse_config(environ={}, min_replicas=1)
    cli = resolve_lighthouse_config(environ={}, defaults=CLI_DEFAULTS, min_replicas=1)
    assert api.join_timeout == timedelta(milliseconds=100)
    assert cli.join_timeout == timedelta(seconds=60)
    assert cli.http_port == 29511


def test_timedelta_and_disabled_dashboard() -> None:
    config = resolve_lighthouse_config(
        environ={}, min_replicas=1, heartbeat_timeout_ms=timedelta(seconds=2), http_port=-1
    )
    assert config.heartbeat_timeout == timedelta(seconds=2)
    assert config.http_port is None


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({}, "min_replicas is required"),
        ({"min_replicas": 0}, "min_replicas (0)"),
        ({"min_replicas": "two"}, "min_replicas ('two')"),
        ({"min_replicas": 1, "quorum_tick_ms": 0}, "quorum_tick"),
        ({"min_replicas": 1, "heartbeat_timeout_ms": -5}, "heartbeat_timeout"),
        ({"min_replicas": 1, "join_timeout_ms": "soon"}, "join_timeout_ms"),
        ({"min_replicas": 1, "bind": "nowhere"}, "bind"),
        ({"min_replicas": 1, "http_port": 70000}, "http_port"),
        ({"min_replicas": 1, "kill_token": ""}, "kill_token"),
    ],
)
def test_invalid_settings_name_the_field(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_lighthouse_config(environ={}, **kwargs)
    assert words in str(info.value)


def test_invalid_environment_value_is_reported() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        resolve_lighthouse_config(environ={"FTDIST_LIGHTHOUSE_MIN_REPLICAS": "x"})


def test_unknown_setting_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="minreplicas"):
        resolve_lighthouse_config(environ={}, minreplicas=1)


@pytest.mark.parametrize(
    "address, target",
    [
        ("host:29510", "host:29510"),
        ("http://host:29510", "host:29510"),
        ("http://host:29510/", "host:29510"),
        ("https://host:29510", "host:29510"),
        ("  10.0.0.1:1  ", "10.0.0.1:1"),
        ("http://[::1]:5", "[::1]:5"),
    ],
)
def test_addresses_accept_both_spellings(address: str, target: str) -> None:
    assert grpc_target(address) == target


@pytest.mark.parametrize("address", ["", "host", "http://host", "host:port", "https://host"])
def test_bad_addresses_are_rejected(address: str) -> None:
    with pytest.raises(ValueError):
        grpc_target(address)


def test_token_tls_and_caps_resolve_and_validate(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    env = {"FTDIST_JOB_TOKEN": "from-env", "FTDIST_TLS_CERT": "c.pem", "FTDIST_TLS_KEY": "k.pem"}
    config = resolve_lighthouse_config(environ=env, min_replicas=1)
    assert (config.token, config.tls_cert, config.tls_key) == ("from-env", "c.pem", "k.pem")
    assert "from-env" not in repr(config)  # secrets stay out of logs
    assert resolve_lighthouse_config(environ=env, min_replicas=1, token="given").token == "given"
    flagged = resolve_lighthouse_config(environ=env, min_replicas=1, token_file=str(token_file))
    assert flagged.token == "from-file"
    assert resolve_lighthouse_config(environ={}, min_replicas=1).token is None
    caps = resolve_lighthouse_config(environ={}, min_replicas=1, max_subscribers="7")
    assert caps.max_subscribers == 7 and caps.max_replica_ids == 65536
    with pytest.raises(ValueError, match="max_parked_per_replica"):
        resolve_lighthouse_config(environ={}, min_replicas=1, max_parked_per_replica=0)
    with pytest.raises(ValueError, match="certificate and its key together"):
        resolve_lighthouse_config(environ={}, min_replicas=1, tls_cert="c.pem")
    with pytest.raises(OSError):
        resolve_lighthouse_config(environ={}, min_replicas=1, token_file=str(tmp_path / "none"))


def test_rpc_server_choice() -> None:
    assert resolve_lighthouse_config(environ={}, min_replicas=1).rpc_server == "h2"
    env = {"FTDIST_LIGHTHOUSE_RPC_SERVER": "GRPCIO"}
    assert resolve_lighthouse_config(environ=env, min_replicas=1).rpc_server == "grpcio"
    explicit = resolve_lighthouse_config(environ=env, min_replicas=1, rpc_server="h2")
    assert explicit.rpc_server == "h2"
    with pytest.raises(ValueError, match=r"rpc_server \('tonic'\).*FTDIST_LIGHTHOUSE_RPC_SERVER"):
        resolve_lighthouse_config(environ={"FTDIST_LIGHTHOUSE_RPC_SERVER": "tonic"}, min_replicas=1)


def test_rpc_client_choice() -> None:
    assert lighthouse_rpc_client(environ={}) == "h2"
    env = {"FTDIST_LIGHTHOUSE_RPC_CLIENT": " GRPCIO "}
    assert lighthouse_rpc_client(environ=env) == "grpcio"
    assert lighthouse_rpc_client("h2", environ=env) == "h2"
    with pytest.raises(ValueError, match=r"rpc_client \('tonic'\).*FTDIST_LIGHTHOUSE_RPC_CLIENT"):
        lighthouse_rpc_client(environ={"FTDIST_LIGHTHOUSE_RPC_CLIENT": "tonic"})
