"""
Coordination (low-level API)
============================

torchft's ``torchft.coordination``: a module of aliases, re-exporting from
:mod:`ftdist.lighthouse` and :mod:`ftdist.manager` the servers and clients a
fault-tolerant job coordinates through, for code that builds its own
fault-tolerance algorithm. (vLLM's ``GroupCoordinator`` is another concept,
in :mod:`ftdist.coordinator`.)

* :class:`LighthouseServer` / :class:`LighthouseClient`: the job's quorum
  server (see :mod:`ftdist.lighthouse`).
* :class:`ManagerServer` / :class:`ManagerClient`: one server per replica
  group, gathering its ranks' quorum requests and commit votes (see
  :mod:`ftdist.manager`).
* :class:`Quorum` / :class:`QuorumMember`: what a quorum call returns.

Glossary, used everywhere in ftdist:

``replica_id``
    Stable string id of a replica group (a uuid is appended per restart).
``replica_rank`` / ``replica_world_size``
    A replica group's position in the sorted quorum, and the quorum's size.
``group_rank`` / ``group_world_size``
    A rank's position inside its replica group, and the group's size.
``quorum_id``
    Id of a quorum; grows on a membership change or after a failed commit.
``step``
    The training step a replica group reports; members behind the quorum's
    max step heal from an up-to-date peer.
"""

from __future__ import annotations

from ftdist.lighthouse import (
    LighthouseClient,
    LighthouseConfig,
    LighthouseEvent,
    LighthouseEventStream,
    LighthouseServer,
    Quorum,
    QuorumMember,
    Timestamp,
)
from ftdist.manager.client import ManagerClient
from ftdist.manager.server import ManagerServer

__all__ = [
    "LighthouseClient",
    "LighthouseConfig",
    "LighthouseEvent",
    "LighthouseEventStream",
    "LighthouseServer",
    "ManagerClient",
    "ManagerServer",
    "Quorum",
    "QuorumMember",
    "Timestamp",
]
