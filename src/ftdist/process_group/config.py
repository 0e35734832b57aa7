"""
The process groups' settings
============================

What the process-group package reads from the environment, each variable
spelled out here (docs/configuration.md lists them all):

``FTDIST_STORE_BIND``
    where a replica group's own TCPStore (and a reconfigure handle's store)
    listens: an address, or ``0.0.0.0``/``::`` for every interface (see
    :func:`ftdist.process_group._store.store_bind_host` for the default).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV_STORE_BIND", "store_bind"]

ENV_STORE_BIND = "FTDIST_STORE_BIND"


def store_bind(environ: Mapping[str, str] | None = None) -> str:
    """``FTDIST_STORE_BIND``, stripped of spaces and IPv6 brackets ("" when unset)."""
    env = os.environ if environ is None else environ
    return env.get("FTDIST_STORE_BIND", "").strip().strip("[]")
