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

``FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB``
    The most memory, in MiB (default 1024), that a replica which never
    committed populates while it waits for its first quorum, for the fresh
    tensors of the heal that usually follows (its optimizer's state). As
    large as the replica's own CPU tensors up to this; ``0`` turns it off.
    What the heal does not use is given back when it ends.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = [
    "ENV_DIRECT_READS",
    "ENV_LOCAL_SOCKET",
    "ENV_RECEIVE_RESERVE_MB",
    "direct_reads",
    "local_socket",
    "receive_reserve_bytes",
]

ENV_LOCAL_SOCKET = "FTDIST_CHECKPOINT_LOCAL_SOCKET"
ENV_DIRECT_READS = "FTDIST_CHECKPOINT_DIRECT_READS"
ENV_RECEIVE_RESERVE_MB = "FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB"
DEFAULT_RECEIVE_RESERVE_MB = 1024
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


def receive_reserve_bytes(
    argument: int | None = None, environ: Mapping[str, str] | None = None
) -> int:
    """The most memory a never-committed replica populates for its first heal, in
    bytes: ``argument`` (bytes), else ``FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB`` (MiB),
    else 1024 MiB; 0 is off.

    Raises:
        ValueError: the argument or the variable is negative or not a whole number.
    """
    if argument is not None:
        if isinstance(argument, bool) or not isinstance(argument, int) or argument < 0:
            raise ValueError(
                f"receive reserve of {argument!r} bytes: give a whole number of bytes, 0 for none"
            )
        return argument
    env = os.environ if environ is None else environ
    value = env.get("FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB", "").strip()
    if not value:
        return DEFAULT_RECEIVE_RESERVE_MB << 20
    # ASCII digits only: str.isdigit() also takes superscripts and full-width digits.
    if not re.fullmatch(r"[0-9]+", value):
        raise ValueError(
            f"FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB={value!r} is not understood: set it to a "
            f"whole number of MiB (default {DEFAULT_RECEIVE_RESERVE_MB}), or 0 for none"
        )
    return int(value) << 20


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
