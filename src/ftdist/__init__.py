"""
ftdist
======

Fault-tolerant, runtime-reconfigurable process groups and training primitives
for PyTorch, in pure Python.

Replica groups that fail drop out of the quorum at the next step; the survivors
reconfigure their process groups and keep stepping; a restarted replica heals
live from a healthy peer's memory.

The public API follows torchft's (replace ``torchft`` by ``ftdist`` in imports).
Submodules are imported lazily so that ``import ftdist`` stays cheap.
"""

from __future__ import annotations

from ftdist.errors import (
    CollectiveTimeoutError,
    CommunicationError,
    FtdistError,
    ProcessGroupAbortedError,
)

__version__ = "0.1.0"

__all__ = [
    "CollectiveTimeoutError",
    "CommunicationError",
    "FtdistError",
    "ProcessGroupAbortedError",
    "__version__",
]
