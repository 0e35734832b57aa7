"""
A launched child process
========================

:func:`child_main` is the entry point of every process the launcher starts:
it arms "die with the launcher", applies the environment the launcher
chose, runs its job, and reports how the job ended over a pipe. A job is a
function (:class:`FunctionJob`, what
:func:`~ftdist.launch.launch_subprocesses` runs) or a script
(:class:`ScriptJob`, what ``ftdist run`` runs as ``__main__``).

Report protocol: exactly one message, ``("ok", None)`` or ``("err",
traceback_text)``, then the process exits: 0 after ``ok``, the job's
``SystemExit`` code or 1 after an error. A ``KeyboardInterrupt`` ends the
job cleanly (``ok``), as in ml-starter. The process leaves with
``os._exit`` after flushing stdout and stderr, so that destructors of a
half-torn-down backend (Gloo threads, sockets to dead peers) cannot hang it.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ftdist._forkserver import exit_with_parent
from ftdist.launch.config import FaultTolerance, MultiprocessConfig

if TYPE_CHECKING:
    from ftdist.launch.process import ReplicaInfo

logger = logging.getLogger(__name__)


@dataclass
class FunctionJob:
    """Run ``setup()``, then the function under :func:`~ftdist.launch.init_and_run`.

    With ``replica`` set, the function runs as one rank of a replica group
    under a Manager (:func:`~ftdist.launch.process.run_replica`).
    """

    func: Callable[..., None]
    setup: Callable[[], None] | None
    cfg: MultiprocessConfig
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    replica: ReplicaInfo | None = None
    fault_tolerance: FaultTolerance | None = None

    def __call__(self) -> None:
        """Run the job in this process.

        Raises:
            Exception: whatever ``setup`` or the function raises.
        """
        from ftdist.launch import process

        if self.setup is not None:
            self.setup()
        if self.replica is None or self.fault_tolerance is None:
            process.init_and_run(self.func, self.cfg, *self.args, **self.kwargs)
        else:
            process.run_replica(
                self.func, self.cfg, self.replica, self.fault_tolerance, self.args, self.kwargs
            )


@dataclass
class ScriptJob:
    """Run a script (or ``-m`` module) as ``__main__`` with ``argv``, as ``python`` would."""

    target: str
    argv: list[str]
    module: bool = False

    def __call__(self) -> None:
        """Run the script in this process.

        Raises:
            Exception: whatever the script raises (``SystemExit`` included).
        """
        if self.module:
            sys.argv = [self.target, *self.argv]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(self.target, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(self.target)
            sys.argv = [self.target, *self.argv]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def child_main(
    job: Callable[[], None],
    env: Mapping[str, str],
    conn: Any,
    parent_pid: int,
) -> None:
    """Entry point of a launched process (see the module docstring)."""
    exit_with_parent(parent_pid)
    os.environ.update(env)
    report: tuple[str, str | None] = ("ok", None)
    code = 0
    try:
        job()
    except KeyboardInterrupt:
        logger.info("caught KeyboardInterrupt; exiting")
    except SystemExit as exc:
        code = _exit_code(exc)
        if code:
            report = ("err", f"SystemExit: exit code {code}\n")
    except BaseException:
        report = ("err", traceback.format_exc())
        code = 1
    try:
        conn.send(report)
        conn.close()
    except Exception:
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


__all__ = ["FunctionJob", "ScriptJob", "child_main"]
