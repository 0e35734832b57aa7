"""
One fragment of a DiLoCo model
==============================

:class:`_StreamingDiLoCoFragment` (torchft's name and methods) holds what
DiLoCo keeps for one fragment of the model:

* ``original_parameters``: the **global** weights, the state every replica
  shares (on ``backup_device``, the CPU by default), and the outer
  optimizer's state. Both change only when a sync commits; both move with a
  heal and are compared across replicas (state and consistency key
  ``StreamingDiLoCoFragment_{i}``).
* the local weights are the model's own parameters, trained by the inner
  optimizer; they differ between replicas by design.

A sync of the fragment has two halves. :meth:`prepare_sync` takes the
pseudo-gradient ``global - local`` (today's torchft sign; the seed era's
``local - global`` moved the global weights away from the replicas'
progress) and starts averaging it over the replica groups without waiting.
:meth:`perform_sync` waits for the average, puts the global weights back in
the model, and asks the Manager's vote. Only if the vote says yes does
anything change: the outer optimizer steps on the averaged pseudo-gradient,
the result becomes the new global weights, and the model is set to
``lerp(global, local, fragment_update_alpha)``. If it says no, the model is
left at the last global weights: the local progress since the last sync is
discarded, never half-applied.

A replica that heals receives its source's global weights and outer
optimizer state here; its local weights are whatever the user's own state
(the Manager's ``load_state_dict``) moves, as in torchft: with the model in
it (torchft's examples), the healed replica trains on from its source's
local weights, and at the sync where it healed both contribute the same
pseudo-gradient. The global state is never torn: it changes only after the
vote, which waits for transfers in flight; DiLoCo keeps a source's local
weights still while a peer downloads them (see :mod:`ftdist.local_sgd.diloco`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn, optim

from ftdist.local_sgd import config
from ftdist.local_sgd.local_sgd import (
    assign_local,
    bind_state,
    like_param,
    local_view,
)

__all__ = ["FRAGMENT_KEY", "_StreamingDiLoCoFragment", "bucketization_enabled", "plan_buckets"]

FRAGMENT_KEY = "StreamingDiLoCoFragment_{}"


def bucketization_enabled(argument: bool, env: Mapping[str, str] | None = None) -> bool:
    """Whether to bucketize: ``FTDIST_USE_BUCKETIZATION`` or torchft's
    ``TORCHFT_USE_BUCKETIZATION`` set to ``True`` forces it (torchft's rule),
    else the argument."""
    return config.bucketization_forced(env) or bool(argument)


def plan_buckets(tensors: Sequence[tuple[int, object]], cap_bytes: int) -> list[list[int]]:
    """Group tensors into allreduce buckets, in order.

    Consecutive tensors of the same kind (dtype and device) share a bucket
    while their total stays within ``cap_bytes``; a tensor bigger than the
    cap gets a bucket of its own. Every tensor is in exactly one bucket
    (torchft's packing could leave one out).

    Args:
        tensors: ``(nbytes, kind)`` per tensor.
        cap_bytes: the most bytes in a bucket of several tensors.

    Returns:
        The tensors' indices, by bucket.

    Raises:
        ValueError: ``cap_bytes < 1``.
    """
    if cap_bytes < 1:
        raise ValueError(f"the bucket cap must be at least 1 byte, got {cap_bytes}")
    buckets: list[list[int]] = []
    size, kind = 0, None
    for i, (nbytes, k) in enumerate(tensors):
        if buckets and k == kind and size + nbytes <= cap_bytes:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size, kind = nbytes, k
    return buckets


class _StreamingDiLoCoFragment:
    """What DiLoCo keeps and does for one fragment (see the module docstring).

    Args:
        manager: the Manager.
        model_fragment: the fragment's module.
        fragment_id: its index (names its state key).
        fragment_sync_offset: inner steps into the cycle at which it syncs
            (informational, as in torchft).
        inner_optimizer: the optimizer of the local steps.
        outer_optimizer: the optimizer of the global weights.
        sync_every: inner steps of a whole cycle over every fragment.
        backup_device: where the global weights live (default CPU).
        pin_memory: pin them (CPU backups, when an accelerator exists).
        use_bucketization: average in flat buckets instead of per tensor.
        bucket_cap_mb: bucket size in MiB (default 1 GiB).
        should_quantize: send the pseudo-gradients quantized (True or
            ``"int8"``, or ``"bf16"``; see :mod:`ftdist.collectives`).
        fragment_sync_delay: inner steps between starting and awaiting the
            average.
        fragment_update_alpha: how much of the local weights to keep after
            a committed sync (0: take the global weights).
        shared_outer: the outer optimizer also holds other fragments'
            parameters.

    Raises:
        ValueError: ``fragment_sync_offset > sync_every``.
    """

    # torchft's attribute: bytes, whatever the name says (1 GiB).
    bucket_cap_mb: int = 1 * 1024 * 1024 * 1024
    use_bucketization: bool = False

    def __init__(
        self,
        manager: Any,
        model_fragment: nn.Module,
        fragment_id: int,
        fragment_sync_offset: int,
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer,
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: float | None = None,
        should_quantize: bool | str = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        shared_outer: bool = False,
    ) -> None:
        if fragment_sync_offset > sync_every:
            raise ValueError(
                f"fragment {fragment_id} syncs at offset {fragment_sync_offset}, past "
                f"sync_every={sync_every}: a fragment must sync once every sync_every steps"
            )
        self._fragment_id = fragment_id
        self._manager = manager
        self._model_fragment = model_fragment
        self._fragment_sync_offset = fragment_sync_offset
        self._local_optimizer = inner_optimizer
        self._outer_optimizer = outer_optimizer
        self._sync_every = sync_every
        self._backup_device = backup_device
        self._pin_memory = pin_memory
        self._fragment_sync_delay = fragment_sync_delay
        self._fragment_update_alpha = fragment_update_alpha
        self._shared_outer = shared_outer
        if bucket_cap_mb is not None:
            self.bucket_cap_mb = int(bucket_cap_mb * 1024 * 1024)
        self.use_bucketization = bucketization_enabled(use_bucketization)
        self.should_quantize = should_quantize
        self._allreduce_work: list[Any] = []
        self._prepared = False
        self._grads: dict[str, torch.Tensor] = {}
        self._local_parameters: dict[str, torch.Tensor] = {}
        self.original_parameters: dict[str, torch.Tensor] = {}
        device = backup_device or torch.device("cpu")
        for name, p in model_fragment.named_parameters():
            local = local_view(p)
            t = torch.empty(tuple(local.shape), dtype=local.dtype, device=device)
            if pin_memory and t.device.type == "cpu" and torch.accelerator.is_available():
                t = t.pin_memory()
            self.original_parameters[name] = t

    @property
    def fragment_id(self) -> int:
        """The fragment's index."""
        return self._fragment_id

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The fragment's parameters, by name."""
        return list(self._model_fragment.named_parameters())

    # -- state that moves with a heal ----------------------------------------------------
    def register_state_dict_fn(self) -> None:
        """Register the global weights and outer optimizer state with the Manager.

        Under ``StreamingDiLoCoFragment_{i}``, both as state that moves with
        a heal and as a consistency part compared across replicas.
        """
        bind_state(
            self._manager,
            FRAGMENT_KEY.format(self._fragment_id),
            self._load_state,
            self._save_state,
            self._consistency,
        )

    def _save_state(self) -> dict[str, Any]:
        # The backups themselves, not copies: they change only after a
        # commit vote, which waits for transfers in flight.
        return {
            "outer_optimizer": self._outer_optimizer.state_dict(),
            "original_parameters": dict(self.original_parameters),
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        received = state["original_parameters"]
        with torch.no_grad():
            for name, t in received.items():
                if name in self.original_parameters:
                    self.original_parameters[name].copy_(t)
        self._outer_optimizer.load_state_dict(state["outer_optimizer"])
        # The local weights are the user's state (the Manager's "default"
        # key), as in torchft: resetting them here would override the model
        # the user's load_state_dict just received (docs/local_sgd.md).

    def _consistency(self) -> dict[str, Any]:
        outer = self._outer_optimizer
        return {
            "original_parameters": self.original_parameters,
            "outer_optimizer": {
                name: outer.state.get(p, {}) for name, p in self.named_parameters()
            },
            "outer_hyperparameters": [
                {k: v for k, v in group.items() if k != "params"} for group in outer.param_groups
            ],
        }

    # -- global and local weights --------------------------------------------------------
    def save_parameters(self) -> None:
        """Make the model's current weights the global weights."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                self.original_parameters[name].copy_(local_view(p), non_blocking=True)

    def restore_parameters(self) -> None:
        """Set the model's weights to the global weights."""
        for name, p in self.named_parameters():
            assign_local(p, self.original_parameters[name].to(local_view(p).device))

    def _save_local_parameters(self) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters():
                self._local_parameters[name] = local_view(p).clone()

    def _clear_local_parameters(self) -> None:
        self._local_parameters = {}

    def _merge_parameters(self) -> None:
        alpha = self._fragment_update_alpha
        if alpha == 0:  # the model already holds the global weights
            return
        with torch.no_grad():
            for name, p in self.named_parameters():
                local_view(p).lerp_(self._local_parameters[name], alpha)

    def _save_grads(self) -> None:
        """The pseudo-gradient of every parameter: global minus local."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                local = local_view(p)
                self._grads[name] = self.original_parameters[name].to(local.device) - local

    def _set_grads(self) -> None:
        """Give every parameter its averaged pseudo-gradient as ``.grad``."""
        for name, p in self.named_parameters():
            p.grad = like_param(p, self._grads.pop(name))

    # -- averaging -----------------------------------------------------------------------
    def _average_grads(self) -> None:
        """Start averaging the pseudo-gradients (per tensor, or in buckets)."""
        if self.use_bucketization:
            self._allreduce_bucketized()
        else:
            self._allreduce_per_param()

    def _allreduce_per_param(self) -> None:
        for name, _p in self.named_parameters():
            work = self._manager.allreduce(self._grads[name], should_quantize=self.should_quantize)
            self._allreduce_work.append(work)

    def _allreduce_bucketized(self) -> None:
        grads = list(self._grads.values())
        kinds = [(g.numel() * g.element_size(), (g.dtype, g.device)) for g in grads]
        for bucket in plan_buckets(kinds, self.bucket_cap_mb):
            members = [grads[i] for i in bucket]
            flat = torch.cat([g.reshape(-1) for g in members])
            work = self._manager.allreduce(flat, should_quantize=self.should_quantize)

            def copy_back(
                fut: torch.futures.Future[Any],
                flat: torch.Tensor = flat,
                members: list[torch.Tensor] = members,
            ) -> None:
                offset = 0
                for g in members:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

            work.get_future().then(copy_back)
            self._allreduce_work.append(work)

    def wait_for_average(self) -> None:
        """Wait until the average started by :meth:`prepare_sync` is done (it stays pending)."""
        for work in self._allreduce_work:
            work.wait()

    def wait(self) -> None:
        """Wait for the averaging started by :meth:`prepare_sync`."""
        works, self._allreduce_work = self._allreduce_work, []
        for work in works:
            work.wait()

    # -- the two halves of a sync --------------------------------------------------------
    def prepare_sync(self) -> None:
        """Take the pseudo-gradients and start averaging them; does not wait.

        Raises:
            RuntimeError: the fragment's previous sync was never performed.
        """
        if self._prepared:
            raise RuntimeError(
                f"fragment {self._fragment_id} is already being synchronised: "
                "perform_sync() it before preparing it again"
            )
        self._save_grads()
        self._prepared = True
        self._average_grads()

    def perform_sync(self) -> bool:
        """Finish the sync: wait for the average, vote, step the outer optimizer if committed.

        Returns:
            Whether the sync committed.

        Raises:
            RuntimeError: :meth:`prepare_sync` was not called first.
        """
        if not self._prepared:
            raise RuntimeError(
                f"perform_sync() of fragment {self._fragment_id} before prepare_sync(): "
                "there is no average to wait for"
            )
        self._prepared = False
        self.wait()
        if self._fragment_update_alpha > 0:
            self._save_local_parameters()
        self.restore_parameters()
        committed = bool(self._manager.should_commit())
        if committed:
            if self._shared_outer:
                # Other fragments' parameters still hold inner gradients: the
                # outer optimizer must not step them.
                self._outer_optimizer.zero_grad()
            self._set_grads()
            self._outer_optimizer.step()
            self.save_parameters()
            self._merge_parameters()
        self._grads.clear()
        self._outer_optimizer.zero_grad()
        self._clear_local_parameters()
        return committed
