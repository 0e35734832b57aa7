"""
torchft's native module, by name
================================

torchft's tests and low-level code import the coordination classes from its
native extension, ``torchft._torchft``. Replacing the package prefix turns
that into ``ftdist._torchft`` (this module); a global ``torchft`` ->
``ftdist`` replace turns it into ``ftdist._ftdist``, which re-exports the same
objects. A table of aliases: each object lives in its own package. Nothing
here imports torch.
"""

from __future__ import annotations

from ftdist.cli.lighthouse import lighthouse_main
from ftdist.lighthouse.client import LighthouseClient
from ftdist.lighthouse.server import LighthouseServer
from ftdist.lighthouse.types import Quorum, QuorumMember, Timestamp
from ftdist.manager.client import ManagerClient
from ftdist.manager.rule import QuorumResult
from ftdist.manager.server import ManagerServer

__all__ = [
    "LighthouseClient",
    "LighthouseServer",
    "ManagerClient",
    "ManagerServer",
    "Quorum",
    "QuorumMember",
    "QuorumResult",
    "Timestamp",
    "lighthouse_main",
]
