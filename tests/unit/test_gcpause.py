"""The cyclic collector's pause around per-tensor work (ftdist._gcpause)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from ftdist._gcpause import gc_paused

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_the_collector_is_off_inside_and_back_on_after_even_on_error() -> None:
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off() -> None:
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_as_a_decorator() -> None:
    gc.enable()

    @gc_paused()
    def inside() -> bool:
        return gc.isenabled()

    assert inside() is False
    assert gc.isenabled()


def test_overlapping_pauses_on_two_threads_resume_when_the_last_ends() -> None:
    gc.enable()
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with gc_paused():
        thread.start()
        assert entered.wait(10)
    # This thread's pause ended; the other's has not.
    assert not gc.isenabled()
    release.set()
    thread.join(10)
    assert not thread.is_alive()
    assert gc.isenabled()
