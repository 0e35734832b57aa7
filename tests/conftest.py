"""Shared fixtures: every test is checked for leaked threads and child processes."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

# Threads that belong to the interpreter or to libraries for the whole
# session, not to one test.
_SESSION_THREADS = ("pytest_timeout", "QueueFeederThread", "resource_sharer")


def _children() -> set[int]:
    me = str(os.getpid())
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            pids.add(int(entry))
    return pids


def _forkserver_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate()
            if t is not threading.main_thread() and not t.name.startswith(_SESSION_THREADS)}


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves a thread or a child process behind."""
    threads_before = _threads()
    children_before = _children()
    yield
    deadline = time.monotonic() + 10
    while True:
        # The fork server is the harness's process-wide cache, not a test's.
        allowed = children_before | {_forkserver_pid()}
        leaked_children = _children() - allowed
        leaked_threads = {t for t in _threads() - threads_before if t.is_alive()}
        if not leaked_children and not leaked_threads:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    names = sorted(t.name for t in leaked_threads)
    pytest.fail(f"test leaked child processes {sorted(leaked_children)} and threads {names}")
