"""
The checkpoint transports' settings
===================================

What ``ftdist.checkpointing`` reads from the environment, each variable
spelled out here (docs/configuration.md lists them all):

``FTDIST_CHECKPOINT_LOCAL_SOCKET``
    ``1`` (the default) or ``0``: whether an ``HTTPTransport`` also serves
    peers on its own host over an abstract Unix socket. Off, every heal goes
    over TCP (a sandbox that forbids Unix sockets, or a comparison).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV_LOCAL_SOCKET", "local_socket"]

ENV_LOCAL_SOCKET = "FTDIST_CHECKPOINT_LOCAL_SOCKET"
_ON = {"1", "true", "yes", "on"}
_OFF = {"0", "false", "no", "off"}


def local_socket(argument: bool | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether to serve peers on this host over a local socket: ``argument``, else
    ``FTDIST_CHECKPOINT_LOCAL_SOCKET``, else yes.

    Raises:
        ValueError: the variable is set to something other than 1/0 (or true/false,
            yes/no, on/off).
    """
    if argument is not None:
        return argument
    env = os.environ if environ is None else environ
    value = env.get("FTDIST_CHECKPOINT_LOCAL_SOCKET", "").strip().lower()
    if not value or value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"FTDIST_CHECKPOINT_LOCAL_SOCKET={value!r} is not understood: set it to 1 (serve peers on "
        "this host over a local socket, the default) or 0 (TCP only)"
    )
