"""
Single-threaded gRPC server on grpcio's completion queue
========================================================

The coordination servers answer many small calls and park many of them (a
quorum request waits until everybody asked), so their cost per call decides
how large a job they can serve. grpcio's public servers pay for generality:
``grpc.aio`` wakes an asyncio loop from a poller thread for every completed
operation, and ``grpc.server`` hands every call to a thread pool; either costs
about 200 us of CPU per call on a small machine, three times what torchft's
Rust lighthouse spends. This module drives grpcio's core directly from one
thread, the way ``grpc.server`` does internally, without the hand-offs: about
60 us per call.

It uses ``grpc._cython.cygrpc``, grpcio's internal layer under its public
servers. That layer has been stable for years, but it is not a public API:
the integration tests exercise every path here so that a grpcio upgrade that
changes it fails loudly.

Model: handlers run on the server thread, get the request bytes and an
:class:`RpcCall`, and either answer at once (:meth:`RpcCall.reply`,
:meth:`RpcCall.abort`) or keep the call to answer later, from the same
thread (anything scheduled with :meth:`CompletionQueueServer.call_soon`, the
periodic tick, or another call's handler). Nothing here blocks the thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc._cython import cygrpc

from ftdist._rpc.call import handler_for, run_handler
from ftdist._rpc.schedule import Schedule

__all__ = ["CompletionQueueServer", "Handler", "RpcCall"]

logger = logging.getLogger("ftdist.rpc")

_NO_FLAGS = 0
# Longest sleep between checks for work sent from other threads; it bounds the
# latency of call_soon() and shutdown, and costs one wake-up each time.
_MAX_POLL_S = 0.02
_POSTED_REQUESTS = 256


def _status(code: grpc.StatusCode) -> int:
    return int(code.value[0])


_OK = _status(grpc.StatusCode.OK)


class RpcCall:
    """One server-side call, used only on the server thread.

    Attributes:
        method: the full method path, e.g. ``/torchft.LighthouseService/Quorum``.
        metadata: the client's invocation metadata, ``(key, value)`` pairs.
        done: the call has been answered (or its client went away).
        cancelled: its client cancelled it, disconnected or ran out of time.
    """

    __slots__ = (
        "_call",
        "_close_watched",
        "_finish",
        "_metadata_sent",
        "_on_cancel",
        "_outbox",
        "_sending",
        "cancelled",
        "done",
        "metadata",
        "method",
    )

    def __init__(self, call: Any, method: str, metadata: tuple[tuple[str, Any], ...] = ()) -> None:
        self._call = call
        self.method = method
        self.metadata = metadata
        self.done = False
        self.cancelled = False
        self._metadata_sent = False
        self._close_watched = False
        self._on_cancel: Callable[[], None] | None = None
        self._outbox: collections.deque[bytes] | None = None
        self._sending = False
        self._finish: tuple[int, bytes, tuple[tuple[str, str], ...] | None] | None = None

    # -- unary ------------------------------------------------------------

    def reply(self, payload: bytes) -> None:
        """Answer with ``payload`` and status OK. Ignored once done.

        A call whose client left completes silently.
        """
        if self.done:
            return
        ops: list[Any] = []
        if not self._metadata_sent:
            ops.append(cygrpc.SendInitialMetadataOperation(None, _NO_FLAGS))
        ops.append(cygrpc.SendMessageOperation(payload, _NO_FLAGS))
        ops.append(cygrpc.SendStatusFromServerOperation(None, _OK, b"", _NO_FLAGS))
        self._end(ops)

    def abort(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        """End the call with an error status, and ``trailing`` metadata when
        given. Ignored once done.

        A stream with messages still queued ends after they are sent.
        """
        if self.done:
            return
        if self._sending:
            self._finish = (_status(code), details.encode(), trailing)
            return
        ops: list[Any] = []
        if not self._metadata_sent:
            ops.append(cygrpc.SendInitialMetadataOperation(None, _NO_FLAGS))
        ops.append(
            cygrpc.SendStatusFromServerOperation(
                trailing, _status(code), details.encode(), _NO_FLAGS
            )
        )
        self._end(ops)

    def metadata_value(self, key: str) -> str | None:
        """The value of one invocation metadata key, or None when absent."""
        for k, v in self.metadata:
            if k == key:
                return v if isinstance(v, str) else bytes(v).decode("utf-8", "replace")
        return None

    def _end(self, ops: list[Any]) -> None:
        self.done = True
        if not self._close_watched:
            # Completes once the client has the status; nothing to do then.
            ops.append(cygrpc.ReceiveCloseOnServerOperation(_NO_FLAGS))
            self._close_watched = True
        self._call.start_server_batch(ops, _ignore)

    # -- server streaming ---------------------------------------------------

    def send(self, payload: bytes) -> None:
        """Queue one message of a server-streaming response. Ignored once done."""
        if self.done or self._finish is not None:
            return
        if self._sending:
            if self._outbox is None:
                self._outbox = collections.deque()
            self._outbox.append(payload)
            return
        self._send_now(payload)

    def _send_now(self, payload: bytes) -> None:
        ops: list[Any] = []
        if not self._metadata_sent:
            ops.append(cygrpc.SendInitialMetadataOperation(None, _NO_FLAGS))
            self._metadata_sent = True
        ops.append(cygrpc.SendMessageOperation(payload, _NO_FLAGS))
        self._sending = True
        self._call.start_server_batch(ops, self._on_sent)

    def _on_sent(self, event: Any) -> None:
        self._sending = False
        if self.done:
            return
        if not event.success:
            self._outbox = None  # the client is gone; _on_close reports it
            return
        if self._outbox:
            self._send_now(self._outbox.popleft())
        elif self._finish is not None:
            code, details, trailing = self._finish
            self._finish = None
            ops: list[Any] = [
                cygrpc.SendStatusFromServerOperation(trailing, code, details, _NO_FLAGS)
            ]
            self._end(ops)

    @property
    def pending_messages(self) -> int:
        """Messages queued but not yet handed to the transport."""
        return len(self._outbox) if self._outbox else 0

    # -- cancellation -------------------------------------------------------

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the server thread) if the client goes away
        before the call is answered: cancel, disconnect or deadline.
        """
        self._on_cancel = callback
        if not self._close_watched:
            self._close_watched = True
            self._call.start_server_batch(
                (cygrpc.ReceiveCloseOnServerOperation(_NO_FLAGS),), self._on_close
            )

    def _on_close(self, event: Any) -> None:
        cancelled = not event.success or event.batch_operations[0].cancelled()
        if not cancelled or self.done:
            return
        self.cancelled = True
        self.done = True
        callback, self._on_cancel = self._on_cancel, None
        if callback is not None:
            callback()


def _ignore(event: Any) -> None:
    pass


Handler = Callable[[RpcCall, bytes], None]
"""A method implementation: gets the call and the serialized request."""


class CompletionQueueServer:
    """A gRPC server whose every callback runs on one thread.

    Args:
        bind: listen address, ``host:port``.
        handlers: method path to handler.
        options: gRPC server options.
        tick: called on the server thread every ``tick_period_s``.
        tick_period_s: tick period in seconds.
        thread_name: name of the server thread.
        auth: given a call's invocation metadata, why it is refused (None to
            serve it); a refused call is answered UNAUTHENTICATED before its
            request is read or any handler runs.
        credentials: TLS credentials for the port; None serves plaintext.

    Raises:
        OSError: (from :meth:`start`) if the address cannot be bound.
    """

    def __init__(
        self,
        bind: str,
        handlers: dict[str, Handler],
        options: list[tuple[str, int]],
        *,
        tick: Callable[[], object] | None = None,
        tick_period_s: float = 0.1,
        thread_name: str = "ftdist-grpc",
        auth: Callable[[Any], str | None] | None = None,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self._bind = bind
        self._handlers = handlers
        self._auth = auth
        self._credentials = credentials
        # gRPC's completion queue cannot be woken from Python; the loop polls
        # every _MAX_POLL_S instead, which bounds call_soon()'s latency.
        self._schedule = Schedule(tick, tick_period_s)
        self._cq = cygrpc.CompletionQueue()
        self._server = cygrpc.Server(tuple(options), False)
        self._server.register_completion_queue(self._cq)
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._schedule.thread = self._thread
        self._stopping = False
        self._grace_deadline = 0.0
        self._cancelled_all = False
        self._shutdown_done = False
        self.port = 0

    def start(self) -> int:
        """Bind, start serving and return the bound port.

        Returns:
            The port.

        Raises:
            OSError: if the address cannot be bound.
        """
        credentials = None if self._credentials is None else self._credentials._credentials
        port = self._server.add_http2_port(self._bind.encode(), credentials)
        if not port:
            self._server.destroy()
            raise OSError(f"cannot bind gRPC server to {self._bind} (address in use?)")
        self.port = int(port)
        self._server.start()
        # Requests kept posted: with one, calls that arrive together queue in
        # gRPC's core, which caps that queue (1000 calls) and drains it one
        # match per loop; a thousand replica groups asking at once stalled
        # the round for seconds.
        for _ in range(_POSTED_REQUESTS):
            self._server.request_call(self._cq, self._cq, self._on_request_call)
        self._thread.start()
        return self.port

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server thread within about 20 ms. Thread-safe.

        What ``fn`` raises is logged on the server thread.
        """
        self._schedule.call_soon(fn)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server thread ``delay_s`` seconds from now. Thread-safe.

        What ``fn`` raises is logged on the server thread.
        """
        self._schedule.call_later(delay_s, fn)

    def run(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run ``fn`` on the server thread and return its result. Thread-safe.

        Args:
            fn: what to run.
            timeout: how long to wait for it, in seconds.

        Returns:
            What ``fn`` returned.

        Raises:
            RuntimeError: if the server is stopped or stopping.
            TimeoutError: if it did not run in time.
            Exception: whatever ``fn`` raised.
        """
        running = not self._stopping and self._thread.is_alive()
        return self._schedule.run(fn, timeout, running)

    def stop(self, grace_s: float) -> None:
        """Stop accepting calls, give running ones ``grace_s`` seconds to end,
        cancel the rest and join the thread. Thread-safe and idempotent.
        """
        if not self._thread.is_alive():
            return
        self.call_soon(lambda: self._begin_shutdown(grace_s))
        self._thread.join()

    # -- the server thread --------------------------------------------------

    def _serve(self) -> None:
        schedule = self._schedule
        while True:
            wait = schedule.wait_s(time.monotonic(), _MAX_POLL_S)
            event = self._cq.poll(time.time() + wait)
            kind = event.completion_type
            if kind == cygrpc.CompletionType.queue_shutdown:
                break
            if kind == cygrpc.CompletionType.operation_complete:
                try:
                    event.tag(event)
                except Exception:
                    logger.exception("gRPC callback failed")
            schedule.run_due(self._stopping)
            now = time.monotonic()
            if self._stopping and not self._cancelled_all and now >= self._grace_deadline:
                self._cancelled_all = True
                self._server.cancel_all_calls()
            event = None
        self._server.destroy()

    def _begin_shutdown(self, grace_s: float) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._grace_deadline = time.monotonic() + grace_s
        self._server.shutdown(self._cq, self._on_shutdown)

    def _on_shutdown(self, event: Any) -> None:
        self._shutdown_done = True
        self._cq.shutdown()

    def _on_request_call(self, event: Any) -> None:
        if not event.success or self._stopping:
            return
        self._server.request_call(self._cq, self._cq, self._on_request_call)
        method = event.call_details.method.decode("utf-8", "replace")
        rpc = RpcCall(event.call, method, tuple(event.invocation_metadata or ()))
        handler = handler_for(rpc, self._handlers, self._auth)
        if handler is None:
            return

        def on_message(msg_event: Any) -> None:
            if not msg_event.success:
                rpc.done = True
                return
            payload = msg_event.batch_operations[0].message()
            run_handler(handler, rpc, payload if payload is not None else b"")

        event.call.start_server_batch((cygrpc.ReceiveMessageOperation(_NO_FLAGS),), on_message)
