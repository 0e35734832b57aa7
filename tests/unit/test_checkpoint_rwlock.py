"""The serving lock: torchft's RWLock contract, plus writer preference and closing."""

from __future__ import annotations

import threading

import pytest

from ftdist.checkpointing._rwlock import LockClosedError, RWLock


def test_torchft_contract() -> None:
    lock = RWLock(timeout=0.01)
    with lock.w_lock():
        assert lock.w_locked()
    assert not lock.w_locked()
    lock.r_acquire()
    lock.r_acquire()
    assert lock.w_locked()  # torchft: readers hold the writer's mutex too
    with pytest.raises(TimeoutError, match=r"Timed out waiting for wlock after 0\.01 seconds"):
        lock.w_acquire()
    with pytest.raises(TimeoutError), lock.w_lock():
        pass
    lock.r_release()
    with pytest.raises(TimeoutError):
        lock.w_acquire()
    lock.r_release()
    with lock.w_lock():
        with pytest.raises(TimeoutError, match="rlock"):
            lock.r_acquire()
        with pytest.raises(TimeoutError), lock.r_lock():
            pass
    lock.w_acquire()


def test_the_write_side_may_be_released_by_another_thread() -> None:
    lock = RWLock(timeout=1)
    lock.w_acquire()
    releaser = threading.Thread(target=lock.w_release)
    releaser.start()
    releaser.join()
    lock.r_acquire()
    lock.r_release()


def test_a_waiting_writer_holds_new_readers_back() -> None:
    lock = RWLock(timeout=5)
    lock.r_acquire()  # a transfer in flight
    writer_has_it = threading.Event()

    def writer() -> None:
        lock.w_acquire()
        writer_has_it.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not lock._writers_waiting:
        threading.Event().wait(0.001)
    # A reader arriving now waits behind the writer instead of overtaking it.
    with pytest.raises(TimeoutError):
        lock.r_acquire(timeout=0.05)
    lock.r_release()
    thread.join(timeout=5)
    assert writer_has_it.is_set()
    lock.w_release()
    lock.r_acquire(timeout=0.05)  # and readers go once it is done
    lock.r_release()


def test_a_writer_that_gives_up_lets_readers_in() -> None:
    lock = RWLock(timeout=0.05)
    lock.r_acquire()
    with pytest.raises(TimeoutError):
        lock.w_acquire()
    lock.r_acquire()  # not held back by a writer that left
    lock.r_release()
    lock.r_release()


def test_force_takes_the_write_side_past_stuck_readers() -> None:
    lock = RWLock(timeout=0.01)
    lock.r_acquire()
    lock.w_force()
    with pytest.raises(TimeoutError):
        lock.r_acquire()
    lock.r_release()  # the stuck reader's late release is harmless
    lock.w_release()
    lock.r_acquire()
    lock.r_release()
    assert not lock.w_locked()


def test_close_wakes_waiters_and_refuses_later_acquires() -> None:
    lock = RWLock(timeout=30)
    lock.w_acquire()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            lock.r_acquire()
        except BaseException as exc:  # recorded for the assertion
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    lock.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and isinstance(errors[0], LockClosedError)
    with pytest.raises(LockClosedError):
        lock.w_acquire()
