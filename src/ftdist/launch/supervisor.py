"""
The launcher's supervisor
=========================

:class:`Supervisor` runs in the launching process. It starts the children
of every replica group, hosts each group's rendezvous store, watches the
children, and carries out what :func:`~ftdist.launch.policy.decide` rules
when one exits: wait, restart its replica group, fail, or finish.

Ports: each replica group's store is a ``TCPStore`` server in this process,
bound before the group's children start. With no port configured it binds
port 0 and the kernel picks a free one, which the children receive with
their job, so no port is ever "found free, released, and reused" (the race
of ml-starter's ``get_unused_port``). A restarted group gets a fresh store,
so the replacement never reads keys of the processes it replaces.

Children start from ftdist's fork server (torch already imported, so a
restart costs milliseconds, not an interpreter start), or from the
``spawn``/``fork`` context; each dies with this process, even when it is
SIGKILLed (:func:`ftdist._forkserver.exit_with_parent`).

Stopping: a failed launch stops the other children with SIGTERM, then
SIGKILL after ``stop_grace``; a replica group being restarted is SIGKILLed
at once (its members are stuck in collectives with the dead one anyway).
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ftdist.errors import ProcessFailedError
from ftdist.launch.children import child_main
from ftdist.launch.policy import Action, ChildExit, SupervisorState, decide

logger = logging.getLogger(__name__)

# A job for (rank, replica group, attempt, store port): what the child runs
# and the environment it runs in.
MakeJob = Callable[[int, int, int, int], tuple[Callable[[], None], Mapping[str, str]]]


@dataclass
class _Child:
    rank: int
    group: int
    proc: Any
    conn: Any
    error: str | None = None
    handled: bool = False


def host_store(master_addr: str, port: int, timeout: timedelta) -> Any:
    """A ``TCPStore`` server on ``port`` (0: a free port the kernel picks).

    Raises:
        OSError: ``port`` is in use (``errno.EADDRINUSE``); the message
            names the fix.
    """
    import errno

    import torch.distributed as dist

    try:
        return dist.TCPStore(
            master_addr, port, is_master=True, wait_for_workers=False, timeout=timeout
        )
    except (RuntimeError, OSError) as exc:
        if "in use" not in str(exc).lower():
            raise
        raise OSError(
            errno.EADDRINUSE,
            f"master_port {port} is already in use: pick another, or leave master_port unset "
            "and the launcher's store binds a free port itself",
        ) from exc


class Supervisor:
    """Starts, watches and restarts the children of one launch (see the module docstring).

    Args:
        context: the multiprocessing context children start from.
        groups: replica groups (1 without fault tolerance).
        group_size: processes per replica group.
        first_rank: the global rank of the first child (``rank_offset``).
        make_job: builds a child's job and environment.
        master_addr: the host the stores are reached at.
        master_port: the store port; 0 for a free one.
        host_stores: host a store per replica group here (else the children
            meet elsewhere, e.g. at a ``tcp://`` address of another machine).
        fault_tolerant: restart a failed replica group instead of failing.
        max_restarts: restarts allowed per replica group.
        store_timeout: the stores' timeout.
        stop_grace: how long stopped children get between SIGTERM and SIGKILL.
        on_restart: called with ``(group, attempt, reason)`` after each restart.
    """

    def __init__(
        self,
        *,
        context: Any,
        groups: int,
        group_size: int,
        first_rank: int,
        make_job: MakeJob,
        master_addr: str,
        master_port: int,
        host_stores: bool,
        fault_tolerant: bool,
        max_restarts: int,
        store_timeout: timedelta = timedelta(minutes=5),
        stop_grace: timedelta = timedelta(seconds=3),
        on_restart: Callable[[int, int, str], None] | None = None,
    ) -> None:
        self._ctx = context
        self._groups = groups
        self._group_size = group_size
        self._first_rank = first_rank
        self._make_job = make_job
        self._master_addr = master_addr
        self._master_port = master_port
        self._host_stores = host_stores
        self._fault_tolerant = fault_tolerant
        self._max_restarts = max_restarts
        self._store_timeout = store_timeout
        self._stop_grace_s = stop_grace.total_seconds()
        self._on_restart = on_restart
        self._children: list[_Child] = []
        self._stores: dict[int, Any] = {}
        self._attempts = [0] * groups
        self._done: set[int] = set()
        self.ports: dict[int, int] = {}

    # -- starting -------------------------------------------------------------------
    def _group_port(self, group: int) -> int:
        if not self._host_stores:
            return self._master_port
        self._stores.pop(group, None)  # the previous attempt's server closes
        store = host_store(self._master_addr, self._master_port, self._store_timeout)
        self._stores[group] = store
        port = int(store.port)
        self.ports[group] = port
        return port

    def _start_group(self, group: int) -> None:
        attempt = self._attempts[group]
        port = self._group_port(group)
        first = self._first_rank + group * self._group_size
        for rank in range(first, first + self._group_size):
            job, env = self._make_job(rank, group, attempt, port)
            parent_end, child_end = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(
                target=child_main,
                args=(job, dict(env), child_end, os.getpid()),
                name=f"ftdist-rank-{rank}",
                # Not daemonic: a rank may start processes of its own.
                daemon=False,
            )
            try:
                proc.start()
            finally:
                child_end.close()
            self._children.append(_Child(rank, group, proc, parent_end))

    # -- watching -------------------------------------------------------------------
    def run(self) -> None:
        """Start every replica group and supervise until every rank has returned.

        Raises:
            ProcessFailedError: a rank failed (without fault tolerance), or a
                replica group failed more than ``max_restarts`` times; the
                other children are stopped first.
            OSError: a configured store port is in use.
            KeyboardInterrupt: Ctrl-C in this process (children are stopped).
        """
        try:
            for group in range(self._groups):
                self._start_group(group)
            while True:
                event = self._next_exit()
                if event is None:
                    continue
                child, exit_ = event
                decision = decide(self._state(), exit_)
                if decision.action is Action.WAIT:
                    self._done.add(child.rank)
                elif decision.action is Action.DONE:
                    return
                elif decision.action is Action.RESTART_GROUP:
                    self._restart(child, decision.reason)
                else:
                    self._fail(child, exit_, decision.reason)
        finally:
            self.stop()

    def _state(self) -> SupervisorState:
        return SupervisorState(
            world_size=self._groups * self._group_size,
            fault_tolerant=self._fault_tolerant,
            max_restarts=self._max_restarts,
            restarts=tuple(self._attempts),
            done=frozenset(self._done),
        )

    def _next_exit(self) -> tuple[_Child, ChildExit] | None:
        live = [c for c in self._children if not c.handled]
        waitables: list[Any] = [c.proc.sentinel for c in live]
        waitables += [c.conn for c in live if not c.conn.closed]
        ready = set(mpc.wait(waitables, timeout=1.0))
        for child in live:
            if not child.conn.closed and child.conn in ready:
                _take_report(child)
        for child in live:
            if child.proc.sentinel in ready or child.proc.exitcode is not None:
                child.proc.join(timeout=5)
                if child.proc.exitcode is None:
                    continue
                _take_report(child)
                child.handled = True
                return child, ChildExit(
                    child.rank, child.group, child.proc.exitcode, child.error is not None
                )
        return None

    def _restart(self, failed: _Child, reason: str) -> None:
        group = failed.group
        logger.warning("%s", reason)
        if failed.error:
            logger.warning("rank %d's traceback:\n%s", failed.rank, failed.error)
        members = [c for c in self._children if c.group == group]
        _kill_now([c for c in members if not c.handled])
        self._children = [c for c in self._children if c.group != group]
        for child in members:
            child.conn.close()
            self._done.discard(child.rank)
        self._attempts[group] += 1
        self._start_group(group)
        if self._on_restart is not None:
            self._on_restart(group, self._attempts[group], reason)

    def _fail(self, failed: _Child, exit_: ChildExit, reason: str) -> None:
        self.stop()
        message = reason
        if failed.error:
            message += f"\n\n-- rank {failed.rank} failed with:\n{failed.error}"
        raise ProcessFailedError(message, failed.rank, exit_.exitcode, failed.error, failed.group)

    # -- stopping -------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every child still running (SIGTERM, then SIGKILL after the grace); idempotent."""
        live = [c for c in self._children if c.proc.exitcode is None]
        for child in live:
            _signal(child.proc, signal.SIGCONT)
            _signal(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + self._stop_grace_s
        for child in live:
            child.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        _kill_now([c for c in live if c.proc.exitcode is None])
        for child in self._children:
            child.conn.close()
        self._stores.clear()


def _signal(proc: Any, sig: int) -> None:
    if proc.pid is not None and proc.exitcode is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def _kill_now(children: list[_Child]) -> None:
    for child in children:
        _signal(child.proc, signal.SIGCONT)
        _signal(child.proc, signal.SIGKILL)
    for child in children:
        child.proc.join(timeout=10)


def _take_report(child: _Child) -> None:
    """Read the child's report if one is waiting; close the pipe once read or broken."""
    conn = child.conn
    if conn.closed:
        return
    try:
        if not conn.poll(0):
            return
        kind, payload = conn.recv()
    except (EOFError, OSError):
        conn.close()
        return
    if kind == "err":
        child.error = payload or "(no traceback)"
    conn.close()


__all__ = ["MakeJob", "Supervisor", "host_store"]
