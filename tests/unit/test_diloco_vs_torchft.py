"""ftdist's DiLoCo against torchft's, number for number.

Two replica groups train in two threads of this process, each over a fake
Manager: the pair averages in memory (a sum in replica order, then a
division by the participants, as the Manager does), quorums are lockstep
and every sync commits. The same scenario runs once with torchft's
``DiLoCo`` (the installed wheel; skipped without it) and once with
ftdist's, and every replica's weights and global weights must be equal bit
for bit. The replicas see different data, so the averaging matters.

Scenarios: plain DiLoCo; streaming DiLoCo (2 fragments, delay 1, alpha
0.5); and streaming with a heal at the first quorum (replica 1 starts from
other weights and receives replica 0's state, as ``init_sync`` does when
nothing ran a quorum before training).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from ftdist.local_sgd import DiLoCo

torchft_local_sgd = pytest.importorskip(
    "torchft.local_sgd", reason="torchft is not installed: nothing to compare against"
)

pytestmark = pytest.mark.timeout(60)

INNER_STEPS = 13  # the last step after a sync: the replicas differ at the end


@dataclass(frozen=True)
class Scenario:
    n_fragments: int
    sync_every: int
    delay: int
    alpha: float
    heal_at_first_quorum: bool = False


class _Done:
    """A finished allreduce (the fake's averaging is synchronous)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(self._tensor)
        return fut


class _Pair:
    """What two replica groups' Managers share: a barrier and the slots of an average."""

    def __init__(self, heal_at_first_quorum: bool) -> None:
        self.barrier = threading.Barrier(2, timeout=20)
        self.slots: list[torch.Tensor | None] = [None, None]
        self.heal_pending = heal_at_first_quorum
        self.managers = [_FakeManager(self, r) for r in range(2)]


class _FakeManager:
    """The part of the Manager DiLoCo uses, for one of two replica groups."""

    _use_async_quorum = False

    def __init__(self, pair: _Pair, replica: int) -> None:
        self._pair = pair
        self._replica = replica
        self._step = 0
        self.loads: dict[str, Callable[[Any], None]] = {}
        self.saves: dict[str, Callable[[], Any]] = {}

    def register_state_dict_fn(
        self, key: str, load: Callable[[Any], None], save: Callable[[], Any]
    ) -> None:
        self.loads[key] = load
        self.saves[key] = save

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass

    def current_step(self) -> int:
        return self._step

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        pair = self._pair
        pair.barrier.wait()
        if pair.heal_pending and self._replica == 1:
            # Replica 0 is parked at the next barrier: its state is still.
            source = pair.managers[0]
            state = {key: copy.deepcopy(save()) for key, save in source.saves.items()}
            for key, load in self.loads.items():  # in registration order, as the Manager
                load(state[key])
            self._step = source.current_step()
            pair.heal_pending = False
        pair.barrier.wait()

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _Done:
        pair = self._pair
        pair.slots[self._replica] = tensor.clone()
        pair.barrier.wait()
        first, second = pair.slots
        assert first is not None and second is not None
        total = first + second
        pair.barrier.wait()  # both have read the slots before either writes again
        tensor.copy_(total / 2)
        return _Done(tensor)

    def should_commit(self, timeout: Any = None) -> bool:
        self._step += 1
        return True


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _replica(
    diloco_cls: Any, scenario: Scenario, manager: _FakeManager, replica: int, model: nn.Sequential
) -> Any:
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager.register_state_dict_fn(
        "default", load, lambda: {"model": model.state_dict(), "inner": inner.state_dict()}
    )
    fragments: list[nn.Module] = [model] if scenario.n_fragments == 1 else [model[0], model[2]]
    outers = [
        torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments
    ]
    data = torch.Generator().manual_seed(100 + replica)
    with diloco_cls(
        manager,
        fragments,
        inner,
        outers,
        sync_every=scenario.sync_every,
        fragment_sync_delay=scenario.delay,
        fragment_update_alpha=scenario.alpha,
    ) as diloco:
        for _ in range(INNER_STEPS):
            x = torch.randn(8, 3, generator=data)
            y = torch.randn(8, 2, generator=data)
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            inner.step()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    globals_ = [
        {name: t.clone() for name, t in f.original_parameters.items()} for f in diloco._fragments
    ]
    return weights, globals_, manager.current_step()


def _run(diloco_cls: Any, scenario: Scenario) -> list[Any]:
    pair = _Pair(scenario.heal_at_first_quorum)
    # Built here: torch's global generator is not for two threads at once.
    models = [_model(0), _model(7 if scenario.heal_at_first_quorum else 0)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(_replica, diloco_cls, scenario, pair.managers[r], r, models[r])
            for r in range(2)
        ]
        return [f.result(timeout=30) for f in futures]


SCENARIOS = {
    "plain": Scenario(n_fragments=1, sync_every=4, delay=0, alpha=0.0),
    "streaming": Scenario(n_fragments=2, sync_every=4, delay=1, alpha=0.5),
    "streaming-heal": Scenario(
        n_fragments=2, sync_every=4, delay=1, alpha=0.5, heal_at_first_quorum=True
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ftdist_diloco_matches_torchft_bit_for_bit(name: str) -> None:
    scenario = SCENARIOS[name]
    theirs = _run(torchft_local_sgd.DiLoCo, scenario)
    ours = _run(DiLoCo, scenario)
    syncs = INNER_STEPS // (scenario.sync_every // scenario.n_fragments)
    initial = dict(_model(0).named_parameters())
    for replica in range(2):
        t_weights, t_globals, t_step = theirs[replica]
        o_weights, o_globals, o_step = ours[replica]
        assert t_step == o_step == syncs, (replica, t_step, o_step)
        for pname, t in t_weights.items():
            assert torch.equal(o_weights[pname], t), (name, replica, pname, o_weights[pname], t)
            assert not torch.equal(t, initial[pname])  # training moved it
        for f, t_global in enumerate(t_globals):
            for pname, t in t_global.items():
                assert torch.equal(o_globals[f][pname], t), (name, replica, f, pname)
    # The replicas share their global weights, and their data differ.
    for f in range(scenario.n_fragments):
        for pname, t in ours[0][1][f].items():
            assert torch.equal(ours[1][1][f][pname], t)
    assert any(not torch.equal(ours[0][0][p], ours[1][0][p]) for p in ours[0][0])
