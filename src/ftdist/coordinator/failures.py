"""
Failure news between coordinators built over ftdist groups
==========================================================

A dead rank makes only the operations that touch it fail: Gloo sees its
connections close. A survivor that waits on *another survivor* (one that
has already failed and left the step) would wait out the whole collective
timeout. So the first coordinator that sees a :class:`~ftdist.CommunicationError`
posts it under a key in the job's store, and every process watching that
key aborts its coordinators: their operations in flight fail at once with
:class:`~ftdist.ProcessGroupAbortedError`, and the job can reconfigure.
The coordinator methods that post are the ones marked :func:`reports_failures`.

Invariants:

- One watcher (one thread, one store connection) per process and store
  address, shared by the coordinators that meet there; it stops when the
  last one leaves (reconfigure to a new address, or destroy).
- News is scoped to a store address, and every reconfigure uses a fresh
  one, so news of an old failure never aborts the rebuilt groups.
- Posting is best effort: if the store itself is gone, each survivor still
  fails within its own collective timeout.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from ftdist.errors import CommunicationError
from ftdist.process_group import create_store_client

logger = logging.getLogger(__name__)

FAILURE_KEY = "ftdist-coordinator-failure"
# How often a watcher looks for news: the bound on how late a survivor hears.
POLL_INTERVAL_S = 0.05

_lock = threading.Lock()
_watches: dict[str, FailureWatch] = {}

F = TypeVar("F", bound=Callable[..., Any])


class FailureWatch:
    """Posts and watches failure news under one store address (see the module docstring).

    Use :func:`watch` to get the shared instance for an address.

    Args:
        store_addr: ``host:port/prefix``; the news key lives below it.
        timeout: store operation timeout.

    Raises:
        ValueError: malformed ``store_addr``.
        RuntimeError: the store is unreachable.
    """

    def __init__(self, store_addr: str, timeout: timedelta) -> None:
        self.store_addr = store_addr
        # A connection of its own, so the groups' rendezvous never queues
        # behind the poller; one for both polling and posting, because every
        # new connection to a store costs (and some hosts stall on them).
        self._store = create_store_client(store_addr, timeout)
        self._store_lock = threading.Lock()
        self._members: weakref.WeakSet[Any] = weakref.WeakSet()
        self._stop = threading.Event()
        self.news: str | None = None
        self._thread = threading.Thread(
            target=self._run, name="ftdist-coordinator-failures", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            try:
                with self._store_lock:
                    if not self._store.check([FAILURE_KEY]):
                        continue
                    news = self._store.get(FAILURE_KEY).decode(errors="replace")
            except Exception:
                if self._stop.is_set():
                    return
                continue  # the store is slow or gone; collective timeouts still apply
            self.news = news
            logger.warning(
                "failure news at %s: %s; aborting this process's coordinators",
                self.store_addr,
                news,
            )
            for member in list(self._members):
                try:
                    member.abort()
                except Exception:
                    logger.exception("aborting %r after failure news failed", member)
            return

    def add(self, coordinator: Any) -> None:
        """Abort ``coordinator`` when news arrives (at once if it already has)."""
        self._members.add(coordinator)
        if self.news is not None:
            coordinator.abort()

    def report(self, reason: str) -> None:
        """Post failure news (first poster wins; later posts are dropped)."""
        try:
            with self._store_lock:
                self._store.compare_set(FAILURE_KEY, "", reason)
        except Exception:
            logger.warning("could not post failure news at %s", self.store_addr, exc_info=True)

    def close(self) -> None:
        """Stop watching."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def watch(store_addr: str, timeout: timedelta, coordinator: Any) -> FailureWatch:
    """The process's watcher for ``store_addr``, with ``coordinator`` added.

    Raises:
        ValueError: malformed ``store_addr``.
        RuntimeError: the store is unreachable.
    """
    with _lock:
        w = _watches.get(store_addr)
        if w is None:
            w = _watches[store_addr] = FailureWatch(store_addr, timeout)
    w.add(coordinator)
    return w


def unwatch(w: FailureWatch, coordinator: Any) -> None:
    """Remove ``coordinator`` from ``w``; the last one out stops it."""
    with _lock:
        w._members.discard(coordinator)
        if len(w._members):
            return
        if _watches.get(w.store_addr) is w:
            del _watches[w.store_addr]
    w.close()


def reports_failures(fn: F) -> F:
    """Make a coordinator method post its communication failure as failure news.

    For a coordinator built over ftdist groups (one with a watcher), a
    :class:`~ftdist.CommunicationError` from the method is posted, naming
    the coordinator, rank and method, and then raised as before; other
    coordinators, and calls while ``torch.compile`` traces, run unchanged.
    """

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._watch is None or torch.compiler.is_compiling():
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        except CommunicationError as exc:
            self._watch.report(f"{self.unique_name} (rank {self.rank}) {fn.__name__}: {exc}")
            raise

    return wrapper  # type: ignore[return-value]


__all__ = ["FAILURE_KEY", "FailureWatch", "reports_failures", "unwatch", "watch"]
