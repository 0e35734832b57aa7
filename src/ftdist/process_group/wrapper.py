"""
In-process reconfigurable groups
================================

:class:`ProcessGroupWrapper` owns one backend at a time and rebuilds it on
every :meth:`~ProcessGroupWrapper.configure`. Each backend lifetime is a
:class:`~ftdist.process_group.work.Generation`: tearing a backend down fails
the work still in flight on it at once, instead of leaving a thread blocked
until the backend's own timeout.

A torn-down backend is not destroyed at once but kept until its in-flight
ops have timed out (see :class:`_Graveyard`). Until then such an op may still
write into the tensors it was given; callers must treat the tensors of a
failed step as garbage (the Manager never commits such a step).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as BaseProcessGroup

from ftdist._durations import as_timedelta
from ftdist.errors import CommunicationError, ProcessGroupAbortedError
from ftdist.process_group._store import StoreClients
from ftdist.process_group.base import BACKEND_NAME, Post, ProcessGroup
from ftdist.process_group.work import WAIT_MARGIN, CompletedWork, FtWork, Generation, WorkList

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(seconds=60)


# (deadline, backend, busy)
_Grave = tuple[float, Any, Callable[[], bool]]


class _Graveyard:
    """Torn-down backends, kept alive until no op of theirs is running.

    A Gloo backend must not be destroyed (nor ``abort()``-ed) while an op is
    in flight: its destructor and ``abort`` join the worker thread while
    holding the GIL, and that worker needs the GIL to run the op's completion
    callback, so the process deadlocks. A backend goes once the backend
    itself says every op of it completed (its flag is set after the
    callbacks returned), or once its timeout passed, by which time every op
    has timed out. Under churn (a reconfigure a second) keeping every old
    backend for the whole timeout would hold hundreds, with their threads and
    sockets. Sweeping happens on configures; no thread is kept for it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._graves: list[_Grave] = []
        self._reapers: list[threading.Thread] = []

    def bury(self, backend: Any, timeout: timedelta, busy: Callable[[], bool]) -> None:
        if backend is None:
            return
        deadline = time.monotonic() + (timeout + WAIT_MARGIN).total_seconds()
        with self._lock:
            self._graves.append((deadline, backend, busy))

    def sweep(self) -> None:
        # No local of this frame may name an expired backend: whichever thread
        # drops the last reference runs its destructor (~10 ms: Gloo joins its
        # threads), and that must be the reaper thread, never a configure.
        with self._lock:
            expired, kept = _split_expired(self._graves, time.monotonic())
            self._graves = kept
            self._reapers = [t for t in self._reapers if t.is_alive()]
        if expired:
            reaper = threading.Thread(target=expired.clear, name="ftdist-pg-sweep", daemon=True)
            with self._lock:
                self._reapers.append(reaper)
            reaper.start()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait for backends being destroyed right now (at exit, see below)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            reapers = list(self._reapers)
        for reaper in reapers:
            reaper.join(max(0.0, deadline - time.monotonic()))

    def __len__(self) -> int:
        return len(self._graves)


def _split_expired(graves: list[_Grave], now: float) -> tuple[list[_Grave], list[_Grave]]:
    """(expired, kept): a grave expires at its deadline or once its backend is idle."""
    expired: list[_Grave] = []
    kept: list[_Grave] = []
    for grave in graves:
        (expired if grave[0] <= now or not grave[2]() else kept).append(grave)
    return expired, kept


GRAVEYARD = _Graveyard()
# A process that exits while a reaper thread is inside a Gloo destructor
# aborts ("terminate called without an active exception": the interpreter
# tears the daemon thread down under C++ that is joining its threads). Exit
# waits for the reapers first; atexit runs before daemon threads are stopped.
atexit.register(GRAVEYARD.drain)


def split_pg_and_timeout(first: Any, second: Any, default: timedelta) -> tuple[Any, timedelta]:
    """Sort ``(pg, timeout)`` out of two arguments given in either order.

    torchft's early-2025 wrappers take ``(pg)`` first, today's take
    ``(timeout, pg)``: the first positional argument is read by its type.

    Raises:
        TypeError: both are groups, both are durations, or one is neither.
    """

    def is_group(x: Any) -> bool:
        return isinstance(x, (BaseProcessGroup, c10d.Backend))

    def is_duration(x: Any) -> bool:
        return isinstance(x, (timedelta, int, float)) and not isinstance(x, bool)

    if is_duration(first) and (second is None or is_group(second)):
        first, second = second, first
    pg, timeout = first, second
    if pg is not None and not is_group(pg):
        raise TypeError(
            f"pg must be a torch.distributed.ProcessGroup (or Backend), got {type(pg).__name__}"
        )
    if is_group(timeout):
        raise TypeError("got two process groups; pass one pg and, optionally, a timeout")
    return pg, as_timedelta(default if timeout is None else timeout, "timeout")


class ProcessGroupWrapper(ProcessGroup):
    """A reconfigurable group around a backend created anew on each configure.

    The first positional argument may be either parameter, told apart by
    its type: ``ProcessGroupWrapper(pg)`` (torchft's early-2025 order) and
    ``ProcessGroupWrapper(timedelta(seconds=30))`` (today's) both work.

    Args:
        pg: an existing group to wrap. An ftdist group is reconfigured through
            this wrapper; a plain torch group is used as is (it cannot be
            reconfigured).
        timeout: collective timeout of the backends this wrapper creates.

    Raises:
        TypeError: ``pg`` is not a ``torch.distributed.ProcessGroup``, or
            ``timeout`` is not a duration.
        ValueError: ``timeout`` is not positive.
    """

    def __init__(
        self,
        pg: BaseProcessGroup | c10d.Backend | timedelta | float | None = None,
        timeout: timedelta | float | BaseProcessGroup | c10d.Backend | None = None,
    ) -> None:
        super().__init__()
        wrapped, self._timeout = split_pg_and_timeout(pg, timeout, DEFAULT_TIMEOUT)
        self._pg: Any = wrapped
        self._gen: Generation | None = None
        self._error: Exception | None = None
        # A plain torch group is used as it is and cannot be rebuilt.
        self._static = wrapped is not None and not isinstance(wrapped, ProcessGroup)
        self._stores = StoreClients()
        if self._static:
            self._gen = Generation(self._describe(), self._timeout)
            self._rank, self._world_size = wrapped.rank(), wrapped.size()

    def __repr__(self) -> str:
        pg = self._pg
        if pg is None or isinstance(pg, ProcessGroup):
            inner = repr(pg)
        else:  # a torch backend: its name, not its (changing) address
            inner = str(pg.name()) if hasattr(pg, "name") else type(pg).__name__
        return f"{type(self).__name__}(pg={inner})"

    # -- torchft's reconfiguration API: a wrapped ftdist group answers -----------
    def set_rank_info(
        self,
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        global_rank: int | None = None,
    ) -> None:
        """See :meth:`ProcessGroup.set_rank_info`; also tells a wrapped ftdist group."""
        super().set_rank_info(replica_id, group_rank, group_world_size, global_rank)
        if isinstance(self._pg, ProcessGroup):
            self._pg.set_rank_info(replica_id, group_rank, group_world_size, global_rank)

    def _handle_id(self) -> str:
        pg = self._pg
        return pg._handle_id() if isinstance(pg, ProcessGroup) else super()._handle_id()

    def get_reconfigure_handle(self) -> str:
        """See :meth:`ProcessGroup.get_reconfigure_handle` (a wrapped ftdist group's)."""
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            return pg.get_reconfigure_handle()
        return super().get_reconfigure_handle()

    def reconfigure(self, opts: Any) -> dist.Work:
        """See :meth:`ProcessGroup.reconfigure`; a wrapped ftdist group reconfigures itself.

        Raises:
            ValueError: the handles do not include this group's.
            RuntimeError: the backend could not be created.
        """
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            with self._config_lock:
                work = pg.reconfigure(opts)
                self._set_topology(pg.rank(), pg.size())
                return work
        return super().reconfigure(opts)

    def rank(self) -> int:
        """This process's rank (the wrapped ftdist group's, if any)."""
        pg = self._pg
        return pg.rank() if isinstance(pg, ProcessGroup) else self._rank

    def size(self) -> int:
        """The world size (the wrapped ftdist group's, if any)."""
        pg = self._pg
        return pg.size() if isinstance(pg, ProcessGroup) else self._world_size

    @property
    def parent(self) -> BaseProcessGroup:
        """The current backend (or wrapped group).

        Raises:
            RuntimeError: the group was never configured, or was aborted.
        """
        pg = self._pg
        if pg is None:
            raise RuntimeError(
                f"{type(self).__name__}: process group not initialized; call "
                "configure(store_addr, rank, world_size) before running collectives"
            )
        parent: BaseProcessGroup = pg
        return parent

    def _describe(self) -> str:
        return f"{self.getBackendName()} group (rank {self._rank} of {self._world_size})"

    def _native_avg(self) -> bool:
        # A wrapped ftdist group emulates AVG itself.
        return isinstance(self._pg, ProcessGroup)

    def getBackendName(self) -> str:
        """The wrapped backend's name."""
        pg = self._pg
        if pg is None:
            return "ftdist-wrapper"
        if isinstance(pg, ProcessGroup):
            return pg.getBackendName()
        return str(pg.name()) if hasattr(pg, "name") else type(pg).__name__

    # -- reconfiguration ---------------------------------------------------------
    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Tear down the current backend and build a new one.

        See :meth:`ProcessGroup.configure`.

        Raises:
            ValueError: malformed ``store_addr`` or invalid rank/world size.
            TypeError: this wrapper wraps a plain torch group, which cannot be
                reconfigured.
            RuntimeError: the new backend could not be created.
        """
        with self._config_lock:
            if isinstance(self._pg, ProcessGroup):
                # The wrapped group checks what it needs (a dummy takes any address).
                self._pg.configure(store_addr, rank, world_size)
                self._set_topology(rank, world_size)
                return
            self._check_configure_args(store_addr, rank, world_size)
            if self._static:
                raise TypeError(
                    "this wrapper wraps a plain torch group, which cannot be "
                    "reconfigured; wrap an ftdist ProcessGroup instead"
                )
            self._teardown("reconfigured")
            self._set_topology(rank, world_size)
            try:
                store = self._stores.client(store_addr, self._timeout)
                backend = self._create_pg(store, rank, world_size)
            except Exception as exc:
                self._stores.forget(store_addr)
                raise RuntimeError(
                    f"{type(self).__name__}.configure({store_addr!r}, rank={rank}, "
                    f"world_size={world_size}) failed: {exc}"
                ) from exc
            self._gen = Generation(self._describe(), self._timeout)
            self._error = None
            self._pg = backend

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> BaseProcessGroup:
        raise NotImplementedError(f"{type(self).__name__} cannot create a backend")

    def _teardown(self, reason: str) -> None:
        gen, self._gen = self._gen, None
        if gen is not None:
            gen.abort(reason)
        # Buried straight from the attribute: a local naming the backend
        # would make this thread the last owner, and its destructor would run
        # here, on the configure path, instead of on the reaper thread.
        self._bury(self._pg, gen.busy if gen is not None else lambda: True)
        self._pg = None
        GRAVEYARD.sweep()

    def _bury(self, backend: Any, busy: Callable[[], bool]) -> None:
        GRAVEYARD.bury(backend, self._timeout, busy)

    def abort(self) -> None:
        """Fail all in-flight work now; configure to resume.

        Does not wait for a configure in progress (which may be stuck in a
        rendezvous with a dead peer): the work of the current backend fails
        at once, and the backend itself is dropped by the next configure.
        """
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            pg.abort()
            return
        gen = self._gen
        if gen is not None and not self._static:
            self._error = ProcessGroupAbortedError(f"{self._describe()} was aborted")
            gen.abort("aborted")

    def shutdown(self) -> None:
        """Drop the backend; in-flight work fails. The group may be configured again."""
        with self._config_lock:
            if isinstance(self._pg, ProcessGroup):
                self._pg.shutdown()
            else:
                self._teardown("shut down")
        super().shutdown()

    def errored(self) -> Exception | None:
        """The abort error, until the next configure."""
        if isinstance(self._pg, ProcessGroup):
            return self._pg.errored()
        return self._error

    def set_timeout(self, timeout: timedelta) -> None:
        """Use ``timeout`` for backends created by later configures."""
        self._timeout = as_timedelta(timeout, "timeout")

    # -- the hook ---------------------------------------------------------------------
    def _collective(self, op: str, args: tuple[Any, ...], post: Post = None) -> dist.Work:
        pg = self.parent
        if isinstance(pg, ProcessGroup):
            work: dist.Work = getattr(pg, op)(*args)
            return work
        gen = self._gen
        assert gen is not None
        if gen.error is not None:
            raise ProcessGroupAbortedError(
                f"{self._describe()} was aborted: call configure() to resume"
            )
        name = BACKEND_NAME.get(op, op)
        fn = getattr(pg, name, None)
        if fn is None:
            raise RuntimeError(f"{self.getBackendName()} does not support {op}")
        work = self._post(op, fn, args)
        if work is None:  # monitored_barrier blocks and returns nothing
            return CompletedWork(None)
        return self._wrap(work, gen, op, post)

    def _post(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Hand one op to the backend.

        Raises:
            CommunicationError: the backend refused it for a broken connection.
        """
        try:
            return fn(*args)
        except RuntimeError as exc:
            # Gloo's send and recv raise at once, instead of failing their work,
            # for a peer whose connection its loop already saw closed (a peer
            # that died while this rank did something else). That is the
            # fault the work would report; an argument Gloo refuses is not.
            if "gloo/transport/" not in str(exc):
                raise
            raise CommunicationError(f"{self._describe()}: {op} failed: {exc}") from exc

    def _collective_many(
        self, op: str, calls: list[tuple[Any, ...]], post: Post = None
    ) -> dist.Work:
        pg = self.parent
        if isinstance(pg, ProcessGroup):
            return pg._collective_many(op, calls, post)
        gen = self._gen
        assert gen is not None
        fn = getattr(pg, BACKEND_NAME.get(op, op))
        return self._wrap(WorkList([self._post(op, fn, args) for args in calls]), gen, op, post)

    def _wrap(self, work: Any, gen: Generation, op: str, post: Post) -> dist.Work:
        return FtWork(work, gen, op, post)


__all__ = ["GRAVEYARD", "ProcessGroupWrapper"]
