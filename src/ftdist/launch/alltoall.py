"""
Differentiable all-to-all
=========================

:func:`all_to_all` splits its input into equal chunks along dimension 0,
sends chunk ``j`` to rank ``j`` of the group, and returns the chunks it
received, concatenated in rank order. An all-to-all with equal splits is
its own adjoint, so the backward pass is an all-to-all of the gradient
over the same group. Without an initialized torch.distributed (and no
group), it is the identity, as in ml-starter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ftdist.coordinator import GroupCoordinator


def _exchange(group: Any, input_: torch.Tensor) -> torch.Tensor:
    input_ = input_.contiguous()
    if not dist.is_initialized():
        return input_
    output = torch.empty_like(input_)
    dist.all_to_all_single(output, input_, group=group)
    return output


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Any, input_: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return _exchange(group, input_)

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.group, *grad_output)


def all_to_all(
    input: torch.Tensor, group: dist.ProcessGroup | GroupCoordinator | None
) -> torch.Tensor:
    """All-to-all of ``input`` over ``group`` along dimension 0; differentiable.

    Args:
        input: a tensor whose first dimension divides by the group's size.
        group: a process group, a :class:`~ftdist.coordinator.GroupCoordinator`
            (its device group is used), or None for the default group (the
            identity when torch.distributed is not initialized).

    Returns:
        The chunks every rank sent to this one, in rank order.

    Raises:
        TypeError: ``input`` is not a tensor.
        ValueError: ``input.shape[0]`` is not divisible by the group's size,
            or a group is given while torch.distributed is not initialized.
    """
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    pg: Any = group.device_group if isinstance(group, GroupCoordinator) else group
    if not dist.is_initialized():
        if pg is not None:
            raise ValueError(
                "a group was given but torch.distributed is not initialized; pass "
                "group=None for the single-process identity"
            )
        return input
    if pg is None:
        pg = dist.group.WORLD
    size = dist.get_world_size(pg)
    if input.dim() == 0 or input.shape[0] % size:
        raise ValueError(
            f"all_to_all splits dimension 0 into {size} equal chunks, but input has shape "
            f"{tuple(input.shape)}; make its first dimension a multiple of {size}"
        )
    result: torch.Tensor = _AllToAll.apply(pg, input)
    return result


__all__ = ["all_to_all"]
