"""ftdist.futures: timeouts for futures and blocks, one timer thread that does not linger."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from unittest import mock

import pytest
import torch
from torch.futures import Future

import ftdist.futures as futures
from ftdist.futures import (
    _TIMEOUT_MANAGER,
    _TimerHandle,
    context_timeout,
    future_timeout,
    future_wait,
    stream_timeout,
)

SHORT = timedelta(milliseconds=10)
LONG = timedelta(seconds=30)


@pytest.fixture(autouse=True)
def stopped_timer_thread() -> Iterator[None]:
    yield
    _TIMEOUT_MANAGER.shutdown()


def test_future_timeout_fails_a_late_future() -> None:
    late: Future[int] = Future()
    timed = future_timeout(late, SHORT)
    with pytest.raises(TimeoutError, match=r"future did not complete within 0:00:00.010000"):
        timed.wait()
    late.set_result(1)  # completing afterwards changes nothing
    with pytest.raises(TimeoutError):
        timed.wait()


def test_future_timeout_passes_results_and_errors_through() -> None:
    ok: Future[int] = Future()
    timed_ok = future_timeout(ok, LONG)
    assert not timed_ok.done()
    ok.set_result(7)
    assert timed_ok.wait() == 7
    bad: Future[int] = Future()
    timed_bad = future_timeout(bad, LONG)
    # torch's stub types set_exception's argument as the future's value type.
    bad.set_exception(RuntimeError("inner failure"))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="inner failure"):
        timed_bad.wait()
    done: Future[int] = Future()
    done.set_result(3)
    assert future_timeout(done, LONG).wait() == 3


def test_future_timeout_passes_mocks_through() -> None:
    fake = mock.MagicMock()
    assert future_timeout(fake, SHORT) is fake


def test_future_wait() -> None:
    pending: Future[int] = Future()
    with pytest.raises(TimeoutError, match="future did not complete within"):
        future_wait(pending, SHORT)
    done: Future[int] = Future()
    done.set_result(5)
    assert future_wait(done, timedelta(seconds=1)) == 5
    failed: Future[int] = Future()
    # torch's stub types set_exception's argument as the future's value type.
    failed.set_exception(ValueError("nope"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nope"):
        future_wait(failed, timedelta(seconds=1))
    with pytest.raises(ValueError, match="timeout must not be negative"):
        future_wait(done, timedelta(seconds=-1))


def test_context_timeout_fires_in_a_slow_block_only() -> None:
    meet = threading.Barrier(2, timeout=10)
    with context_timeout(meet.wait, SHORT):
        meet.wait()  # only the timer's callback can release this
    fired: list[str] = []
    with context_timeout(lambda: fired.append("late"), timedelta(seconds=0.3)):
        pass
    with (
        pytest.raises(KeyError),
        context_timeout(lambda: fired.append("late"), timedelta(seconds=0.3)),
    ):
        raise KeyError("the block failed")  # leaving by an exception cancels too
    time.sleep(0.5)
    assert fired == []


def test_timer_handle_cancels_once_and_before_the_timer_exists() -> None:
    timer = mock.Mock()
    handle = _TimerHandle()
    handle.cancel()
    handle.set_timer_handle(timer)  # already cancelled: the timer is cancelled at once
    timer.cancel.assert_called_once_with()
    with pytest.raises(AssertionError, match="timer can only be cancelled once"):
        handle.cancel()


def test_timer_thread_ends_when_idle_and_after_shutdown() -> None:
    def timer_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("ftdist-timeout")]

    done: Future[int] = Future()
    timed = future_timeout(done, LONG)
    assert len(timer_threads()) == 2  # the timer thread and its watchdog
    done.set_result(1)
    assert timed.wait() == 1
    deadline = time.monotonic() + 10
    while timer_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert timer_threads() == []  # no pending timer: both threads ended
    pending: Future[int] = Future()
    timed = future_timeout(pending, LONG)
    _TIMEOUT_MANAGER.shutdown()  # cancels the pending timer, joins at once
    assert timer_threads() == [] and not timed.done()


def test_watchdog_exits_when_a_callback_blocks_the_timer_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_TIMEOUT_MANAGER, "_watchdog_interval", timedelta(seconds=0.2))
    exited = threading.Event()
    exit_mock = mock.Mock(side_effect=lambda code: exited.set())
    monkeypatch.setattr(futures.sys, "exit", exit_mock)
    release = threading.Event()
    with context_timeout(lambda: release.wait(10), SHORT):
        assert exited.wait(10)
    exit_mock.assert_called_once_with(1)
    release.set()


def test_stream_timeout_without_an_accelerator_never_calls_back() -> None:
    if torch.accelerator.is_available():
        pytest.skip("checks the CPU-only behaviour")
    called: list[int] = []
    stream_timeout(lambda: called.append(1), SHORT)
    time.sleep(0.1)
    assert called == [] and _TIMEOUT_MANAGER._clear_del_queue() == 0


def test_timeouts_are_checked_before_anything_is_scheduled() -> None:
    with pytest.raises(TypeError, match=r"timeout must be a datetime\.timedelta"):
        future_timeout(Future(), "soon")  # type: ignore[arg-type]


def test_the_watchdog_interval_is_read_when_the_timer_thread_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Not at import: a process forked from a fork server that imported this
    # module sets its own environment after the fork.
    manager = futures._TimeoutManager()
    monkeypatch.setenv("FTDIST_WATCHDOG_TIMEOUT_SEC", "7")
    try:
        manager._schedule(lambda: None, SHORT)
        assert manager._watchdog_interval == timedelta(seconds=7)
    finally:
        manager.shutdown()


def test_a_completed_future_lets_go_of_its_timeout_callback_at_once() -> None:
    # The cancelled timer waits in the heap until its deadline: it used to
    # hold the callback, and all it reached (a reduced tensor, the Manager),
    # for the whole timeout after the future completed.
    class Payload:
        pass

    payload = Payload()
    watched = weakref.ref(payload)
    got: list[object] = []
    fut: Future[int] = Future()

    def callback(value: int | None, error: BaseException | None, held: object = payload) -> None:
        got.append((value, error))

    futures.when_done(fut, LONG, callback)
    del payload, callback
    assert watched() is not None  # pending: the timer may still need it
    fut.set_result(3)
    assert got == [(3, None)]
    assert watched() is None, "the cancelled timer still holds its callback"
    assert all(entry[2].callback is futures._nothing for entry in _TIMEOUT_MANAGER._heap)


def test_cancelled_timers_do_not_pile_up_until_their_deadlines() -> None:
    # A step's buckets each arm a timer of the Manager's timeout and complete
    # long before it: thousands would wait in the heap for a minute.
    futs: list[Future[int]] = []
    for _ in range(2000):
        fut: Future[int] = Future()
        futures.when_done(fut, LONG, lambda value, error: None)
        futs.append(fut)
    pending = Future()  # type: ignore[var-annotated]
    fired: list[object] = []
    futures.when_done(pending, SHORT, lambda value, error: fired.append(error))
    for fut in futs:
        fut.set_result(1)
    assert len(_TIMEOUT_MANAGER._heap) <= 2 * futures._COMPACT_AT
    deadline = time.monotonic() + 10
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fired) == 1 and isinstance(fired[0], TimeoutError)  # the live one still fires
