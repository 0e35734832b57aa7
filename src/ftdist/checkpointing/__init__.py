"""
Live checkpoint transports
==========================

How a recovering replica gets the state of a healthy one, in memory, without
touching storage:

- :class:`HTTPTransport` (the Manager's default): the source serves its live
  state over HTTP, the destination pulls it.
- :class:`PGTransport`: send/recv over the (just reconfigured) process group.

Both stream tensors straight from and into memory (no serialised copy of the
whole state), describe the state in a plain-data header (no pickle: a peer's
bytes never run code here), end each stream with word sums of its bytes so corruption or
truncation is an error, and refuse a checkpoint of the wrong step. The wire
format and the security properties are in docs/checkpointing.md.
"""

from __future__ import annotations

from ftdist.checkpointing.http_transport import (
    CheckpointHTTPError,
    CheckpointTimeoutError,
    CheckpointURLError,
    HTTPTransport,
)
from ftdist.checkpointing.pg_transport import PGTransport
from ftdist.checkpointing.transport import CheckpointTransport, TransferStats

__all__ = [
    "CheckpointHTTPError",
    "CheckpointTimeoutError",
    "CheckpointTransport",
    "CheckpointURLError",
    "HTTPTransport",
    "PGTransport",
    "TransferStats",
]
