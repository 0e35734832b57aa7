"""Prefaulting fresh receive tensors: never changes a byte, stays in its window, always stops."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ftdist.checkpointing import _prefault
from ftdist.checkpointing._prefault import MIN_BYTES, WINDOW, Prefaulter, _madvise

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
