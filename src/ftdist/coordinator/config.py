"""
The coordinator's settings
==========================

What the coordinator reads from the environment, each variable spelled out
here (docs/configuration.md lists them all):

``LOCAL_RANK``
    torchrun's local rank, for ``init_distributed_environment`` with
    ``env://`` and no ``local_rank``.
``FTDIST_HOST_IP``
    the address a MessageQueue writer advertises to remote readers
    (default: what the host name resolves to).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

__all__ = ["HOST_IP_ENV", "host_ip", "local_rank"]

HOST_IP_ENV = "FTDIST_HOST_IP"


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """torchrun's ``LOCAL_RANK`` (0 when unset).

    Raises:
        ValueError: it is set but not an integer.
    """
    env = os.environ if environ is None else environ
    raw = env.get("LOCAL_RANK") or "0"
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={raw!r} is not an integer") from None


def host_ip(environ: Mapping[str, str] | None = None) -> str:
    """``FTDIST_HOST_IP`` if set, else what the host name resolves to (loopback if nothing)."""
    env = os.environ if environ is None else environ
    ip = env.get("FTDIST_HOST_IP")
    if ip:
        return ip
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
