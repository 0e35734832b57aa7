"""The Manager's behaviour that torchft code (and torchft's own tests) relies on.

Each test pins one behaviour that a converted torchft test exercised and
ftdist once got wrong, through the scripted client and the fake group.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from ftdist.manager import Manager
from ftdist.testing import FakeManagerClient, FakeProcessGroup

pytestmark = pytest.mark.timeout(30)


class _RaisingGroup(FakeProcessGroup):
    """A group whose next ``allreduce`` call raises at once (a broken backend)."""

    def __init__(self) -> None:
        super().__init__()
        self.raise_next: Exception | None = None

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        error, self.raise_next = self.raise_next, None
        if error is not None:
            self.ops.append("allreduce-raised")
            raise error
        return super().allreduce(*args, **kwargs)


@pytest.fixture
def manager_and_pg() -> Iterator[tuple[Manager, _RaisingGroup]]:
    pg = _RaisingGroup()
    state = {"w": torch.zeros(1)}
    manager = Manager(
        pg,
        state.update,
        lambda: state,
        client=FakeManagerClient(),
        min_replica_size=1,
        timeout=timedelta(seconds=5),
    )
    yield manager, pg
    manager.shutdown()


def test_after_a_collective_fails_the_steps_later_allreduces_are_skipped(
    manager_and_pg: tuple[Manager, _RaisingGroup],
) -> None:
    manager, pg = manager_and_pg
    manager.start_quorum()
    manager.allreduce(torch.ones(1)).wait()
    pg.raise_next = RuntimeError("injected failure")
    manager.allreduce(torch.ones(1)).wait()
    assert manager.errored() is not None
    t = torch.full((1,), 3.0)
    manager.allreduce(t).wait()  # the group is broken: not run
    assert pg.ops == ["allreduce", "allreduce-raised"]
    assert t.tolist() == [3.0]  # handed back as it is
    assert not manager.should_commit()
    # The next step starts afresh and runs its collectives again.
    manager.start_quorum()
    assert manager.errored() is None
    manager.allreduce(torch.ones(1)).wait()
    assert pg.ops[-1] == "allreduce"
    assert manager.should_commit()


def test_a_failed_collective_future_also_stops_the_steps_later_allreduces(
    manager_and_pg: tuple[Manager, _RaisingGroup],
) -> None:
    manager, pg = manager_and_pg
    manager.start_quorum()
    pg.fail_next(RuntimeError("peer hung up"))
    manager.allreduce(torch.ones(1)).wait()
    assert "peer hung up" in str(manager.errored())
    manager.allreduce(torch.ones(1)).wait()
    assert pg.ops == ["allreduce"]
    assert not manager.should_commit()


def test_an_error_outside_the_group_still_takes_part_with_zeros(
    manager_and_pg: tuple[Manager, _RaisingGroup],
) -> None:
    # Not a broken group: the peers wait for this replica's contribution.
    manager, pg = manager_and_pg
    manager.start_quorum()
    manager.report_error(RuntimeError("data loader broke"))
    t = torch.ones(1)
    manager.allreduce(t).wait()
    assert pg.ops == ["allreduce"] and t.tolist() == [0.0]
    assert not manager.should_commit()
