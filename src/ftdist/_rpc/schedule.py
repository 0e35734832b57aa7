"""
What a single-threaded server runs besides its calls
====================================================

Both of the lighthouse's gRPC servers (:mod:`ftdist._rpc.h2_server`,
:mod:`ftdist._rpc.cq_server`) run everything on one thread: work that other
threads hand over, timers, and a periodic tick. This is that part, shared;
each server's loop asks :meth:`Schedule.wait_s` how long it may sleep and
calls :meth:`Schedule.run_due` after each wake-up.
"""

from __future__ import annotations

import collections
import concurrent.futures
import heapq
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Schedule"]

logger = logging.getLogger("ftdist.rpc")


class Schedule:
    """Work for one server thread: handed-over calls, timers, a tick.

    Args:
        tick: called on the server thread every ``tick_period_s``.
        tick_period_s: tick period in seconds.
        wake: interrupts the server thread's wait (from another thread);
            None when the loop polls often enough on its own.
    """

    def __init__(
        self,
        tick: Callable[[], object] | None,
        tick_period_s: float,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self._tick = tick
        self._tick_period_s = tick_period_s
        self._wake = wake
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        # (when, seq, fn); only the server thread touches it.
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = 0
        self._next_tick = time.monotonic() + tick_period_s
        self._stopping = False
        self.thread: threading.Thread | None = None

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server thread. Thread-safe; what it raises is logged."""
        self._commands.append(fn)
        if self._wake is not None and threading.current_thread() is not self.thread:
            self._wake()

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server thread ``delay_s`` seconds from now. Thread-safe."""
        when = time.monotonic() + max(0.0, delay_s)
        self.call_soon(lambda: self.at(when, fn))

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at monotonic time ``when``; from the server thread only."""
        self._timer_seq += 1
        heapq.heappush(self._timers, (when, self._timer_seq, fn))

    def run(self, fn: Callable[[], Any], timeout: float, running: bool) -> Any:
        """Run ``fn`` on the server thread and return its result. Thread-safe.

        Raises:
            RuntimeError: if ``running`` is false (the server is stopped or stopping).
            TimeoutError: if it did not run in time.
            Exception: whatever ``fn`` raised.
        """
        if not running:
            raise RuntimeError("server is not running")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def call() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self.call_soon(call)
        return future.result(timeout)

    def wait_s(self, now: float, longest: float) -> float:
        """How long the server thread may wait for I/O: at most ``longest``."""
        if self._commands:
            return 0.0
        wait = min(longest, self._next_tick - now)
        if self._timers and not self._stopping:
            wait = min(wait, self._timers[0][0] - now)
        return max(0.0, wait)

    def run_due(self, stopping: bool) -> None:
        """Run what was handed over, then (unless ``stopping``) due timers and the tick."""
        while self._commands:
            try:
                self._commands.popleft()()
            except Exception:
                logger.exception("scheduled call failed")
        now = time.monotonic()
        self._stopping = stopping
        if stopping:
            # Neither timers nor the tick run any more; the next tick time
            # still moves on, or wait_s() would say 0 for the whole grace.
            self._next_tick = max(self._next_tick, now + self._tick_period_s)
            return
        while self._timers and self._timers[0][0] <= now:
            _, _, due = heapq.heappop(self._timers)
            try:
                due()
            except Exception:
                logger.exception("timer failed")
        if now >= self._next_tick:
            self._next_tick = now + self._tick_period_s
            if self._tick is not None:
                try:
                    self._tick()
                except Exception:
                    # A bug in one tick must not stop the server; calls keep
                    # being served and the next tick may succeed.
                    logger.exception("server tick failed")
