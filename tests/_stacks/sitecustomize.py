"""Stack dumps on demand for every Python process the tests start.

``tests/conftest.py`` puts this folder first on ``PYTHONPATH``, so every
Python process the tests start (trainers, torchrun and its workers, the
``ftdist`` command, fork servers) runs this at start-up. With
``FTDIST_STACKS_DIR`` set, SIGUSR1 makes the process write every thread's
Python stack to ``$FTDIST_STACKS_DIR/<pid>`` (faulthandler: it works even
while the process is stuck in C code holding the GIL), and
``tests/_diagnostics.py`` sends it when a test fails or times out. Product
code is untouched: nothing here runs outside the tests.

Harmless by construction: nothing is printed; a process that inherits
SIGUSR1 ignored keeps it ignored; one that installs a SIGUSR1 handler of
its own keeps it, and its dump file is removed, so the diagnostics leave it
alone. A ``sitecustomize`` further down ``sys.path`` still runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import FrameType
from typing import Any

# signal.signal's handler type, as typeshed spells it.
_Handler = Callable[[int, FrameType | None], Any] | int | None


def _install(directory: str) -> None:
    import faulthandler
    import signal

    if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN:
        return  # someone wants it ignored (nohup-like): leave it so
    current: list[Any] = []

    def path() -> str:
        return os.path.join(directory, str(os.getpid()))

    def register() -> None:
        # A forked child inherits the handler with its parent's file: give it
        # one of its own, so that each pid's dump lands in its own file. Not
        # where the process installed a handler of its own before forking.
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            return
        try:
            f = open(path(), "w")  # held for the process's life
        except OSError:
            return  # the folder is gone: the test session ended
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
        for old in current:
            old.close()
        current[:] = [f]

    original_signal = signal.signal

    # signal.signal's own parameter names: callers may pass them by keyword.
    def signal_(signalnum: int, handler: _Handler | signal.Handlers) -> _Handler | signal.Handlers:
        if signalnum == signal.SIGUSR1:
            # The process takes SIGUSR1 for itself: no dump file, so the
            # diagnostics never send it one.
            try:
                os.unlink(path())
            except OSError:
                pass
        return original_signal(signalnum, handler)

    signal.signal = signal_
    register()
    os.register_at_fork(after_in_child=register)


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, if there is one."""
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if os.environ.get("FTDIST_STACKS_DIR"):
    try:
        _install(os.environ["FTDIST_STACKS_DIR"])
    except Exception:
        pass  # diagnostics must never stop a process from starting
_chain()
