"""
LocalSGD and what the semi-synchronous algorithms share
=======================================================

:class:`LocalSGD` averages the model's weights over the replica groups every
``sync_every`` optimizer steps (https://arxiv.org/abs/1805.09767); between
syncs each replica group trains on its own, and no collective runs.

It follows torchft's ``LocalSGD`` (both generations): a context manager that
hooks the optimizer, ``sync()`` = ``start_quorum()``, an allreduce of a copy
of every parameter, and, only if ``should_commit()`` says yes, the averages
copied into the parameters. A sync that does not commit changes nothing: the
replica keeps its local weights and averages them at the next sync.

What must be identical across replicas is the weights right after a
committed sync, and only then: between syncs they differ by design, so
neither the weights nor the optimizer state are consistency parts. LocalSGD
registers instead, under ``"LocalSGD"``, a digest (64-bit word sums per parameter) of
the weights its last committed sync produced, both as a consistency part and
as state that moves with a heal (so that a healed replica's digest is its
source's). Replicas at the same step must hold the same digest.

A replica that heals receives its source's user state. With a synchronous
quorum (``use_async_quorum=False``) the heal is applied before the averaging,
so the healed replica contributes a copy of its source's weights (which then
count twice); with the default asynchronous quorum it contributes nothing
and takes the average at the vote. Either way every replica that commits
ends the sync with the same weights.

The helpers here are shared with :mod:`ftdist.local_sgd.diloco`: the hooks,
``extract_local_tensor``, DTensor access, and :func:`bind_state`, which lets
a new LocalSGD or DiLoCo take over the state keys of an earlier one on the
same Manager (the Manager refuses a key registered twice).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn, optim
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ftdist.local_sgd.config import USE_BUCKETIZATION_ENV
from ftdist.manager.heal import fingerprint

__all__ = ["USE_BUCKETIZATION_ENV", "LocalSGD", "bind_state", "extract_local_tensor"]

logger = logging.getLogger(__name__)

# torchft's name; ftdist's FTDIST_USE_BUCKETIZATION is read first.
LOCAL_SGD_KEY = "LocalSGD"


def extract_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s values (of a DTensor: of its local shard), without a gradient."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach().clone()


def local_view(p: torch.Tensor) -> torch.Tensor:
    """The values of ``p`` (a DTensor's local shard), without copying."""
    data = p.data
    return data.to_local() if isinstance(data, DTensor) else data


def like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` shaped as ``p``: a DTensor with ``p``'s mesh and placements if ``p`` is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(
            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )
    return local


def assign_local(p: torch.Tensor, local: torch.Tensor) -> None:
    """Copy ``local`` into ``p``'s values (a DTensor's local shard)."""
    with torch.no_grad():
        p.data.copy_(like_param(p, local))


class _Slot:
    """The functions registered once per Manager and key; a newer owner rebinds them."""

    def __init__(self) -> None:
        self.load: Callable[[Any], None] = lambda _sd: None
        self.save: Callable[[], Any] = dict
        self.check: Callable[[], Any] = dict


# A Manager's slots live on the Manager itself. They once lived in a module-level
# WeakKeyDictionary keyed by the Manager, but a slot reaches the Manager
# (its functions are the owner's bound methods, and the owner holds the
# Manager), so the entry kept its own key alive: the Manager and the model
# were never freed, not even by the cyclic collector. Objects without a
# __dict__ (no attributes can be set) still go in the dictionary.
_SLOTS_ATTR = "_ftdist_state_slots"
_SLOTS: weakref.WeakKeyDictionary[Any, dict[str, _Slot]] = weakref.WeakKeyDictionary()


def _slots_of(manager: Any) -> dict[str, _Slot]:
    try:
        slots: dict[str, _Slot] = vars(manager).setdefault(_SLOTS_ATTR, {})
    except TypeError:  # no __dict__
        slots = _SLOTS.setdefault(manager, {})
    return slots


def bind_state(
    manager: Any,
    key: str,
    load: Callable[[Any], None],
    save: Callable[[], Any],
    consistency: Callable[[], Any] | None,
) -> None:
    """Register state that moves with a heal (and, if given, is compared across replicas).

    The Manager takes each key once; a later call for the same Manager and
    key (a new LocalSGD or DiLoCo replacing an old one) points the
    registered functions at the new owner instead.

    Raises:
        TypeError: the Manager rejects the functions.
    """
    slots = _slots_of(manager)
    slot = slots.get(key)
    fresh = slot is None
    if slot is None:
        slot = slots[key] = _Slot()
    slot.load, slot.save = load, save
    if consistency is not None:
        slot.check = consistency
    if not fresh:
        return
    bound = slot
    manager.register_state_dict_fn(key, lambda sd: bound.load(sd), lambda: bound.save())
    register = getattr(manager, "register_consistency_fn", None)
    if consistency is not None and callable(register):
        register(key, lambda: bound.check())


class OptimizerHooks:
    """A context manager that runs ``_after_inner_step`` after every ``optimizer.step()``.

    While the optimizer steps, peers may not read the state for a heal
    (``disallow_state_dict_read``), so that none receives half-updated
    weights.
    """

    _manager: Any
    _local_optimizer: optim.Optimizer

    def _init_hooks(self) -> None:
        self._hooks: list[RemovableHandle] = []

    def __enter__(self) -> Any:
        if callable(getattr(self._manager, "disallow_state_dict_read", None)):
            self._hooks.append(self._local_optimizer.register_step_pre_hook(self._step_pre_hook))
        self._hooks.append(self._local_optimizer.register_step_post_hook(self._step_post_hook))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return False

    def _step_pre_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._manager.disallow_state_dict_read()

    def _step_post_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        allow = getattr(self._manager, "allow_state_dict_read", None)
        if callable(allow):
            allow()
        self._after_inner_step()

    def _after_inner_step(self) -> None:
        raise NotImplementedError

    def _start_quorum(self) -> None:
        """Start the sync's quorum; a quorum that fails fails the sync, not the loop.

        With a synchronous quorum ``start_quorum`` raises when no quorum
        forms; the Manager has the error, its allreduces do nothing and
        ``should_commit`` votes no, so training goes on and the next sync
        tries again.
        """
        try:
            self._manager.start_quorum()
        except (TypeError, ValueError):
            raise
        except Exception as exc:
            logger.warning("the quorum of this sync failed (the sync will not commit): %s", exc)


def check_sync_every(sync_every: object) -> int:
    """``sync_every`` as a positive int.

    Raises:
        TypeError: not an int.
        ValueError: less than 1.
    """
    if isinstance(sync_every, bool) or not isinstance(sync_every, int):
        raise TypeError(f"sync_every must be an int, got {sync_every!r}")
    if sync_every < 1:
        raise ValueError(f"sync_every must be greater than or equal to 1, got {sync_every}")
    return sync_every


def digest(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """A 64-bit digest of each parameter's values: what LocalSGD compares across replicas."""
    return fingerprint({name: local_view(p) for name, p in named})


class LocalSGD(OptimizerHooks):
    """Average the model's weights over the replica groups every ``sync_every`` steps.

    Use it as a context manager around the training loop; see the module
    docstring for what a sync does when it fails or when a replica heals.

    Args:
        manager: the Manager (synchronous or asynchronous quorum).
        model: the model whose parameters are averaged. Do not wrap it in
            ftdist's ``DistributedDataParallel`` (no per-step allreduce).
        optimizer: the plain (unwrapped) optimizer whose steps are counted.
        sync_every: optimizer steps between syncs.

    Raises:
        TypeError: ``sync_every`` is not an int.
        ValueError: ``sync_every < 1``.

    Example::

        with LocalSGD(manager, model, optimizer, sync_every=100):
            for x, y in loader:
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()   # every 100th step also syncs
    """

    def __init__(
        self,
        manager: Any,
        model: nn.Module,
        optimizer: optim.Optimizer,
        sync_every: int,
    ) -> None:
        self._sync_every = check_sync_every(sync_every)
        self._manager = manager
        self._model = model
        self._local_optimizer = optimizer
        self._local_step = 0
        self._synced_digest: dict[str, int] = {}
        self._init_hooks()
        bind_state(manager, LOCAL_SGD_KEY, self._load_state, self._save_state, self._consistency)

    def __enter__(self) -> LocalSGD:
        super().__enter__()
        return self

    def _load_state(self, state: dict[str, Any]) -> None:
        self._synced_digest = dict(state.get("synced_digest", {}))

    def _save_state(self) -> dict[str, Any]:
        return {"synced_digest": dict(self._synced_digest)}

    def _consistency(self) -> dict[str, int]:
        return self._synced_digest

    def _after_inner_step(self) -> None:
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> None:
        """Average the weights now (quorum, allreduce, vote); resets the step count."""
        self._start_quorum()
        self._perform_sync()
        self._local_step = 0

    def _perform_sync(self) -> None:
        averaged = self._average()
        if self._manager.should_commit():
            params = list(self._model.parameters())
            for p, avg in zip(params, averaged, strict=True):
                assign_local(p, avg)
            self._synced_digest = digest(self._model.named_parameters())

    def _average(self) -> list[torch.Tensor]:
        works = []
        averaged = []
        for p in self._model.parameters():
            avg = extract_local_tensor(p.data)
            works.append(self._manager.allreduce(avg))
            averaged.append(avg)
        for work in works:
            work.wait()
        return averaged
