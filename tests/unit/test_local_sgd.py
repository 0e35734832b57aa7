"""LocalSGD and DiLoCo against a mocked Manager: torchft's own unit tests (both
generations, restated), the schedule, validation, and what a sync does on a
commit, a failed commit and a heal."""

from __future__ import annotations

import itertools
from typing import Any
from unittest.mock import MagicMock, create_autospec

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ftdist.local_sgd import DiLoCo, LocalSGD, _StreamingDiLoCoFragment, extract_local_tensor
from ftdist.local_sgd.diloco import ASYNC_QUORUM_ERROR, sync_action
from ftdist.local_sgd.fragment import bucketization_enabled, plan_buckets
from ftdist.manager import Manager

pytestmark = pytest.mark.timeout(30)


class DummyWork:
    """A finished allreduce (torchft's ``_DummyWork``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._fut.set_result(tensor)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        return self._fut


def create_manager() -> MagicMock:
    manager: MagicMock = create_autospec(Manager)
    manager.errored.return_value = None
    manager._use_async_quorum = False

    def mock_allreduce(tensor: torch.Tensor, should_quantize: bool = False) -> DummyWork:
        return DummyWork(tensor)

    manager.allreduce.side_effect = mock_allreduce
    return manager


class SimpleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 5), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(x)
        return out


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.w2 = nn.Parameter(torch.tensor([3.0, 4.0, 5.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w1.unsqueeze(0).T + self.w2.sum()


def _params(m: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.data for name, p in m.named_parameters()}


def _copy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sd.items()}


def _inner_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.rand(2, 3)).mean().backward()
    optim.step()


# -- torchft's unit tests, both generations --------------------------------------------------
def test_local_sgd_healthy() -> None:
    model = SimpleModel()
    optimizer = torch.optim.SGD(model.parameters())
    manager = create_manager()
    with LocalSGD(manager, model, optimizer, sync_every=2) as local_sgd:
        assert local_sgd._local_step == 0
        _inner_step(model, optimizer)
        assert local_sgd._local_step == 1
        assert manager.start_quorum.call_count == 0
        _inner_step(model, optimizer)
        assert manager.start_quorum.call_count == 1
        assert local_sgd._local_step == 0
        assert manager.should_commit.call_count == 1
        assert manager.allreduce.call_count == 4


def test_local_sgd_steps_without_a_sync() -> None:
    model = SimpleModel()
    optimizer = torch.optim.SGD(model.parameters())
    with LocalSGD(create_autospec(Manager), model, optimizer, sync_every=2) as local_sgd:
        before = _copy(model.state_dict())
        _inner_step(model, optimizer)
        for name, p in model.state_dict().items():
            assert not torch.equal(before[name], p), name
        assert local_sgd._local_step == 1


def test_extract_local_tensor() -> None:
    regular = torch.rand(3, 3, requires_grad=True)
    result = extract_local_tensor(regular)
    assert torch.equal(result, regular) and result.grad is None and result is not regular
    local = torch.rand(3, 3, requires_grad=True)
    dtensor = MagicMock(spec=DTensor)
    dtensor.to_local.return_value = local
    result = extract_local_tensor(dtensor)
    assert torch.equal(result, local) and result.grad is None and result is not local
    dtensor.to_local.assert_called_once()


@pytest.mark.parametrize("seed_era", [False, True])
def test_diloco_healthy(seed_era: bool) -> None:
    model = SimpleModel()
    inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = create_manager()
    fragments: Any = model if seed_era else [model]
    with DiLoCo(manager, fragments, inner, outer, sync_every=2) as diloco:
        n_params = len(list(model.parameters()))
        assert outer.state_dict()["state"] == {}
        assert diloco._local_step == 0
        backups = (
            diloco.original_parameters if seed_era else diloco._fragments[0].original_parameters
        )
        torch.testing.assert_close(dict(backups), _params(model))
        _inner_step(model, inner)
        assert diloco._local_step == 1
        assert manager.start_quorum.call_count == 0
        manager.current_step.return_value = 0
        manager.should_commit.return_value = True
        _inner_step(model, inner)
        assert diloco._local_step == 0
        assert manager.start_quorum.call_count == 1
        torch.testing.assert_close(dict(backups), _params(model))
        assert manager.should_commit.call_count == 1
        assert manager.allreduce.call_count == n_params
        assert len(outer.state_dict()["state"]) == n_params


def test_seed_era_call_with_model_keyword_and_a_truthy_mock_vote() -> None:
    model = SimpleModel()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
    manager: MagicMock = create_autospec(Manager)  # should_commit() and current_step() return mocks
    manager._use_async_quorum = False
    with DiLoCo(
        manager, model=model, inner_optimizer=inner, outer_optimizer=outer, sync_every=1
    ) as diloco:
        _inner_step(model, inner)
        assert manager.start_quorum.call_count == 1
        assert len(outer.state_dict()["state"]) == 4
        diloco.sync()  # the seed era's method: one more sync right now
        assert manager.start_quorum.call_count == 2


@pytest.mark.parametrize("bucketize", [True, False])
def test_diloco_allreduce_call_efficiency(bucketize: bool) -> None:
    model = SimpleModel()
    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = create_manager()
    manager.should_commit.return_value = True
    with DiLoCo(manager, [model], inner, outer, sync_every=2, use_bucketization=bucketize):
        _inner_step(model, inner)
        manager.current_step.return_value = 0
        _inner_step(model, inner)
        _inner_step(model, inner)
    n_params = len(list(model.parameters()))
    if bucketize:
        assert manager.allreduce.call_count < n_params
    else:
        assert manager.allreduce.call_count == n_params


def _doubling_manager() -> MagicMock:
    manager: MagicMock = create_autospec(Manager)
    manager._use_async_quorum = False
    manager.should_commit.return_value = True

    def fake_allreduce(tensor: torch.Tensor, should_quantize: bool) -> DummyWork:
        tensor.mul_(2)
        return DummyWork(tensor)

    manager.allreduce.side_effect = fake_allreduce
    return manager


def test_bucketization_correctness() -> None:
    model = TinyModel()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(
        _doubling_manager(), [model], inner, outer, sync_every=2, use_bucketization=True
    )
    fragment = diloco._fragments[0]
    fragment.bucket_cap_mb = 10 * 1024 * 1024
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])]
    for g, (name, _) in zip(grads, model.named_parameters(), strict=True):
        fragment._grads[name] = g.clone()
    fragment._average_grads()
    assert all(p.grad is None for p in model.parameters())
    fragment._set_grads()
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g * 2)


def test_gradient_correctness_pins_the_sign_global_minus_local() -> None:
    model = TinyModel()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(_doubling_manager(), [model], inner, outer, sync_every=2)
    fragment = diloco._fragments[0]
    fragment.save_parameters()
    for p in model.parameters():
        p.data.add_(2)
    fragment._save_grads()
    fragment._average_grads()
    assert all(p.grad is None for p in model.parameters())
    fragment._set_grads()
    # +2 locally, doubled by the fake allreduce: global - local = -2, times 2.
    for p in model.parameters():
        assert p.grad is not None
        assert torch.equal(p.grad, torch.full_like(p.grad, -4.0))


# -- the schedule ------------------------------------------------------------------------------
@pytest.mark.parametrize("period", range(1, 9))
def test_each_period_prepares_once_and_performs_delay_steps_later(period: int) -> None:
    for delay in range(period):
        actions = [sync_action(step, period, delay) for step in range(1, period + 1)]
        prepares = [i + 1 for i, a in enumerate(actions) if a.prepare]
        performs = [i + 1 for i, a in enumerate(actions) if a.perform]
        assert performs == [period]
        assert prepares == [period - delay]
        assert all(a.reason for a in actions)


@pytest.mark.parametrize(
    ("step", "period", "delay"), [(0, 4, 0), (5, 4, 0), (1, 4, 4), (1, 4, -1), (1, 0, 0)]
)
def test_the_schedule_rejects_impossible_states(step: int, period: int, delay: int) -> None:
    with pytest.raises(ValueError):
        sync_action(step, period, delay)


def test_fragments_rotate_with_the_step_and_a_failed_sync_retries_the_same_fragment() -> None:
    frags = [nn.Linear(2, 2), nn.Linear(2, 3), nn.Linear(3, 1)]
    model = nn.Sequential(*frags)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outers = [torch.optim.SGD(f.parameters(), lr=0.5, momentum=0.5) for f in frags]
    manager = create_manager()
    step = {"now": 0}
    votes = iter([True, False, True, True])

    def vote() -> bool:
        ok = next(votes)
        step["now"] += ok
        return ok

    manager.current_step.side_effect = lambda: step["now"]
    manager.should_commit.side_effect = vote
    reduced: list[int] = []

    def allreduce(tensor: torch.Tensor, should_quantize: bool = False) -> DummyWork:
        reduced.append(tensor.numel())
        return DummyWork(tensor)

    manager.allreduce.side_effect = allreduce
    with DiLoCo(manager, frags, inner, outers, sync_every=6, fragment_sync_delay=1):
        for _ in range(8):
            model(torch.rand(4, 2)).sum().backward()
            inner.step()
            inner.zero_grad()
    # Syncs of fragments 0 (commits), 1 (fails), 1 again (commits), 2.
    assert reduced == [4, 2, 6, 3, 6, 3, 3, 1]
    assert [len(o.state) for o in outers] == [2, 2, 2]


# -- a sync: commit, failed commit, merge ------------------------------------------------------
def _setup(alpha: float = 0.0, **kwargs: Any) -> tuple[nn.Module, Any, DiLoCo, MagicMock]:
    model = TinyModel()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = torch.optim.SGD(model.parameters(), lr=0.5)
    manager = create_manager()
    diloco = DiLoCo(
        manager, [model], inner, outer, sync_every=2, fragment_update_alpha=alpha, **kwargs
    )
    return model, inner, diloco, manager


def _constant_step(model: nn.Module, inner: torch.optim.Optimizer, grad: float = 2.0) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    inner.step()


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_a_committed_sync_steps_the_global_weights_and_mixes_in_the_local(alpha: float) -> None:
    model, inner, diloco, manager = _setup(alpha)
    manager.should_commit.return_value = True
    start = _copy(_params(model))
    with diloco:
        _constant_step(model, inner)
        _constant_step(model, inner)
    # Inner lr 1, grad 2: local = start - 4; pseudo-gradient = +4; outer lr 0.5.
    for name, p in model.named_parameters():
        new_global = start[name] - 0.5 * 4.0
        assert torch.equal(diloco.original_parameters[name], new_global)
        expected = torch.lerp(new_global, start[name] - 4.0, alpha) if alpha else new_global
        assert torch.equal(p.data, expected), name
        assert p.grad is None


def test_a_failed_sync_discards_the_local_progress_and_keeps_the_global_state() -> None:
    model, inner, diloco, manager = _setup(0.5)
    manager.should_commit.return_value = False
    start = _copy(_params(model))
    outer = diloco._fragments[0]._outer_optimizer
    with diloco:
        _constant_step(model, inner)
        _constant_step(model, inner)
    for name, p in model.named_parameters():
        assert torch.equal(p.data, start[name])
        assert torch.equal(diloco.original_parameters[name], start[name])
        assert p.grad is None
    assert outer.state_dict()["state"] == {}
    assert diloco._fragments[0]._grads == {}


def test_a_shared_outer_optimizer_steps_only_the_syncing_fragment() -> None:
    frags = [nn.Linear(2, 2), nn.Linear(2, 1)]
    model = nn.Sequential(*frags)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
    manager = create_manager()
    manager.current_step.return_value = 0
    manager.should_commit.return_value = True
    with DiLoCo(manager, frags, inner, outer, sync_every=2):
        model(torch.rand(3, 2)).sum().backward()
        inner.step()
        inner.zero_grad()
        model(torch.rand(3, 2)).sum().backward()  # fragment 1 holds inner gradients now
        before = [p.detach().clone() for p in frags[1].parameters()]
        grads = [p.grad.clone() for p in frags[1].parameters() if p.grad is not None]
        inner.step()  # syncs fragment 0 only
    momentum = [outer.state[p] for p in model.parameters()]
    assert all("momentum_buffer" in s for s in momentum[:2])
    assert all(s == {} for s in momentum[2:])
    # Fragment 1 moved by its inner step alone, not by an outer step on its inner gradients.
    for p, b, g in zip(frags[1].parameters(), before, grads, strict=True):
        assert torch.equal(p.data, b.add(g, alpha=-0.1))  # as SGD computes it


# -- heals and registration --------------------------------------------------------------------
def test_fragments_register_state_and_consistency_under_torchfts_key() -> None:
    frags = [nn.Linear(2, 2), nn.Linear(2, 1)]
    inner = torch.optim.SGD(nn.Sequential(*frags).parameters(), lr=0.1)
    outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9) for f in frags]
    manager = create_manager()
    DiLoCo(manager, frags, inner, outers, sync_every=2)
    keys = [c.args[0] for c in manager.register_state_dict_fn.call_args_list]
    assert keys == ["StreamingDiLoCoFragment_0", "StreamingDiLoCoFragment_1"]
    checks = [c.args[0] for c in manager.register_consistency_fn.call_args_list]
    assert checks == keys


def _registered(manager: MagicMock, key: str) -> tuple[Any, Any, Any]:
    (load, save) = next(
        c.args[1:] for c in manager.register_state_dict_fn.call_args_list if c.args[0] == key
    )
    check = next(
        c.args[1] for c in manager.register_consistency_fn.call_args_list if c.args[0] == key
    )
    return load, save, check


def test_a_heal_loads_the_global_state_and_leaves_the_local_weights_to_the_user_state() -> None:
    src_model, src_inner, src, src_manager = _setup()
    src_manager.should_commit.return_value = True
    with src:
        for _ in range(4):  # two committed syncs: momentum-free SGD, new globals
            _constant_step(src_model, src_inner)
        _constant_step(src_model, src_inner)  # and local progress since
    _, save, src_check = _registered(src_manager, "StreamingDiLoCoFragment_0")
    sent = save()

    model, inner, diloco, manager = _setup()
    with diloco:
        _constant_step(model, inner, grad=-3.0)  # local progress from another history
    local = {name: p.detach().clone() for name, p in model.named_parameters()}
    load, _, check = _registered(manager, "StreamingDiLoCoFragment_0")
    load(sent)
    for name, p in model.named_parameters():
        assert torch.equal(diloco.original_parameters[name], src.original_parameters[name])
        # The model moves with the user's own state (torchft's split), not here.
        assert torch.equal(p.data, local[name])
        assert not torch.equal(p.data, src.original_parameters[name])
    from ftdist.manager.heal import fingerprint

    assert fingerprint(check()) == fingerprint(src_check())


def test_a_new_diloco_on_the_same_manager_takes_over_the_state_keys() -> None:
    model, inner, _first, manager = _setup()
    outer2 = torch.optim.SGD(model.parameters(), lr=0.1)
    second = DiLoCo(manager, [model], inner, outer2, sync_every=2)
    assert manager.register_state_dict_fn.call_count == 1  # registered once...
    _, save, _ = _registered(manager, "StreamingDiLoCoFragment_0")
    with torch.no_grad():
        second._fragments[0].original_parameters["w1"].fill_(7.0)
    assert torch.equal(
        save()["original_parameters"]["w1"], torch.full((2,), 7.0)
    )  # ...now the new one's


def test_local_sgd_digest_moves_with_a_heal_and_follows_committed_syncs() -> None:
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = create_manager()
    manager.should_commit.return_value = True
    with LocalSGD(manager, model, optimizer, sync_every=1):
        (load, save) = manager.register_state_dict_fn.call_args.args[1:]
        check = manager.register_consistency_fn.call_args.args[1]
        assert check() == {}
        _constant_step(model, optimizer)
        digest = dict(check())
        assert digest and save() == {"synced_digest": digest}
        manager.should_commit.return_value = False
        _constant_step(model, optimizer)  # a failed sync keeps the digest
        assert check() == digest
    load({"synced_digest": {"w1": 1}})
    assert check() == {"w1": 1}


def test_original_parameters_assignment_copies_into_the_backups() -> None:
    _, _, diloco, _ = _setup()
    backups = diloco.original_parameters
    diloco.original_parameters = {"w1": torch.tensor([9.0, 9.0])}
    assert diloco.original_parameters is backups
    assert backups["w1"].tolist() == [9.0, 9.0]
    with pytest.raises(KeyError, match="nope"):
        diloco.original_parameters = {"nope": torch.zeros(1)}


def test_several_fragments_show_a_merged_read_only_view() -> None:
    frags = [nn.Linear(2, 2), nn.Linear(2, 1)]
    inner = torch.optim.SGD(nn.Sequential(*frags).parameters(), lr=0.1)
    diloco = DiLoCo(create_manager(), frags, inner, torch.optim.SGD(frags[0].parameters()), 2)
    view = diloco.original_parameters
    assert sorted(view) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    with pytest.raises(TypeError):
        view["0.bias"] = torch.zeros(2)  # type: ignore[index]


# -- validation --------------------------------------------------------------------------------
def _args(**overrides: Any) -> dict[str, Any]:
    frags = [nn.Linear(2, 2), nn.Linear(2, 1)]
    inner = torch.optim.SGD(nn.Sequential(*frags).parameters(), lr=0.1)
    args: dict[str, Any] = {
        "manager": create_manager(),
        "model_fragments": frags,
        "inner_optimizer": inner,
        "outer_optimizer": [torch.optim.SGD(f.parameters()) for f in frags],
        "sync_every": 4,
    }
    args.update(overrides)
    return args


def _async_manager() -> MagicMock:
    manager = create_manager()
    manager._use_async_quorum = True
    return manager


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"manager": _async_manager()}, ValueError, "synchronous quorum"),
        (
            {"outer_optimizer": [torch.optim.SGD([nn.Parameter(torch.ones(1))])]},
            ValueError,
            "outer optimizers",
        ),
        ({"sync_every": 1}, ValueError, "only one fragment"),
        ({"sync_every": 3}, ValueError, "not a multiple"),
        ({"fragment_sync_delay": 2}, ValueError, "fragment_sync_delay"),
        ({"fragment_sync_delay": -1}, ValueError, "fragment_sync_delay"),
        ({"fragment_update_alpha": 1.5}, ValueError, "between 0 and 1"),
        ({"should_quantize": "fp4"}, ValueError, "should_quantize"),
        ({"sync_every": 0}, ValueError, "greater than or equal to 1"),
        ({"sync_every": 2.0}, TypeError, "int"),
        ({"model_fragments": []}, TypeError, "non-empty list"),
        ({"model_fragments": None}, TypeError, "model_fragments"),
        ({"inner_optimizer": None}, TypeError, "inner_optimizer"),
    ],
)
def test_misuse_raises_before_anything_runs(
    overrides: dict[str, Any], error: type[Exception], match: str
) -> None:
    args = _args(**overrides)
    with pytest.raises(error, match=match):
        DiLoCo(**args)
    args["manager"].start_quorum.assert_not_called()


def test_the_async_quorum_error_is_torchfts() -> None:
    assert "use_async_quorum=False" in ASYNC_QUORUM_ERROR


def test_a_parameter_in_two_fragments_is_refused() -> None:
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="belong to one fragment"):
        DiLoCo(**_args(model_fragments=[shared, nn.Sequential(shared)]))


def test_local_sgd_validates_sync_every() -> None:
    model = TinyModel()
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        LocalSGD(create_manager(), model, torch.optim.SGD(model.parameters()), 0)


def test_a_fragment_offset_past_sync_every_is_refused() -> None:
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters())
    with pytest.raises(ValueError, match="once every sync_every"):
        _StreamingDiLoCoFragment(create_manager(), model, 0, 5, opt, opt, 4)


def test_perform_before_prepare_and_prepare_twice_are_refused() -> None:
    _, _, diloco, _ = _setup()
    fragment = diloco._fragments[0]
    with pytest.raises(RuntimeError, match="before prepare_sync"):
        fragment.perform_sync()
    fragment.prepare_sync()
    with pytest.raises(RuntimeError, match="already being synchronised"):
        fragment.prepare_sync()


def test_a_quorum_that_fails_fails_the_sync_not_the_loop() -> None:
    model, inner, diloco, manager = _setup()
    manager.start_quorum.side_effect = TimeoutError("no quorum")
    manager.should_commit.return_value = False
    with diloco:
        _constant_step(model, inner)
        _constant_step(model, inner)  # no exception
    assert manager.should_commit.call_count == 1
    manager.start_quorum.side_effect = ValueError("misuse")
    with diloco, pytest.raises(ValueError, match="misuse"):
        _constant_step(model, inner)
        _constant_step(model, inner)


# -- buckets -----------------------------------------------------------------------------------
def test_buckets_hold_every_tensor_once_in_order_within_the_cap() -> None:
    sizes = [0, 1, 3, 4, 5, 9]
    kinds = ["a", "b"]
    for n in range(5):
        for tensors in itertools.product(itertools.product(sizes, kinds), repeat=n):
            for cap in (1, 4, 8):
                buckets = plan_buckets(list(tensors), cap)
                assert [i for b in buckets for i in b] == list(range(n))
                for b in buckets:
                    assert len({tensors[i][1] for i in b}) == 1
                    if len(b) > 1:
                        assert sum(tensors[i][0] for i in b) <= cap
                # Greedy: the next tensor did not fit (or was of another kind).
                for b, nxt in itertools.pairwise(buckets):
                    first = nxt[0]
                    same = tensors[first][1] == tensors[b[0]][1]
                    total = sum(tensors[i][0] for i in b) + tensors[first][0]
                    assert not same or total > cap
    with pytest.raises(ValueError):
        plan_buckets([(1, "a")], 0)


def test_the_bucketization_environment_forces_it() -> None:
    assert bucketization_enabled(False, {"TORCHFT_USE_BUCKETIZATION": "True"})
    assert bucketization_enabled(False, {"FTDIST_USE_BUCKETIZATION": "True"})
    assert not bucketization_enabled(False, {"TORCHFT_USE_BUCKETIZATION": "1"})
    assert bucketization_enabled(True, {})


def test_bucket_cap_mb_is_mebibytes_and_the_default_one_gibibyte_in_bytes() -> None:
    _, _, diloco, _ = _setup(bucket_cap_mb=2)
    assert diloco._fragments[0].bucket_cap_mb == 2 * 1024 * 1024
    assert _StreamingDiLoCoFragment.bucket_cap_mb == 1024**3


def test_a_delayed_average_runs_while_training_goes_on() -> None:
    """Prepared at inner step 2 of 4, awaited at step 4: steps 3 and 4 overlap it.
    Only a replica that serves a heal in that quorum waits at once (its
    weights must not change under the peer's download)."""
    model = TinyModel()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = torch.optim.SGD(model.parameters(), lr=0.5)
    manager = create_manager()
    manager.heal_timelines = []
    manager.should_commit.return_value = True
    waited: list[int] = []
    steps = {"n": 0}

    class Pending(DummyWork):
        def wait(self, timeout: Any = None) -> bool:
            waited.append(steps["n"])
            return True

    manager.allreduce.side_effect = lambda t, should_quantize=False: Pending(t)

    def serve() -> None:
        manager.heal_timelines.append(MagicMock(role="send"))

    with DiLoCo(manager, [model], inner, outer, sync_every=4, fragment_sync_delay=2):
        for n in range(1, 9):
            steps["n"] = n
            if n == 6:  # the second sync's quorum serves a peer
                manager.start_quorum.side_effect = serve
            _constant_step(model, inner)
    assert manager.start_quorum.call_count == 2
    # First sync: prepared at step 2, its two allreduces awaited at step 4
    # only. Second: prepared at step 6, awaited at once (serving), then at 8.
    assert waited == [4, 4, 6, 6, 8, 8]
