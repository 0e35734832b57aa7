"""
Following the leader
====================

What a client of a replicated lighthouse knows and reads to find the leader:
the replicas' addresses (:func:`parse_addresses`, which also checks them), the
leader a "not the leader" answer names (:func:`leader_hint`), each replica
with its connection (:class:`Replica`), and one call's search for the leader
(:class:`Search`). :class:`~ftdist.lighthouse.client.LighthouseClient` acts
on them; the wire protocol is in :mod:`ftdist._rpc.common`
(``FOLLOW_LEADER_METADATA``, ``LEADER_METADATA``, ``NOT_LEADER_PREFIX``).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from ftdist._rpc import common as _rpc
from ftdist.lighthouse.connection import Connection

__all__ = [
    "FIRST_PAUSE_S",
    "MOST_PAUSE_S",
    "MOST_REPLICAS",
    "Replica",
    "Search",
    "describe",
    "leader_hint",
    "parse_addresses",
]

# While no replica names a leader (an election), a call asks the replicas in
# turn, pausing this long at first and twice as long each round up to the
# most: an election takes a lease's lifetime, and nobody should spin on it;
# but a pause outlasts the election by up to its length, which adds straight
# to every group's stall (at 500 ms, a SIGKILLed leader's 2 s lease became a
# 3 s stall under load; bench/lighthouse_failover.py).
FIRST_PAUSE_S = 0.05
MOST_PAUSE_S = 0.2
# Leader names not listed are added as replicas, up to this many in all: a
# confused replica must not make the client open channels without end.
MOST_REPLICAS = 16
_FORM = "host:port or http://host:port, one per lighthouse replica, separated by commas"


def parse_addresses(addr: str) -> tuple[str, ...]:
    """Split a lighthouse address into the addresses of its replicas.

    Args:
        addr: one address (``host:port``, ``http://host:port`` or
            ``https://host:port``), or several separated by commas: the
            replicas of a replicated lighthouse.

    Returns:
        The addresses in the order given, without surrounding blanks.

    Raises:
        TypeError: if ``addr`` is not a string.
        ValueError: naming the entry, for an empty or malformed one, two
            naming the same ``host:port``, or ``https://`` mixed with plain
            entries.
    """
    if not isinstance(addr, str):
        raise TypeError(f"lighthouse address must be a string, got {type(addr).__name__}")
    if "," not in addr:
        _rpc.grpc_target(addr)  # one address: the message it always had
        return (addr.strip(),)
    entries = tuple(entry.strip() for entry in addr.split(","))
    seen: dict[str, str] = {}
    for entry in entries:
        if not entry:
            raise ValueError(f"lighthouse address {addr!r} has an empty entry; expected {_FORM}")
        try:
            target = _rpc.grpc_target(entry)
        except ValueError:
            raise ValueError(
                f"lighthouse address entry {entry!r} in {addr!r} is malformed; expected {_FORM}"
            ) from None
        if target in seen:
            raise ValueError(
                f"lighthouse address {addr!r} names {target} twice ({seen[target]!r} and "
                f"{entry!r}); list each replica once"
            )
        seen[target] = entry
    if len({entry.startswith("https://") for entry in entries}) > 1:
        raise ValueError(
            f"lighthouse address {addr!r} mixes https:// and plain entries; the replicas "
            "of one lighthouse are reached the same way"
        )
    return entries


def leader_hint(exc: grpc.RpcError) -> str | None:
    """The leader a "not the leader" answer names ("" while none is known), else None."""
    if not isinstance(exc, grpc.Call) or exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
        return None
    if not (exc.details() or "").startswith(_rpc.NOT_LEADER_PREFIX):
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == _rpc.LEADER_METADATA:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def describe(exc: grpc.RpcError) -> str:
    """A failed call's status and text, for logs and messages."""
    if not isinstance(exc, grpc.Call):
        return str(exc)
    code = exc.code()
    return f"{code.name if code is not None else 'UNKNOWN'}: {exc.details()}"


class Replica:
    """One address of the lighthouse and, once used, its connection."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.target = _rpc.grpc_target(addr)  # how replicas are told apart
        self.conn: Connection | None = None


@dataclass
class Search:
    """One call's way to the leader of a replicated lighthouse."""

    what: str  # "Quorum call to", "event stream from"
    deadline: float  # time.monotonic(); math.inf until a stream first fails
    timeout_s: float | None  # the call's; None: a stream, bounded by connect_timeout
    pause_s: float = FIRST_PAUSE_S
    hops: int = 0  # moves made at once since the last pause
    pauses: int = 0
    unreachable_since: float | None = None  # no replica has answered since
    last: str = ""
