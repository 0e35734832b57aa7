"""ExactSampler's own logic (ftdist.data.exact) against a stand-in for the
Manager's quorum accessors: the indices it hands out, its settings and their
checks. The end-to-end proof under failures is tests/integration/test_exact_data.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest

from ftdist.data import ExactSampler


class _Quorum:
    """The Manager calls ExactSampler makes, with a settable step and quorum."""

    def __init__(self, participants: int = 2, rank: int | None = 0) -> None:
        self.step = 0
        self.participants = participants
        self.rank = rank
        self.registered: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self.consistency: dict[str, Callable[[], Any]] = {}

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int | None:
        return self.rank

    def is_participating(self) -> bool:
        return self.rank is not None

    def register_state_dict_fn(
        self, key: str, load: Callable[[Any], None], save: Callable[[], Any]
    ) -> None:
        if key in self.registered:
            raise ValueError(f"{key} is registered")
        self.registered[key] = (load, save)

    def register_consistency_fn(self, key: str, fn: Callable[[], Any]) -> str:
        self.consistency[key] = fn
        return key


def _sampler(quorum: _Quorum, **kwargs: Any) -> ExactSampler:
    options: dict[str, Any] = {"global_batch_size": 8, "micro_batch_size": 2, "seed": 3}
    options.update(kwargs)
    return ExactSampler(20, cast(Any, quorum), **options)


def test_groups_split_each_step_and_the_epoch_is_one_permutation() -> None:
    quorums = [_Quorum(2, 0), _Quorum(2, 1)]
    samplers = [_sampler(q) for q in quorums]
    seen: list[int] = []
    for step in range(3):  # 8 + 8 + 4 = one epoch of 20
        for q in quorums:
            q.step = step
        shares = [[i for mb in s.micro_batches() for i in mb] for s in samplers]
        assert not set(shares[0]) & set(shares[1])
        seen += shares[0] + shares[1]
    assert sorted(seen) == list(range(20))
    assert samplers[0].epoch_order(0) != list(range(20))  # shuffled, seeded
    assert samplers[0].epoch_order(0) == samplers[1].epoch_order(0)
    assert samplers[0].epoch_order(1) != samplers[0].epoch_order(0)
    quorums[0].step = 3
    assert samplers[0].cursor.epoch == 1 and samplers[0].cursor.position == 0


def test_a_group_that_reads_nothing_still_gets_one_empty_micro_batch() -> None:
    assert _sampler(_Quorum(2, None)).micro_batches() == [[]]


def test_settings_travel_with_heals_and_checkpoints() -> None:
    quorum = _Quorum(1, 0)
    sampler = _sampler(quorum)
    load, save = quorum.registered["ftdist.exact_sampler"]
    assert "ftdist.exact_sampler" in quorum.consistency
    quorum.step = 2
    state = save()
    assert (state["epoch"], state["position"], state["seed"]) == (0, 16, 3)
    other = _sampler(_Quorum(1, 0), seed=99)
    other._manager.step = 2  # type: ignore[attr-defined]
    other.load_state_dict(state)
    assert other.seed == 3
    other._manager.step = 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"load manager\.state_dict"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size=8"):
        _sampler(_Quorum(), global_batch_size=4).load_state_dict(state)
    load({**state, "seed": 5})  # a heal: settings only, the step comes with it
    assert sampler.seed == 5


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="must divide global_batch_size"):
        _sampler(_Quorum(), micro_batch_size=3)
    with pytest.raises(TypeError, match="must have a length"):
        ExactSampler(cast(Any, object()), cast(Any, _Quorum()), global_batch_size=2)
    with pytest.raises(ValueError, match="global_batch_size must be at least 1"):
        _sampler(_Quorum(), global_batch_size=0)
    quorum = _Quorum()
    _sampler(quorum)
    with pytest.raises(ValueError, match="is registered"):
        _sampler(quorum)
