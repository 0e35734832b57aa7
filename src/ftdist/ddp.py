"""
Distributed Data Parallel
=========================

DistributedDataParallel driven by a fault-tolerance :class:`~ftdist.manager.Manager`:
gradients are averaged with ``manager.allreduce`` across the replica groups
in the current quorum. A failed allreduce never raises into ``backward``: the
Manager records the error and the step does not commit.

Parameters must be in sync at step 0 through an external mechanism (the
Manager heals every replica from the same source with ``init_sync``), not
through DDP's own initial broadcast.
"""

# No "from __future__ import annotations": DDP checks the comm hook's
# annotations at runtime and needs real types, not strings.

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import parallel

from ftdist.process_group import ProcessGroupDummy

if TYPE_CHECKING:
    from ftdist.manager import Manager


# A torch without the argument always runs the initial broadcast.
_HAS_INIT_SYNC = "init_sync" in inspect.signature(parallel.DistributedDataParallel).parameters


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torch DDP whose gradient averaging goes through the Manager.

    DDP's own initial broadcast is skipped (``init_sync=False`` unless
    given): over the dummy group of one it moves nothing, yet torch still
    flattens every parameter into fresh memory and copies it back, 35 ms
    for a 50 MB model, on a replacement's path to its heal. The real
    communication happens in the comm hook. Buckets are never rebuilt
    (``find_unused_parameters=True``): a rebuild after the first step could
    give a recovering replica different buckets than its peers.

    Features of DDP beyond plain data parallelism are untested with ftdist.

    Args:
        manager: the replica group's Manager.
        module: the model.
        **kwargs: passed to ``torch.nn.parallel.DistributedDataParallel``.
    """

    def __init__(self, manager: "Manager", module: nn.Module, **kwargs: Any) -> None:
        if _HAS_INIT_SYNC:
            kwargs.setdefault("init_sync", False)
        super().__init__(
            module,
            process_group=ProcessGroupDummy(0, 1),
            find_unused_parameters=True,
            **kwargs,
        )
        self.register_comm_hook(manager, self._comm_hook)
        _check_parameters(manager, module)

    @staticmethod
    def _comm_hook(state: "Manager", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # The Manager's result is a future that never fails: an error is
        # recorded for the commit vote and it resolves to the buffer as is.
        return _as_future(state.allreduce(bucket.buffer()), bucket.buffer())


class PureDistributedDataParallel(nn.Module):
    """A pure-Python DDP: one Manager allreduce per gradient, no reducer.

    Simple and slow; prefer :class:`DistributedDataParallel`.

    Args:
        manager: the replica group's Manager.
        module: the model.
    """

    def __init__(self, manager: "Manager", module: nn.Module) -> None:
        super().__init__()
        self.module = module

        def post_grad_hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                manager.allreduce(p.grad)

        for p in module.parameters():
            p.register_post_accumulate_grad_hook(post_grad_hook)
        _check_parameters(manager, module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)


def _check_parameters(manager: "Manager", module: nn.Module) -> None:
    # Parameters must be identical on every replica at the same step; buffers
    # (BatchNorm statistics) legitimately differ and are not compared.
    register = getattr(manager, "register_consistency_fn", None)
    if callable(register):
        register("model", lambda: {n: p.detach() for n, p in module.named_parameters()})


def _as_future(result: Any, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """The future DDP waits on, from what ``allreduce`` returned.

    ftdist's Manager (and torchft's seed era) return a future of the tensor;
    today's torchft returns a Work: wait for it, and hand DDP its future (the
    built chain of torchft's lazy ``_ManagedFuture``). Never raises into
    backward: a failed Work leaves the buffer as it is.
    """
    if isinstance(result, torch.futures.Future) and not isinstance(result, dist._Work):
        return result
    try:
        ok = result.wait()
    except Exception:
        ok = False
    if ok is False:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    fut = result.get_future()
    inner = getattr(fut, "_fut", None)
    return inner if isinstance(inner, torch.futures.Future) else fut
