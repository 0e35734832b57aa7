"""The advertised address: peers heal and rendezvous over the address the user chose."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any

import pytest
import torch

from ftdist import _advertise
from ftdist.launch.ranks import RankContext, run_ranks
from tests.integration.test_checkpoint_transports import _barrier

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TIMEOUT = timedelta(seconds=20)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _heal_and_rendezvous(ctx: RankContext) -> dict[str, Any]:
    from ftdist.checkpointing import HTTPTransport
    from ftdist.process_group import ProcessGroupGloo, ReconfigureOptions

    lines = _Lines()
    log = logging.getLogger("ftdist.advertise")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    store = ctx.store()
    out: dict[str, Any] = {}
    transport = HTTPTransport[dict[str, Any]](TIMEOUT)  # no hostname: the setting decides
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    try:
        state = {"w": torch.arange(1000, dtype=torch.float32)}
        if ctx.rank == 0:
            transport.send_checkpoint([1], 3, state, TIMEOUT)
            store.set("metadata", transport.metadata())
        metadata = store.get("metadata").decode()
        out["metadata"] = metadata
        if ctx.rank == 1:
            got = transport.recv_checkpoint(0, metadata, 3, TIMEOUT)
            out["healed"] = torch.equal(got["w"], state["w"])
        handle = pg.get_reconfigure_handle()
        out["handle_store"] = json.loads(handle)["store"]
        store.set(f"handle/{ctx.rank}", handle)
        handles = [store.get(f"handle/{r}").decode() for r in range(ctx.world_size)]
        pg.reconfigure(ReconfigureOptions(uuid=7, handles=handles)).wait()
        t = torch.ones(2) * (ctx.rank + 1)
        pg.allreduce([t]).wait()
        out["sum"] = t.tolist()
        _barrier(store, "done", ctx.world_size)
        out["log"] = lines.lines
        return out
    finally:
        transport.shutdown()
        pg.shutdown()
        log.removeHandler(lines)


@pytest.mark.parametrize(
    "env", [{"FTDIST_ADVERTISE_IFNAME": "lo"}, {"FTDIST_ADVERTISE_ADDR": "127.0.0.1"}]
)
def test_heals_and_rendezvous_use_the_advertised_address_and_say_so(env: dict[str, str]) -> None:
    results = run_ranks(_heal_and_rendezvous, 2, timeout=100, env=env)
    assert results[0]["metadata"].startswith("http://127.0.0.1:"), results[0]["metadata"]
    assert results[1]["healed"] is True
    for r in results:
        assert r["handle_store"].startswith("127.0.0.1:"), r["handle_store"]
        assert r["sum"] == [3.0, 3.0]
        logged = "\n".join(r["log"])
        assert "the checkpoint server advertised at port" in logged, logged
        assert "a process-group store advertised at port" in logged, logged
        assert "127.0.0.1 on lo" in logged, logged


def test_the_setting_is_argument_then_address_then_interface_then_host_name() -> None:
    import socket

    both = {"FTDIST_ADVERTISE_ADDR": "10.1.2.3", "FTDIST_ADVERTISE_IFNAME": "lo"}
    assert _advertise.advertised_host("given", both) == "given"
    assert _advertise.advertised_host(None, both) == "10.1.2.3"
    assert _advertise.advertised_host(None, {"FTDIST_ADVERTISE_ADDR": "[::1]"}) == "::1"
    assert _advertise.advertised_host(None, {"FTDIST_ADVERTISE_IFNAME": "lo"}) == "127.0.0.1"
    assert _advertise.advertised_host(None, {}) == socket.gethostname()


def test_an_unknown_interface_is_refused_with_the_interfaces_there_are() -> None:
    from ftdist.manager.config import ManagerConfig

    env = {"FTDIST_ADVERTISE_IFNAME": "nosuch9"}
    with pytest.raises(ValueError, match=r"'nosuch9' is not an interface.*lo \(127\.0\.0\.1"):
        _advertise.advertised_host(None, env)
    # The Manager's settings say so before anything starts.
    with pytest.raises(ValueError, match="FTDIST_ADVERTISE_IFNAME"):
        ManagerConfig.resolve(lighthouse_addr="http://127.0.0.1:1", env=env)


def test_describe_names_the_interface_and_warns_about_loopback() -> None:
    text = _advertise.describe("127.0.0.1")
    assert "127.0.0.1 on lo" in text and "only this host reaches it" in text
    assert "does not resolve" in _advertise.describe("no-such-host.invalid")
