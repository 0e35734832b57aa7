"""
Failure news
============

The lighthouse's broadcast of ``ftdist.LighthouseEvent`` messages (a quorum
formed, a member failed or left) to every open ``Subscribe`` stream. Each
event is serialized once, whatever the number of subscribers; a subscriber
that cannot keep up ends its own stream (see :class:`Subscriber`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ftdist._rpc._proto import ftdist_pb2

__all__ = ["News", "Subscriber"]


class Subscriber(Protocol):
    """Receives serialized ``ftdist.LighthouseEvent`` messages."""

    def send(self, payload: bytes) -> None:
        """Deliver one event.

        A subscriber that cannot keep up ends its own stream.
        """

    def close(self) -> None:
        """The lighthouse is closing; end the stream."""


class News:
    """The open subscriptions of one lighthouse engine. Use it from one thread.

    Args:
        wall_clock: wall time in seconds since the epoch, stamped on each event.
    """

    def __init__(self, wall_clock: Callable[[], float]) -> None:
        self._wall_clock = wall_clock
        self._subscribers: set[Subscriber] = set()

    def __len__(self) -> int:
        return len(self._subscribers)

    def _payload(self, event: ftdist_pb2.LighthouseEvent) -> bytes:
        event.time.FromNanoseconds(int(self._wall_clock() * 1e9))
        payload: bytes = event.SerializeToString()
        return payload

    def publish(self, event: ftdist_pb2.LighthouseEvent) -> None:
        """Stamp ``event`` now and send it, serialized once, to every subscriber."""
        payload = self._payload(event)
        # A subscriber may unsubscribe itself while it is sent to.
        for subscriber in list(self._subscribers):
            subscriber.send(payload)

    def add(self, subscriber: Subscriber, event: ftdist_pb2.LighthouseEvent) -> None:
        """Subscribe, starting with ``event`` (SUBSCRIBED, with the current members)."""
        self._subscribers.add(subscriber)
        subscriber.send(self._payload(event))

    def discard(self, subscriber: Subscriber) -> None:
        """Stop sending to ``subscriber`` (nothing if it was not subscribed)."""
        self._subscribers.discard(subscriber)

    def close(self) -> None:
        """Close every stream; later subscribers are not closed by this."""
        subscribers, self._subscribers = self._subscribers, set()
        for subscriber in subscribers:
            subscriber.close()
