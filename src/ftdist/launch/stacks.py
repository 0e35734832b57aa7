"""Python stacks of running processes, on demand: how a hung rank explains itself.

A process calls :func:`dump_on_sigusr1` once; from then on SIGUSR1 makes it
write every thread's Python stack to ``<folder>/<pid>`` (faulthandler: from
the signal handler, so a process stuck in C code still answers). Another
process calls :func:`take` to signal some and read what they wrote.
``ftdist.launch.ranks`` uses it for ranks that ran past a timeout; the tests'
start-up hook (``tests/_stacks``) writes to the same place, so that one
folder, ``$FTDIST_STACKS_DIR``, serves both.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

# Where each process's dump goes: ``<folder>/<pid>``.
STACKS_ENV = "FTDIST_STACKS_DIR"
# How long signalled processes get to write (each writes at once, from its
# signal handler; a loaded machine may take a while to run them all).
WAIT_S = 3.0
_file: Any = None
K = TypeVar("K", bound=Hashable)


def dump_on_sigusr1(folder: str) -> None:
    """In this process: write every thread's stack to ``folder/<pid>`` on SIGUSR1."""
    global _file
    try:
        # Held for the process's life: faulthandler writes to its descriptor.
        # Appended to, not truncated: where the tests' start-up hook made the
        # file already, a dump it took meanwhile stays where a reader expects
        # it (readers read from the size the file had before their signal).
        _file = open(os.path.join(folder, str(os.getpid())), "a")
    except OSError:
        return  # the folder is gone: no stacks, nothing else lost
    faulthandler.register(signal.SIGUSR1, file=_file, all_threads=True, chain=False)


def _status(pid: int) -> tuple[str, bool] | None:
    """(state letter, whether it catches SIGUSR1) from /proc; None if unknown (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        caught = int(fields["SigCgt"].strip(), 16) >> (signal.SIGUSR1 - 1) & 1
        return fields["State"].split()[0], bool(caught)
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _cut_below(dump: str, function: str | None) -> str:
    """The dump without the frames under ``function`` in each thread (start-up noise)."""
    if function is None:
        return dump.rstrip()
    lines, skipping = [], False
    for line in dump.rstrip().splitlines():
        if skipping and line.startswith("  File "):
            continue
        skipping = line.startswith("  File ") and line.endswith(f" in {function}")
        lines.append(line)
    return "\n".join(lines)


def take(
    pids: Mapping[K, int], folder: str, wait: float = WAIT_S, below: str | None = None
) -> dict[K, str]:
    """Every thread's Python stack of each process in ``pids``, or why there is none.

    Signals only processes that have a dump file in ``folder`` and catch
    SIGUSR1 (for any other, SIGUSR1 would be fatal); a stopped process
    (SIGSTOP) cannot answer. Each of those gets a line saying so. Linux
    only (``/proc``).

    Args:
        pids: the processes, under any keys (ranks, say).
        folder: where they write (see :func:`dump_on_sigusr1`).
        wait: how long to wait for what they write, in seconds.
        below: a function whose callers to leave out of each thread's stack.

    Returns:
        The text for each key.
    """
    out: dict[K, str] = {}
    pending: dict[K, tuple[str, int]] = {}
    for key, pid in pids.items():
        status = _status(pid)
        path = os.path.join(folder, str(pid))
        before = _size(path)
        if status is None:
            out[key] = "(no stack: the process is gone or cannot be inspected)"
        elif status[0] in ("T", "t"):
            out[key] = "(stopped: SIGSTOP or a tracer; it cannot write its stack)"
        elif before < 0 or not status[1]:
            out[key] = "(no stack: the process does not (yet) write one on SIGUSR1)"
        else:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                out[key] = "(gone)"
                continue
            pending[key] = (path, before)
    # Each writes its whole dump from the signal handler: a file that grew
    # and then kept its size for a poll is complete.
    deadline = time.monotonic() + wait
    last: dict[K, int] = {}
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        for key, (path, before) in list(pending.items()):
            size = _size(path)
            if size > before and last.get(key) == size:
                with open(path, "rb") as f:
                    f.seek(before)
                    out[key] = _cut_below(f.read().decode(errors="replace"), below)
                del pending[key]
            last[key] = size
    for key in pending:
        out[key] = f"(signalled, but no stack within {wait:g} s)"
    return out


__all__ = ["STACKS_ENV", "WAIT_S", "dump_on_sigusr1", "take"]
