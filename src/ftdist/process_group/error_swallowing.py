"""A wrapper that turns collective failures into a recorded error."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftdist.process_group.base import Post, ProcessGroup
from ftdist.process_group.work import CompletedWork
from ftdist.process_group.wrapper import ProcessGroupWrapper


class _ErrorSwallowingWork(dist._Work):
    """Reports a failure to the wrapper instead of raising it."""

    def __init__(
        self, owner: ErrorSwallowingProcessGroupWrapper, inner: dist.Work, default: Any
    ) -> None:
        super().__init__()
        self._owner = owner
        self._inner = inner
        self._default = default

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._inner.wait(timeout) if timeout else self._inner.wait()
        except Exception as exc:
            self._owner.report_error(exc)
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        owner, default = self._owner, self._default

        def swallow(fut: torch.futures.Future[Any]) -> Any:
            try:
                return fut.value()
            except Exception as exc:
                owner.report_error(exc)
                return default

        return self._inner.get_future().then(swallow)

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Swallows errors: after the first one, every op completes without running.

    This keeps error handling out of modelling code: a collective that fails
    records its error, and every later op returns already-completed work and
    leaves its tensors untouched, until :meth:`configure` clears the error.
    Check :meth:`error` (the Manager does) to decide whether the step counts.

    Args:
        pg: the ftdist group to wrap.

    Raises:
        TypeError: ``pg`` is not an ftdist :class:`ProcessGroup`.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        if not isinstance(pg, ProcessGroup):
            raise TypeError(
                f"ErrorSwallowingProcessGroupWrapper wraps an ftdist ProcessGroup, got "
                f"{type(pg).__name__}"
            )
        super().__init__(pg=pg)
        self._swallowed: Exception | None = None
        self._err_lock = threading.Lock()

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Reconfigure the wrapped group and clear the recorded error.

        Raises:
            ValueError: malformed address or invalid rank/world size.
            RuntimeError: the wrapped group failed to configure.
        """
        super().configure(store_addr, rank, world_size)
        with self._err_lock:
            self._swallowed = None

    def reconfigure(self, opts: Any) -> dist.Work:
        """Reconfigure the wrapped group (torchft's handle API) and clear the recorded error.

        Raises:
            ValueError: the handles do not include this group's.
            RuntimeError: the wrapped group failed to reconfigure.
        """
        work = super().reconfigure(opts)
        with self._err_lock:
            self._swallowed = None
        return work

    def error(self) -> Exception | None:
        """The first error since the last configure, or None."""
        return self._swallowed

    def errored(self) -> Exception | None:
        """Same as :meth:`error` (or the wrapped group's own error)."""
        return self._swallowed or super().errored()

    def report_error(self, e: Exception) -> None:
        """Record ``e``; every later op is skipped until the next configure."""
        with self._err_lock:
            if self._swallowed is None:
                self._swallowed = e

    def _collective(self, op: str, args: tuple[Any, ...], post: Post = None) -> dist.Work:
        default = args[0] if args else None
        if self._swallowed is not None:
            return CompletedWork(default)
        try:
            work = super()._collective(op, args, post)
        except Exception as exc:
            self.report_error(exc)
            return CompletedWork(default)
        return _ErrorSwallowingWork(self, work, default)

    def _collective_many(
        self, op: str, calls: list[tuple[Any, ...]], post: Post = None
    ) -> dist.Work:
        default = [c[0] for c in calls]
        if self._swallowed is not None:
            return CompletedWork(default)
        try:
            work = super()._collective_many(op, calls, post)
        except Exception as exc:
            self.report_error(exc)
            return CompletedWork(default)
        return _ErrorSwallowingWork(self, work, default)
