"""
Optimizer wrapper
=================

Ties an optimizer to the Manager's step protocol: ``zero_grad()`` starts the
quorum for the step, ``step()`` steps only if every replica group member
votes to commit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

if TYPE_CHECKING:
    from ftdist.manager import Manager


class OptimizerWrapper(Optimizer):
    """An optimizer that commits or discards each step with the Manager.

    Args:
        manager: the replica group's Manager.
        optim: the optimizer to wrap.
    """

    def __init__(self, manager: Manager, optim: Optimizer) -> None:
        # Optimizer.__init__ is not called on purpose: every piece of state
        # lives in (and is delegated to) the wrapped optimizer.
        self.optim = optim
        self.manager = manager
        # Optimizer state must be identical on every replica at the same step.
        register = getattr(manager, "register_consistency_fn", None)
        if callable(register):
            register("optimizer", optim.state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Delegate to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Delegate to the wrapped optimizer."""
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        """Delegate to the wrapped optimizer."""
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start this step's quorum, then zero the gradients."""
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Step the optimizer if the step commits.

        Raises:
            ValueError: a closure was given (not supported).
        """
        if closure is not None:
            raise ValueError(
                "OptimizerWrapper does not support closures; compute the loss before calling step()"
            )
        if self.manager.should_commit():
            self.optim.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's parameter groups."""
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's state."""
        return self.optim.state
