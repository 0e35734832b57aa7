"""
Local ranks
===========

Runs N ranks of a function on this host as real OS processes that meet on a
TCPStore bound to ``127.0.0.1`` port 0, and gathers what each rank returned
or the traceback it raised: the in-process counterpart of ``ftdist run`` for
code that wants ranks without a command line. The demo, the chaos suite, the
benchmarks and the tests start their ranks with it.

Children start from a fork server that has already imported torch, so a rank
costs tens of milliseconds to start instead of a full interpreter plus torch
import (seconds on a 2-core machine). The fork server is a clean process: no
Gloo, CUDA or threads exist in it when it forks.

Example::

    def body(ctx: RankContext) -> float:
        pg = ProcessGroupGloo()
        pg.configure(ctx.store_addr, ctx.rank, ctx.world_size)
        ...
        return value

    values = run_ranks(body, world_size=2, timeout=30)

A hung rank explains itself: each rank writes every thread's Python stack
to ``<folder>/<pid>`` on SIGUSR1 (faulthandler), and the harness takes them
before it kills ranks that ran past :func:`run_ranks`'s timeout (they are in
the :class:`RankFailure`), past :meth:`Ranks.join`'s where
:attr:`Ranks.stacks_on_timeout` is set (the tests set it), or that are still
running when an exception leaves a ``with Ranks(...)`` block (a note on the
exception). The folder is ``$FTDIST_STACKS_DIR`` where set (the tests' one,
shared with their other processes), else a temporary one per run.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ftdist._forkserver import exit_with_parent as _exit_with
from ftdist._forkserver import forkserver_context as _context
from ftdist.launch import config as launch_config
from ftdist.launch import stacks as _stacks

_BARRIER_STORES: dict[tuple[int, str], Any] = {}
# Exceptions that leave a ``with Ranks`` block without a failure to explain.
_NOT_FAILURES = (KeyboardInterrupt, SystemExit, GeneratorExit)


@dataclass(frozen=True)
class RankContext:
    """What a rank function receives: its rank and where the group meets.

    Attributes:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks started together.
        store_host: host of the shared TCPStore (always ``127.0.0.1``).
        store_port: port of the shared TCPStore.
        prefix: a store prefix unique to this run; use it (or :meth:`addr`)
            so that runs never see each other's keys.
    """

    rank: int
    world_size: int
    store_host: str
    store_port: int
    prefix: str

    @property
    def store_addr(self) -> str:
        """``host:port/prefix`` for ``ProcessGroup.configure``."""
        return f"{self.store_host}:{self.store_port}/{self.prefix}"

    def addr(self, suffix: str) -> str:
        """A fresh store address below this run's prefix (one per configure)."""
        return f"{self.store_host}:{self.store_port}/{self.prefix}/{suffix}"

    def store(self, timeout: timedelta = timedelta(seconds=30)) -> Any:
        """A client ``PrefixStore`` on the run's TCPStore."""
        import torch.distributed as dist

        tcp = dist.TCPStore(
            self.store_host,
            self.store_port,
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )
        return dist.PrefixStore(self.prefix, tcp)

    def barrier(self, name: str, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Wait until every rank has called ``barrier(name)``, through the run's store.

        Useful between a group's collectives and its next reconfigure: Gloo can
        finish an op on one rank while a slower peer still reads its last
        bytes, and tearing the group down under that peer fails its op.

        Args:
            name: a key unique to this barrier within the run.
            timeout: how long to wait for the other ranks.

        Raises:
            torch.distributed.DistStoreError: not every rank arrived within
                ``timeout``.
        """
        # One client per process: a fresh TCPStore connection per barrier
        # stalls for seconds every dozen or so calls.
        key = (self.store_port, self.prefix)
        store = _BARRIER_STORES.get(key)
        if store is None:
            store = _BARRIER_STORES[key] = self.store()
        if int(store.add(f"barrier/{name}", 1)) == self.world_size:
            store.set(f"barrier/{name}/go", "1")
        store.wait([f"barrier/{name}/go"], timeout)


@dataclass
class RankOutcome:
    """How one rank ended.

    Attributes:
        rank: the rank.
        value: what the function returned (None if it raised or died).
        error: the formatted traceback if the function raised, else None.
        exitcode: the process exit code; negative for a signal (``-9`` SIGKILL),
            None if it was still running when the harness gave up on it.
        stack: every thread's Python stack of a rank that was still running
            when the harness gave up on it (see :meth:`Ranks.stacks`), else None.
    """

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    stack: str | None = None

    @property
    def ok(self) -> bool:
        """True when the rank returned normally."""
        return self.error is None and self.exitcode == 0

    def describe(self) -> str:
        """How the rank ended, for a failure message: its traceback, or its stack if it hung."""
        if self.error is not None:
            return f"--- rank {self.rank} raised:\n{self.error}"
        if self.exitcode is None:
            text = f"--- rank {self.rank} was still running and was killed"
            return text + (f"; its stack:\n{self.stack}" if self.stack else "")
        if self.exitcode == 0:
            return f"--- rank {self.rank} returned {self.value!r}"
        return f"--- rank {self.rank} exited with code {self.exitcode} without a result"


class RankFailure(AssertionError):
    """One or more ranks raised, died or ran past the timeout.

    The message carries every failing child's own traceback, and the Python
    stack of each one that was still running, so pytest shows where the child
    failed or hung rather than where the parent noticed.
    """

    def __init__(self, outcomes: Sequence[RankOutcome], reason: str) -> None:
        self.outcomes = list(outcomes)
        parts = [reason, *(o.describe() for o in outcomes if not o.ok)]
        super().__init__("\n".join(parts))


def _child_main(
    fn: Callable[..., Any],
    ctx: RankContext,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: Mapping[str, str],
    conn: mpc.Connection,
    parent_pid: int,
    stacks_dir: str,
) -> None:
    _exit_with(parent_pid)
    _stacks.dump_on_sigusr1(stacks_dir)
    os.environ.update(env)
    # A rank that the parent SIGSTOPs/SIGKILLs must not take the harness's
    # SIGINT handling with it; keep the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        value = fn(ctx, *args, **kwargs)
    except BaseException:
        msg = ("err", traceback.format_exc())
    else:
        msg = ("ok", value)
    try:
        conn.send(msg)
    except Exception:
        conn.send(("err", "result could not be pickled:\n" + traceback.format_exc()))
    conn.close()
    # Skip interpreter teardown: a rank that already reported must not hang
    # in a destructor of a half-dead backend (Gloo threads, pipes).
    os._exit(0)


def _take_result(conn: mpc.Connection, outcome: RankOutcome) -> None:
    """Move the result a rank sent, if one is waiting, into ``outcome``; close the pipe then."""
    if conn.closed or not conn.poll(0):
        return
    try:
        kind, payload = conn.recv()
    except (EOFError, OSError):
        conn.close()
        return
    if kind == "ok":
        outcome.value = payload
    else:
        outcome.error = payload
    conn.close()


@dataclass
class Ranks:
    """N rank processes started together; a context manager.

    Leaving the ``with`` block kills every rank still running, so no child
    outlives its test, whatever the test did; if an exception leaves it, the
    Python stacks of the ranks still running are added to it as a note first.

    Raises:
        ValueError: ``world_size`` is not a positive int.

    Example::

        with Ranks(body, world_size=3) as ranks:
            time.sleep(1)
            ranks.kill(2)                # SIGKILL rank 2
            outcomes = ranks.join(timeout=30)
    """

    fn: Callable[..., Any]
    world_size: int
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    _procs: list[Any] = field(default_factory=list, init=False)
    _conns: list[mpc.Connection] = field(default_factory=list, init=False)
    _store: Any = field(default=None, init=False)
    _prefix: str = field(default="", init=False)
    _stacks_dir: str = field(default="", init=False)
    # Whether join() takes the stacks of the awaited ranks that ran past its
    # timeout (kept in their outcomes, printed to stderr). Off by default:
    # the demo's and chaos suite's stop paths kill ranks past a short join
    # on purpose. The tests switch it on (tests/conftest.py).
    stacks_on_timeout = False

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")

    def start(self) -> Ranks:
        """Start the store and the rank processes. Returns self."""
        import torch.distributed as dist

        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )
        self._prefix = f"test/{uuid.uuid4().hex[:12]}"
        self._stacks_dir = launch_config.stacks_dir()
        if not self._stacks_dir or not os.path.isdir(self._stacks_dir):
            self._stacks_dir = tempfile.mkdtemp(prefix="ftdist-ranks-")
            weakref.finalize(self, shutil.rmtree, self._stacks_dir, True)
        for rank in range(self.world_size):
            proc, conn = self._spawn(rank, self.args, self.kwargs)
            self._procs.append(proc)
            self._conns.append(conn)
        return self

    def _spawn(
        self, rank: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, mpc.Connection]:
        ctx = _context()
        parent_end, child_end = ctx.Pipe(duplex=False)
        rctx = RankContext(rank, self.world_size, "127.0.0.1", self._store.port, self._prefix)
        proc = ctx.Process(
            target=_child_main,
            args=(
                *(self.fn, rctx, args, kwargs, dict(self.env), child_end),
                *(os.getpid(), self._stacks_dir),
            ),
            name=f"ftdist-rank-{rank}",
            # Not daemonic: a rank may start children of its own (Baby
            # groups). The harness kills every rank itself.
            daemon=False,
        )
        proc.start()
        child_end.close()
        return proc, parent_end

    def restart(self, rank: int, *args: Any, **kwargs: Any) -> None:
        """Start a new process for ``rank`` (its previous one must have exited).

        The new process runs ``fn(ctx, *args, **kwargs)`` with the same
        context (same store and prefix); its outcome replaces the old one's.

        Raises:
            RuntimeError: the rank's previous process is still running.
        """
        old = self._procs[rank]
        old.join(timeout=5)
        if old.exitcode is None:
            raise RuntimeError(f"rank {rank} is still running; kill it before restarting")
        self._conns[rank].close()
        self._procs[rank], self._conns[rank] = self._spawn(rank, args, kwargs)

    def outcome(self, rank: int) -> RankOutcome | None:
        """The outcome of the rank's current process if it has exited, else None.

        Unlike :meth:`join` this neither waits nor stops the other ranks.
        """
        proc, conn = self._procs[rank], self._conns[rank]
        if proc.exitcode is None:
            return None
        out = RankOutcome(rank=rank, exitcode=proc.exitcode)
        _take_result(conn, out)
        return out

    def exitcode(self, rank: int) -> int | None:
        """The rank's current process exit code (None while running).

        Raises:
            IndexError: no such rank.
        """
        code: int | None = self._procs[rank].exitcode
        return code

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, by rank."""
        return [p.pid for p in self._procs]

    @property
    def store_port(self) -> int:
        """Port of the run's TCPStore (the parent hosts it)."""
        return int(self._store.port)

    def parent_store(self) -> Any:
        """A ``PrefixStore`` on the run's TCPStore, for the parent to talk to ranks.

        Keys set here are what a rank reads through ``ctx.store()``.

        Raises:
            RuntimeError: the ranks were not started.
        """
        import torch.distributed as dist

        if self._store is None:
            raise RuntimeError("start() the ranks before asking for their store")
        return dist.PrefixStore(self._prefix, self._store)

    def signal(self, rank: int, sig: int) -> None:
        """Send ``sig`` to a rank (SIGKILL, SIGSTOP, SIGCONT, ...); a rank already gone is skipped.

        Raises:
            IndexError: no such rank.
        """
        pid = self._procs[rank].pid
        if pid is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stacks(
        self, ranks: Sequence[int] | None = None, wait: float = _stacks.WAIT_S
    ) -> dict[int, str]:
        """Every thread's Python stack of each running rank (of ``ranks``; default all).

        Sends each SIGUSR1 and waits up to ``wait`` seconds for what it
        writes (:func:`ftdist.launch.stacks.take`). A stopped rank (SIGSTOP)
        cannot answer and one not yet ready to is not signalled (SIGUSR1
        would kill it): each gets a line saying so. Ranks that have exited
        are left out. Linux only (``/proc``).

        Returns:
            The text for each rank, by rank.
        """
        pids = {
            r: self._procs[r].pid
            for r in (range(self.world_size) if ranks is None else ranks)
            if self._procs[r].exitcode is None and self._procs[r].pid is not None
        }
        # The fork server's frames under _child_main are the same in every rank.
        return _stacks.take(pids, self._stacks_dir, wait, below="_child_main")

    def kill(self, rank: int) -> None:
        """SIGKILL a rank.

        Raises:
            IndexError: no such rank.
        """
        self.signal(rank, signal.SIGKILL)

    def join(
        self, timeout: float, only: Sequence[int] | None = None, stacks: bool | None = None
    ) -> list[RankOutcome]:
        """Wait up to ``timeout`` seconds for every rank (or those in ``only``).

        Then every rank still running is killed; with ``stacks`` (default:
        :attr:`stacks_on_timeout`), the awaited ones that ran past the
        timeout first give their Python stacks (in their outcomes, and on
        stderr). Returns one :class:`RankOutcome` per rank, in rank order.
        Never raises for a failing rank; see :meth:`results` for the strict
        form.
        """
        return self._join(timeout, only, self.stacks_on_timeout if stacks is None else stacks)

    def _join(
        self, timeout: float, only: Sequence[int] | None, stacks: bool, announce: bool = True
    ) -> list[RankOutcome]:
        outcomes = [RankOutcome(rank=r) for r in range(self.world_size)]
        pending = set(range(self.world_size) if only is None else only)
        deadline = time.monotonic() + timeout
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables: list[Any] = [self._conns[r] for r in pending if not self._conns[r].closed]
            waitables += [self._procs[r].sentinel for r in pending]
            ready = mpc.wait(waitables, timeout=min(remaining, 1.0))
            for obj in ready:
                if isinstance(obj, mpc.Connection):
                    _take_result(obj, outcomes[conn_rank[id(obj)]])
            for r in list(pending):
                proc = self._procs[r]
                if proc.exitcode is not None:
                    # The result may have landed just before the exit.
                    _take_result(self._conns[r], outcomes[r])
                    outcomes[r].exitcode = proc.exitcode
                    pending.discard(r)
        if pending and stacks:
            for r, text in sorted(self.stacks(sorted(pending)).items()):
                outcomes[r].stack = text
                # A test may not print the outcome: stderr is in its report.
                if not announce:
                    continue
                print(
                    f"ftdist.launch.ranks: rank {r} (pid {self._procs[r].pid}) still running "
                    f"after join's {timeout:g} s; killing it. Its stack:\n{text}",
                    file=sys.stderr,
                    flush=True,
                )
        self.terminate()
        return outcomes

    def results(self, timeout: float) -> list[Any]:
        """Join and return every rank's value; raise :class:`RankFailure` if any failed.

        Raises:
            RankFailure: a rank raised, died or was still running at ``timeout``.
        """
        # The RankFailure carries the stacks: nothing on stderr.
        outcomes = self._join(timeout, None, stacks=True, announce=False)
        if not all(o.ok for o in outcomes):
            raise RankFailure(
                outcomes, f"{sum(not o.ok for o in outcomes)} of {self.world_size} ranks failed"
            )
        return [o.value for o in outcomes]

    def terminate(self) -> None:
        """Kill every rank still running (SIGCONT first, so a stopped one dies too)."""
        for proc in self._procs:
            if proc.exitcode is None and proc.pid is not None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(proc.pid, sig)
                    except ProcessLookupError:
                        break
        for proc in self._procs:
            proc.join(timeout=10)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> Ranks:
        return self.start()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, _NOT_FAILURES) and self._procs:
            # Killing them loses where they were: note it on the way out.
            stacks = self.stacks()
            if stacks and hasattr(exc, "add_note"):
                exc.add_note(
                    "Ranks still running when the exception left `with Ranks`:\n"
                    + "\n".join(f"--- rank {r}:\n{t}" for r, t in sorted(stacks.items()))
                )
        self.terminate()
        self._store = None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` rank processes.

    ``fn`` must be importable by name (a module-level function). Returns the
    values in rank order.

    Raises:
        RankFailure: a rank raised (its traceback is in the message), died, or
            was still running after ``timeout`` seconds (it is killed).
        ValueError: ``world_size`` is not a positive int.
    """
    with Ranks(fn, world_size, args=args, kwargs=kwargs, env=dict(env or {})) as ranks:
        return ranks.results(timeout)


__all__ = ["RankContext", "RankFailure", "RankOutcome", "Ranks", "run_ranks"]
