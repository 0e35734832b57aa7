from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from ftdist.process_group import create_store_client, parse_store_addr


@pytest.mark.parametrize(
    ("addr", "host", "port", "prefix"),
    [
        ("127.0.0.1:29500/ftdist/0", "127.0.0.1", 29500, "ftdist/0"),
        ("localhost:1/a", "localhost", 1, "a"),
        ("[::1]:29500/x/y/z", "::1", 29500, "x/y/z"),
        ("fd00:0:1::2:29521/torchft/0/1", "fd00:0:1::2", 29521, "torchft/0/1"),
        ("my-host.example:65535/p", "my-host.example", 65535, "p"),
    ],
)
def test_parse_valid(addr: str, host: str, port: int, prefix: str) -> None:
    parsed = parse_store_addr(addr)
    assert (parsed.host, parsed.port, parsed.prefix) == (host, port, prefix)


@pytest.mark.parametrize(
    ("addr", "needle"),
    [
        ("127.0.0.1:29500", "no '/prefix'"),
        ("127.0.0.1:29500/", "no '/prefix'"),
        ("127.0.0.1/prefix", "no numeric port"),
        ("127.0.0.1:http/prefix", "no numeric port"),
        (":29500/prefix", "empty host"),
        ("[::1:29500/prefix", "unclosed"),
        ("host:0/prefix", "outside 1..65535"),
        ("host:70000/prefix", "outside 1..65535"),
    ],
)
def test_parse_invalid_names_the_value(addr: str, needle: str) -> None:
    with pytest.raises(ValueError, match="store_addr") as info:
        parse_store_addr(addr)
    assert needle in str(info.value)
    assert repr(addr) in str(info.value)


def test_parse_rejects_non_str() -> None:
    with pytest.raises(TypeError, match="store_addr must be a str"):
        parse_store_addr(29500)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_create_store_client_round_trip(host: str) -> None:
    server = dist.TCPStore(
        "127.0.0.1" if host != "[::1]" else "::1", 0, is_master=True, wait_for_workers=False
    )
    client = create_store_client(f"{host}:{server.port}/pre/fix", timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert server.get("pre/fix/k") == b"v"
