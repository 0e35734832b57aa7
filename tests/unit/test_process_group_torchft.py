"""torchft's process-group API on ftdist groups (world size 1, in this process):
today's reconfiguration by handles, registration naming, XCCL, wrappers' old and
new constructor orders, and the Baby group's torchft-visible behaviour."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import ftdist.process_group as fpg
from ftdist.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ProcessGroupBabyGloo,
    ProcessGroupBabyXCCL,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
    ProcessGroupXCCL,
    ReconfigureOptions,
    create_store_client,
    reconfigure_with_store,
)
from ftdist.process_group._baby_proc import child_stacks, start_child

# torchft's test vectors: (address, host, port, prefix)
STORE_ADDRS = [
    ("localhost:1234/my/prefix", "localhost", 1234, "my/prefix"),
    ("127.0.0.1:29500/torchft/0/1", "127.0.0.1", 29500, "torchft/0/1"),
    ("fdaa:0:1:2:3:4:5:6:29521/torchft/0/1", "fdaa:0:1:2:3:4:5:6", 29521, "torchft/0/1"),
    ("::1:29521/torchft/0/1", "::1", 29521, "torchft/0/1"),
    ("[fdaa:0:1:2:3:4:5:6]:29521/torchft/0/1", "fdaa:0:1:2:3:4:5:6", 29521, "torchft/0/1"),
]


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _addr(store: dist.TCPStore) -> str:
    return f"127.0.0.1:{store.port}/{uuid.uuid4().hex}"


def _missing_peer(pg: fpg.ProcessGroup) -> None:
    opts = ReconfigureOptions()
    opts.uuid = 1
    opts.handles = [
        pg.get_reconfigure_handle(),
        json.dumps({"id": "missing", "store": "unused", "global_rank": None}),
    ]
    pg.reconfigure(opts).wait()


@pytest.mark.timeout(60)
def test_reconfigure_with_store_builds_a_working_group_again_and_again(
    store: dist.TCPStore,
) -> None:
    pg = ProcessGroupGloo(timeout=10)
    try:
        assert pg.supports_reconfigure
        for _ in range(2):
            reconfigure_with_store(pg, _addr(store), 0, 1)
            assert (pg.rank(), pg.size()) == (0, 1)
            t = torch.tensor([2.0])
            pg.allreduce([t], dist.ReduceOp.SUM).wait()
            assert t.item() == 2.0
    finally:
        pg.shutdown()


def test_reconfigure_rank_is_the_index_of_the_own_handle() -> None:
    pg = ProcessGroupDummy(0, 1)
    pg.set_rank_info("replica_3", group_rank=0, group_world_size=1, global_rank=5)
    handle = json.loads(pg.get_reconfigure_handle())
    assert handle["global_rank"] == 5 and handle["id"] == pg._handle_id()
    host, _, port = handle["store"].rpartition(":")
    assert host and int(port) > 0
    from ftdist.process_group.reconfigure import rendezvous

    other = json.dumps({"id": "peer", "store": "h:1", "global_rank": 4})
    opts = ReconfigureOptions(uuid=9, handles=[other, pg.get_reconfigure_handle()])
    meeting = rendezvous(opts, pg._handle_id())
    assert (meeting.rank, meeting.world_size, meeting.store_addr) == (1, 2, "h:1/ftdist/9")
    assert meeting.global_ranks == [4, 5]
    pg.shutdown()


@pytest.mark.parametrize(
    ("handles", "needle"),
    [
        ({"a"}, "require ordered handles"),
        ([], "handles is empty"),
        (["not json"], "is not a reconfigure handle"),
        ([json.dumps({"id": "x", "store": "h:1"})], "is not among the 1 handles"),
    ],
)
def test_reconfigure_rejects_bad_handles(handles: object, needle: str) -> None:
    pg = ProcessGroupGloo(timeout=1)
    opts = ReconfigureOptions()
    opts.handles = handles
    with pytest.raises(ValueError, match=needle):
        pg.reconfigure(opts)
    pg.shutdown()


@pytest.mark.timeout(30)
def test_reconfigure_with_a_missing_peer_times_out() -> None:
    pg = ProcessGroupGloo(timeout=timedelta(milliseconds=10))
    # On a loaded machine the connect to the store itself can be what
    # overruns 10 ms ("timed out after 10ms"); either way the error names it.
    with pytest.raises(RuntimeError, match=r"(time(out|d out) after 10ms|Socket Timeout)"):
        _missing_peer(pg)
    pg.shutdown()


@pytest.mark.timeout(30)
def test_reconfigure_with_store_fails_without_touching_the_group_when_a_peer_is_missing(
    store: dist.TCPStore,
) -> None:
    pg = ProcessGroupDummy(0, 1)
    # Long enough that the connect to the live store cannot be what times
    # out on a loaded machine: the wait for the missing peer's handle is.
    with pytest.raises(dist.DistStoreError, match="wait timeout after 500ms"):
        reconfigure_with_store(pg, _addr(store), 0, 2, timeout=timedelta(milliseconds=500))
    assert pg.reconfigure_count == 0
    pg.shutdown()


@pytest.mark.parametrize(("addr", "host", "port", "prefix"), STORE_ADDRS)
def test_create_store_client_parses_addresses_through_the_package_names(
    monkeypatch: pytest.MonkeyPatch, addr: str, host: str, port: int, prefix: str
) -> None:
    tcp, prefix_store = mock.Mock(), mock.Mock()
    monkeypatch.setattr(fpg, "TCPStore", tcp)
    monkeypatch.setattr(fpg, "PrefixStore", prefix_store)
    create_store_client(addr, timeout=timedelta(seconds=1))
    assert (tcp.call_args.kwargs["host_name"], tcp.call_args.kwargs["port"]) == (host, port)
    assert prefix_store.call_args.args[0] == prefix


@pytest.mark.timeout(60)
def test_register_follows_torchs_group_naming_with_a_default_group(
    store: dist.TCPStore,
) -> None:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    pg = ProcessGroupGloo(timeout=10)
    try:
        assert pg.register("ft_test") is pg
        assert pg.group_name == str(dist.get_pg_count() - 1)
        assert dist.distributed_c10d._resolve_process_group(pg.group_name) is pg
        reconfigure_with_store(pg, _addr(store), 0, 1)  # registered, then configured
        out = funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", pg))
        assert out.tolist() == [1.0, 1.0]
        t = torch.ones(1)
        dist.broadcast(t, src=0, group=pg)  # src stays a rank of pg
        with pytest.raises(RuntimeError, match="another group is registered"):
            ProcessGroupGloo().register("ft_test")
        pg.unregister()
        pg.allreduce([t]).wait()  # unregistering does not shut the group down
        pg.register("ft_test")  # the same name again
        assert pg.group_name == str(dist.get_pg_count() - 1)
        pg.unregister()
    finally:
        pg.shutdown()
        dist.destroy_process_group()


def test_wrappers_take_either_generations_argument_order() -> None:
    inner = ProcessGroupDummy(0, 1)
    assert ProcessGroupWrapper(inner).parent is inner  # early 2025: (pg)
    assert ProcessGroupWrapper(pg=inner).parent is inner
    both = ProcessGroupWrapper(timedelta(seconds=7), inner)  # today: (timeout, pg)
    assert both.parent is inner and both._timeout == timedelta(seconds=7)
    assert ProcessGroupWrapper(timedelta(seconds=3))._timeout == timedelta(seconds=3)
    assert ProcessGroupNCCL(timedelta(seconds=30))._timeout == timedelta(seconds=30)
    assert ProcessGroupXCCL(timedelta(seconds=30))._timeout == timedelta(seconds=30)
    with pytest.raises(TypeError, match="two process groups"):
        ProcessGroupWrapper(inner, inner)
    with pytest.raises(TypeError, match=r"pg must be a torch\.distributed\.ProcessGroup"):
        ProcessGroupWrapper("nope")  # type: ignore[arg-type]


def test_wrapper_delegates_configure_and_reconfigure_and_reprs_like_torchft() -> None:
    inner = ProcessGroupDummy(0, 1)
    wrapper = ProcessGroupWrapper(inner)
    wrapper.configure("addr", 0, 1)  # the dummy takes any address
    assert inner.configure_count == 1
    opts = ReconfigureOptions()
    opts.handles = [wrapper.get_reconfigure_handle()]
    assert wrapper.reconfigure(opts).wait()
    assert inner.reconfigure_count == 1
    assert repr(wrapper) == "ProcessGroupWrapper(pg=ProcessGroupDummy())"
    assert repr(ProcessGroupGloo()) == "ProcessGroupGloo(pg=None)"
    with pytest.raises(RuntimeError, match="process group not initialized"):
        _ = ProcessGroupGloo().parent
    inner.shutdown()


def test_dummy_answers_point_to_point_and_barrier_with_completed_work() -> None:
    pg = ProcessGroupDummy(0, 1)
    for work in (pg.send([torch.ones(1)], 0, 0), pg.recv([torch.ones(1)], 0, 0), pg.barrier()):
        assert isinstance(work, fpg._DummyWork) and work.wait()


def test_error_swallowing_reconfigure_clears_the_error() -> None:
    wrapper = ErrorSwallowingProcessGroupWrapper(ProcessGroupDummy(0, 1))
    assert isinstance(wrapper.allreduce([torch.ones(1)]), fpg._ErrorSwallowingWork)
    wrapper.report_error(RuntimeError("boom"))
    assert isinstance(wrapper.allreduce([torch.ones(1)]), fpg._DummyWork)
    opts = ReconfigureOptions(handles=[wrapper.get_reconfigure_handle()])
    wrapper.reconfigure(opts)
    assert wrapper.error() is None


def test_fake_wrapper_fails_the_next_allreduce_future_only() -> None:
    wrapper = FakeProcessGroupWrapper(ProcessGroupDummy(0, 1))
    wrapper.report_future_error(RuntimeError("injected"))
    work = wrapper.allreduce([torch.ones(1)])
    assert work.wait()
    with pytest.raises(RuntimeError, match="injected"):
        work.get_future().wait()
    assert wrapper.allreduce([torch.ones(1)]).get_future().wait()[0].item() == 1.0
    wrapper.report_future_error(RuntimeError("dropped"))
    wrapper.reconfigure(ReconfigureOptions(handles=[wrapper.get_reconfigure_handle()]))
    wrapper.allreduce([torch.ones(1)]).get_future().wait()  # the injection was cleared


@pytest.mark.parametrize("cls", [ProcessGroupXCCL, ProcessGroupBabyXCCL])
def test_xccl_groups_construct_anywhere_and_name_the_fix_at_configure(cls: type) -> None:
    if getattr(dist, "is_xccl_available", lambda: False)() and torch.xpu.is_available():
        pytest.skip("this machine can run XCCL")
    pg = cls(timeout=timedelta(seconds=5))
    try:
        assert pg.getBackendName() in ("ftdist-xccl", "ftdist-baby-xccl")
        # An unreachable store: the XCCL check comes first, before any connection.
        with pytest.raises(RuntimeError, match=r"needs an Intel XPU.*pip install torch"):
            pg.configure("127.0.0.1:1/never", 0, 1)
    finally:
        pg.shutdown()


@pytest.mark.timeout(60)
def test_baby_group_torchft_contract(store: dist.TCPStore) -> None:
    pg = ProcessGroupBabyGloo(timeout=10)
    try:
        reconfigure_with_store(pg, _addr(store), 0, 1)
        first = (pg._p, pg._future_thread, pg._future_pipe)
        pg.allreduce([torch.ones(2)]).wait()
        assert pg.num_active_work() == 0
        reconfigure_with_store(pg, _addr(store), 0, 1)
        p, thread, pipe = first
        assert p is not pg._p and thread is not pg._future_thread
        assert pg._future_pipe is not None
        assert pg._p.is_alive() and not pg._future_pipe.closed()
        # The old child is killed in the background, off the configure path.
        assert thread is not None and pipe is not None
        thread.join(10)
        p.join(10)
        assert not thread.is_alive() and not p.is_alive() and pipe.closed()
    finally:
        pg.shutdown()
    with pytest.raises(OSError, match="handle is closed"):
        pg.allreduce([torch.zeros(3)]).wait()


@pytest.mark.timeout(60)
def test_baby_configure_with_a_missing_peer_is_a_timeout_error(store: dist.TCPStore) -> None:
    pg = ProcessGroupBabyGloo(timeout=timedelta(milliseconds=50))
    try:
        with pytest.raises(TimeoutError, match=r"timed out after 0\.05 seconds") as info:
            pg.configure(_addr(store), 0, 2)
        assert isinstance(info.value, RuntimeError)  # what ftdist's own callers catch
    finally:
        pg.shutdown()


@pytest.mark.timeout(60)
def test_a_baby_child_that_never_answers_configure_names_the_configured_timeout(
    store: dist.TCPStore,
) -> None:
    # A stopped child never answers: the parent's backstop, not the child's
    # own error, reports the timeout, and says the same thing.
    pg = ProcessGroupBabyGloo(timeout=timedelta(milliseconds=50))
    try:
        deadline = time.monotonic() + 60
        while pg._spares._spare is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pg._spares._spare is not None
        proc, conn, _ = pg._spares._spare
        assert conn.poll(60)  # the child said "up"; the message stays queued
        os.kill(proc.pid, signal.SIGSTOP)
        with pytest.raises(
            TimeoutError, match=r"timed out after 0\.05 seconds .*no answer"
        ) as info:
            pg.configure(_addr(store), 0, 2)
        # A stopped child cannot write its stacks; the error says why there are none.
        assert "where it was:\n(no stacks within 2 s: the child is stopped" in str(info.value)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        pg.shutdown()


@pytest.mark.timeout(60)
def test_a_baby_child_writes_its_stacks_when_asked() -> None:
    child = start_child()
    try:
        assert child.conn.poll(60) and child.conn.recv() == ("up",)
        for _ in range(2):  # once is not the end of it: a second dump comes whole too
            dump = child_stacks(child.proc.pid, child.stacks)
            assert dump.startswith("Current thread"), dump
            # Where a spare waits: for its configure message, in child_main.
            assert re.search(r'_baby_child\.py", line \d+ in child_main', dump), dump
    finally:
        child.discard()
    # Gone either way: on EOF (it exits 0) or killed.
    assert child.proc.exitcode in (0, -signal.SIGKILL)


def test_coalesced_collectives_need_one_output_per_input() -> None:
    pg = ProcessGroupDummy(0, 1)
    with pytest.raises(ValueError, match="got 3 outputs for 1 inputs"):
        pg.allgather_into_tensor_coalesced([torch.ones(1)] * 3, [torch.ones(1)])
    with pytest.raises(ValueError, match="got 1 outputs for 2 inputs"):
        pg.reduce_scatter_tensor_coalesced([torch.ones(1)], [torch.ones(1)] * 2)
