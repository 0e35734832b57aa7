"""
``ftdist._ftdist``: the same objects as :mod:`ftdist._torchft`
=============================================================

What ``torchft._torchft`` becomes when a script's ``torchft`` is replaced by
``ftdist`` everywhere, including inside the module name.
"""

from __future__ import annotations

from ftdist._torchft import (
    LighthouseClient,
    LighthouseServer,
    ManagerClient,
    ManagerServer,
    Quorum,
    QuorumMember,
    QuorumResult,
    Timestamp,
    lighthouse_main,
)

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
