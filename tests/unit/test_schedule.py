"""The part of a single-threaded server that is not I/O (ftdist._rpc.schedule)."""

from __future__ import annotations

import threading
import time

import pytest

from ftdist._rpc.schedule import Schedule

pytestmark = pytest.mark.timeout(30)


def test_ticks_timers_and_handed_over_calls_run_in_order() -> None:
    ran: list[str] = []
    schedule = Schedule(lambda: ran.append("tick"), 0.05)
    schedule.call_soon(lambda: ran.append("soon"))
    assert schedule.wait_s(time.monotonic(), 1.0) == 0.0  # work is waiting
    schedule.at(time.monotonic() + 0.02, lambda: ran.append("timer"))
    schedule.run_due(stopping=False)
    assert ran == ["soon"]
    time.sleep(0.06)
    schedule.run_due(stopping=False)
    assert ran == ["soon", "timer", "tick"]


def test_while_stopping_nothing_is_due_and_the_wait_is_not_zero() -> None:
    ran: list[str] = []
    schedule = Schedule(lambda: ran.append("tick"), 0.05)
    schedule.at(time.monotonic(), lambda: ran.append("timer"))
    time.sleep(0.06)
    for _ in range(3):
        schedule.run_due(stopping=True)
        # A wait of 0 here was a hot loop through the whole shutdown grace.
        assert schedule.wait_s(time.monotonic(), 1.0) > 0.01
    assert ran == []


def test_a_failing_call_is_logged_and_the_rest_run(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[int] = []
    schedule = Schedule(None, 10.0)
    schedule.call_soon(lambda: 1 / 0)  # type: ignore[arg-type]
    schedule.call_soon(lambda: ran.append(1))
    schedule.run_due(stopping=False)
    assert ran == [1]
    assert "scheduled call failed" in caplog.text


def test_run_returns_the_result_from_the_server_thread() -> None:
    schedule = Schedule(None, 10.0, wake=lambda: None)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            schedule.run_due(stopping=False)
            time.sleep(0.001)

    thread = threading.Thread(target=loop)
    schedule.thread = thread
    thread.start()
    try:
        assert schedule.run(lambda: threading.current_thread() is thread, 5.0, True) is True
        with pytest.raises(RuntimeError, match="not running"):
            schedule.run(lambda: None, 5.0, False)
    finally:
        stop.set()
        thread.join()
