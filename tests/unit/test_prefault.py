"""Prefaulting fresh receive tensors: never changes a byte, stays in its window, always stops;
reserves populated ahead hand out tensors of their own and give back the rest."""

from __future__ import annotations

import io
import mmap
import threading
import time
from typing import Any

import pytest
import torch

from ftdist.checkpointing import _prefault, _receive, _wire
from ftdist.checkpointing._prefault import (
    MIN_BYTES,
    WINDOW,
    Prefaulter,
    ReceiveReserve,
    _madvise,
)

pytestmark = pytest.mark.timeout(60)


def _helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ftdist-prefault"]


def test_populating_pages_keeps_what_the_receiver_already_wrote() -> None:
    tensors = [torch.empty(8 << 20, dtype=torch.uint8) for _ in range(4)]
    with Prefaulter() as prefault:
        for t in tensors:
            prefault.add(t, fresh=True)
        # The receiver writes while the helper populates, in any order.
        for i, t in enumerate(tensors):
            t.fill_(i + 1)
            prefault.advance(t.numel())
    for i, t in enumerate(tensors):
        assert int(t.min()) == int(t.max()) == i + 1
    assert not _helpers()


def test_the_window_bounds_what_is_allocated_ahead_of_the_bytes() -> None:
    with Prefaulter() as prefault:
        assert prefault.wants_more()
        prefault.add(torch.empty(WINDOW, dtype=torch.uint8), fresh=True)
        assert not prefault.wants_more()  # nothing arrived: no more room
        prefault.advance(MIN_BYTES)
        assert prefault.wants_more()
        assert prefault.added == WINDOW


def test_the_helper_never_runs_past_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    if _madvise() is None:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    done: list[int] = []
    real = _madvise()

    def recording(start: int, length: int, advice: int) -> int:
        done.append(length)
        return int(real(start, length, advice))

    monkeypatch.setattr(_prefault, "_madvise", lambda: recording)
    big = torch.empty(2 * WINDOW + (16 << 20), dtype=torch.uint8)
    with Prefaulter() as prefault:
        prefault.add(big, fresh=True)
        time.sleep(0.3)
        assert sum(done) <= WINDOW  # nothing received yet
        prefault.advance(big.numel())
        deadline = time.monotonic() + 10
        while sum(done) < big.numel() - 2 * 4096 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sum(done) >= big.numel() - 2 * 4096


def test_small_tensors_and_targets_start_no_thread() -> None:
    with Prefaulter() as prefault:
        prefault.add(torch.empty(MIN_BYTES // 2, dtype=torch.uint8), fresh=True)
        prefault.add(torch.empty(4 * MIN_BYTES, dtype=torch.uint8), fresh=False)
        assert prefault._thread is None


# -- ReceiveReserve: memory populated ahead of a receive ---------------------------------------

needs_populate = pytest.mark.skipif(
    _madvise() is None, reason="this kernel has no MADV_POPULATE_WRITE"
)


def _reserve_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ftdist-reserve"]


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True, "4096"])
def test_a_reserve_of_no_bytes_is_refused(nbytes: Any) -> None:
    with pytest.raises(ValueError, match=f"nbytes={nbytes!r}"):
        ReceiveReserve(nbytes)


@needs_populate
def test_each_tensor_taken_has_a_storage_of_its_own_and_keeps_its_bytes() -> None:
    reserve = ReceiveReserve(8 * MIN_BYTES)
    assert reserve.nbytes == 8 * MIN_BYTES
    a = reserve.take(3 * MIN_BYTES + 5)
    b = reserve.take(2 * MIN_BYTES)
    assert a is not None and b is not None
    assert reserve.taken == 5 * MIN_BYTES + 5
    # Exactly its own size (torch.save, share_memory_ see only it), page aligned.
    assert a.untyped_storage().nbytes() == a.numel() == 3 * MIN_BYTES + 5
    assert b.untyped_storage().nbytes() == b.numel() == 2 * MIN_BYTES
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    assert b.data_ptr() >= a.data_ptr() + a.numel()
    a.fill_(7)
    b.fill_(9)
    assert reserve.take(4 * MIN_BYTES) is None  # what is left is too small
    assert reserve.take(MIN_BYTES // 2) is None  # small tensors are the receiver's own
    reserve.close()
    # The tail went back to the kernel; what was taken stays.
    assert int(a.min()) == int(a.max()) == 7 and int(b.min()) == int(b.max()) == 9
    assert reserve.take(MIN_BYTES) is None  # closed
    assert not _reserve_threads()


@needs_populate
def test_closing_a_reserve_that_nothing_used_unmaps_it_and_stops_its_helper() -> None:
    with ReceiveReserve(256 << 20) as reserve:  # the helper is still populating
        pass
    assert reserve._map.closed
    assert not _reserve_threads()


def _resident() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@needs_populate
def test_the_helper_populates_the_reserve_and_close_gives_back_what_nothing_took() -> None:
    before = _resident()
    reserve = ReceiveReserve(64 * MIN_BYTES)
    assert reserve._thread is not None
    reserve._thread.join(timeout=30)
    assert not reserve._thread.is_alive()
    # Resident before anything touched it: the helper populated it.
    assert _resident() - before >= 60 * MIN_BYTES
    # Populated memory is zeroed memory: a take is ready to receive into.
    t = reserve.take(16 * MIN_BYTES)
    assert t is not None and not t.any()
    reserve.close()
    assert _resident() - before < 24 * MIN_BYTES  # the 48 MiB tail went back
    del t


@needs_populate
def test_a_reserve_is_as_large_as_the_states_cpu_tensors_within_its_limit() -> None:
    state = {
        "model": {"w": torch.empty(MIN_BYTES, dtype=torch.uint8), "b": torch.empty(10)},
        "optim": [torch.empty(MIN_BYTES // 2, dtype=torch.float16)],  # MIN_BYTES
        "meta": torch.device("meta"),
        "on_meta": torch.empty(4 * MIN_BYTES, device="meta"),
    }
    reserve = ReceiveReserve.like(state, limit=1 << 30)
    assert reserve is not None
    assert reserve.nbytes == 2 * MIN_BYTES  # the small and the non-CPU ones left out
    reserve.close()
    capped = ReceiveReserve.like(state, limit=MIN_BYTES + 4096)
    assert capped is not None and capped.nbytes == MIN_BYTES + 4096
    capped.close()
    assert ReceiveReserve.like(state, limit=0) is None
    assert ReceiveReserve.like({"b": torch.empty(10)}, limit=1 << 30) is None
    assert ReceiveReserve.like(None, limit=1 << 30) is None


@needs_populate
@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.uint8, torch.bfloat16, torch.float32, torch.complex64]
)
def test_fresh_leaves_of_any_dtype_and_dense_layout_come_out_of_the_reserve(
    dtype: torch.dtype,
) -> None:
    from tests.unit.checkpoint_helpers import assert_identical, stream_bytes

    g = torch.Generator().manual_seed(3)
    noise = torch.randn(1024, 1024, generator=g)
    base = noise > 0 if dtype == torch.bool else (noise * 100).to(dtype)  # >= 1 MiB each
    state = {
        "plain": base,
        "transposed": base.t().clone().t(),  # dense, another dimension order
        "permuted": base.clone().reshape(8, 128, 1024).permute(2, 0, 1),
    }
    (data,) = stream_bytes(state)
    with ReceiveReserve(3 * base.numel() * base.element_size() + 3 * 4096) as reserve:
        reader = _wire.StreamReader(io.BytesIO(data).readinto, "test")
        header, got = _receive.read_leaves(reader, 1, size=len(data), reserve=reserve)
        assert all(reserve.owns(t) for t in got.values())
    assert_identical(state, _receive.assemble(header, got))


@needs_populate
def test_leaves_that_leave_the_host_are_not_carved_out_of_the_reserve() -> None:
    # Staged on the host and moved: a carved staging copy, dropped, would keep
    # the reserve's mapping resident for as long as anything carved lives.
    from tests.unit.checkpoint_helpers import stream_bytes

    state = {"stays": torch.ones(MIN_BYTES // 4), "goes": torch.full((MIN_BYTES // 4,), 2.0)}
    (data,) = stream_bytes(state)

    def device(meta: Any) -> torch.device:
        return torch.device("meta" if meta.path[-1] == "goes" else "cpu")

    with ReceiveReserve(4 * MIN_BYTES) as reserve:
        reader = _wire.StreamReader(io.BytesIO(data).readinto, "test")
        header, got = _receive.read_leaves(reader, 1, device, size=len(data), reserve=reserve)
        moved = _receive.assemble(header, got)
        assert reserve.taken == MIN_BYTES
    assert moved["goes"].device.type == "meta" and torch.equal(moved["stays"], state["stays"])
