"""A wrapper that injects collective failures, for tests of fault handling."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftdist.process_group.base import ProcessGroup
from ftdist.process_group.wrapper import ProcessGroupWrapper


class _FailingFutureWork(dist._Work):
    """A work that completes, but whose future fails with an injected error."""

    def __init__(self, inner: dist.Work, error: Exception) -> None:
        super().__init__()
        self._inner = inner
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        return bool(self._inner.wait(timeout) if timeout else self._inner.wait())

    def get_future(self) -> torch.futures.Future[Any]:
        error = self._error

        def fail(_: torch.futures.Future[Any]) -> Any:
            raise error

        return self._inner.get_future().then(fail)

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """Wraps a group and fails the future of the next allreduce on demand.

    torchft's test helper (``torchft.process_group.FakeProcessGroupWrapper``):
    after :meth:`report_future_error`, the next allreduce runs as usual and
    its ``wait()`` succeeds, but its ``get_future()`` fails with the reported
    error, as a collective whose failure surfaces asynchronously would.
    Reconfiguring clears a pending injection.

    Args:
        pg: the ftdist group to wrap.

    Raises:
        TypeError: ``pg`` is not an ftdist :class:`ProcessGroup`.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        if not isinstance(pg, ProcessGroup):
            raise TypeError(f"FakeProcessGroupWrapper wraps an ftdist ProcessGroup, got {pg!r}")
        super().__init__(pg=pg)
        self._lock = threading.Lock()
        self._future_error: Exception | None = None

    def report_future_error(self, e: Exception) -> None:
        """Make the future of the next allreduce fail with ``e``.

        Args:
            e: the error to inject.
        """
        with self._lock:
            self._future_error = e

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Reconfigure the wrapped group; a pending injection is dropped.

        Raises:
            ValueError: malformed address or invalid rank/world size.
            RuntimeError: the wrapped group failed to configure.
        """
        with self._lock:
            self._future_error = None
        super().configure(store_addr, rank, world_size)

    def reconfigure(self, opts: Any) -> dist.Work:
        """Reconfigure the wrapped group (handle API); a pending injection is dropped.

        Raises:
            ValueError: the handles do not include this group's.
            RuntimeError: the wrapped group failed to reconfigure.
        """
        with self._lock:
            self._future_error = None
        return super().reconfigure(opts)

    # As in base.ProcessGroup: the stub's (tensor(s), op, timeout) overload; no timeout here.
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """All-reduce through the wrapped group; see :meth:`report_future_error`."""
        work = super().allreduce(tensors, opts)
        with self._lock:
            error, self._future_error = self._future_error, None
        return work if error is None else _FailingFutureWork(work, error)


__all__ = ["FakeProcessGroupWrapper"]
