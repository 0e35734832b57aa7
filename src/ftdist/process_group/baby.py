"""
Baby process groups: the backend in a child process
===================================================

A backend that hangs (a peer stopped mid-collective, a wedged NCCL kernel)
cannot be cancelled from inside its own process. A Baby group runs the real
backend in a child process and talks to it over a pipe; tensors are shared,
not copied (see :mod:`._shm`). When an op outlives its timeout, or the child
dies, the child is killed and the op fails; the trainer lives on and the next
:meth:`~ProcessGroupBaby.configure` starts a new child.

Reconfiguring must not pay a Python + torch start in the critical path, so a
warm spare child (already forked, torch already imported) waits ahead of
need; ``configure`` hands it the new store and starts the next spare in the
background.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from typing import Any

import torch
import torch.distributed as dist

from ftdist._durations import as_timedelta
from ftdist.errors import (
    BackendProcessError,
    CollectiveTimeoutError,
    CommunicationError,
    ProcessGroupAbortedError,
)
from ftdist.process_group._baby_proc import SparePool, child_stacks
from ftdist.process_group._pipe import MonitoredPipe
from ftdist.process_group._shm import Exporter
from ftdist.process_group.base import BACKEND_NAME, Post, ProcessGroup
from ftdist.process_group.work import WAIT_MARGIN, FtWork, Generation, WorkList, _SettableOnce

logger = logging.getLogger(__name__)


class GroupClosedError(ProcessGroupAbortedError, OSError):
    """An op on a Baby group after :meth:`ProcessGroupBaby.shutdown`.

    An ``OSError`` too: torchft's Baby groups raise ``OSError("handle is
    closed")`` from their closed pipe here.
    """


class _BabyWork(dist._Work):
    """An op running in the child; completed by the parent's reader thread."""

    def __init__(self, child: _Child, op: str, outputs: Any, post: Post) -> None:
        super().__init__()
        self._child = child
        self._op = op
        self._outputs = outputs
        self._post = post
        self._event = threading.Event()
        self._error: Exception | None = None
        self._extra: Any = None
        self._future: _SettableOnce | None = None
        self._lock = threading.Lock()

    def _complete(self, error: Exception | None, extra: Any = None) -> None:
        if error is None and self._post is not None:
            try:
                self._post()
            except Exception as exc:
                error = CommunicationError(f"{self._op} post-processing failed: {exc}")
        with self._lock:
            if self._event.is_set():
                return
            self._error, self._extra = error, extra
            self._event.set()
            future = self._future
        if future is not None:
            self._resolve(future)

    def _resolve(self, future: _SettableOnce) -> None:
        if self._error is not None:
            future.exception(self._error)
        else:
            future.result(self._outputs)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the child reports the op done.

        With no ``timeout``, a child that does not answer within the group's
        timeout is killed; an explicit ``timeout`` only bounds this wait.

        Raises:
            CollectiveTimeoutError: no answer in time (the child was killed).
            CommunicationError: the op failed in the child, or the child died.
            ProcessGroupAbortedError: the group was reconfigured meanwhile.
        """
        limit = timeout.total_seconds() if timeout else None
        if limit:
            # A caller's own bound: the op may still finish; leave the child be.
            if not self._event.wait(limit):
                raise CollectiveTimeoutError(
                    f"{self._child.describe()}: {self._op} not done within {limit:.3f}s"
                )
        else:
            limit = (self._child.timeout + WAIT_MARGIN).total_seconds()
            if not self._event.wait(limit):
                err = CollectiveTimeoutError(
                    f"{self._child.describe()}: {self._op} got no answer within {limit:.1f}s; "
                    "the child process was killed"
                )
                self._child.kill(err)
                raise err
        if self._error is not None:
            raise self._error
        if isinstance(self._extra, torch.cuda.Event):
            self._extra.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """Resolves to the op's output tensors, or fails like :meth:`wait`."""
        with self._lock:
            if self._future is None:
                self._future = _SettableOnce()
                if self._event.is_set():
                    self._resolve(self._future)
            return self._future.fut

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> Any:
        return self._error

    def source_rank(self) -> int:
        if not isinstance(self._extra, int):
            raise RuntimeError("source_rank() is only known after a recv_anysource completes")
        return self._extra

    def result(self) -> Any:
        return self._outputs


# How long a child may take to start (fork from the fork server, which may
# itself still be importing torch) before its configure deadline starts.
CHILD_START_TIMEOUT = timedelta(seconds=60)


class _Child:
    """The parent's handle on one configured child process."""

    def __init__(
        self, proc: Any, conn: Connection, stacks: Connection, timeout: timedelta, label: str
    ) -> None:
        self.proc = proc
        self.conn = conn
        self._stacks = stacks
        self.timeout = timeout
        self.label = label
        self.pipe = MonitoredPipe(conn)
        self.exporter = Exporter()
        self.pending: dict[int, _BabyWork] = {}
        self.dead: Exception | None = None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # A forkserver child's exit code is one int on a pipe: two threads
        # polling at once both see it readable, one reads it and the other
        # reads EOF, which multiprocessing reports as exit code 255.
        self._proc_lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def describe(self) -> str:
        return f"{self.label} (child pid {self.proc.pid})"

    def stacks(self) -> str:
        """Every thread's Python stack in the child now, or why there is none."""
        if self.exitcode() is not None:
            return "(no stacks: the child has exited)"
        return child_stacks(self.proc.pid, self._stacks)

    def exitcode(self) -> int | None:
        """The child's exit code (negative: killed by that signal), or None while it runs."""
        with self._proc_lock:
            code: int | None = self.proc.exitcode
        return code

    def join(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the child to exit.

        Returns:
            The exit code, or None if the child still runs.
        """
        wait_for([self.proc.sentinel], timeout)
        return self.exitcode()

    def configure(
        self, kind: str, store_addr: str, rank: int, world_size: int, device: int | None
    ) -> None:
        # The configure deadline counts from a running child: a child still
        # being forked (a cold fork server on a busy machine takes seconds)
        # must not eat into a short timeout.
        if not self.conn.poll(CHILD_START_TIMEOUT.total_seconds()):
            raise BackendProcessError(
                f"{self.describe()} did not start within {CHILD_START_TIMEOUT.total_seconds():g} s"
            )
        try:
            self.conn.recv()  # ("up",)
        except (EOFError, OSError) as exc:
            raise BackendProcessError(f"{self.describe()} exited before configure") from exc
        self.conn.send(("configure", kind, store_addr, rank, world_size, self.timeout, device))
        # The child bounds its own connect by timeout + WAIT_MARGIN (Gloo
        # ignores its timeout across a partition); wait one margin longer so
        # that its precise error, not this backstop, reports a slow peer.
        limit = (self.timeout + 2 * WAIT_MARGIN).total_seconds()
        if not self.conn.poll(limit):
            # Name the configured timeout, as the child's own error does: a
            # caller matching "timed out after <timeout> seconds" (torchft's
            # tests do) must not depend on which side noticed first.
            raise CollectiveTimeoutError(
                f"{self.describe()}: configure timed out after "
                f"{self.timeout.total_seconds()} seconds (the child gave no answer "
                f"within {limit:g} s); where it was:\n{self.stacks()}"
            )
        msg = self.conn.recv()
        if msg[0] != "ready":
            if len(msg) > 2 and msg[2]:
                raise CollectiveTimeoutError(
                    f"{self.describe()}: configure timed out after "
                    f"{self.timeout.total_seconds()} seconds: {msg[1]}"
                )
            raise RuntimeError(f"{self.describe()}: configure failed in the child: {msg[1]}")
        self._reader = threading.Thread(
            target=self._read_loop, name="ftdist-baby-reader", daemon=True
        )
        self._reader.start()

    def submit(self, name: str, args: tuple[Any, ...], op: str, post: Post) -> _BabyWork:
        outputs = args[0] if args else None
        new: list[tuple[int, Any]] = []
        event = None
        with self._lock:
            if self.dead is not None:
                raise self.dead
            encoded = self.exporter.encode(args, new)
            tensors = [a for a in _flatten(args) if isinstance(a, torch.Tensor)]
            if any(t.is_cuda for t in tensors):
                event = torch.cuda.Event(interprocess=True)
                event.record()
            elif any(t.device.type == "xpu" for t in tensors):
                # No inter-process XPU events: the inputs must be ready now.
                torch.xpu.current_stream().synchronize()
            op_id = next(self._ids)
            work = _BabyWork(self, op, outputs, post)
            self.pending[op_id] = work
            try:
                self.conn.send(("op", op_id, name, encoded, new, self.exporter.retired(), event))
            except (OSError, ValueError) as exc:
                self.pending.pop(op_id, None)
                raise BackendProcessError(f"{self.describe()}: the child is gone: {exc}") from exc
        return work

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError, ValueError, TypeError):
                # TypeError: the pipe was closed under this read, which kill()
                # does only if this thread has not ended seconds after EOF.
                break
            _, op_id, err, extra = msg
            with self._lock:
                work = self.pending.pop(op_id, None)
            if work is not None:
                error = (
                    CommunicationError(f"{self.describe()}: {work._op} failed: {err}")
                    if err is not None
                    else None
                )
                work._complete(error, extra)
        code = self.join(timeout=1)
        self.kill(BackendProcessError(f"{self.describe()} exited unexpectedly (exit code {code})"))

    def fail_pending(self, reason: Exception) -> None:
        """Mark the child dead and fail every op still pending with ``reason``."""
        with self._lock:
            if self.dead is None:
                self.dead = reason
            pending, self.pending = self.pending, {}
        for work in pending.values():
            work._complete(self.dead)

    def kill(self, reason: Exception) -> None:
        """Kill the child and fail every op still pending with ``reason``."""
        self.fail_pending(reason)
        with self._proc_lock:
            if self.proc.exitcode is None:
                self.proc.kill()
        # Wake the reader with EOF now, even where another process still
        # holds the child's end. Closing the pipe instead would pull the
        # handle from under a reader blocked in recv(), which then fails with
        # a TypeError rather than ending.
        try:
            with socket.socket(fileno=os.dup(self.conn.fileno())) as wake:
                wake.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        self.join(timeout=5)
        for end in (self.conn, self._stacks):
            try:
                end.close()
            except OSError:
                pass


def _flatten(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [x for o in obj for x in _flatten(o)]
    return [obj]


class ProcessGroupBaby(ProcessGroup):
    """A reconfigurable group whose backend runs in a child process.

    CPU tensors are moved to shared memory the first time they are used (in
    place: ``share_memory_()``) and are never copied per op. Each distinct
    tensor storage costs one file descriptor in this process and one in the
    child for as long as it lives: keep collective buffers few and reused
    (DDP's buckets are), or raise ``ulimit -n``. CUDA tensors are
    shared through CUDA IPC and synchronised with inter-process events: as
    with NCCL, ``wait()`` orders the current stream, call
    ``torch.cuda.synchronize()`` for a CPU sync.

    Args:
        timeout: collective timeout (seconds or timedelta). An op whose child
            does not answer within it (plus a small margin) kills the child.

    Raises:
        TypeError/ValueError: ``timeout`` is not a positive duration.
    """

    BACKEND = "gloo"

    def __init__(self, timeout: timedelta | float = 60.0) -> None:
        super().__init__()
        self._timeout = as_timedelta(timeout, "timeout")
        self._child: _Child | None = None
        self._closed = False
        self._spares = SparePool()
        self._error: Exception | None = None
        try:
            self._check_backend()
        except RuntimeError:
            return  # configure will say why; no spare child for a backend that cannot run
        self._spares.refill()

    def _device(self) -> int | None:
        return None

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Hand the warm spare child the new store; kill the old child.

        See :meth:`ProcessGroup.configure`.

        Raises:
            ValueError: malformed ``store_addr`` or invalid rank/world size.
            CollectiveTimeoutError: peers did not arrive within the timeout
                (a ``TimeoutError`` and a ``RuntimeError``: "configure timed
                out after {timeout} seconds").
            RuntimeError: the child could not create the backend, or this
                group's backend cannot run on this machine.
        """
        self._check_configure_args(store_addr, rank, world_size)
        self._check_backend()
        with self._config_lock:
            self._teardown(
                ProcessGroupAbortedError(
                    f"{self.getBackendName()} group was reconfigured; work in flight was abandoned"
                ),
                background=True,
            )
            self._closed = False
            self._configure_child(store_addr, rank, world_size)

    def _check_backend(self) -> None:
        """Raise before starting anything if this group's backend cannot run here."""

    def _configure_child(self, store_addr: str, rank: int, world_size: int) -> None:
        self._set_topology(rank, world_size)
        proc, conn, stacks = self._spares.take()
        child = _Child(
            proc, conn, stacks, self._timeout, f"{self.getBackendName()} rank {rank}/{world_size}"
        )
        try:
            child.configure(self.BACKEND, store_addr, rank, world_size, self._device())
        except CollectiveTimeoutError as exc:
            child.kill(BackendProcessError(str(exc)))
            raise
        except Exception as exc:
            child.kill(BackendProcessError(str(exc)))
            raise RuntimeError(
                f"{type(self).__name__}.configure({store_addr!r}, rank={rank}, "
                f"world_size={world_size}) failed: {exc}"
            ) from exc
        finally:
            threading.Thread(
                target=self._spares.refill, name="ftdist-baby-spare", daemon=True
            ).start()
        self._child = child
        self._error = None

    def _teardown(self, reason: Exception, background: bool = False) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        if background:
            # The old child's ops fail at once; waiting for its process to
            # exit (~20 ms) need not delay the new configure.
            child.fail_pending(reason)
            threading.Thread(
                target=child.kill, args=(reason,), name="ftdist-baby-reap", daemon=True
            ).start()
        else:
            child.kill(reason)

    def abort(self) -> None:
        """Kill the child; in-flight ops fail at once. Configure to resume.

        Does not wait for a configure in progress.
        """
        child = self._child
        if child is not None:
            self._error = ProcessGroupAbortedError(f"{self.getBackendName()} group was aborted")
            child.fail_pending(self._error)
            threading.Thread(
                target=child.kill, args=(self._error,), name="ftdist-baby-reap", daemon=True
            ).start()

    def shutdown(self) -> None:
        """Kill the child and the warm spare; later ops raise until the next configure."""
        with self._config_lock:
            self._teardown(ProcessGroupAbortedError(f"{self.getBackendName()} group was shut down"))
            self._spares.close()
            self._closed = True
        super().shutdown()

    def num_active_work(self) -> int:
        """How many ops the child has not answered yet.

        Returns:
            The number of pending ops of the current child (0 if none).
        """
        child = self._child
        return len(child.pending) if child is not None else 0

    # torchft's names for the current child's process, reader thread and pipe
    @property
    def _p(self) -> Any:
        child = self._child
        return child.proc if child is not None else None

    @property
    def _future_thread(self) -> threading.Thread | None:
        child = self._child
        return child._reader if child is not None else None

    @property
    def _future_pipe(self) -> MonitoredPipe | None:
        child = self._child
        return child.pipe if child is not None else None

    def errored(self) -> Exception | None:
        """The error that killed the current child, if any, until the next configure."""
        child = self._child
        if child is not None and child.dead is not None:
            return child.dead
        return self._error

    def set_timeout(self, timeout: timedelta) -> None:
        """Use ``timeout`` from the next configure on."""
        self._timeout = as_timedelta(timeout, "timeout")

    def getBackendName(self) -> str:
        """``"ftdist-baby-<backend>"``."""
        return f"ftdist-baby-{self.BACKEND}"

    def _live_child(self) -> _Child:
        child = self._child
        if child is None:
            if self._closed:
                raise GroupClosedError(
                    f"{type(self).__name__} was shut down (handle is closed); configure it "
                    "again to run collectives"
                )
            raise RuntimeError(
                f"{type(self).__name__}: process group not initialized; call "
                "configure(store_addr, rank, world_size) before running collectives"
            )
        return child

    def _collective(self, op: str, args: tuple[Any, ...], post: Post = None) -> dist.Work:
        return self._live_child().submit(BACKEND_NAME.get(op, op), args, op, post)

    def _collective_many(
        self, op: str, calls: list[tuple[Any, ...]], post: Post = None
    ) -> dist.Work:
        child = self._live_child()
        works = [child.submit(BACKEND_NAME.get(op, op), args, op, None) for args in calls]
        gen = Generation(child.describe(), self._timeout)
        return FtWork(WorkList(works), gen, op, post)


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """Gloo in a child process. Prefer :class:`ProcessGroupGloo` unless Gloo hangs bite."""

    BACKEND = "gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """NCCL in a child process.

    The child holds its own CUDA context (about 1 GB of device memory) and
    time-shares the GPU with the trainer. A child killed mid-op may leave the
    CUDA IPC mappings of the tensors it held until the trainer frees them.
    """

    BACKEND = "nccl"

    def _device(self) -> int | None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None

    def _native_avg(self) -> bool:
        return True


class ProcessGroupBabyXCCL(ProcessGroupBaby):
    """XCCL (Intel XPU) in a child process.

    Constructs anywhere; ``configure`` raises at once, before starting
    anything, where torch has no XPU support. XPU tensors cross to the child
    through torch's IPC; with no inter-process XPU events, each op is finished
    before the child answers (slower than NCCL's stream-ordered waits).
    """

    BACKEND = "xccl"

    def _check_backend(self) -> None:
        from ftdist.process_group.xccl import check_xccl

        check_xccl(type(self).__name__)

    def _device(self) -> int | None:
        return torch.xpu.current_device() if torch.xpu.is_available() else None
