"""The coordinator's pure parts: ring protocol and framing, tensor-dict split, checks, layout, ops."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ftdist.coordinator import (
    FtBackend,
    GroupCoordinator,
    ShmRingBuffer,
    TensorMetadata,
    get_pp_group,
    get_tp_group,
    get_world_group,
    lookup_group,
    model_parallel_is_initialized,
    model_parallel_layout,
    ops,
    shm_ring,
)
from ftdist.coordinator.communicator import check_group_rank, check_sizes, normalize_dim
from ftdist.coordinator.groups import check_group_ranks, group_store_addr, own_group
from ftdist.coordinator.tensor_dict import slice_for, split_tensor_dict, uses_all_gather


# -- the shared-memory ring ---------------------------------------------------------
@pytest.fixture
def ring() -> Iterator[tuple[ShmRingBuffer, ShmRingBuffer]]:
    writer = ShmRingBuffer(2, 256, 3)
    reader = ShmRingBuffer(*writer.handle()[:3], name=writer.name)
    yield writer, reader
    reader.close()
    writer.close()


def test_ring_flags_follow_the_protocol(ring: tuple[ShmRingBuffer, ShmRingBuffer]) -> None:
    writer, reader = ring
    assert all(writer.writable(i) for i in range(3))
    assert not reader.readable(0, 0)
    writer.begin_write(0)
    shm_ring.write_frames(writer.data(0), [b"hello"])
    writer.publish(0)
    assert not writer.writable(0)  # unread by both readers
    assert writer.unread_by(0) == [0, 1]
    assert reader.readable(0, 0) and reader.readable(0, 1)
    assert [bytes(f) for f in shm_ring.read_frames(reader.data(0))] == [b"hello"]
    reader.mark_read(0, 0)
    assert not reader.readable(0, 0) and writer.unread_by(0) == [1]
    assert not writer.writable(0)
    reader.mark_read(0, 1)
    assert writer.writable(0)  # read by all: the writer may reuse it
    # Publishing again clears the reader flags before setting "written".
    writer.begin_write(0)
    assert not reader.readable(0, 1)
    writer.publish(0)
    assert reader.readable(0, 1)


def test_frames_round_trip_and_corruption_is_refused() -> None:
    rng = random.Random(0)
    buf = bytearray(4096)
    for _ in range(200):
        frames = [
            bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
            for _ in range(rng.randrange(1, 5))
        ]
        if shm_ring.frames_size(frames) > len(buf):
            continue
        shm_ring.write_frames(memoryview(buf), frames)
        assert shm_ring.chunk_kind(memoryview(buf)) == shm_ring.INLINE
        assert [bytes(f) for f in shm_ring.read_frames(memoryview(buf))] == frames
    shm_ring.write_frames(memoryview(buf), [b"abc"])
    buf[5:13] = (10**6).to_bytes(8, "little")  # a length past the end
    with pytest.raises(ValueError, match="past the end"):
        shm_ring.read_frames(memoryview(buf))
    buf[0] = 7
    with pytest.raises(ValueError, match="unknown kind"):
        shm_ring.chunk_kind(memoryview(buf))
    shm_ring.mark_overflow(memoryview(buf))
    assert shm_ring.chunk_kind(memoryview(buf)) == shm_ring.OVERFLOW


def test_ring_attach_checks_the_segment() -> None:
    writer = ShmRingBuffer(1, 128, 2)
    try:
        with pytest.raises(ValueError, match="the ring needs"):
            ShmRingBuffer(4, 4096, 8, name=writer.name)
    finally:
        writer.close()
    with pytest.raises(FileNotFoundError):
        ShmRingBuffer(1, 128, 2, name=writer.name)  # unlinked by close
    with pytest.raises(ValueError, match="at least 1"):
        ShmRingBuffer(0, 128, 2)
    with pytest.raises(TypeError, match="int"):
        ShmRingBuffer(1, 128.0, 2)  # type: ignore[arg-type]


# -- tensor dicts --------------------------------------------------------------------
def test_split_tensor_dict_keeps_order_and_sends_device_types() -> None:
    d = {"b": torch.ones(2, 3, dtype=torch.int8), "a": "text", "c": torch.empty(0)}
    meta, tensors = split_tensor_dict(d)
    assert [k for k, _ in meta] == ["b", "a", "c"]
    assert meta[0][1] == TensorMetadata("cpu", torch.int8, torch.Size([2, 3]))
    assert meta[1] == ("a", "text")
    assert tensors[0] is d["b"] and tensors[1] is d["c"]
    with pytest.raises(TypeError, match="Expecting a dictionary"):
        split_tensor_dict([("a", 1)])  # type: ignore[arg-type]


def test_all_gather_slicing_rules() -> None:
    t = torch.arange(12)
    assert uses_all_gather("k", t, 3, None, enabled=True)
    assert not uses_all_gather("k", torch.arange(7), 3, None, enabled=True)
    assert not uses_all_gather("k", t, 3, None, enabled=False)
    assert not uses_all_gather("k", t, 3, {"k": False}, enabled=True)
    assert uses_all_gather("other", t, 3, {"k": False}, enabled=True)
    parts = [slice_for(t.reshape(3, 4), 3, r) for r in range(3)]
    assert torch.equal(torch.cat(parts), t)


# -- argument checks ------------------------------------------------------------------
def test_dim_rank_and_size_checks_name_the_value() -> None:
    x = torch.ones(2, 3, 4)
    assert [normalize_dim(x, d) for d in (0, 2, -1, -3)] == [0, 2, 2, 0]
    with pytest.raises(
        ValueError, match=r"Invalid dim \(3\) for input tensor with shape \(2, 3, 4\)"
    ):
        normalize_dim(x, 3)
    with pytest.raises(TypeError):
        normalize_dim(x, 1.0)
    with pytest.raises(ValueError, match=r"Invalid src rank \(2\).*2 ranks"):
        check_group_rank(2, 2, "src")
    with pytest.raises(TypeError):
        check_group_rank(True, 2, "dst")
    assert check_sizes((1, 2), 2) == [1, 2]
    with pytest.raises(ValueError, match="3 entries"):
        check_sizes([1, 2, 3], 2)
    with pytest.raises(ValueError, match="non-negative"):
        check_sizes([1, -2], 2)


def test_group_ranks_are_validated() -> None:
    assert check_group_ranks([[0, 1], (2, 3)]) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="more than one group"):
        check_group_ranks([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="repeats"):
        check_group_ranks([[0, 0]])
    with pytest.raises(TypeError, match="non-empty"):
        check_group_ranks([])
    with pytest.raises(TypeError, match="not an int"):
        check_group_ranks([[0, "1"]])
    with pytest.raises(ValueError, match="none of the groups"):
        own_group([[0, 1]], 5)
    assert group_store_addr("h:1/p", "tp:0", [2, 3], "cpu") == "h:1/p/tp:0/2-3/cpu"


def test_ft_backend_is_validated() -> None:
    spec = FtBackend("127.0.0.1:29500/job", 3)
    assert spec.device == "gloo" and spec.timeout == timedelta(seconds=60) and spec.failure_news
    with pytest.raises(ValueError, match="prefix"):
        FtBackend("127.0.0.1:29500", 0)
    with pytest.raises(ValueError, match="device"):
        FtBackend("h:1/p", 0, device="mpi")
    with pytest.raises(TypeError):
        FtBackend("h:1/p", 0, timeout=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        FtBackend("h:1/p", -1)


def test_coordinator_construction_errors_come_before_any_communication() -> None:
    with pytest.raises(RuntimeError, match="init_distributed_environment"):
        GroupCoordinator([[0, 1]], 0, "gloo", True)
    with pytest.raises(TypeError, match="FtBackend"):
        GroupCoordinator([[0, 1]], 0, 42, True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="local_rank"):
        GroupCoordinator([[0, 1]], -1, "gloo", True)
    with pytest.raises(ValueError, match="none of the groups"):
        GroupCoordinator([[0, 1]], 0, FtBackend("127.0.0.1:1/p", 7), True)


# -- layout and module state -------------------------------------------------------------
def test_layout_matches_vllm_examples() -> None:
    tp, pp = model_parallel_layout(list(range(8)), 2, 4)
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pp == [[0, 2, 4, 6], [1, 3, 5, 7]]
    tp, pp = model_parallel_layout(list(range(8)), 2, 2)  # data parallel 2 outside
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # Survivors keep their ids: positions are laid out, ids fill them.
    tp, pp = model_parallel_layout([0, 1, 3], 3, 1)
    assert tp == [[0, 1, 3]] and pp == [[0], [1], [3]]
    with pytest.raises(ValueError, match="not divisible"):
        model_parallel_layout(list(range(6)), 4, 1)
    with pytest.raises(ValueError, match="at least 1"):
        model_parallel_layout(list(range(4)), 0, 1)


def test_accessors_before_init_say_what_to_call() -> None:
    assert not model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed_environment"):
        get_world_group()
    with pytest.raises(RuntimeError, match="tensor model parallel group is not initialized"):
        get_tp_group()
    with pytest.raises(RuntimeError, match="pipeline model parallel group is not initialized"):
        get_pp_group()


# -- custom ops --------------------------------------------------------------------------
def test_custom_ops_are_registered_with_shapes_for_tracing() -> None:
    for name in ("all_reduce", "all_gather", "reduce_scatter"):
        assert hasattr(torch.ops.ftdist, name)
    with FakeTensorMode():
        x = torch.empty(4, 6)
        assert torch.ops.ftdist.all_reduce(x, "g").shape == (4, 6)
        assert torch.ops.ftdist.all_gather(x, 1, 3, "g").shape == (4, 18)
        assert torch.ops.ftdist.all_gather(x, -2, 2, "g").shape == (8, 6)
        assert torch.ops.ftdist.reduce_scatter(x, -1, 3, "g").shape == (4, 2)
    with pytest.raises(ValueError, match="not found"):
        torch.ops.ftdist.all_reduce(torch.ones(2), "no-such-group:0")


def test_unique_names_count_per_base_name_and_lookup_is_weak() -> None:
    base = f"unit{random.randrange(1 << 30)}"
    assert [ops.get_unique_name(base) for _ in range(3)] == [f"{base}:0", f"{base}:1", f"{base}:2"]

    class Fake:
        """Just enough of a coordinator to register (the collectives are never called)."""

        unique_name = f"{base}:x"
        destroyed = False

        def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
            raise NotImplementedError

        def _all_gather_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
            raise NotImplementedError

        def _reduce_scatter_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
            raise NotImplementedError

    fake = Fake()
    ops.register_group(fake)
    assert lookup_group(fake.unique_name) is fake
    fake.destroyed = True
    with pytest.raises(ValueError, match="destroyed"):
        lookup_group(fake.unique_name)
    fake.destroyed = False
    name = fake.unique_name
    del fake
    with pytest.raises(ValueError, match="destroyed"):
        lookup_group(name)


def test_cpu_tensors_carried_in_a_header_round_trip_any_dtype() -> None:
    import pickle

    from ftdist.coordinator.tensor_dict import CpuTensorData

    for t in (
        torch.arange(10, dtype=torch.bfloat16),
        torch.tensor(3.5),
        torch.arange(12).reshape(3, 4).t(),
        torch.empty(0, 3),
        torch.ones(300_000),
    ):
        back = pickle.loads(pickle.dumps(CpuTensorData.of(t), protocol=5)).to_tensor()
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
        back.add_(1)  # writable
