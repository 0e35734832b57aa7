"""
Tensor collectives of a coordinator's device group
==================================================

:class:`DeviceCommunicator` holds the tensor collectives a
:class:`~ftdist.coordinator.GroupCoordinator` runs on its device group, in
plain ``torch.distributed`` calls, so they work over any backend: Gloo, NCCL
or an ftdist reconfigurable group. It plays the part of vLLM's
``DeviceCommunicatorBase``.

Invariants:

- Every peer is named by its rank *in the group* (``group_src=``/
  ``group_dst=``), so the same code serves torch groups and ftdist groups
  (which are their own rank space).
- ``all_reduce`` sums in place into a contiguous ``input_`` and returns it
  (callers use the return value, as in vLLM); every other result is a new
  tensor and leaves its input alone.
- ``all_gather`` and ``gather`` equal ``torch.cat`` of the ranks' inputs in
  rank order; ``reduce_scatter`` keeps chunk ``rank_in_group`` of the sum,
  for every ``dim`` of every rank (vLLM permutes the wrong axes for
  ``dim >= 2``; here ``dim`` is moved to the front and back exactly).
- Arguments are checked before any communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

# torch >= 2.10 renamed the flat collectives; the old names warn.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_tensor(input_: Any, what: str = "input_") -> torch.Tensor:
    """Raises TypeError unless ``input_`` is a tensor; returns it.

    Raises:
        TypeError: ``input_`` is not a ``torch.Tensor``.
    """
    if not isinstance(input_, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(input_).__name__}")
    return input_


def normalize_dim(input_: torch.Tensor, dim: Any) -> int:
    """``dim`` as a non-negative axis of ``input_``.

    Raises:
        TypeError: ``dim`` is not an int.
        ValueError: ``dim`` is outside ``[-ndim, ndim)``.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    ndim = input_.dim()
    if not -ndim <= dim < ndim:
        raise ValueError(f"Invalid dim ({dim}) for input tensor with shape {tuple(input_.size())}")
    return dim + ndim if dim < 0 else dim


def check_group_rank(rank: Any, world_size: int, what: str) -> int:
    """Check a peer's rank within a group of ``world_size``.

    Raises:
        TypeError: ``rank`` is not an int.
        ValueError: ``rank`` is outside ``[0, world_size)``; the message
            says that ``src``/``dst`` are ranks in the group.
    """
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{what} rank must be an int, got {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"Invalid {what} rank ({rank}): it is a rank within the group, "
            f"which has {world_size} ranks (0..{world_size - 1})"
        )
    return rank


def check_sizes(sizes: Any, world_size: int) -> list[int]:
    """Check per-rank sizes for the ``*v`` collectives.

    Raises:
        TypeError: ``sizes`` is not a sequence of ints.
        ValueError: it does not have one non-negative entry per rank.
    """
    if not isinstance(sizes, Sequence) or isinstance(sizes, (str, bytes)):
        raise TypeError(f"sizes must be a list of ints, one per rank, got {sizes!r}")
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"sizes must hold ints, got {s!r} in {list(sizes)}")
        if s < 0:
            raise ValueError(f"sizes must be non-negative, got {list(sizes)}")
        out.append(int(s))
    if len(out) != world_size:
        raise ValueError(f"sizes has {len(out)} entries, the group has {world_size} ranks: {out}")
    return out


class DeviceCommunicator:
    """Tensor collectives over a device group (see the module docstring).

    Args:
        cpu_group: the coordinator's Gloo group.
        device: where received tensors are allocated.
        device_group: the group the collectives run on.
        unique_name: the coordinator's name.
        rank_in_group: this process's rank in both groups.
        world_size: the groups' size.
    """

    def __init__(
        self,
        cpu_group: Any,
        device: torch.device,
        device_group: Any,
        unique_name: str,
        rank_in_group: int,
        world_size: int,
    ) -> None:
        self.cpu_group = cpu_group
        self.device = device
        self.device_group = device_group
        self.unique_name = unique_name
        self.rank_in_group = rank_in_group
        self.world_size = world_size

    # -- reductions -------------------------------------------------------------
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum of ``input_`` over the group, computed in ``input_`` if it is contiguous.

        A fresh output per call would cost a page fault per page of it, which
        on some hosts costs more than the reduction itself.
        """
        out = input_ if input_.is_contiguous() else input_.contiguous()
        dist.all_reduce(out, group=self.device_group)
        return out

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over the group, then keep this rank's equal chunk along ``dim``.

        Raises:
            ValueError: ``dim`` is invalid or its size does not divide by the
                world size.
        """
        d = normalize_dim(input_, dim)
        if input_.shape[d] % self.world_size:
            raise ValueError(
                f"reduce_scatter: dim {dim} has size {input_.shape[d]}, which does "
                f"not divide by the world size {self.world_size}; use "
                "reduce_scatterv(sizes=...) for uneven chunks"
            )
        x = input_.movedim(d, 0).contiguous()
        out = x.new_empty((x.shape[0] // self.world_size, *x.shape[1:]))
        _reduce_scatter_flat(out, x, group=self.device_group)
        return out.movedim(0, d).contiguous()

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Like :meth:`reduce_scatter`, but rank ``r`` keeps ``sizes[r]`` rows along ``dim``.

        Raises:
            ValueError: ``sizes`` does not have one entry per rank or does not
                add up to the size of ``dim``.
        """
        d = normalize_dim(input_, dim)
        if sizes is None:
            return self.reduce_scatter(input_, d)
        sizes = check_sizes(sizes, self.world_size)
        if sum(sizes) != input_.shape[d]:
            raise ValueError(
                f"reduce_scatterv: sizes {sizes} add up to {sum(sizes)}, but dim "
                f"{dim} has size {input_.shape[d]}"
            )
        if len(set(sizes)) == 1:
            return self.reduce_scatter(input_, d)
        x = input_.movedim(d, 0).contiguous()
        out = x.new_empty((sizes[self.rank_in_group], *x.shape[1:]))
        dist.reduce_scatter(out, list(x.split(sizes, 0)), group=self.device_group)
        return out.movedim(0, d).contiguous()

    # -- gathers ----------------------------------------------------------------
    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """``torch.cat`` of every rank's ``input_`` along ``dim``, in rank order.

        Raises:
            ValueError: ``dim`` is invalid.
        """
        d = normalize_dim(input_, dim)
        x = input_.contiguous()
        flat = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        _all_gather_flat(flat, x, group=self.device_group)
        if d == 0:
            return flat
        stacked = flat.reshape(self.world_size, *x.shape)
        shape = list(x.shape)
        shape[d] *= self.world_size
        return stacked.movedim(0, d).reshape(shape)

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: Sequence[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """All-gather where rank ``r`` contributes ``sizes[r]`` rows along ``dim``.

        ``input_`` may be a list of tensors, each gathered with the same
        ``sizes``; a list comes back. Uneven inputs are padded to the
        largest size for the transfer (Gloo's all-gather needs equal sizes).

        Raises:
            ValueError: ``sizes`` does not have one entry per rank, or this
                rank's input does not have ``sizes[rank_in_group]`` rows.
        """
        if isinstance(input_, (list, tuple)):
            return [self._all_gatherv_one(check_tensor(t), dim, sizes) for t in input_]
        return self._all_gatherv_one(input_, dim, sizes)

    def _all_gatherv_one(
        self, input_: torch.Tensor, dim: int, sizes: Sequence[int] | None
    ) -> torch.Tensor:
        d = normalize_dim(input_, dim)
        if sizes is None:
            return self.all_gather(input_, d)
        sizes = check_sizes(sizes, self.world_size)
        if input_.shape[d] != sizes[self.rank_in_group]:
            raise ValueError(
                f"all_gatherv: this rank ({self.rank_in_group}) has {input_.shape[d]} "
                f"rows along dim {dim}, but sizes[{self.rank_in_group}] = "
                f"{sizes[self.rank_in_group]}"
            )
        if len(set(sizes)) == 1:
            return self.all_gather(input_, d)
        x = input_.movedim(d, 0)
        longest = max(sizes)
        padded = x.new_zeros((longest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        flat = x.new_empty((self.world_size * longest, *x.shape[1:]))
        _all_gather_flat(flat, padded, group=self.device_group)
        parts = [flat[r * longest : r * longest + n] for r, n in enumerate(sizes)]
        return torch.cat(parts, 0).movedim(0, d).contiguous()

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """``torch.cat`` of every rank's ``input_`` along ``dim`` on ``dst``; None elsewhere.

        Raises:
            ValueError: ``dst`` or ``dim`` is invalid.
        """
        d = normalize_dim(input_, dim)
        check_group_rank(dst, self.world_size, "dst")
        x = input_.contiguous()
        gather_list = (
            [torch.empty_like(x) for _ in range(self.world_size)]
            if self.rank_in_group == dst
            else None
        )
        dist.gather(x, gather_list, group=self.device_group, group_dst=dst)
        if gather_list is None:
            return None
        return torch.cat(gather_list, dim=d)

    # -- point to point -----------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to ``dst`` (default: the next rank), blocking.

        Raises:
            ValueError: ``dst`` is invalid or this rank.
        """
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        self._check_peer(dst, "dst")
        dist.send(tensor.contiguous(), group=self.device_group, group_dst=dst)

    def recv(self, size: Any, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Receive a tensor of ``size`` and ``dtype`` from ``src`` (default: the previous rank).

        Raises:
            ValueError: ``src`` is invalid or this rank.
        """
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        self._check_peer(src, "src")
        tensor = torch.empty(size, dtype=dtype, device=self.device)
        dist.recv(tensor, group=self.device_group, group_src=src)
        return tensor

    def _check_peer(self, peer: Any, what: str) -> None:
        check_group_rank(peer, self.world_size, what)
        if peer == self.rank_in_group:
            raise ValueError(
                f"Invalid {what} rank ({peer}): it is this rank; "
                "a rank cannot send to or receive from itself"
            )

    # -- hooks ----------------------------------------------------------------------
    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        """Nothing to prepare: plain collectives need no registered buffers."""

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Any:
        """No all-to-all backend: the inputs come back unchanged."""
        if extra_tensors is not None:
            return hidden_states, router_logits, extra_tensors
        return hidden_states, router_logits

    def combine(
        self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        """No all-to-all backend: ``hidden_states`` comes back unchanged."""
        return hidden_states

    def destroy(self) -> None:
        """Nothing to release; the groups belong to the coordinator."""


__all__ = ["DeviceCommunicator", "check_group_rank", "check_sizes", "check_tensor", "normalize_dim"]
