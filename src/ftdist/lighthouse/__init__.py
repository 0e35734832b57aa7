"""
The lighthouse
==============

One lighthouse serves a whole fault-tolerant job. Every replica group's
manager server heartbeats it and, at each step, asks it for the **quorum**:
the replica groups that take the step together.

Invariants:

* **One answer per round.** Every member of a round receives the same quorum
  (members sorted by ``replica_id``) at the same moment.
* **Split-brain guard.** A new quorum needs at least ``min_replicas`` members
  and more than half of the replica groups heartbeating, so two quorums can
  never form apart.
* **quorum_id is the reconfigure signal.** It grows exactly when the process
  groups must be rebuilt: the membership changed, or a member reported a
  failed commit.
* **Failure news.** A member whose connection closes or whose heartbeat
  stops is reported to every subscriber at once (ftdist's extension; torchft
  clients never ask for it).

Modules, from the decision out:

* :mod:`~ftdist.lighthouse.quorum`: the pure quorum rule (no I/O, no clock).
* :mod:`~ftdist.lighthouse.engine`: the state machine around the rule.
* :mod:`~ftdist.lighthouse.server`: the gRPC server, wire-compatible with
  torchft's, and its failure-news stream.
* :mod:`~ftdist.lighthouse.client`: the client, with torchft's API.
* :mod:`~ftdist.lighthouse.status`: the status document and its metrics.
* :mod:`~ftdist.lighthouse.dashboard`: the HTTP dashboard.
* :mod:`~ftdist.lighthouse.config`: settings, environment, defaults.
* :mod:`~ftdist.lighthouse.types`: the value types clients get back.
"""

from __future__ import annotations

from ftdist.lighthouse.client import LighthouseClient, LighthouseEventStream
from ftdist.lighthouse.config import LighthouseConfig
from ftdist.lighthouse.server import LighthouseServer
from ftdist.lighthouse.types import LighthouseEvent, Quorum, QuorumMember, Timestamp

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
