"""Wire compatibility with torchft's own (Rust) lighthouse, client and manager.

Skipped unless torchft is importable. torchft's package ``__init__`` needs
extra dependencies (opentelemetry), so its native module is loaded directly.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from datetime import timedelta
from types import ModuleType

import pytest

from ftdist.errors import CoordinationError
from ftdist.lighthouse.client import LighthouseClient
from tests.integration.lighthouse_helpers import (
    TIMEOUT,
    Lighthouses,
    member_ids,
    torchft_manager_server,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("torchft")]


def _load_native_torchft() -> ModuleType:
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchft is not installed")
    package_dir = next(iter(spec.submodule_search_locations))
    candidates = glob.glob(os.path.join(package_dir, "_torchft*.so"))
    if not candidates:
        pytest.skip("torchft has no native module")
    native_spec = importlib.util.spec_from_file_location("_torchft", candidates[0])
    assert native_spec is not None and native_spec.loader is not None
    module = importlib.util.module_from_spec(native_spec)
    native_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tft() -> ModuleType:
    return _load_native_torchft()


def _local(address: str) -> str:
    """torchft advertises its hostname; tests talk over loopback."""
    return "http://127.0.0.1:" + address.rsplit(":", 1)[1]


def test_torchft_client_uses_ftdist_lighthouse(tft: ModuleType, lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1)
    client = tft.LighthouseClient(server.address(), timedelta(seconds=5))
    client.heartbeat("a")
    quorum = client.quorum(
        "a",
        timedelta(seconds=TIMEOUT),
        address="m:1",
        store_address="s:2",
        step=4,
        world_size=2,
        data={"k": [1, 2]},
    )
    assert quorum.quorum_id == 1
    (member,) = quorum.participants
    assert (
        member.replica_id,
        member.address,
        member.store_address,
        member.step,
        member.world_size,
        member.data,
    ) == ("a", "m:1", "s:2", 4, 2, {"k": [1, 2]})
    assert quorum.created.seconds > 0


def test_ftdist_client_uses_torchft_lighthouse(tft: ModuleType, lh: Lighthouses) -> None:
    server = tft.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        client = lh.client(_local(server.address()))
        client.heartbeat("a")
        quorum = client.quorum("a", TIMEOUT, step=9, data={"x": 1})
        assert member_ids(quorum) == ["a"] and quorum.quorum_id == 1
        assert quorum.participants[0].data == {"x": 1}
        with pytest.raises(CoordinationError, match="UNIMPLEMENTED"):
            next(iter(client.subscribe("a")))
    finally:
        server.shutdown()


def test_torchft_manager_joins_ftdist_lighthouse(tft: ModuleType, lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1, http_port=0)
    manager = torchft_manager_server(tft, server.address(), "rep0")
    try:
        client = tft.ManagerClient(manager.address(), timedelta(seconds=5))
        result = client._quorum(
            group_rank=0,
            step=3,
            checkpoint_metadata="meta",
            shrink_only=False,
            timeout=timedelta(seconds=TIMEOUT),
            commit_failures=0,
            reconfigure_handle="h0",
            init_sync=True,
        )
        assert result.quorum_id == 1
        assert result.replica_rank == 0 and result.replica_world_size == 1
        assert result.store_address == "store:1" and result.max_step == 3
        assert list(result.replica_ids) == ["rep0"]
        assert list(result.reconfigure_handles) == ["h0"]
    finally:
        manager.shutdown()


def test_torchft_client_without_a_token_is_refused_by_a_lighthouse_with_one(
    tft: ModuleType, lh: Lighthouses
) -> None:
    # torchft's client sends no token: a lighthouse without one serves it
    # (the tests above); one with a job token refuses it, saying why.
    server = lh.server(min_replicas=1, token="job-s3cret")
    client = tft.LighthouseClient(server.address(), timedelta(seconds=5))
    refused = "Unauthenticated.*this lighthouse requires the job token: set FTDIST_JOB_TOKEN"
    with pytest.raises(RuntimeError, match=refused):
        client.heartbeat("a")
    with pytest.raises(RuntimeError, match=refused):
        client.quorum("a", timedelta(seconds=5))
    # Nothing was recorded, and the lighthouse serves clients that have the token.
    with LighthouseClient(server.address(), 5, token="job-s3cret") as ftdist_client:
        assert ftdist_client.status()["heartbeats"] == []


@pytest.mark.parametrize("rpc_client", ["h2", "grpcio"])
def test_ftdist_manager_client_talks_to_torchfts_manager_server(
    tft: ModuleType, lh: Lighthouses, rpc_client: str
) -> None:
    from ftdist.manager.client import ManagerClient

    server = lh.server(min_replicas=1, http_port=0)
    manager = torchft_manager_server(tft, server.address(), "rep0")
    try:
        with ManagerClient(manager.address(), timedelta(seconds=5), rpc_client=rpc_client) as c:
            for step in (3, 4):
                result = c._quorum(
                    group_rank=0,
                    step=step,
                    checkpoint_metadata="meta",
                    shrink_only=False,
                    timeout=timedelta(seconds=TIMEOUT),
                )
                assert result.replica_ids == ["rep0"] and result.max_step == step
                assert result.store_address == "store:1"
                assert c.checkpoint_metadata(0, timedelta(seconds=TIMEOUT)) == "meta"
                assert c.should_commit(0, step, True, timedelta(seconds=TIMEOUT)) is True
            assert c.should_commit(0, 5, False, timedelta(seconds=TIMEOUT)) is False
    finally:
        manager.shutdown()
