"""
torchft's native module, by name
================================

torchft's tests and low-level code import the coordination classes from its
native extension, ``torchft._torchft``. Replacing the package prefix turns
that into ``ftdist._torchft`` (this module); a global ``torchft`` ->
``ftdist`` replace turns it into ``ftdist._ftdist``, which re-exports the same
objects. Nothing here imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ftdist.lighthouse.client import LighthouseClient
from ftdist.lighthouse.server import LighthouseServer
from ftdist.lighthouse.types import Quorum, QuorumMember, Timestamp
from ftdist.manager.client import ManagerClient
from ftdist.manager.rule import QuorumResult
from ftdist.manager.server import ManagerServer


def lighthouse_main(argv: Sequence[str] | None = None) -> int:
    """Run a lighthouse in the foreground: torchft's ``torchft_lighthouse``.

    The ``ftdist_lighthouse`` console script runs this; it is
    ``ftdist lighthouse`` and takes torchft's flags (``--min_replicas``,
    ``--join_timeout_ms``, ``--quorum_tick_ms``, ``--heartbeat_timeout_ms``,
    ``--bind``) as well as ftdist's.

    Args:
        argv: the flags (default: ``sys.argv[1:]``).

    Returns:
        The exit status of ``ftdist lighthouse``.

    Raises:
        SystemExit: on ``--help`` or a usage error, as argparse does.
    """
    from ftdist.cli import main

    args = list(sys.argv[1:] if argv is None else argv)
    return main(["lighthouse", *args])


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
