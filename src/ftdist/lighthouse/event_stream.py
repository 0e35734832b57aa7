"""
The failure-news stream
=======================

:class:`LighthouseEventStream` is what :meth:`LighthouseClient.subscribe
<ftdist.lighthouse.client.LighthouseClient.subscribe>` returns: an iterator
of :class:`~ftdist.lighthouse.types.LighthouseEvent` that a manager reads on
its own thread, closed from another. With a replicated lighthouse it follows
the leader until its first event (the client gives it the way to).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ftdist._rpc import common as _rpc
from ftdist.errors import CoordinationError, CoordinationTimeoutError
from ftdist.lighthouse.types import LighthouseEvent

__all__ = ["LighthouseEventStream"]


class LighthouseEventStream:
    """An open failure-news stream; iterate it for :class:`LighthouseEvent`.

    The first event is always ``"subscribed"``. Iteration blocks until the next
    event, ends after :meth:`close` (from any thread), and raises
    :class:`~ftdist.errors.CoordinationError` if the lighthouse goes away.
    With several replicas, a stream refused or cut before its first event is
    reopened at the leader, within the client's ``connect_timeout``.
    """

    def __init__(
        self,
        call: Any,
        what: str,
        follow: Callable[[grpc.RpcError, bool], Any] | None = None,
    ) -> None:
        self._call = call
        self._what = what
        # Replicated lighthouse only: given a failure and whether the stream
        # may be reopened (no event read yet), moves the client and returns
        # the reopened call, or None.
        self._follow = follow
        self._subscribed = False
        self._closed = False
        self._lock = threading.Lock()  # guards _call against close()

    def __iter__(self) -> Iterator[LighthouseEvent]:
        return self

    def __next__(self) -> LighthouseEvent:
        """Wait for the next event.

        Raises:
            StopIteration: after :meth:`close`.
            CoordinationError: if the stream broke (the lighthouse stopped).
        """
        while True:
            try:
                message = next(self._call)
            except grpc.RpcError as exc:
                if self._closed:
                    raise StopIteration from None
                if not self._reopened(exc):
                    raise _rpc.map_rpc_error(exc, self._what) from exc
                continue
            self._subscribed = True
            return LighthouseEvent.from_proto(message)

    def _reopened(self, exc: grpc.RpcError) -> bool:
        if self._follow is None:
            return False
        if self._subscribed:
            # A stream that was open is news for the caller, who reopens it
            # with subscribe(): the client has moved for that call.
            self._follow(exc, False)
            return False
        try:
            call = self._follow(exc, True)
        except (CoordinationError, CoordinationTimeoutError):
            if self._closed:  # closing the client ends the search
                raise StopIteration from None
            raise
        if call is None:
            return False
        with self._lock:
            if not self._closed:
                self._call = call
                return True
        call.cancel()
        raise StopIteration

    def close(self) -> None:
        """End the stream; a blocked iteration stops. Idempotent."""
        with self._lock:
            self._closed = True
            call = self._call
        call.cancel()

    def __enter__(self) -> LighthouseEventStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
