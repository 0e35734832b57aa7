"""
A gathering of a replica group's ranks
======================================

Both of the manager server's rounds, a quorum and a commit vote, gather one
call from every group rank and answer them all at once. This module keeps
one such round: what each rank sent and by when, how the round ended (a
quorum, a decision or an error), and the remote calls parked on it.

Group rank 0 waits on :attr:`Gathering.done` on its own thread. Remote
ranks' calls wait on the server thread: :meth:`Gathering.answer` answers
them all when the round ends, :meth:`Gathering.expire` each one whose
deadline passes first. Both run on the server thread, which alone appends
to :attr:`Gathering.parked`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from ftdist._rpc.h2_call import H2Call
from ftdist.lighthouse.types import Quorum
from ftdist.manager.rule import QuorumResult

__all__ = ["MAX_CALL_S", "Gathering", "timeout_problem"]

logger = logging.getLogger("ftdist.manager.server")

# A call's longest wait in a round: a week (timeouts are seconds to hours).
MAX_CALL_S = 7 * 24 * 3600.0

Outcome = Callable[["Gathering", Any], Any]
"""One rank's answer from an ended round: a response message, or an error
status as ``(code, details)``."""


@dataclass
class Gathering:
    """One round of every group rank: a quorum or a commit vote.

    Attributes:
        what: ``"quorum"`` or ``"commit"``, for messages.
        world_size: the group ranks it waits for.
        arrivals: each rank's request (a vote: ``(should_commit, step)``).
        deadlines: each rank's deadline, ``time.monotonic()``-based.
        done: set once the round has ended, with a quorum, a decision or an error.
        parked: the remote calls waiting for it: ``(group rank, request, call)``.
        results: a quorum's per-rank results, by the requester's
            ``init_sync``, computed once for every rank.
    """

    what: str
    world_size: int
    arrivals: dict[int, Any] = field(default_factory=dict)
    deadlines: dict[int, float] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    quorum: Quorum | None = None
    divergence: str = ""
    diverged: frozenset[str] = frozenset()
    decision: bool = False
    error: tuple[grpc.StatusCode, str] | None = None
    parked: list[tuple[int, Any, H2Call]] = field(default_factory=list)
    results: dict[bool, list[QuorumResult] | LookupError] = field(default_factory=dict)

    def incomplete(self) -> str:
        """What the round lacks, for a rank that stopped waiting."""
        if self.what == "quorum":
            return (
                f"quorum did not complete: {len(self.arrivals)} of "
                f"{self.world_size} group ranks arrived"
            )
        return (
            f"commit vote incomplete: {len(self.arrivals)} of {self.world_size} group ranks voted"
        )

    def answer(self, outcome: Outcome) -> None:
        """Answer every parked call still waiting; on the server thread, once the round ended."""
        for _, request, call in self.parked:
            if call.done:
                continue  # its client gave up or left
            try:
                answer = outcome(self, request)
            except Exception as exc:  # one rank's bad answer must not silence the others
                logger.exception("answering a parked %s call failed", call.method)
                answer = (grpc.StatusCode.INTERNAL, f"manager server error: {exc!r}")
            if isinstance(answer, tuple):
                call.abort(*answer)
            else:
                call.reply(answer.SerializeToString())

    def expire(self) -> None:
        """End the parked calls whose deadline passed; on the server thread.

        Dropping the answered ones is safe while the round is open (only
        this thread appends, nothing has been answered from the list yet)
        and keeps a retrying client's calls from piling up.
        """
        for _, _, call in self.parked:
            if not call.done and not call.time_remaining():
                call.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self.incomplete())
        self.parked[:] = [entry for entry in self.parked if not entry[2].done]


def timeout_problem(remaining: float | None) -> tuple[grpc.StatusCode, str] | None:
    """Why a call's deadline is refused (None when it is fine).

    Both rounds wait for the group's other ranks, so a call must say how
    long. grpcio's servers report a call sent without a deadline as
    centuries left.
    """
    if remaining is None or remaining > MAX_CALL_S:
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            "missing timeout: send the call with a deadline (gRPC's grpc-timeout) "
            f"of at most {MAX_CALL_S:.0f} s",
        )
    if remaining <= 0:
        # It would bound the round's lighthouse call, and fail every rank's.
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed before it arrived"
    return None
