"""
Forwarding to the leader
========================

A follower of a replicated lighthouse (:mod:`ftdist.lighthouse.replica`)
passes calls from clients that do not follow the leader themselves (torchft's
managers, which take one address) on to the leader, and the leader's answer
back, so that such a client works through any replica, behind one DNS name
for example. ftdist's own clients are told where the leader is instead and
move there (one hop less).

A forwarded call keeps its method and bytes; it carries the replica's own job
token, and is cancelled when its client goes away. When the leader dies
during the call, the client gets ``UNAVAILABLE`` and retries, as it would
against a single lighthouse that restarted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from ftdist._auth import tls_files
from ftdist._rpc import common as _rpc
from ftdist._rpc.auth import Metadata, open_channel
from ftdist._rpc.call import ServerCall

__all__ = ["LeaderForwarder"]


class LeaderForwarder:
    """Forwards calls to the leader, one channel per leader address.

    Args:
        metadata: the call metadata every forwarded call carries (the job
            token), or None.
    """

    def __init__(self, metadata: Metadata | None) -> None:
        self._metadata = metadata
        self._channels: dict[str, grpc.Channel] = {}

    def forward(
        self,
        rpc: ServerCall,
        request: bytes,
        leader: str,
        call_soon: Callable[[Callable[[], None]], None],
    ) -> None:
        """Send ``rpc``'s request to ``leader`` and answer ``rpc`` with its reply.

        Called on the server thread; the answer is handed back to it through
        ``call_soon``.

        Args:
            rpc: the call to answer.
            request: its request bytes.
            leader: the leader's gRPC address.
            call_soon: runs a function on the server thread.

        Raises:
            ValueError: ``leader`` is not a valid address.
        """
        channel = self._channels.get(leader)
        if channel is None:
            channel = open_channel(leader, _rpc.client_channel_options(), tls_files())
            self._channels[leader] = channel
        future = channel.unary_unary(rpc.method).future(request, metadata=self._metadata)

        def done(finished: Any) -> None:
            # On a gRPC thread: hand the outcome to the server thread.
            try:
                payload = finished.result()
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                if code is None or code is grpc.StatusCode.CANCELLED:
                    code = grpc.StatusCode.UNAVAILABLE
                text = f"{_rpc.FORWARDED_PREFIX} {leader}: {details}"
                call_soon(lambda: rpc.abort(code, text))
                return
            except Exception as exc:  # a cancelled future
                text = f"{_rpc.FORWARDED_PREFIX} {leader}: failed: {exc!r}"
                call_soon(lambda: rpc.abort(grpc.StatusCode.UNAVAILABLE, text))
                return
            call_soon(lambda: rpc.reply(payload))

        future.add_done_callback(done)
        rpc.on_cancel(future.cancel)

    def close(self) -> None:
        """Close every channel (forwarded calls in flight fail)."""
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            channel.close()
