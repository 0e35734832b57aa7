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

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import parallel

from ftdist.process_group import ProcessGroupDummy

if TYPE_CHECKING:
    from ftdist.manager import Manager


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torch DDP whose gradient averaging goes through the Manager.

    A dummy group of one soaks up DDP's own initial broadcast; the real
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
        super().__init__(
            module,
            process_group=ProcessGroupDummy(0, 1),
            find_unused_parameters=True,
            **kwargs,
        )
        self.register_comm_hook(manager, self._comm_hook)

    @staticmethod
    def _comm_hook(state: "Manager", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # The Manager's future never fails: an error is recorded for the
        # commit vote and the future resolves to the (unaveraged) buffer.
        return state.allreduce(bucket.buffer()).get_future()


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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)
