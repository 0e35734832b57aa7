"""
Coordination
============

How the replica groups of a fault-tolerant job agree on who trains together.

One **lighthouse** (:class:`LighthouseServer`, or ``ftdist lighthouse``) runs
for the whole job. Each replica group's manager heartbeats it and, at every
step, asks it for the **quorum**: the replica groups that take this step
together. The lighthouse answers every member at once, with the members
sorted by ``replica_id`` and a ``quorum_id`` that changes exactly when the
process groups must be rebuilt (membership changed, or a commit failed).

Glossary, used everywhere in ftdist:

``replica_id``
    Stable string id of a replica group (torchft appends a uuid per restart).
``replica_rank``
    A replica group's position in the sorted quorum.
``quorum_id``
    Id of a quorum; grows on a membership change or after a failed commit.
``step``
    The training step a replica group reports; members behind the max step
    recover from an up-to-date peer.

Modules, from the decision out:

* :mod:`~ftdist.coordination.quorum`: the pure quorum rule (no I/O, no clock).
* :mod:`~ftdist.coordination.engine`: the lighthouse state machine on asyncio.
* :mod:`~ftdist.coordination.lighthouse`: the gRPC server (wire-compatible
  with torchft) and its failure-news stream.
* :mod:`~ftdist.coordination.lighthouse_client`: the client with torchft's API.
* :mod:`~ftdist.coordination.dashboard`: HTML page, JSON status, Prometheus
  metrics, kill action.
* :mod:`~ftdist.coordination.config`: settings, environment, defaults.
* ``proto/*.proto``: the wire protocol (``make proto`` regenerates ``_proto``).

The manager side (``ManagerServer``, ``ManagerClient``) joins this package next;
its messages are already in ``proto/torchft.proto``.
"""

from __future__ import annotations

from ftdist.coordination.config import LighthouseConfig
from ftdist.coordination.lighthouse import LighthouseServer
from ftdist.coordination.lighthouse_client import LighthouseClient, LighthouseEventStream
from ftdist.coordination.types import LighthouseEvent, Quorum, QuorumMember, Timestamp

__all__ = [
    "LighthouseClient",
    "LighthouseConfig",
    "LighthouseEvent",
    "LighthouseEventStream",
    "LighthouseServer",
    "Quorum",
    "QuorumMember",
    "Timestamp",
]
