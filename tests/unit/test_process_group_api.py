"""The seed API of ftdist.process_group, in this process (world size 1 where real)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import ftdist.process_group as fpg
from ftdist.errors import ProcessGroupAbortedError
from ftdist.process_group import (
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupWrapper,
)

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

SEED_NAMES = [
    "ProcessGroup",
    "ProcessGroupWrapper",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ErrorSwallowingProcessGroupWrapper",
    "ManagedProcessGroup",
    "create_store_client",
    "extend_device_mesh",
    "ft_init_device_mesh",
    "ManagedDeviceMesh",
]


def test_every_seed_name_exists_and_groups_are_torch_groups() -> None:
    for name in SEED_NAMES:
        assert hasattr(fpg, name), name
    assert issubclass(ProcessGroup, dist.ProcessGroup)
    for method in (
        "configure",
        "allreduce",
        "allgather",
        "broadcast",
        "broadcast_one",
        "size",
        "getBackendName",
        "register",
        "unregister",
    ):
        assert callable(getattr(ProcessGroup, method)), method


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _addr(store: dist.TCPStore) -> str:
    return f"127.0.0.1:{store.port}/{uuid.uuid4().hex}"


@pytest.mark.parametrize("cls", [ProcessGroupGloo, ProcessGroupBabyGloo])
def test_ops_before_configure_name_configure(cls: type) -> None:
    pg = cls()
    try:
        assert pg.size() == 0
        with pytest.raises(RuntimeError, match=r"configure\(\)|call configure"):
            pg.allreduce([torch.ones(1)])
        with pytest.raises(RuntimeError, match="configure"):
            dist.all_reduce(torch.ones(1), group=pg)
    finally:
        pg.shutdown()


@pytest.mark.parametrize(
    ("addr", "rank", "world", "exc", "needle"),
    [
        ("nope", 0, 1, ValueError, "store_addr 'nope'"),
        ("127.0.0.1:1/x", 1, 1, ValueError, "rank must be in"),
        ("127.0.0.1:1/x", 0, 0, ValueError, "world_size must be >= 1"),
        ("127.0.0.1:1/x", "0", 1, TypeError, "rank must be an int"),
        (1234, 0, 1, TypeError, "store_addr must be a str"),
    ],
)
def test_configure_rejects_bad_input_before_connecting(
    addr: object, rank: object, world: object, exc: type, needle: str
) -> None:
    pg = ProcessGroupGloo(timeout=1)
    with pytest.raises(exc, match=needle):
        pg.configure(addr, rank, world)  # type: ignore[arg-type]


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout must be positive"):
        ProcessGroupGloo(timeout=0)
    with pytest.raises(TypeError, match="timeout must be"):
        ProcessGroupGloo(timeout="60")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", [ProcessGroupGloo, ProcessGroupBabyGloo])
def test_world_size_one_and_reconfigure(cls: type, store: dist.TCPStore) -> None:
    pg = cls(timeout=10)
    try:
        for _ in range(3):
            pg.configure(_addr(store), 0, 1)
            assert (pg.rank(), pg.size(), dist.get_world_size(pg)) == (0, 1, 1)
            t = torch.arange(4, dtype=torch.float)
            dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
            assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
            pg.broadcast_one(t, 0).wait()
        assert pg.getBackendName().startswith("ftdist-")
        assert pg.errored() is None
    finally:
        pg.shutdown()


def test_avg_of_integers_is_a_clear_error(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timeout=5)
    pg.configure(_addr(store), 0, 1)
    try:
        with pytest.raises(
            ValueError, match=r"AVG needs floating-point tensors, got dtype torch.int64"
        ):
            pg.allreduce([torch.ones(2, dtype=torch.int64)], dist.ReduceOp.AVG)
    finally:
        pg.shutdown()


def test_bad_peer_ranks_are_rejected(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timeout=5)
    pg.configure(_addr(store), 0, 1)
    try:
        with pytest.raises(ValueError, match="broadcast root 3 is not a rank"):
            pg.broadcast([torch.ones(1)], 3)
        with pytest.raises(TypeError, match="send destination must be an int"):
            pg.send([torch.ones(1)], "1", 0)  # type: ignore[arg-type]
    finally:
        pg.shutdown()


def test_abort_fails_pending_and_configure_resumes(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timeout=5)
    pg.configure(_addr(store), 0, 1)
    pg.abort()
    assert isinstance(pg.errored(), ProcessGroupAbortedError)
    with pytest.raises(RuntimeError, match="configure"):
        pg.allreduce([torch.ones(1)])
    pg.configure(_addr(store), 0, 1)
    assert pg.errored() is None
    pg.allreduce([torch.ones(1)]).wait()
    pg.shutdown()


def test_register_enables_functional_collectives_and_unregister_undoes(
    store: dist.TCPStore,
) -> None:
    pg = ProcessGroupGloo(timeout=5)
    pg.configure(_addr(store), 0, 1)
    name = f"t{uuid.uuid4().hex[:6]}"
    with pytest.raises(ValueError, match="name not set"):
        _ = pg.group_name
    assert pg.register(name) is pg
    try:
        assert pg.group_name == f"ftdist-gloo:{name}"
        assert dist.distributed_c10d._resolve_process_group(pg.group_name) is pg
        with pytest.raises(ValueError, match="already registered"):
            pg.register("again")
        out = funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", pg))
        assert out.tolist() == [1.0, 1.0]
    finally:
        pg.unregister()
    with pytest.raises(ValueError, match="name not set"):
        funcol.all_reduce(torch.ones(2), "sum", pg)
    with pytest.raises(RuntimeError, match="Could not resolve"):
        # A cast, not GroupName(...): older torch has no GroupName.
        dist.distributed_c10d._resolve_process_group(cast("GroupName", f"ftdist-gloo:{name}"))
    with pytest.raises(ValueError, match="not registered"):
        pg.unregister()
    pg.shutdown()


def test_dummy_accepts_world_one_only_and_discards() -> None:
    with pytest.raises(ValueError, match="only rank 0 of world size 1"):
        ProcessGroupDummy(0, 2)
    pg = ProcessGroupDummy(0, 1)
    t = torch.tensor([3.0])
    assert pg.allreduce([t]).wait()
    assert t.item() == 3.0
    out = [torch.zeros(1)]
    pg.allgather([out], [t]).wait()
    assert out[0].item() == 3.0
    dist.all_reduce(t, group=pg)
    pg.configure("x:1/y", 0, 1)
    assert pg.configure_count == 1
    with pytest.raises(ValueError, match="world_size=2"):
        pg.configure("x:1/y", 0, 2)
    assert pg.size() == 1 and pg.getBackendName() == "ftdist-dummy"


class _FakeManager:
    """The Manager surface ManagedProcessGroup uses; errors are recorded, as a Manager does."""

    def __init__(self) -> None:
        self._pg = ProcessGroupDummy(0, 1)
        self.calls: list[tuple[float, object]] = []
        self.participants = 3
        self.errors: list[Exception] = []
        self.quorum_waits = 0
        self.fail_with: Exception | None = None

    def allreduce(self, tensor: torch.Tensor, reduce_op: object = None) -> dist.Work:
        self.calls.append((float(tensor[0]), reduce_op))
        if self.fail_with is not None:
            fut: torch.futures.Future[object] = torch.futures.Future()
            fut.set_exception(self.fail_with)
            return _FailingWork(fut)
        tensor.mul_(2)
        return fpg.CompletedWork(tensor)

    def wait_quorum(self) -> None:
        self.quorum_waits += 1

    def errored(self) -> Exception | None:
        return self.errors[0] if self.errors else None

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def wrap_future(
        self, fut: torch.futures.Future[object], default: object, timeout: object = None
    ) -> torch.futures.Future[object]:
        out: torch.futures.Future[object] = torch.futures.Future()

        def settle(f: torch.futures.Future[object]) -> None:
            try:
                out.set_result(f.value())
            except Exception as exc:
                self.report_error(exc)
                out.set_result(default)

        fut.add_done_callback(settle)
        return out

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int | None:
        return 1


class _FailingWork(dist._Work):
    def __init__(self, fut: torch.futures.Future[object]) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._fut.wait()
        return True

    def get_future(self) -> torch.futures.Future[object]:
        return self._fut


def test_managed_routes_allreduce_to_manager_and_reports_participants() -> None:
    manager = _FakeManager()
    pg = ManagedProcessGroup(manager)
    t = torch.tensor([5.0])
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
    assert t.item() == 10.0
    assert manager.calls == [(5.0, dist.ReduceOp.AVG)]
    assert manager.quorum_waits == 1  # the step's quorum comes first
    assert pg.size() == 3 and dist.get_world_size(pg) == 3
    assert pg.rank() == 1
    manager.participants = 2
    assert pg.size() == 2
    with pytest.raises(ValueError, match="exactly one tensor"):
        pg.allreduce([torch.ones(1), torch.ones(1)])
    pg.broadcast([t], 0).wait()  # other ops go to the manager's group
    assert pg.getBackendName() == "ftdist-dummy"


def test_managed_allreduce_failure_is_recorded_with_the_manager_not_raised() -> None:
    manager = _FakeManager()
    manager.fail_with = RuntimeError("peer died")
    pg = ManagedProcessGroup(manager)
    t = torch.tensor([5.0])
    work = pg.allreduce([t], dist.ReduceOp.SUM)
    assert work.wait() is True
    assert [str(e) for e in manager.errors] == ["peer died"]
    assert work.get_future().wait() == [t]  # resolves to the input tensors
    # Once the step has failed nothing more runs: a completed work, no call.
    work2 = pg.allreduce([t], dist.ReduceOp.SUM)
    assert work2.wait() is True and len(manager.calls) == 1
    assert work2.get_future().wait() == [t]


def test_managed_allreduce_failed_quorum_is_recorded_not_raised() -> None:
    manager = _FakeManager()

    def broken_quorum() -> None:
        raise TimeoutError("no quorum")

    manager.wait_quorum = broken_quorum  # type: ignore[method-assign]
    pg = ManagedProcessGroup(manager)
    t = torch.tensor([1.0])
    assert pg.allreduce([t], dist.ReduceOp.SUM).wait() is True
    assert manager.calls == [] and [type(e) for e in manager.errors] == [TimeoutError]


def test_wrapper_of_plain_group_cannot_reconfigure(store: dist.TCPStore) -> None:
    plain = torch.distributed.distributed_c10d.ProcessGroupGloo(
        dist.PrefixStore("plain", store), 0, 1, timedelta(seconds=5)
    )
    wrapper = ProcessGroupWrapper(pg=plain)
    t = torch.ones(1)
    wrapper.allreduce([t]).wait()
    with pytest.raises(TypeError, match="cannot be reconfigured"):
        wrapper.configure(_addr(store), 0, 1)
    wrapper.allreduce([t]).wait()  # the wrapped group still works
    assert (wrapper.rank(), wrapper.size()) == (0, 1)
    with pytest.raises(TypeError, match=r"torch\.distributed\.ProcessGroup"):
        ProcessGroupWrapper(pg="nope")  # type: ignore[arg-type]


class _Backend:
    """A stand-in backend that records which thread destroyed it."""

    def __init__(self, destroyed_on: list[str]) -> None:
        self._destroyed_on = destroyed_on

    def __del__(self) -> None:
        self._destroyed_on.append(threading.current_thread().name)


class _RecordingGroup(ProcessGroupWrapper):
    def __init__(self, destroyed_on: list[str]) -> None:
        super().__init__(timeout=timedelta(seconds=5))
        self._destroyed_on = destroyed_on

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> Any:
        return _Backend(self._destroyed_on)


@pytest.mark.timeout(60)
def test_an_idle_old_backend_is_destroyed_off_the_configure_thread(
    store: dist.TCPStore,
) -> None:
    # Destroying an idle Gloo backend joins its threads (~10 ms). Done on the
    # thread that calls configure(), it made every reconfigure ~20x slower;
    # whichever thread drops the last reference runs the destructor.
    destroyed_on: list[str] = []
    pg = _RecordingGroup(destroyed_on)
    for _ in range(20):
        pg.configure(_addr(store), 0, 1)
    pg.shutdown()
    deadline = time.monotonic() + 10
    while len(destroyed_on) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(destroyed_on) == 20, destroyed_on
    assert set(destroyed_on) == {"ftdist-pg-sweep"}, destroyed_on
