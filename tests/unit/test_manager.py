"""The Manager's step protocol through its test seam: a scripted client, a fake group.

No servers, sockets or peers: each test scripts the quorum answers and commit
decisions and checks what the Manager did with them.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from ftdist.checkpointing import CheckpointTransport
from ftdist.errors import CheckpointError, CoordinationTimeoutError, StateDivergenceError
from ftdist.manager import Manager, WorldSizeMode
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
        manager = Manager(
            pg,
            model.load,
            model.save,
            client=client,
            checkpoint_transport=transport or MemoryTransport(),
            timeout=timedelta(seconds=5),
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


def test_errored_step_skips_later_collectives(make: Any) -> None:
    manager, _, pg, _ = make()
    manager.start_quorum()
    manager.report_error(RuntimeError("data loader broke"))
    t = torch.ones(2)
    work = manager.allreduce(t)
    assert work.wait()
    assert "allreduce" not in pg.ops
    assert not manager.should_commit()


def test_max_retries_raises_after_that_many_failures_in_a_row(make: Any) -> None:
    manager, _, pg, _ = make(max_retries=1)
    pg.fail_next(RuntimeError("one"))
    assert not step(manager)[0]
    pg.fail_next(RuntimeError("two"))
    with pytest.raises(
        RuntimeError, match="should_commit failed 2 times in a row, more than max_retries=1"
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
        "user": {"default": {"w": torch.full((3,), 9.0)}},
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
    assert sent["user"]["default"]["w"].tolist() == [2.0] * 3
    assert sent["torchft"] == {"step": 0, "batches_committed": 0}
    assert transport.disallowed == 1
    assert [h.role for h in manager.heal_timelines] == ["send"]


def test_divergence_reported_by_the_quorum_fails_the_step(make: Any) -> None:
    manager, client, _, _ = make()
    client.push_quorum(quorum_result(divergence="'user/default/w' differs"))
    assert not step(manager)[0]
    assert isinstance(manager.errored().original_exception, StateDivergenceError)  # type: ignore[union-attr]


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
        manager.register_state_dict_fn("other", None, model.save)  # type: ignore[arg-type]
    manager.start_quorum()
    with pytest.raises(ValueError, match="AVG needs a floating-point tensor"):
        manager.allreduce(torch.ones(2, dtype=torch.int64))


def test_shutdown_closes_the_client(make: Any) -> None:
    manager, client, _, _ = make()
    step(manager)
    manager.shutdown()
    assert client.closed
