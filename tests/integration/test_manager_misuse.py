"""Misuse of the Manager raises at once, with a message that says what to do."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from ftdist.launch.ranks import RankContext, run_ranks
from ftdist.manager import Manager
from ftdist.process_group import ProcessGroupGloo
from tests.integration.lighthouse_helpers import Lighthouses

T = timedelta(seconds=10)
pytestmark = pytest.mark.timeout(60)


def _state() -> tuple[Callable[[Any], None], Callable[[], dict[str, torch.Tensor]]]:
    return (lambda sd: None), (lambda: {"w": torch.ones(2)})


def test_bad_construction_raises_before_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    load, save = _state()
    pg = ProcessGroupGloo()
    with pytest.raises(ValueError, match="min_replica_size must be an int >= 1, got 0"):
        Manager(pg, load, save, min_replica_size=0, lighthouse_addr="127.0.0.1:1")
    with pytest.raises(TypeError, match="pg must be an ftdist ProcessGroup"):
        Manager(
            object(),  # type: ignore[arg-type]  # deliberately not a group: the error under test
            load,
            save,
            min_replica_size=1,
            lighthouse_addr="127.0.0.1:1",
        )
    for name in ("FTDIST_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="no lighthouse address: pass lighthouse_addr="):
        Manager(pg, load, save, min_replica_size=1)
    with pytest.raises(ValueError, match="pass both load_state_dict and state_dict"):
        Manager(pg, load, None, min_replica_size=1, lighthouse_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match="max_retries must be None or an int >= 0"):
        Manager(pg, load, save, min_replica_size=1, lighthouse_addr="127.0.0.1:1", max_retries=-1)


def test_wait_quorum_before_start_quorum_and_duplicate_state_keys(lighthouse: str) -> None:
    load, save = _state()
    pg = ProcessGroupGloo(timeout=T)
    manager = Manager(
        pg,
        load,
        save,
        min_replica_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        replica_id="solo",
        connect_timeout=T,
    )
    try:
        with pytest.raises(RuntimeError, match=r"wait_quorum\(\) called before start_quorum\(\)"):
            manager.wait_quorum()
        with pytest.raises(ValueError, match="already registered under 'default'"):
            manager.register_state_dict_fn("default", load, save)
        assert manager.num_participants() == 0 and manager.participating_rank() is None
        manager.start_quorum()
        t = torch.full((3,), 4.0)
        manager.allreduce(t).wait()
        assert t.tolist() == [4.0] * 3  # AVG over the one participant
        with pytest.raises(ValueError, match="AVG needs a floating-point tensor"):
            manager.allreduce(torch.ones(2, dtype=torch.int64))
        assert manager.should_commit()
        assert (manager.current_step(), manager.batches_committed()) == (1, 1)
    finally:
        manager.shutdown()
        pg.shutdown()


def _no_state_fns(ctx: RankContext, lighthouse: str) -> str:
    import torch.distributed as dist

    own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=T)
    manager = Manager(
        pg,
        None,
        None,
        min_replica_size=2,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        replica_id=f"r{ctx.rank}",
        store_addr="127.0.0.1",
        store_port=own.port,
        connect_timeout=T,
    )
    try:
        manager.start_quorum()
        try:
            manager.wait_quorum()
        except ValueError as exc:
            return str(exc)
        return "no error"
    finally:
        manager.shutdown()
        pg.shutdown()


def test_healing_without_state_functions_is_a_clear_error(lh: Lighthouses) -> None:
    # Two replicas at step 0 with init_sync: both must exchange state, and
    # neither registered any.
    address = lh.server(min_replicas=2, join_timeout_ms=200).address()
    for message in run_ranks(_no_state_fns, 2, address, timeout=50):
        assert "no state_dict function is registered" in message
