"""
A connection to a lighthouse
============================

One gRPC channel to one lighthouse (or one replica of a replicated one) and
the callables of every method the client uses on it, with the options that
make a dead connection show: a channel of its own, so that a renewed
connection is really new, and optional keepalive pings, so that a long
stream across a partition fails instead of staying half-open.

On plaintext, the unary calls (the quorum and heartbeat of every round
among them) go on :class:`~ftdist._rpc.h2_client.H2Channel` instead, which
makes them on the calling thread, about 120 us sooner each than through
grpcio; the gRPC channel still tells when the lighthouse is up and carries
the failure-news stream.
"""

from __future__ import annotations

from typing import Any

from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import ftdist_pb2, torchft_pb2
from ftdist._rpc.auth import open_channel, unary_calls

__all__ = ["Connection"]


class Connection:
    """One channel to the lighthouse and the calls made on it."""

    def __init__(
        self, addr: str, tls: Any, keepalive_s: float | None = None, rpc_client: str = "h2"
    ) -> None:
        # A channel of its own (no subchannel shared with other channels to
        # the same address), so that a renewed connection is really new.
        extra: dict[str, int] = {"grpc.use_local_subchannel_pool": 1}
        if keepalive_s is not None:
            ms = max(1, round(keepalive_s * 1000))
            extra.update(
                {
                    "grpc.keepalive_time_ms": ms,
                    "grpc.keepalive_timeout_ms": ms,
                    "grpc.keepalive_permit_without_calls": 1,
                    # An idle stream sends no data: keep pinging regardless.
                    "grpc.http2.max_pings_without_data": 0,
                }
            )
        options = [(k, v) for k, v in _rpc.client_channel_options() if k not in extra]
        self.channel = open_channel(addr, [*options, *extra.items()], tls)
        # No grpc-timeout: both lighthouses take a closed connection as the
        # cancel, and the header block stays cacheable.
        self._unary: Any = unary_calls(self.channel, addr, tls, rpc_client, send_timeout=False)
        # When this connection last showed it works (connected, or answered).
        self.alive_at = float("-inf")
        self.quorum = self._unary.unary_unary(
            _rpc.LIGHTHOUSE_QUORUM,
            request_serializer=torchft_pb2.LighthouseQuorumRequest.SerializeToString,
            response_deserializer=torchft_pb2.LighthouseQuorumResponse.FromString,
        )
        self.heartbeat = self._unary.unary_unary(
            _rpc.LIGHTHOUSE_HEARTBEAT,
            request_serializer=torchft_pb2.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=torchft_pb2.LighthouseHeartbeatResponse.FromString,
        )
        self.subscribe = self.channel.unary_stream(
            _rpc.EVENTS_SUBSCRIBE,
            request_serializer=ftdist_pb2.SubscribeRequest.SerializeToString,
            response_deserializer=ftdist_pb2.LighthouseEvent.FromString,
        )
        self.status = self._unary.unary_unary(
            _rpc.EVENTS_STATUS,
            request_serializer=ftdist_pb2.StatusRequest.SerializeToString,
            response_deserializer=ftdist_pb2.StatusResponse.FromString,
        )
        self.leave = self._unary.unary_unary(
            _rpc.EVENTS_LEAVE,
            request_serializer=ftdist_pb2.LeaveRequest.SerializeToString,
            response_deserializer=ftdist_pb2.LeaveResponse.FromString,
        )
        self.report_heal = self._unary.unary_unary(
            _rpc.EVENTS_REPORT_HEAL,
            request_serializer=ftdist_pb2.HealReport.SerializeToString,
            response_deserializer=ftdist_pb2.HealReportResponse.FromString,
        )

    def close(self) -> None:
        """Close the channel and the unary calls' connections; calls in flight fail."""
        if self._unary is not self.channel:
            self._unary.close()
        self.channel.close()
