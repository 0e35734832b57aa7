"""
What the launcher does when a child exits (pure)
================================================

The launcher's supervisor (:mod:`ftdist.launch.supervisor`) watches its
children and asks :func:`decide` what to do each time one exits: keep
waiting, restart that child's replica group, fail the launch, or finish.

Rules:

- A child that returned (exit code 0, nothing raised) is done; when every
  rank is done the launch is done.
- A child that raised, exited non-zero or died of a signal is a failure.
  Without fault tolerance the launch fails at once (the supervisor stops
  the other children). With fault tolerance its replica group is
  restarted, all of it, while that group has restarts left
  (``max_restarts`` per group, as torchrun counts them per worker group);
  then the launch fails.

No I/O: a decision is a function of the state and the event, with its
reason in words.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass


class Action(enum.Enum):
    """What the supervisor does next."""

    WAIT = "wait"
    RESTART_GROUP = "restart_group"
    FAIL = "fail"
    DONE = "done"


@dataclass(frozen=True)
class ChildExit:
    """One child process ended.

    Attributes:
        rank: its global rank.
        group: its replica group (0 without fault tolerance).
        exitcode: the process's exit code; negative for a signal.
        raised: the child reported an exception (its traceback reached the parent).
    """

    rank: int
    group: int
    exitcode: int
    raised: bool = False

    @property
    def failed(self) -> bool:
        """True unless the child returned normally."""
        return self.raised or self.exitcode != 0


@dataclass(frozen=True)
class SupervisorState:
    """What the supervisor knows when a child exits.

    Attributes:
        world_size: ranks launched (all replica groups).
        fault_tolerant: restart failed replica groups.
        max_restarts: restarts allowed per replica group.
        restarts: restarts used so far, per replica group.
        done: ranks whose current process returned normally.
    """

    world_size: int
    fault_tolerant: bool
    max_restarts: int
    restarts: tuple[int, ...]
    done: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Decision:
    """What to do, for which replica group, and why."""

    action: Action
    group: int | None
    reason: str


def describe_exit(event: ChildExit) -> str:
    """How a child ended, in words: "raised", "was killed by SIGKILL", "exited with code 2"."""
    if event.raised:
        return f"rank {event.rank} raised an exception"
    if event.exitcode < 0:
        try:
            name = signal.Signals(-event.exitcode).name
        except ValueError:
            name = f"signal {-event.exitcode}"
        return f"rank {event.rank} was killed by {name}"
    if event.exitcode == 0:
        return f"rank {event.rank} returned"
    return f"rank {event.rank} exited with code {event.exitcode}"


def decide(state: SupervisorState, event: ChildExit) -> Decision:
    """The supervisor's next step after ``event`` (see the module docstring)."""
    what = describe_exit(event)
    if not event.failed:
        done = state.done | {event.rank}
        left = state.world_size - len(done)
        if left <= 0:
            return Decision(Action.DONE, None, f"{what}; every rank has returned")
        return Decision(Action.WAIT, None, f"{what}; waiting for {left} more")
    if not state.fault_tolerant:
        return Decision(Action.FAIL, event.group, f"{what}; stopping the other ranks")
    used = state.restarts[event.group]
    if used < state.max_restarts:
        return Decision(
            Action.RESTART_GROUP,
            event.group,
            f"{what}; restarting replica group {event.group} "
            f"(restart {used + 1} of {state.max_restarts})",
        )
    return Decision(
        Action.FAIL,
        event.group,
        f"{what}; replica group {event.group} has used all {state.max_restarts} restarts",
    )


__all__ = ["Action", "ChildExit", "Decision", "SupervisorState", "decide", "describe_exit"]
