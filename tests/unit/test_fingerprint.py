"""A heal's consistency check: the source's plan, rebuilt by the receiver from
the bytes it received (real HTTP transports on loopback for the end to end)."""

from __future__ import annotations

import collections
import copy
import itertools
import logging
from datetime import timedelta
from typing import Any, NamedTuple, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftdist.checkpointing import HTTPTransport
from ftdist.checkpointing._checksum import SegmentSum
from ftdist.errors import StateDivergenceError
from ftdist.manager.fingerprint import (
    MAX_PARTS,
    fingerprint,
    fold_parts,
    plan,
    plan_items,
    planned,
)
from ftdist.manager.heal import HealTimeline, Staged, heal_state, load_received
from ftdist.manager.state import ConsistencyParts, UserState

pytestmark = pytest.mark.timeout(120)

TIMEOUT = timedelta(seconds=10)


class Replica:
    """A model and its SGD optimizer, registered as a Manager registers them."""

    def __init__(self, seed: int, widths: tuple[int, ...] = (6, 5, 3)) -> None:
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
        self.model = torch.nn.Sequential(*layers)
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.model(torch.randn(4, widths[0])).sum().backward()
        self.optim.step()
        self.user = UserState(TIMEOUT)
        self.user.register("default", self.load, self.save)
        self.parts = ConsistencyParts()
        self.parts.register("ddp", lambda: dict(self.model.named_parameters()))
        self.parts.register("optimizer", self.optim.state_dict)
        self.after_load: Any = None

    def save(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        if self.after_load is not None:
            self.after_load(self)


def _heal(
    transports: tuple[HTTPTransport[Any], HTTPTransport[Any]],
    source: Replica,
    receiver: Replica,
    old_format: bool = False,
) -> tuple[Staged, StateDivergenceError | None]:
    src, dst = transports
    state = heal_state(source.user, {"step": 3}, source.parts)
    if old_format:  # what sources before the plan sent
        del state["consistency_plan"]
        state["consistency"] = source.parts.fingerprint()
    src.send_checkpoint([1], 3, state, TIMEOUT)
    got = dst.recv_checkpoint(0, src.metadata(), 3, TIMEOUT)
    src.disallow_checkpoint()
    assert dst.last_transfer is not None
    staged = Staged(got, 3, HealTimeline(3, 1, "receive", [0]), dst.last_transfer.tensor_sums)
    return staged, load_received(staged, receiver.user, receiver.parts)


def test_a_heal_that_loads_everything_passes_without_the_source_hashing_its_tensors(
    transports: tuple[HTTPTransport[Any], HTTPTransport[Any]],
) -> None:
    source, receiver = Replica(0), Replica(1)
    state = heal_state(source.user, {"step": 3}, source.parts)
    # Every parameter and momentum buffer travels in the heal: the plan
    # names each by position instead of carrying its sums.
    items = [item for part in state["consistency_plan"].values() for item in plan_items(part)]
    assert sum(item[0] == "t" for item in items) == 2 * len(list(source.model.parameters()))
    staged, error = _heal(transports, source, receiver)
    assert error is None
    assert staged.timeline.load_s > 0
    assert receiver.parts.fingerprint() == source.parts.fingerprint()
    assert len(staged.sums) >= 2 * len(list(source.model.parameters()))
    # The receiver rebuilt the source's fingerprint from the transport's sums:
    # sums off by one bit make the same load a divergence.
    off = {k: SegmentSum(v.s1 ^ 1, v.s2, v.words) for k, v in staged.sums.items()}
    again = Staged(staged.state, 3, staged.timeline, off)
    assert isinstance(load_received(again, receiver.user, receiver.parts), StateDivergenceError)


@pytest.mark.parametrize("old_format", [False, True])
@pytest.mark.parametrize("what", ["weight", "lr"])
def test_a_heal_that_loads_incompletely_names_the_part(
    transports: tuple[HTTPTransport[Any], HTTPTransport[Any]], what: str, old_format: bool
) -> None:
    source, receiver = Replica(0), Replica(1)

    def spoil(replica: Replica) -> None:
        if what == "weight":  # a load function that re-initialises a layer afterwards
            with torch.no_grad():
                cast(torch.nn.Linear, replica.model[1]).weight.add_(1.0)
        else:  # ... or keeps its own learning rate
            replica.optim.param_groups[0]["lr"] = 0.5

    receiver.after_load = spoil
    _, error = _heal(transports, source, receiver, old_format)
    assert isinstance(error, StateDivergenceError)
    part = "ddp/1.weight" if what == "weight" else "optimizer/param_groups/0/lr"
    assert part in str(error) and "load_state_dict" in str(error)


def test_a_plan_that_does_not_fit_the_state_skips_the_check_and_says_so(
    transports: tuple[HTTPTransport[Any], HTTPTransport[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    source = Replica(0)
    user = source.user.save()
    assert planned({"p": [["t", 10_000, 4]]}, user, {}) is None
    assert planned({"p": [["t", 0, 3]]}, user, {}) is None  # not the tensor's size
    assert planned({"p": [["?", 1, 2, 3]]}, user, {}) is None
    assert planned(["not", "a", "plan"], user, {}) is None
    packed = plan({"ddp": dict(source.model.named_parameters())}, user)
    assert planned({k: v[:-3] for k, v in packed.items()}, user, {}) is None  # truncated
    assert planned({k: b"x" + v for k, v in packed.items()}, user, {}) is None  # unknown item
    assert "consistency plan does not fit" in caplog.text


@settings(max_examples=40, deadline=None)
@given(
    widths=st.lists(st.integers(min_value=1, max_value=9), min_size=2, max_size=4),
    extra=st.sampled_from(["none", "own tensor", "transposed", "empty", "value"]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_a_plan_rebuilds_exactly_the_fingerprint_of_the_parts(
    widths: list[int], extra: str, seed: int
) -> None:
    replica = Replica(seed, tuple(widths))
    user = replica.user.save()
    parts: dict[str, Any] = {
        "ddp": dict(replica.model.named_parameters()),
        "optimizer": replica.optim.state_dict(),
    }
    if extra == "own tensor":  # a part the heal does not carry: summed by the source
        parts["extra"] = torch.arange(seed % 7 + 1)
    elif extra == "transposed":  # carried, but its bytes are not in row-major order
        parts["extra"] = cast(torch.nn.Linear, replica.model[0]).weight.t()
    elif extra == "empty":
        parts["extra"] = torch.empty(0, 3)
    elif extra == "value":
        parts["extra"] = {"epoch": seed, "name": "x" * (seed % 11)}
    want = fold_parts(fingerprint(parts), MAX_PARTS)
    the_plan = plan(parts, user)
    assert planned(the_plan, user, {}) == want
    # As a source before the packed plan sent it: lists of items.
    listed = {k: [list(item) for item in plan_items(v)] for k, v in the_plan.items()}
    assert planned(listed, user, {}) == want
    # The receiver holds a copy: the plan is read against its bytes.
    received = copy.deepcopy(user)
    assert planned(the_plan, received, {}) == want
    with torch.no_grad():
        received["model"]["0.bias"][0] += 1.0
    changed = planned(the_plan, received, {})
    assert changed is not None and changed["ddp/0.bias"] != want["ddp/0.bias"]
    assert {k for k in want if changed[k] != want[k]} == {"ddp/0.bias"}


def test_the_plan_is_cheap_to_make_for_a_state_the_heal_carries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    replica = Replica(0, (64, 64, 64))
    the_plan = replica.parts.plan(replica.user.save())
    runs = [item for part in the_plan.values() for item in plan_items(part) if item[0] == "w"]
    # Only headers and values are summed on the source: a handful of words each.
    assert runs and max(int(item[3]) for item in runs) < 16
    assert not caplog.text


def test_a_large_models_rebuilt_fingerprint_is_folded_like_its_own(
    transports: tuple[HTTPTransport[Any], HTTPTransport[Any]],
) -> None:
    # 30 layers: 60 parameters and 60 momentum buffers, more parts than a
    # quorum request carries, so both sides fold them the same way.
    source, receiver = Replica(0, (3,) * 31), Replica(1, (3,) * 31)
    folded = source.parts.fingerprint()
    assert (
        len(folded) <= MAX_PARTS < len(fingerprint({"ddp": dict(source.model.named_parameters())}))
    )
    staged, error = _heal(transports, source, receiver)
    assert error is None
    assert planned(staged.state["consistency_plan"], staged.state["user"], staged.sums) == folded


class _Pair(NamedTuple):
    left: Any
    right: Any


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.integers(0, 3).map(lambda n: torch.arange(n)),
    st.frozensets(st.integers(0, 3), max_size=2),
)
_key = st.one_of(st.text(max_size=4), st.integers(-3, 3))
_tree = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(_key, children, max_size=3),
        st.dictionaries(_key, children, max_size=3).map(collections.OrderedDict),
        st.dictionaries(_key, children, max_size=3).map(lambda d: collections.defaultdict(int, d)),
        st.tuples(children, children).map(lambda lr: _Pair(*lr)),
    ),
    max_leaves=25,
)


@settings(max_examples=200, deadline=None)
@given(tree=_tree)
def test_named_leaves_are_torchs_leaves_with_their_part_names(tree: Any) -> None:
    # Plans name tensors by position among the leaves, and parts by path: a
    # receiver must count and name exactly as the source does, and as
    # torch's pytree (which sources before the fast walk used).
    from torch.utils._pytree import tree_flatten_with_path

    from ftdist.manager.fingerprint import _path_name, named_leaves

    want = [(_path_name(path), leaf) for path, leaf in tree_flatten_with_path(tree)[0]]
    got = named_leaves(tree)
    assert [name for name, _ in got] == [name for name, _ in want]
    assert all(a is b for (_, a), (_, b) in zip(got, want, strict=True))
