"""
Process states from /proc
=========================

What Linux's ``/proc`` says of a process: when it started (which tells a pid
from its reuse) and whether its threads have stopped. Readers answer with
nothing rather than raise where ``/proc`` cannot tell (another system, a
process gone).
"""

from __future__ import annotations

import contextlib
import os
import time

__all__ = ["await_stopped", "start_time", "state", "thread_states"]


def _fields(path: str) -> list[str]:
    # The command name (2nd field) may hold spaces and parentheses; what
    # follows its last ")" splits cleanly: state, ppid, ...
    # A thread may name itself anything (prctl): its bytes need not decode.
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read().rsplit(")", 1)[1].split()


def start_time(pid: int) -> str:
    """The kernel's start time of ``pid`` ("" if gone): tells a pid from its reuse."""
    try:
        return _fields(f"/proc/{pid}/stat")[19]
    except (OSError, IndexError):
        return ""


def state(pid: int) -> str:
    """``pid``'s state letter ("Z": a zombie; "" if gone)."""
    try:
        return _fields(f"/proc/{pid}/stat")[0]
    except (OSError, IndexError):
        return ""


def thread_states(pid: int) -> list[str]:
    """The state letter of each of ``pid``'s threads (empty where /proc cannot tell)."""
    states = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError):
                states.append(_fields(f"/proc/{pid}/task/{tid}/stat")[0])
    return states


def await_stopped(pid: int, deadline: float) -> None:
    """Wait until every thread of ``pid`` is stopped (or dead), as after SIGSTOP.

    kill() only marks SIGSTOP pending: one thread takes it when the scheduler
    next runs it and only then stops the others, so on a loaded machine a
    thread that is already on a CPU serves requests for milliseconds after
    kill() returned.

    Args:
        pid: the process.
        deadline: a ``time.monotonic()`` reading.

    Raises:
        TimeoutError: some thread still ran at ``deadline``.
    """
    while True:
        states = thread_states(pid)
        if all(state in "TtZX" for state in states):  # a dead thread answers nothing either
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"process {pid} did not stop after SIGSTOP: thread states {states}")
        time.sleep(0.001)
