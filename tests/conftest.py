"""Shared fixtures and the test tiers.

Every test is checked for leaked threads and child processes, and marked
with its tier from its folder (``unit``, ``integration``, ``gpu``); ``slow``
and ``browser`` are marked by hand. One fixture family starts lighthouses:
``lh`` (any number, any settings) and ``lighthouse`` (the address of one).
"""

from __future__ import annotations

import os

# torch's TCPStore looks up the name of each connection's address, an
# IPv4-mapped IPv6 one that /etc/hosts does not list, so every store connect
# asks DNS for 1.0.0.127.in-addr.arpa. Where the resolver drops a query (this
# CI's does, about 1 in 20), glibc waits 5 s and retries: a 5 s stall in a
# connect that tests bound by far less. One short try keeps a lost answer
# cheap; torch only logs that the name is unknown. Set before anything
# resolves a name, so that every process the tests start inherits it.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import threading
import time
from collections.abc import Iterator

import pytest

from tests._procs import children
from tests.integration.lighthouse_helpers import Lighthouses

# Threads that belong to the interpreter or to libraries for the whole
# session, not to one test.
_SESSION_THREADS = ("pytest_timeout", "QueueFeederThread", "resource_sharer")


def _children() -> set[int]:
    return {pid for pid, state in children().items() if state != "Z"}


def _session_processes() -> set[int | None]:
    """The fork server and multiprocessing's resource tracker: process-wide caches."""
    from multiprocessing import forkserver, resource_tracker

    return {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }


def _threads() -> set[threading.Thread]:
    # "(_serve)" is multiprocessing's resource sharer, which hands shared
    # memory file descriptors to Baby children for the rest of the session.
    return {
        t
        for t in threading.enumerate()
        if t is not threading.main_thread()
        and not t.name.startswith(_SESSION_THREADS)
        and not t.name.endswith("(_serve)")
    }


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves a thread or a child process behind."""
    threads_before = _threads()
    children_before = _children()
    yield
    deadline = time.monotonic() + 10
    while True:
        # The fork server and resource tracker serve the session, not a test.
        allowed = children_before | _session_processes()
        leaked_children = _children() - allowed
        leaked_threads = {t for t in _threads() - threads_before if t.is_alive()}
        if not leaked_children and not leaked_threads:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    names = sorted(t.name for t in leaked_threads)
    pytest.fail(f"test leaked child processes {sorted(leaked_children)} and threads {names}")


@pytest.fixture
def lh() -> Iterator[Lighthouses]:
    """Lighthouses and clients started on demand on 127.0.0.1 port 0; all closed after the test."""
    lighthouses = Lighthouses()
    try:
        yield lighthouses
    finally:
        lighthouses.close()


@pytest.fixture
def lighthouse(lh: Lighthouses) -> str:
    """The address of a lighthouse that forms quorums of one or more replica groups."""
    return str(lh.server(heartbeat_timeout_ms=1000, join_timeout_ms=200).address())


_TIERS = {"unit": "unit", "integration": "integration", "gpu": "gpu"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its tier, from the folder it lives in."""
    for item in items:
        parts = item.path.parts
        tier = next((_TIERS[p] for p in reversed(parts) if p in _TIERS), None)
        if tier is not None:
            item.add_marker(tier)
