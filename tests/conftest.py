"""Shared fixtures and the test tiers.

Every test is checked for leaked threads and child processes, and marked
with its tier from its folder (``unit``, ``integration``, ``gpu``); ``slow``
and ``browser`` are marked by hand. One fixture family starts lighthouses:
``lh`` (any number, any settings) and ``lighthouse`` (the address of one).

A test that fails or nears its timeout gets an "ftdist diagnostics" section
in its report: the Python stack of every live process it started and the
tail of each output it registered (``tests/_diagnostics.py``).
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
from collections.abc import Generator, Iterator
from datetime import timedelta
from typing import Any

import pytest
from _pytest.nodes import Node

from tests import _diagnostics

# Before anything is started: every Python process the tests start from
# here on dumps its stacks on SIGUSR1 for the failure reports.
_diagnostics.install()

from ftdist.checkpointing import HTTPTransport  # noqa: E402
from ftdist.launch.ranks import Ranks  # noqa: E402
from tests._procs import children  # noqa: E402
from tests.integration.lighthouse_helpers import Lighthouses  # noqa: E402

# Threads that belong to the interpreter or to libraries for the whole
# session, not to one test.
_SESSION_THREADS = (
    "pytest_timeout",
    "QueueFeederThread",
    "resource_sharer",
    _diagnostics.WATCHDOG_THREAD,
)

# A rank still running past a test's join() is (nearly always) the failure:
# its stack goes in the outcome and on stderr before it is killed.
Ranks.stacks_on_timeout = True


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


@pytest.fixture
def transports() -> Iterator[tuple[HTTPTransport[Any], HTTPTransport[Any]]]:
    """A heal's source and receiver: two HTTPTransports on 127.0.0.1 (10 s
    timeouts), shut down after the test."""
    timeout = timedelta(seconds=10)
    src = HTTPTransport[Any](timeout, hostname="127.0.0.1")
    dst = HTTPTransport[Any](timeout, hostname="127.0.0.1")
    try:
        yield src, dst
    finally:
        src.shutdown()
        dst.shutdown()


_TIERS = {"unit": "unit", "integration": "integration", "gpu": "gpu"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its tier, from the folder it lives in."""
    for item in items:
        parts = item.path.parts
        tier = next((_TIERS[p] for p in reversed(parts) if p in _TIERS), None)
        if tier is not None:
            item.add_marker(tier)


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to run when pytest-xdist's ``--dist loadgroup`` would have no effect.

    The heavy tests (demos, chaos, the replicated lighthouse) are kept off
    each other by ``xdist_group``; run side by side on two cores they starve
    each other's replica groups into failures that are not ours. xdist groups
    a test by setting its ``_nodeid`` to ``nodeid@group``; pytest 9.2 stopped
    reading ``_nodeid``, which spread the groups over every worker, silently.
    Drop this probe with the pin in pyproject.toml once pytest-xdist groups
    tests by pytest 9.2's node ids.
    """
    if config.getoption("dist", None) != "loadgroup":
        return
    probe = object.__new__(Node)
    try:
        probe._nodeid = "probe@group"
        honoured = probe.nodeid == "probe@group"
    except AttributeError:
        honoured = False
    if not honoured:
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup has no effect with pytest {pytest.__version__}: "
            "the heavy tests would run side by side and starve each other. Install the "
            "versions that pyproject.toml's dev extra pins (make setup)."
        )


# -- diagnostics of failing tests (tests/_diagnostics.py) ---------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, Any, Any]:
    """Record diagnostics for this test alone."""
    _diagnostics.begin(item.nodeid)
    try:
        return (yield)
    finally:
        _diagnostics.watchdog.disarm()
        _diagnostics.end()


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Snapshot every process of the test a few seconds before pytest-timeout fails it.

    pytest-timeout's failure runs the test's ``finally`` blocks, which kill
    the processes; their stacks must be taken before. Returns None, so that
    pytest-timeout still sets its own timer.
    """
    timeout = float(settings.timeout)
    margin = _diagnostics.watchdog_margin(timeout)
    _diagnostics.watchdog.arm(
        max(0.5, timeout - margin),
        f"watchdog: {margin:.0f} s before the {timeout:.0f} s timeout",
        item.nodeid,
    )


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    """The test ended in time: no snapshot. Returns None: pytest-timeout cancels its timer."""
    _diagnostics.watchdog.disarm()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Put the diagnostics of a failed phase in its report (and a file, for the soak)."""
    report = yield
    if report.failed:
        _diagnostics.watchdog.settle()
        text = _diagnostics.report(report.when)
        if text:
            report.sections.append((f"ftdist diagnostics ({report.when})", text))
            _diagnostics.save(item.nodeid, report.when, text)
    return report
