"""
DiLoCo and streaming DiLoCo
===========================

:class:`DiLoCo` trains every replica group on its own with an inner
optimizer for ``sync_every`` steps, then moves the shared (global) weights
by an outer optimizer step on the average of the replicas' pseudo-gradients
``global - local`` (https://arxiv.org/abs/2311.08105). Streaming DiLoCo
(https://arxiv.org/abs/2501.18512) splits the model into fragments that sync
in turn, one every ``sync_every / n_fragments`` inner steps, each average
running in the background for ``fragment_sync_delay`` inner steps while
training goes on, and mixes a fraction ``fragment_update_alpha`` of the local
weights into the new global ones.

Both generations of torchft's API are served by one class:

* seed era: ``DiLoCo(manager, model, inner_optimizer, outer_optimizer,
  sync_every, backup_device=None, pin_memory=True)``: one module, a
  ``sync()`` method and an ``original_parameters`` attribute;
* today: ``DiLoCo(manager, model_fragments, ...)`` with a list of modules,
  a list of outer optimizers (one per fragment) or a shared one, and the
  streaming parameters.

The schedule (:func:`sync_action`): with ``P = sync_every / n_fragments``
and delay ``d``, the inner step that brings the counter to ``P - d`` starts
the quorum and prepares a fragment, and the one that brings it to ``P``
performs it and restarts the count. The fragment is ``step % n_fragments``
for the Manager's step after the quorum, so every replica (a healed one
included) prepares the same fragment: a failed sync does not advance the
step, and the same fragment is tried again; a heal jumps to the step of the
replicas it joins. The quorum must be synchronous
(``Manager(use_async_quorum=False)``): a heal is then applied before the
pseudo-gradients are taken.

What a sync does, and what a heal does, is in
:mod:`ftdist.local_sgd.fragment`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn, optim

from ftdist.collectives import quantization_mode
from ftdist.local_sgd.fragment import _StreamingDiLoCoFragment
from ftdist.local_sgd.local_sgd import OptimizerHooks, check_sync_every

__all__ = ["DiLoCo", "SyncAction", "sync_action"]

ASYNC_QUORUM_ERROR = (
    "Using DiLoCo require synchronous quorum to be enabled. "
    "Ensure that the manager is initialized with use_async_quorum=False"
)


@dataclass(frozen=True)
class SyncAction:
    """What an inner step triggers.

    Attributes:
        prepare: start the quorum and start averaging a fragment.
        perform: wait for that average, vote, step the outer optimizer.
        reason: why, for logs and tests.
    """

    prepare: bool
    perform: bool
    reason: str


def sync_action(local_step: int, period: int, delay: int) -> SyncAction:
    """The sync work of the inner step that brought the counter to ``local_step``.

    Args:
        local_step: inner steps since the last performed sync, this one
            included (1 to ``period``).
        period: inner steps between two fragment syncs.
        delay: inner steps between preparing and performing a sync.

    Raises:
        ValueError: ``delay`` not in ``[0, period)``, or ``local_step`` not
            in ``[1, period]`` (a sync was skipped).
    """
    if period < 1 or not 0 <= delay < period:
        raise ValueError(f"need 0 <= delay < period, got delay={delay}, period={period}")
    if not 1 <= local_step <= period:
        raise ValueError(
            f"local step {local_step} is outside 1..{period}: a sync must run every "
            f"{period} inner steps"
        )
    prepare = local_step == period - delay
    perform = local_step == period
    if prepare and perform:
        reason = f"step {local_step} of {period}: prepare and perform (no delay)"
    elif prepare:
        reason = f"step {local_step} of {period}: prepare; perform in {delay} steps"
    elif perform:
        reason = f"step {local_step} of {period}: perform the sync prepared {delay} steps ago"
    elif local_step < period - delay:
        reason = f"step {local_step} of {period}: train; prepare at {period - delay}"
    else:
        reason = f"step {local_step} of {period}: train while the average runs"
    return SyncAction(prepare, perform, reason)


def _fragments_of(model_fragments: Any) -> list[nn.Module]:
    if isinstance(model_fragments, nn.Module):
        # One module (nn.Sequential and nn.ModuleList included) is one fragment.
        return [model_fragments]
    if isinstance(model_fragments, (list, tuple)) and model_fragments:
        bad = [type(m).__name__ for m in model_fragments if not isinstance(m, nn.Module)]
        if bad:
            raise TypeError(f"model_fragments must be nn.Modules, got {bad}")
        return list(model_fragments)
    raise TypeError(
        "pass the model (an nn.Module) or a non-empty list of its fragments, got "
        f"{type(model_fragments).__name__}"
    )


def _check_disjoint(fragments: Sequence[nn.Module]) -> None:
    owner: dict[int, int] = {}
    for i, fragment in enumerate(fragments):
        for name, p in fragment.named_parameters():
            j = owner.setdefault(id(p), i)
            if j != i:
                raise ValueError(
                    f"parameter {name!r} is in fragments {j} and {i}: each parameter "
                    "must belong to one fragment"
                )


class DiLoCo(OptimizerHooks):
    """DiLoCo and streaming DiLoCo over a Manager (see the module docstring).

    Use it as a context manager around the training loop; it counts the
    inner optimizer's steps through hooks.

    Args:
        manager: the Manager, with ``use_async_quorum=False``.
        model_fragments: the model (one fragment) or a list of fragments.
            Do not wrap them in ftdist's ``DistributedDataParallel``.
        inner_optimizer: the local optimizer (plain, not ``OptimizerWrapper``).
        outer_optimizer: one optimizer over the model, or one per fragment.
        sync_every: inner steps in which every fragment syncs once.
        backup_device: where the global weights live (default CPU).
        pin_memory: pin CPU backups when an accelerator exists.
        use_bucketization: average each fragment in flat buckets.
        bucket_cap_mb: bucket size in MiB (default 1 GiB).
        should_quantize: send pseudo-gradients quantized (True or ``"int8"``,
            or ``"bf16"``; see :mod:`ftdist.collectives`).
        fragment_sync_delay: inner steps an average runs in the background.
        fragment_update_alpha: fraction of the local weights mixed into the
            model after a committed sync.
        model: the seed era's keyword for a single module.

    Raises:
        TypeError: a missing or mistyped argument.
        ValueError: an asynchronous quorum, a count of outer optimizers that
            does not match the fragments, ``sync_every`` not a positive
            multiple of the fragment count, a delay not below
            ``sync_every / n_fragments``, an alpha outside ``[0, 1]``, a
            parameter in two fragments, or an unknown ``should_quantize``.
    """

    def __init__(
        self,
        manager: Any,
        model_fragments: nn.Module | Sequence[nn.Module] | None = None,
        inner_optimizer: optim.Optimizer | None = None,
        outer_optimizer: optim.Optimizer | Sequence[optim.Optimizer] | None = None,
        sync_every: int | None = None,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: float | None = None,
        should_quantize: bool | str = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        *,
        model: nn.Module | None = None,
    ) -> None:
        if model is not None and model_fragments is not None:
            raise TypeError("pass model_fragments or model (the seed-era name), not both")
        if model_fragments is None and model is None:
            raise TypeError("DiLoCo() missing required argument 'model_fragments'")
        if inner_optimizer is None:
            raise TypeError("DiLoCo() missing required argument 'inner_optimizer'")
        if outer_optimizer is None:
            raise TypeError("DiLoCo() missing required argument 'outer_optimizer'")
        if sync_every is None:
            raise TypeError("DiLoCo() missing required argument 'sync_every'")
        fragments = _fragments_of(model if model is not None else model_fragments)
        n = len(fragments)
        outers: list[optim.Optimizer]
        if isinstance(outer_optimizer, optim.Optimizer):
            outers = [outer_optimizer] * n
        else:
            if len(outer_optimizer) != n:
                raise ValueError(
                    "The number of outer optimizers must match the number of model fragments: "
                    f"{len(outer_optimizer)} outer optimizers for {n} fragments"
                )
            outers = list(outer_optimizer)
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError(ASYNC_QUORUM_ERROR)
        sync_every = check_sync_every(sync_every)
        if sync_every < n:
            raise ValueError(
                f"sync_every={sync_every} is less than the {n} fragments: only one fragment "
                f"can be synchronised at a time; give sync_every >= {n}"
            )
        if sync_every % n != 0:
            raise ValueError(
                f"sync_every={sync_every} is not a multiple of the {n} fragments: "
                "every fragment must sync after the same number of inner steps"
            )
        period = sync_every // n
        if isinstance(fragment_sync_delay, bool) or not isinstance(fragment_sync_delay, int):
            raise TypeError(f"fragment_sync_delay must be an int, got {fragment_sync_delay!r}")
        if not 0 <= fragment_sync_delay < period:
            raise ValueError(
                f"fragment_sync_delay={fragment_sync_delay} must be in [0, {period}) "
                f"(sync_every / n_fragments = {period}): a fragment must be synced before "
                "it is reduced another time"
            )
        if not 0 <= fragment_update_alpha <= 1:
            raise ValueError(
                f"fragment_update_alpha must be between 0 and 1, got {fragment_update_alpha}"
            )
        quantization_mode(should_quantize)  # unknown formats fail here, before any sync
        _check_disjoint(fragments)
        self._manager = manager
        self._local_optimizer = inner_optimizer
        self._sync_every = period
        self._fragment_sync_delay = fragment_sync_delay
        self._local_step = 0
        self._prepared: int | None = None
        self._init_hooks()
        self._fragments = [
            _StreamingDiLoCoFragment(
                manager,
                fragment,
                i,
                math.floor(sync_every / n * (i + 1)),
                inner_optimizer,
                outers[i],
                sync_every,
                backup_device,
                pin_memory,
                use_bucketization,
                bucket_cap_mb,
                should_quantize,
                fragment_sync_delay,
                fragment_update_alpha,
                shared_outer=n > 1 and isinstance(outer_optimizer, optim.Optimizer),
            )
            for i, fragment in enumerate(fragments)
        ]
        self._save_parameters()
        self._register_state_dict_fn()

    def __enter__(self) -> DiLoCo:
        super().__enter__()
        return self

    def _register_state_dict_fn(self) -> None:
        for fragment in self._fragments:
            fragment.register_state_dict_fn()

    def _save_parameters(self) -> None:
        for fragment in self._fragments:
            fragment.save_parameters()

    def _restore_parameters(self) -> None:
        for fragment in self._fragments:
            fragment.restore_parameters()

    def _wait(self) -> None:
        for fragment in self._fragments:
            fragment.wait()

    @property
    def original_parameters(self) -> Mapping[str, torch.Tensor]:
        """The global weights by parameter name.

        With one fragment, its own dict (the seed era's attribute); with
        several, a read-only view named ``"{fragment}.{name}"``.
        """
        if len(self._fragments) == 1:
            return self._fragments[0].original_parameters
        merged = {
            f"{f.fragment_id}.{name}": t
            for f in self._fragments
            for name, t in f.original_parameters.items()
        }
        return MappingProxyType(merged)

    @original_parameters.setter
    def original_parameters(self, values: Mapping[str, torch.Tensor]) -> None:
        """Copy ``values`` into the global weights (names as the getter's).

        Raises:
            KeyError: a name that is no parameter.
        """
        current = self.original_parameters
        unknown = sorted(set(values) - set(current))
        if unknown:
            raise KeyError(f"no parameters named {unknown}; known: {sorted(current)}")
        with torch.no_grad():
            for name, t in values.items():
                current[name].copy_(t)

    def _current_fragment(self) -> int:
        if len(self._fragments) == 1:
            return 0
        return int(self._sync_step()) % len(self._fragments)

    def _sync_step(self) -> Any:
        """The step whose fragment this sync averages: the quorum's max step.

        Every member of a quorum knows it, even one whose heal failed and
        that is still at an older step: its allreduces (zeros, since its
        step failed) then still pair with its peers' fragment instead of
        mismatching them. Without a quorum outcome (a test's Manager, a
        failed round), the Manager's step.
        """
        outcome = getattr(self._manager, "_outcome", None)
        max_step = getattr(getattr(outcome, "quorum", None), "max_step", None)
        if isinstance(max_step, int):
            return max_step
        return self._manager.current_step()

    def _after_inner_step(self) -> None:
        self._local_step += 1
        action = sync_action(self._local_step, self._sync_every, self._fragment_sync_delay)
        if action.prepare:
            self._prepare()
        if action.perform:
            self._perform()

    def _prepare(self) -> None:
        # Every replica must prepare the same fragment, or their allreduces
        # pair up across fragments: the fragment follows the quorum's step.
        served = self._heals_served()
        self._start_quorum()
        self._prepared = self._current_fragment()
        fragment = self._fragments[self._prepared]
        fragment.prepare_sync()
        if self._fragment_sync_delay > 0 and self._heals_served() > served:
            # A peer downloads this replica's state, served by reference, and
            # joins the average only once it has it all: wait for the average
            # before the next inner steps change the weights under the download.
            fragment.wait_for_average()

    def _heals_served(self) -> int:
        timelines = getattr(self._manager, "heal_timelines", None)
        if not isinstance(timelines, list):
            return 0
        return sum(getattr(t, "role", "") == "send" for t in timelines)

    def _perform(self) -> None:
        index, self._prepared = self._prepared, None
        if index is None:
            raise RuntimeError("no fragment was prepared for this sync")
        self._fragments[index].perform_sync()
        self._local_step = 0

    def sync(self) -> None:
        """Sync one fragment now (the one in flight, else the current one); resets the count."""
        if self._prepared is None:
            self._prepare()
        self._perform()
