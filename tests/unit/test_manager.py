"""The Manager's step protocol through its test seam: a scripted client, a fake group.

No servers, sockets or peers: each test scripts the quorum answers and commit
decisions and checks what the Manager did with them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch

from ftdist.checkpointing import CheckpointTransport
from ftdist.checkpointing._prefault import ReceiveReserve
from ftdist.errors import CheckpointError, CoordinationTimeoutError
from ftdist.manager import Manager, WorldSizeMode
from ftdist.manager.allreduce_result import AllreduceResult
from ftdist.testing import FakeManagerClient, FakeProcessGroup, quorum_result

pytestmark = pytest.mark.timeout(30)


class MemoryTransport(CheckpointTransport[Any]):
    """Hands out a preset state; records what it was asked to serve."""

    def __init__(self, state: Any = None, fail: Exception | None = None) -> None:
        self.state = state
        self.fail = fail
        self.sent: list[tuple[list[int], int, Any]] = []
        self.received: list[tuple[int, str, int]] = []
        self.disallowed = 0

    def metadata(self) -> str:
        return "memory://me"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        self.sent.append((dst_ranks, step, state_dict))

    def disallow_checkpoint(self) -> None:
        self.disallowed += 1

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self.received.append((src_rank, metadata, step))
        if self.fail is not None:
            raise self.fail
        return self.state

    def shutdown(self, wait: bool = True) -> None:
        pass


class Model:
    """User state: one tensor, loaded and saved through the Manager."""

    def __init__(self, value: float = 0.0) -> None:
        self.w = torch.full((3,), value)
        self.loads: list[Any] = []

    def load(self, sd: Any) -> None:
        self.loads.append(sd)
        self.w = sd["w"].clone()

    def save(self) -> dict[str, torch.Tensor]:
        return {"w": self.w}


@pytest.fixture
def make() -> Iterator[Any]:
    managers: list[Manager] = []

    def build(
        client: FakeManagerClient | None = None,
        model: Model | None = None,
        transport: CheckpointTransport[Any] | None = None,
        **kwargs: Any,
    ) -> tuple[Manager, FakeManagerClient, FakeProcessGroup, Model]:
        client = client or FakeManagerClient()
        model = model or Model()
        pg = FakeProcessGroup()
        kwargs.setdefault("min_replica_size", 1)
        kwargs.setdefault("timeout", timedelta(seconds=5))
        manager = Manager(
            pg,
            model.load,
            model.save,
            client=client,
            checkpoint_transport=transport or MemoryTransport(),
            **kwargs,
        )
        managers.append(manager)
        return manager, client, pg, model

    yield build
    for manager in managers:
        manager.shutdown()


def step(manager: Manager, value: float = 1.0) -> tuple[bool, torch.Tensor]:
    manager.start_quorum()
    t = torch.full((2,), value)
    manager.allreduce(t).wait()
    return manager.should_commit(), t


def test_a_step_commits_and_averages_over_the_participants(make: Any) -> None:
    manager, client, pg, _ = make()
    client.push_quorum(
        quorum_result(
            quorum_id=7,
            replica_rank=1,
            replica_world_size=2,
            max_replica_rank=1,
            max_world_size=2,
            store_address="store:1",
            replica_ids=["a", "replica"],
        )
    )
    committed, t = step(manager, 3.0)
    assert committed
    # Two identical peers: SUM doubles, the Manager divides by 2 participants.
    assert t.tolist() == [3.0, 3.0]
    assert (manager.current_step(), manager.batches_committed()) == (1, 2)
    assert pg.configures == [("store:1/ftdist/7-0/0", 1, 2)]
    assert manager.quorum_id() == 7
    assert client.quorum_calls[0].step == 0


def test_unchanged_quorum_reuses_the_process_group(make: Any) -> None:
    manager, _, pg, _ = make()
    for _ in range(3):
        assert step(manager)[0]
    assert len(pg.configures) == 1
    assert manager.current_step() == 3


def test_failed_allreduce_votes_no_and_is_reported_to_the_next_quorum(make: Any) -> None:
    manager, client, pg, _ = make()
    assert step(manager)[0]
    pg.fail_next(RuntimeError("peer died"))
    committed, _ = step(manager)
    assert not committed
    assert "peer died" in str(manager.errored())
    assert manager.current_step() == 1
    assert step(manager)[0]
    assert [c.commit_failures for c in client.quorum_calls] == [0, 0, 1]
    # The error is cleared by the next quorum.
    assert manager.errored() is None


def test_errored_replica_still_takes_part_with_zeros_and_votes_no(make: Any) -> None:
    # Its peers must not be left waiting out the collective timeout.
    manager, _, pg, _ = make()
    manager.start_quorum()
    manager.report_error(RuntimeError("data loader broke"))
    t = torch.ones(2)
    manager.allreduce(t).wait()
    assert pg.ops == ["allreduce"]
    assert t.tolist() == [0.0, 0.0]
    assert not manager.should_commit()
    assert manager.current_step() == 0


def test_max_retries_raises_after_that_many_failures_in_a_row(make: Any) -> None:
    manager, _, pg, _ = make(max_retries=1)
    pg.fail_next(RuntimeError("one"))
    assert not step(manager)[0]
    pg.fail_next(RuntimeError("two"))
    with pytest.raises(
        RuntimeError, match="should_commit failed 2 times consecutively, exceeding max_retries=1"
    ):
        step(manager)


def test_too_few_participants_vote_no(make: Any) -> None:
    manager, _, _, _ = make(min_replica_size=2)
    assert not step(manager)[0]
    assert manager.current_step() == 0


def test_the_replica_groups_vote_decides(make: Any) -> None:
    manager, client, _, _ = make(rank=0, world_size=2, store_addr="unused", store_port=1)
    client.push_vote(False)  # another group rank voted no
    assert not step(manager)[0]
    assert step(manager)[0]
    assert client.votes == [(0, 0, True), (0, 0, True)]
    assert manager.current_step() == 1


def test_heal_loads_the_received_state_before_the_vote(make: Any) -> None:
    received = {
        "user": {"w": torch.full((3,), 9.0)},
        "torchft": {"step": 5, "batches_committed": 10},
    }
    transport = MemoryTransport(state=received)
    manager, client, _, model = make(transport=transport)
    client.push_quorum(
        quorum_result(
            heal=True,
            max_step=5,
            recover_src_replica_rank=0,
            recover_src_manager_address="http://src:1",
            max_replica_rank=None,
            max_world_size=1,
        )
    )
    manager.start_quorum()
    t = torch.full((2,), 4.0)
    manager.allreduce(t).wait()
    # A healing replica contributes zeros (async quorum).
    assert t.tolist() == [0.0, 0.0]
    assert manager.should_commit()
    assert model.w.tolist() == [9.0] * 3
    assert transport.received == [(0, "fake://checkpoint", 5)]
    assert manager.current_step() == 6
    assert [h.role for h in manager.heal_timelines] == ["receive"]


def test_failed_heal_does_not_commit(make: Any) -> None:
    transport = MemoryTransport(fail=CheckpointError("truncated"))
    manager, client, _, model = make(transport=transport)
    client.push_quorum(
        quorum_result(
            heal=True,
            max_step=5,
            recover_src_replica_rank=0,
            recover_src_manager_address="http://src:1",
            max_replica_rank=None,
        )
    )
    assert not step(manager)[0]
    assert "truncated" in str(manager.errored())
    assert model.loads == []


def test_serving_sends_user_and_manager_state(make: Any) -> None:
    transport = MemoryTransport()
    manager, client, _, _ = make(transport=transport, model=Model(2.0))
    client.push_quorum(quorum_result(recover_dst_replica_ranks=[1], max_step=0))
    assert step(manager)[0]
    ((dst, at_step, sent),) = transport.sent
    assert (dst, at_step) == ([1], 0)
    # One state function: the seed-era layout, its state itself.
    assert sent["user"]["w"].tolist() == [2.0] * 3
    assert sent["ftdist"] == {"step": 0, "batches_committed": 0}
    assert transport.disallowed == 1
    assert [h.role for h in manager.heal_timelines] == ["send"]


def test_a_diverged_minority_heals_instead_of_failing(make: Any) -> None:
    received = {
        "user": {"w": torch.full((3,), 7.0)},
        "ftdist": {"step": 0, "batches_committed": 0},
    }
    manager, client, _, model = make(transport=MemoryTransport(state=received))
    client.push_quorum(
        quorum_result(
            divergence="'model/w' differs",
            heal=True,
            max_step=0,
            recover_src_replica_rank=1,
            max_replica_rank=None,
            recover_src_manager_address="http://src:1",
        )
    )
    assert step(manager)[0]
    assert manager.errored() is None
    assert model.w.tolist() == [7.0] * 3


def test_spare_contributes_zeros_and_does_not_count(make: Any) -> None:
    manager, client, _, _ = make(world_size_mode=WorldSizeMode.FIXED_WITH_SPARES)
    client.push_quorum(
        quorum_result(
            replica_rank=1,
            replica_world_size=2,
            max_replica_rank=1,
            max_world_size=2,
            replica_ids=["a", "replica"],
        )
    )
    committed, t = step(manager, 5.0)
    assert committed
    assert not manager.is_participating()
    assert t.tolist() == [0.0, 0.0]
    assert manager.num_participants() == 1
    assert manager.batches_committed() == 1


def test_failure_news_aborts_the_group_without_failing_finished_work(make: Any) -> None:
    manager, client, pg, _ = make()
    client.push_quorum(
        quorum_result(replica_world_size=2, max_world_size=2, replica_ids=["replica", "b"])
    )
    manager.start_quorum()
    manager.allreduce(torch.ones(2)).wait()
    manager._on_member_failed("b", "stream closed")
    manager._on_member_failed("not-a-member", "stream closed")
    assert pg.aborts == 1
    # The allreduce had completed: the abort alone does not fail the step.
    assert manager.should_commit()
    # The next quorum rebuilds the aborted group even though its id did not change.
    client.push_quorum(quorum_result(replica_world_size=1, replica_ids=["replica"]))
    assert step(manager)[0]
    assert len(pg.configures) == 2


def test_quorum_timeout_surfaces_from_wait_quorum(make: Any) -> None:
    manager, client, _, _ = make()
    client.push_quorum(CoordinationTimeoutError("lighthouse quorum timed out"))
    manager.start_quorum()
    with pytest.raises(TimeoutError, match="timed out"):
        manager.wait_quorum()


def test_misuse_raises_at_once(make: Any) -> None:
    manager, _, _, model = make()
    with pytest.raises(RuntimeError, match=r"wait_quorum\(\) called before start_quorum\(\)"):
        manager.wait_quorum()
    with pytest.raises(ValueError, match="already registered under 'default'"):
        manager.register_state_dict_fn("default", model.load, model.save)
    with pytest.raises(TypeError, match="must be callables"):
        manager.register_state_dict_fn("other", None, model.save)
    manager.start_quorum()
    with pytest.raises(ValueError, match="AVG needs a floating-point tensor"):
        manager.allreduce(torch.ones(2, dtype=torch.int64))


def test_shutdown_closes_the_client(make: Any) -> None:
    manager, client, _, _ = make()
    step(manager)
    manager.shutdown()
    assert client.closed


def _heal_quorum(max_step: int = 5) -> Any:
    return quorum_result(
        heal=True,
        max_step=max_step,
        recover_src_replica_rank=0,
        recover_src_manager_address="http://src:1",
        max_replica_rank=None,
    )


def _healed_state(value: float, step: int) -> dict[str, Any]:
    return {
        "user": {"w": torch.full((3,), value)},
        "ftdist": {"step": step, "batches_committed": 2 * step},
    }


def test_a_heal_on_a_step_without_allreduce_is_applied_with_its_step(make: Any) -> None:
    # LocalSGD-style: most steps run no collective at all.
    manager, client, _, model = make(transport=MemoryTransport(state=_healed_state(9.0, 5)))
    client.push_quorum(_heal_quorum(5))
    manager.start_quorum()
    assert manager.should_commit()
    assert model.w.tolist() == [9.0] * 3
    assert manager.current_step() == 6


def test_a_heal_is_applied_even_when_the_step_already_failed(make: Any) -> None:
    # The received state and its step move together, commit or not.
    manager, client, _, model = make(transport=MemoryTransport(state=_healed_state(9.0, 5)))
    client.push_quorum(_heal_quorum(5))
    manager.start_quorum()
    manager.report_error(RuntimeError("an earlier collective failed"))
    manager.allreduce(torch.ones(2)).wait()
    assert not manager.should_commit()
    assert model.w.tolist() == [9.0] * 3
    assert manager.current_step() == 5
    # The next quorum sees this replica up to date at step 5.
    assert step(manager)[0]
    assert client.quorum_calls[-1].step == 5
    assert manager.current_step() == 6


def test_the_step_does_not_move_before_the_state_is_applied(make: Any) -> None:
    manager, client, _, model = make(transport=MemoryTransport(state=_healed_state(9.0, 5)))
    manager.load_state_dict({"step": 2, "batches_committed": 2})  # it committed before
    client.push_quorum(_heal_quorum(5))
    manager.start_quorum()
    manager.wait_quorum()  # the round has received the state...
    assert manager.current_step() == 2  # ...but neither the step nor the weights moved
    assert model.w.tolist() == [0.0] * 3
    assert manager.should_commit()
    assert (manager.current_step(), model.w.tolist()) == (6, [9.0] * 3)


def test_a_replica_that_never_committed_heals_before_its_first_forward(make: Any) -> None:
    # A fresh replacement: its forward would run on weights about to be
    # replaced. The heal is applied as the round ends, step and weights
    # together, and the step still counts it as healing (it adds zeros).
    manager, client, _, model = make(transport=MemoryTransport(state=_healed_state(9.0, 5)))
    client.push_quorum(_heal_quorum(5))
    manager.start_quorum()
    assert (manager.current_step(), model.w.tolist()) == (5, [9.0] * 3)
    assert not manager.is_participating()
    assert manager.should_commit()
    assert manager.current_step() == 6


def test_a_group_applies_a_heal_only_if_every_rank_received_its_part(make: Any) -> None:
    manager, client, _, model = make(
        transport=MemoryTransport(state=_healed_state(9.0, 5)),
        rank=0,
        world_size=2,
        store_addr="unused",
        store_port=1,
    )
    client.push_quorum(replace(_heal_quorum(5), group_heals=True))
    client.push_vote(False)  # the other rank's transfer failed
    manager.start_quorum()
    assert not manager.should_commit()
    assert model.loads == [] and manager.current_step() == 0
    # The heal vote (True: this rank received its part), then the commit
    # vote: no, the replica did not heal.
    assert [v for _, _, v in client.votes] == [True, False]
    client.push_quorum(replace(_heal_quorum(5), group_heals=True))
    assert step(manager)[0]
    assert manager.current_step() == 6 and model.w.tolist() == [9.0] * 3
    assert [v for _, _, v in client.votes[2:]] == [True, True]


def test_a_failed_quorum_fails_one_step_and_the_next_one_retries(make: Any) -> None:
    manager, client, _, _ = make()
    client.push_quorum(CoordinationTimeoutError("lighthouse quorum timed out"))
    committed, t = step(manager, 2.0)
    assert not committed
    assert isinstance(manager.errored(), TimeoutError)
    assert t.tolist() == [2.0, 2.0]  # nothing ran
    assert step(manager)[0]
    assert manager.current_step() == 1


def test_allreduce_result_is_a_future_of_the_tensor_and_a_work(make: Any) -> None:
    manager, _, _, _ = make()
    manager.start_quorum()
    t = torch.full((2,), 3.0)
    result: AllreduceResult = manager.allreduce(t)
    assert isinstance(result, torch.futures.Future)
    seen: list[float] = []
    result.get_future().then(lambda f: seen.append(float(f.value()[0])))
    assert result.wait() is t
    assert seen == [3.0]  # callbacks ran before wait returned
    assert result.value() is t and result.is_completed()
    assert manager.should_commit()


def test_wrap_future_records_failures_and_timeouts(make: Any) -> None:
    manager, _, _, _ = make()
    manager.start_quorum()
    failing: torch.futures.Future[int] = torch.futures.Future()
    wrapped = manager.wrap_future(failing, 7)
    # torch's stub types set_exception's argument as the future's value type.
    failing.set_exception(RuntimeError("peer gone"))  # type: ignore[arg-type]
    assert wrapped.wait() == 7
    assert str(manager.errored()) == "peer gone"
    assert manager.errored().original_exception is manager.errored()
    never: torch.futures.Future[int] = torch.futures.Future()
    bounded = manager.wrap_future(never, 8, timeout=timedelta(milliseconds=10))
    assert bounded.wait() == 8
    assert isinstance(manager.errored(), TimeoutError)
    assert "future did not complete within 0:00:00.010000" in str(manager.errored())
    assert not manager.should_commit()


def test_state_layout_follows_the_registered_keys(make: Any) -> None:
    manager, _, _, model = make()
    assert manager._manager_state_dict()["user"]["w"] is model.w
    manager.set_state_dict_fns(lambda sd: None, lambda: {"new": 1})
    assert manager._manager_state_dict()["user"] == {"new": 1}
    manager.register_state_dict_fn("extra", lambda sd: None, lambda: {"x": 2})
    assert manager._manager_state_dict()["user"] == {"default": {"new": 1}, "extra": {"x": 2}}


def test_disallowed_reads_wait_for_allow(make: Any) -> None:
    manager, _, _, _ = make(timeout=timedelta(milliseconds=200))
    manager.disallow_state_dict_read()
    manager.disallow_state_dict_read()  # idempotent
    with pytest.raises(TimeoutError):
        manager._manager_state_dict()
    manager.allow_state_dict_read()
    assert "user" in manager._manager_state_dict()


def test_ddp_and_the_optimizer_wrapper_register_what_must_match(make: Any) -> None:
    from ftdist.ddp import DistributedDataParallel
    from ftdist.optim import OptimizerWrapper

    manager, _, _, _ = make()
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    DistributedDataParallel(manager, net)
    OptimizerWrapper(manager, torch.optim.SGD(net.parameters(), lr=0.1))
    assert manager.consistency_keys() == ["model", "optimizer"]
    parts = manager._consistency.fingerprint()
    assert any(p.startswith("model/0.weight") for p in parts)
    # BatchNorm running statistics differ between replicas legitimately.
    assert not any("running_mean" in p for p in parts)
    manager.unregister_consistency_fn("optimizer")
    assert manager.consistency_keys() == ["model"]
    with pytest.raises(KeyError, match="no consistency part 'optimizer'"):
        manager.unregister_consistency_fn("optimizer")


def test_ddp_skips_the_initial_broadcast_over_its_group_of_one(make: Any) -> None:
    # Over the dummy group the broadcast moves nothing; torch would still
    # flatten and copy every parameter. A caller's own init_sync wins.
    from torch.nn.parallel import distributed as torch_ddp

    from ftdist.ddp import DistributedDataParallel

    manager, _, _, _ = make()
    net = torch.nn.Linear(4, 4)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with mock.patch.object(
        torch_ddp, "_sync_module_states", wraps=torch_ddp._sync_module_states
    ) as sync:
        DistributedDataParallel(manager, net)
        assert sync.call_count == 0
        DistributedDataParallel(manager, net, init_sync=True)
        assert sync.call_count == 1
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_the_healer_keeps_few_source_clients_open() -> None:
    from ftdist.manager.heal import MAX_SOURCE_CLIENTS, Healer

    opened: list[FakeManagerClient] = []

    def connect(address: str) -> FakeManagerClient:
        opened.append(FakeManagerClient(metadata=address))
        return opened[-1]

    healer = Healer(MemoryTransport(state=_healed_state(1.0, 3)), timedelta(seconds=1), connect)
    for i in range(MAX_SOURCE_CLIENTS + 3):
        quorum = replace(_heal_quorum(3), recover_src_manager_address=f"http://src{i}:1")
        healer.receive(quorum, 0, 0.0, 0.0)
    healer.receive(replace(_heal_quorum(3), recover_src_manager_address="http://src6:1"), 0, 0, 0)
    assert len(opened) == MAX_SOURCE_CLIENTS + 3  # the last address was reused
    deadline = time.monotonic() + 10
    while sum(c.closed for c in opened) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [c.closed for c in opened] == [True] * 3 + [False] * MAX_SOURCE_CLIENTS
    healer.close()
    assert all(c.closed for c in opened)


def test_fingerprints_of_large_models_fold_into_few_parts() -> None:
    from ftdist.manager.heal import fold_parts
    from ftdist.manager.state import MAX_PARTS, ConsistencyParts

    parts = ConsistencyParts()
    layers = [torch.nn.Linear(2, 2) for _ in range(100)]
    big = torch.nn.Sequential(*layers)
    parts.register("model", lambda: {n: p.detach() for n, p in big.named_parameters()})
    folded = parts.fingerprint()
    assert len(folded) <= MAX_PARTS and set(folded) == {"model"}
    before = dict(folded)
    with torch.no_grad():
        layers[57].bias.add_(1)
    assert parts.fingerprint() != before  # folding loses names, not detection
    fine = {"a/b/c/d": 1, "a/b/c/e": 2, "x": 3}
    assert fold_parts(fine, 3) == fine
    assert set(fold_parts(fine, 2)) == {"a/b/c", "x"}
    assert set(fold_parts(fine, 1)) == {"a", "x"}  # as coarse as it goes


# -- the receive reserve of a replica that never committed ------------------------------------

BIG = 2 << 20  # bytes of the big model's one tensor: worth a reserve


class ReserveSeeingTransport(MemoryTransport):
    """Records the receive reserve each receive was given."""

    def __init__(self, state: Any = None) -> None:
        super().__init__(state)
        self.reserves: list[Any] = []

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self.reserves.append(self.receive_reserve)
        return super().recv_checkpoint(src_rank, metadata, step, timeout)


class BigModel(Model):
    """A model of one 2 MiB tensor that counts how often its state is asked."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.w = torch.zeros(BIG // 4)
        self.fail = fail
        self.saves = 0

    def save(self) -> dict[str, torch.Tensor]:
        self.saves += 1
        if self.fail:
            raise RuntimeError("state_dict() is broken")
        return {"w": self.w}


def _reserve_threads() -> list[Any]:
    import threading

    return [t for t in threading.enumerate() if t.name == "ftdist-reserve"]


needs_populate = pytest.mark.skipif(
    not ReceiveReserve.possible(1), reason="this kernel has no MADV_POPULATE_WRITE"
)


@needs_populate
def test_a_fresh_replicas_heal_gets_a_reserve_as_large_as_its_state_then_it_is_closed(
    make: Any,
) -> None:
    transport = ReserveSeeingTransport(state=_healed_state(9.0, 5))
    model = BigModel()
    manager, client, _, _ = make(transport=transport, model=model)
    client.push_quorum(_heal_quorum(5))
    manager.start_quorum()
    (reserve,) = transport.reserves
    assert isinstance(reserve, ReceiveReserve) and reserve.nbytes == BIG
    assert transport.receive_reserve is None  # set for that receive only
    assert reserve.take(BIG) is None and not _reserve_threads()  # closed with the round
    assert model.saves == 1  # asked once, for the reserve and the in-place heal both
    assert manager.current_step() == 5


@needs_populate
@pytest.mark.parametrize("answer", ["no heal", "quorum fails"])
def test_a_round_that_does_not_heal_closes_its_reserve(
    make: Any, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    made: list[ReceiveReserve] = []
    like = ReceiveReserve.like

    def recording(state: object, limit: int) -> ReceiveReserve | None:
        reserve = like(state, limit)
        made.extend([reserve] if reserve is not None else [])
        return reserve

    monkeypatch.setattr(ReceiveReserve, "like", recording)
    manager, client, _, model = make(transport=ReserveSeeingTransport(), model=BigModel())
    if answer == "quorum fails":
        client.push_quorum(CoordinationTimeoutError("lighthouse quorum timed out"))
    manager.start_quorum()
    if answer == "quorum fails":
        with pytest.raises(TimeoutError):
            manager.wait_quorum()
    assert model.saves == 1 and not _reserve_threads()
    (reserve,) = made
    assert reserve.take(BIG) is None  # closed with the round, nothing taken


def test_no_reserve_without_a_heal_allowed_a_setting_or_a_working_state_dict(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, _, _, model = make(transport=ReserveSeeingTransport(), model=BigModel())
    manager.start_quorum(allow_heal=False)
    assert model.saves == 0  # nothing to reserve for: the state is not asked

    def heal(model: BigModel) -> list[Any]:
        transport = ReserveSeeingTransport(state=_healed_state(9.0, 5))
        manager, client, _, _ = make(transport=transport, model=model)
        client.push_quorum(_heal_quorum(5))
        manager.start_quorum()
        assert manager.current_step() == 5  # healed all the same
        return transport.reserves

    assert heal(BigModel(fail=True)) == [None]
    monkeypatch.setenv("FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB", "0")
    assert heal(BigModel()) == [None]
    assert not _reserve_threads()


def test_a_reserve_that_cannot_be_had_does_not_fail_the_round(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(ReceiveReserve, "like", classmethod(refuse))
    transport = ReserveSeeingTransport(state=_healed_state(9.0, 5))
    manager, client, _, _ = make(transport=transport, model=BigModel())
    client.push_quorum(_heal_quorum(5))
    manager.start_quorum()
    assert transport.reserves == [None] and manager.current_step() == 5


def test_torchfts_logger_prefixes_the_step_without_keeping_its_manager_alive() -> None:
    import types
    import weakref

    from ftdist.manager.lazy_work import ManagerLogger

    class Stepper:
        def current_step(self) -> int:
            return 3

    manager = Stepper()
    logger = ManagerLogger(manager, "replica", 1)
    assert logger.prefix() == "[replica/1 - step 3]"
    watched = weakref.ref(manager)
    del manager
    assert watched() is None  # the logger does not hold it
    assert logger.prefix() == "[replica/1 - step ?]"
    # A stand-in without weak references is held as it is.
    stand_in = types.SimpleNamespace(current_step=lambda: 7)
    assert ManagerLogger(stand_in, "r", 0).prefix() == "[r/0 - step 7]"
