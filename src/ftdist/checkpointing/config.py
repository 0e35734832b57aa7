"""
The checkpoint transports' settings
===================================

What ``ftdist.checkpointing`` reads from the environment, each variable
spelled out here (docs/configuration.md lists them all):

``FTDIST_CHECKPOINT_LOCAL_SOCKET``
    ``1`` (the default) or ``0``: whether an ``HTTPTransport`` also serves
    peers on its own host over an abstract Unix socket. Off, every heal goes
    over TCP (a sandbox that forbids Unix sockets, or a comparison).

``FTDIST_CHECKPOINT_DIRECT_READS``
    ``1`` (the default) or ``0``: whether a heal from a peer on the same host
    copies the state straight out of the peer's memory (``process_vm_readv``,
    where the kernel allows it) instead of streaming it over the local
    socket. Off on either side, the bytes stream.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV_DIRECT_READS", "ENV_LOCAL_SOCKET", "direct_reads", "local_socket"]

ENV_LOCAL_SOCKET = "FTDIST_CHECKPOINT_LOCAL_SOCKET"
ENV_DIRECT_READS = "FTDIST_CHECKPOINT_DIRECT_READS"
_ON = {"1", "true", "yes", "on"}
_OFF = {"0", "false", "no", "off"}


def local_socket(argument: bool | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether to serve peers on this host over a local socket: ``argument``, else
    ``FTDIST_CHECKPOINT_LOCAL_SOCKET``, else yes.

    Raises:
        ValueError: the variable is set to something other than 1/0 (or true/false,
            yes/no, on/off).
    """
    return _switch(
        argument,
        "FTDIST_CHECKPOINT_LOCAL_SOCKET",
        environ,
        "serve peers on this host over a local socket, the default",
        "TCP only",
    )


def direct_reads(argument: bool | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether heals between processes on this host may copy straight from the source's
    memory: ``argument``, else ``FTDIST_CHECKPOINT_DIRECT_READS``, else yes.

    Raises:
        ValueError: the variable is set to something other than 1/0 (or true/false,
            yes/no, on/off).
    """
    return _switch(
        argument,
        "FTDIST_CHECKPOINT_DIRECT_READS",
        environ,
        "copy a same-host peer's state straight from its memory, the default",
        "always stream over the socket",
    )


def _switch(
    argument: bool | None, name: str, environ: Mapping[str, str] | None, on: str, off: str
) -> bool:
    if argument is not None:
        return argument
    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if not value or value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name}={value!r} is not understood: set it to 1 ({on}) or 0 ({off})")
