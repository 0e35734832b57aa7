"""The work a Manager allreduce returns."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ftdist.manager import Manager


class ManagedWork(dist._Work):
    """A Manager allreduce: never raises; averages on completion.

    Errors go to the Manager (the step will not commit) instead of to the
    caller: :meth:`wait` returns False and the future resolves to the
    tensor as it is.
    """

    def __init__(
        self,
        manager: Manager,
        work: dist.Work,
        tensor: torch.Tensor,
        divisor: int | None,
        timeout: timedelta,
    ) -> None:
        super().__init__()
        self._timeout = timeout
        self._manager = manager
        self._work = work
        self._tensor = tensor
        self._divisor = divisor
        self._lock = threading.Lock()
        self._future: torch.futures.Future[Any] | None = None

    def _finish(self) -> None:
        with self._lock:
            divisor, self._divisor = self._divisor, None
        if divisor:
            self._tensor /= divisor

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the allreduce; on failure record it and return False."""
        try:
            self._work.wait(timeout or self._timeout)
        except Exception as exc:
            self._manager.report_error(exc)
            return False
        self._finish()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """Resolves to the (averaged) tensor; on failure, to the tensor as is."""
        if self._future is None:

            def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
                try:
                    fut.value()
                except Exception as exc:
                    self._manager.report_error(exc)
                    return self._tensor
                self._finish()
                return self._tensor

            self._future = self._work.get_future().then(done)
        return self._future

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())
