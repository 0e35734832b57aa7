"""
``ftdist._ftdist``: the same objects as :mod:`ftdist._torchft`
=============================================================

What ``torchft._torchft`` becomes when a script's ``torchft`` is replaced by
``ftdist`` everywhere, including inside the module name.
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
