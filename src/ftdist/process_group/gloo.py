"""
Gloo
====

:class:`ProcessGroupGloo`: a Gloo backend in this process, rebuilt on every
:meth:`~ftdist.process_group.ProcessGroup.configure`. Gloo runs on CPU
tensors (and CUDA tensors, staged through the host); ftdist emulates the
``AVG`` reduction Gloo lacks.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as BaseProcessGroup

from ftdist.errors import CollectiveTimeoutError
from ftdist.process_group.work import WAIT_MARGIN
from ftdist.process_group.wrapper import DEFAULT_TIMEOUT, ProcessGroupWrapper


def create_gloo_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A Gloo backend built as ``torch.distributed`` builds its own, within ``timeout``.

    Gloo's own connect is not bounded by ``timeout`` when a peer's packets
    vanish (a network partition): its connect waits on the kernel's SYN
    retries and its rendezvous gives up only after about five times the
    timeout. The backend is therefore built on a helper thread (Gloo releases
    the GIL while it connects) and abandoned if it is not ready within the
    timeout plus :data:`~ftdist.process_group.work.WAIT_MARGIN`; a backend
    that completes later is dropped by that thread.

    Raises:
        RuntimeError: peers did not all arrive within ``timeout`` (a
            ``CollectiveTimeoutError`` when the connect itself overran).
    """
    from torch._C._distributed_c10d import ProcessGroupGloo as GlooBackend

    outcome: dict[str, Any] = {}
    done = threading.Event()

    def build() -> None:
        try:
            backend = GlooBackend(store, rank, world_size, timeout)
            backend._set_sequence_number_for_group()
            outcome["backend"] = backend
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=build, name="ftdist-gloo-connect", daemon=True)
    thread.start()
    if not done.wait((timeout + WAIT_MARGIN).total_seconds()):
        raise CollectiveTimeoutError(
            f"Gloo did not connect rank {rank} of {world_size} within {timeout} "
            "(a peer unreachable: its packets vanish)"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["backend"]


class ProcessGroupGloo(ProcessGroupWrapper):
    """A reconfigurable Gloo group.

    Args:
        timeout: the collective timeout; a dead or stopped peer makes waits
            raise within it (plus a small margin).

    Raises:
        TypeError: ``timeout`` is not a timedelta or a number of seconds.
        ValueError: ``timeout`` is not positive.
    """

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout=timeout)

    def getBackendName(self) -> str:
        """``"ftdist-gloo"``."""
        return "ftdist-gloo"

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> BaseProcessGroup:
        backend: BaseProcessGroup = create_gloo_backend(store, rank, world_size, self._timeout)
        return backend


__all__ = ["ProcessGroupGloo", "create_gloo_backend"]
