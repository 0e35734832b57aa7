"""Every future the Manager hands out completes within its timeout, on the
DDP gradient-hook path too; a hung Baby child on that path is killed."""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from typing import Any

import pytest
import torch

from ftdist.launch.ranks import RankContext, run_ranks

pytestmark = pytest.mark.timeout(90)


def _hung_child_in_backward(ctx: RankContext) -> dict[str, Any]:
    from ftdist.ddp import DistributedDataParallel
    from ftdist.manager import Manager
    from ftdist.optim import OptimizerWrapper
    from ftdist.process_group import ProcessGroupBabyGloo
    from ftdist.testing import FakeManagerClient, quorum_result

    # The child's own op timeout is long: only the Manager's deadline can end
    # the step in time.
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    model = torch.nn.Linear(4, 4)
    client = FakeManagerClient()
    manager = Manager(
        pg,
        lambda sd: None,
        lambda: {"w": model.state_dict()},
        min_replica_size=1,
        client=client,
        timeout=timedelta(seconds=1),
    )
    store = f"127.0.0.1:{ctx.store_port}"
    try:
        ddp = DistributedDataParallel(manager, model)
        opt = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
        client.push_quorum(quorum_result(quorum_id=1, store_address=store))
        opt.zero_grad()
        ddp(torch.ones(2, 4)).sum().backward()
        opt.step()
        assert manager.current_step() == 1
        child = pg._child
        assert child is not None
        os.kill(child.proc.pid, signal.SIGSTOP)
        opt.zero_grad()
        ddp(torch.ones(2, 4)).sum().backward()  # the hook's future must complete
        committed = manager.should_commit()
        return {
            "committed": committed,
            "error": repr(manager.errored()),
            # The reaper thread joins the child too: read its exit code
            # through the handle that serialises the two.
            "child_exit": child.join(timeout=10),
        }
    finally:
        manager.shutdown()
        pg.shutdown()


def test_a_hung_baby_child_in_backward_is_killed_and_the_step_fails() -> None:
    (result,) = run_ranks(_hung_child_in_backward, 1, timeout=80)
    assert result["committed"] is False
    assert "did not complete within" in result["error"], result
    # Killed (SIGKILL), not waited on: it was stopped, it could not exit.
    assert result["child_exit"] == -signal.SIGKILL, result
