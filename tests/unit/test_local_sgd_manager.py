"""DiLoCo and LocalSGD over a real Manager with a scripted quorum
(``FakeManagerClient``) and a group of identical peers (``FakeProcessGroup``):
the heal path, the consistency parts, quantization."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from ftdist.local_sgd import DiLoCo, LocalSGD
from ftdist.manager import Manager
from ftdist.manager.allreduce_result import AllreduceResult
from ftdist.manager.heal import fingerprint
from ftdist.testing import FakeManagerClient, FakeProcessGroup, quorum_result
from tests.unit.test_manager import MemoryTransport

pytestmark = pytest.mark.timeout(30)


class Net(nn.Module):
    def __init__(self, value: float = 1.0) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(value)


def _heal_quorum(max_step: int) -> Any:
    return quorum_result(
        heal=True,
        max_step=max_step,
        recover_src_replica_rank=0,
        recover_src_manager_address="http://src:1",
        max_replica_rank=None,
    )


def _manager(
    net: Net, inner: torch.optim.Optimizer, transport: Any = None
) -> tuple[Manager, FakeManagerClient, FakeProcessGroup]:
    client, pg = FakeManagerClient(), FakeProcessGroup()

    def load(sd: dict[str, Any]) -> None:
        net.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = Manager(
        pg,
        load,
        lambda: {"model": net.state_dict(), "inner": inner.state_dict()},
        min_replica_size=1,
        use_async_quorum=False,
        client=client,
        checkpoint_transport=transport or MemoryTransport(),
        timeout=timedelta(seconds=5),
    )
    return manager, client, pg


def _step(net: Net, inner: torch.optim.Optimizer) -> None:
    inner.zero_grad()
    net.b(net.a(torch.ones(3, 2))).sum().backward()
    inner.step()


def test_a_synchronous_quorum_applies_a_heal_before_start_quorum_returns() -> None:
    net = Net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    source = Net(5.0)
    state = {
        "user": {"model": source.state_dict(), "inner": inner.state_dict()},
        "torchft": {"step": 7, "batches_committed": 14},
    }
    manager, client, _ = _manager(net, inner, MemoryTransport(state=state))
    try:
        client.push_quorum(_heal_quorum(7))
        manager.start_quorum()
        # DiLoCo takes its pseudo-gradients right after this: they must see the heal.
        assert manager.current_step() == 7
        assert all(torch.equal(p, torch.full_like(p, 5.0)) for p in net.parameters())
        assert manager.should_commit()
        assert manager.current_step() == 8
        assert [t.role for t in manager.heal_timelines] == ["receive"]
    finally:
        manager.shutdown()


def test_diloco_heals_the_global_state_and_its_fragment_follows_the_healed_step() -> None:
    # The source: one replica that committed three syncs of two fragments.
    src_net = Net()
    src_inner = torch.optim.SGD(src_net.parameters(), lr=0.1)
    src_outers = [
        torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9) for m in (src_net.a, src_net.b)
    ]
    src_manager, _, _ = _manager(src_net, src_inner)
    try:
        with DiLoCo(src_manager, [src_net.a, src_net.b], src_inner, src_outers, sync_every=2):
            for _ in range(3):
                _step(src_net, src_inner)
        assert src_manager.current_step() == 3
        sent = copy.deepcopy(src_manager._manager_state_dict())
    finally:
        src_manager.shutdown()

    net = Net(-1.0)
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    outers = [torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9) for m in (net.a, net.b)]
    manager, client, _ = _manager(net, inner, MemoryTransport(state=sent))
    try:
        reduced: list[int] = []
        real_allreduce = manager.allreduce
        # Fragment 1's pseudo-gradient, from the received state: its global
        # weights minus the source's local ones (the model moves with the
        # user's state, as in torchft), not from this replica's own progress.
        b_global = sent["user"]["StreamingDiLoCoFragment_1"]["original_parameters"]
        src_model = sent["user"]["default"]["model"]
        expected = [b_global[n] - src_model[f"b.{n}"] for n in ("weight", "bias")]
        assert any(bool(e.abs().sum() > 0) for e in expected)  # the source trained b since

        def allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> AllreduceResult:
            reduced.append(tensor.numel())
            if len(reduced) <= 2:
                assert torch.equal(tensor, expected[len(reduced) - 1])
            return real_allreduce(tensor, *args, **kwargs)

        manager.allreduce = allreduce  # type: ignore[method-assign]
        diloco = DiLoCo(manager, [net.a, net.b], inner, outers, sync_every=2)
        client.push_quorum(_heal_quorum(3))
        with diloco:
            _step(net, inner)  # local progress from its own (wrong) start: replaced
        # Healed to step 3: fragment 3 % 2 = 1 (net.b: 2 + 1 elements).
        assert reduced == [2, 1]
        assert manager.current_step() == 4
        for f in (0, 1):
            assert fingerprint(diloco._fragments[f]._consistency()) != {}
        keys = manager.consistency_keys()
        assert keys == ["StreamingDiLoCoFragment_0", "StreamingDiLoCoFragment_1"]
        # Fragment 0 was not synced: it holds the source's local weights, and
        # its global weights are the source's.
        a_global = sent["user"]["StreamingDiLoCoFragment_0"]["original_parameters"]
        for name, p in net.a.named_parameters():
            assert torch.equal(p.data, src_model[f"a.{name}"])
            assert torch.equal(diloco._fragments[0].original_parameters[name], a_global[name])
    finally:
        manager.shutdown()


def test_diloco_sends_quantized_pseudo_gradients_through_the_manager() -> None:
    net = Net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = torch.optim.SGD(net.parameters(), lr=1.0)
    manager, client, pg = _manager(net, inner)
    try:
        client.push_quorum(quorum_result(replica_world_size=2, max_world_size=2))
        with DiLoCo(manager, net, inner, outer, sync_every=1, should_quantize=True):
            _step(net, inner)
        assert pg.ops == ["all_gather_single"] * 4
        assert manager.current_step() == 1
    finally:
        manager.shutdown()


def test_local_sgd_registers_its_digest_as_the_consistency_part() -> None:
    net = Net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    manager, client, _ = _manager(net, inner)
    try:
        client.push_quorum(quorum_result(replica_world_size=2, max_world_size=2))
        with LocalSGD(manager, net, inner, sync_every=1):
            _step(net, inner)
        assert manager.consistency_keys() == ["LocalSGD"]
        assert manager.current_step() == 1
        digest = manager._manager_state_dict()["user"]["LocalSGD"]["synced_digest"]
        assert digest == fingerprint({n: p.data for n, p in net.named_parameters()})
    finally:
        manager.shutdown()


class _SlottedManager:
    """A manager stand-in without a ``__dict__`` (its slots cannot live on
    it) that records what is registered with it."""

    __slots__ = ("__weakref__", "registered", "save")

    def __init__(self) -> None:
        self.registered: list[str] = []
        self.save: Any = None

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.registered.append(key)
        self.save = save


class _PlainManager(_SlottedManager):
    """The same with a ``__dict__``."""


@pytest.mark.parametrize("cls", [_PlainManager, _SlottedManager])
def test_bind_state_registers_once_and_rebinds_to_a_new_owner(cls: type[_SlottedManager]) -> None:
    from ftdist.local_sgd.local_sgd import bind_state

    manager = cls()
    bind_state(manager, "k", lambda sd: None, lambda: "first", None)
    bind_state(manager, "k", lambda sd: None, lambda: "second", None)
    assert manager.registered == ["k"]  # the Manager takes each key once
    assert manager.save() == "second"  # the registered function follows the new owner
