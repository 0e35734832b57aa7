"""
Baby children: started ahead of need, asked where they are
===========================================================

A Baby group's child is forked from the fork server before a ``configure``
needs it (:class:`SparePool`), so that a reconfiguration pays no Python and
torch start. Each child also gets a second, one-way pipe on which it writes
every thread's Python stack when sent :data:`STACKS_SIGNAL`
(:func:`child_stacks`): a child that stops answering is killed, and its
stacks are what explain the error that reports it.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from typing import Any, NamedTuple

from ftdist._forkserver import forkserver_context
from ftdist.process_group._baby_child import STACKS_SIGNAL, child_main

# How long a child that stopped answering gets to write its stacks (it
# writes from a signal handler, at once, unless the machine is starved or
# the child is stopped).
STACKS_WAIT_S = 2.0


class Started(NamedTuple):
    """A started child process and the parent's ends of its pipes."""

    proc: Any
    conn: Connection
    stacks: Connection

    def discard(self) -> None:
        """Close the pipes (the child exits on EOF) and kill it in case it is slow to see it."""
        self.conn.close()
        self.stacks.close()
        self.proc.kill()
        self.proc.join(timeout=5)


def start_child() -> Started:
    """Fork a child from the fork server; it says ``("up",)`` and waits for configure."""
    ctx = forkserver_context()
    parent_end, child_end = ctx.Pipe(duplex=True)
    stacks_end, stacks_child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=child_main, args=(child_end, stacks_child_end), name="ftdist-baby", daemon=True
    )
    proc.start()
    child_end.close()
    stacks_child_end.close()
    return Started(proc, parent_end, stacks_end)


class SparePool:
    """One child process started ahead of need."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spare: Started | None = None
        self._closed = False

    def take(self) -> Started:
        """A started child: the warm spare if it is alive, else a new one."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.proc.is_alive():
            return spare
        if spare is not None:
            spare.discard()
        return start_child()

    def refill(self) -> None:
        """Start the next spare if none is waiting."""
        with self._lock:
            if self._spare is not None or self._closed:
                return
            self._spare = start_child()

    def close(self) -> None:
        """Kill the waiting spare; no more are started."""
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.discard()


def child_stacks(pid: int, stacks: Connection, wait: float = STACKS_WAIT_S) -> str:
    """Every thread's Python stack in the running child ``pid``, or why there is none.

    Args:
        pid: the child's process id.
        stacks: the read end of its stacks pipe.
        wait: how long to wait for the dump, in seconds.
    """
    try:
        os.kill(pid, STACKS_SIGNAL)
    except ProcessLookupError:
        return "(no stacks: the child has exited)"
    # The handler writes the whole dump at once: a pipe that stays quiet for
    # a moment after the first bytes holds all of it.
    chunks: list[bytes] = []
    deadline = time.monotonic() + wait
    fd = stacks.fileno()
    while (left := deadline - time.monotonic()) > 0:
        if not wait_for([fd], min(left, 0.05) if chunks else left):
            if chunks:
                break
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    if not chunks:
        return f"(no stacks within {wait:g} s: the child is stopped or starved)"
    return b"".join(chunks).decode(errors="replace").rstrip()


__all__ = ["STACKS_SIGNAL", "STACKS_WAIT_S", "SparePool", "Started", "child_stacks", "start_child"]
