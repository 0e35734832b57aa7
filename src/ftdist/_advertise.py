"""
The advertised address
======================

Peers reach a replica group's servers (its manager server, its checkpoint
server, its process group's rendezvous store) at the host name those servers
advertise. By default that is this host's name, which on a cluster with
several networks may resolve to the slow one: torchft's issue #329 lost
780 s of a heal to a checkpoint server advertised under a name that resolved
to the management network. The choice is read here, once for every server:

``FTDIST_ADVERTISE_ADDR``
    the address (or name) peers use for this host;
``FTDIST_ADVERTISE_IFNAME``
    else, a network interface (``ib0``, ``eth1``), like ``GLOO_SOCKET_IFNAME``:
    its first IPv4 address, or its first IPv6 one when it has none;

else this host's name. An explicit ``hostname=`` argument wins over both.
Every server logs, when it starts, the address it advertises and the
interface that address belongs to (:func:`describe`), so a heal that
crawls can be traced to the network it used.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import struct
import sys
from collections.abc import Mapping

__all__ = [
    "ENV_ADVERTISE_ADDR",
    "ENV_ADVERTISE_IFNAME",
    "advertised_host",
    "describe",
    "interface_addresses",
    "log_advertised",
]

logger = logging.getLogger("ftdist.advertise")

ENV_ADVERTISE_ADDR = "FTDIST_ADVERTISE_ADDR"
ENV_ADVERTISE_IFNAME = "FTDIST_ADVERTISE_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_IF_INET6 = "/proc/net/if_inet6"


def _ipv4_of(ifname: str) -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    import fcntl

    request = struct.pack("256s", ifname.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
        except OSError:  # no such interface, or no IPv4 address on it
            return None
    return socket.inet_ntoa(answer[20:24])


def _ipv6_addresses() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    with contextlib.suppress(OSError), open(_IF_INET6) as f:
        for line in f:
            fields = line.split()
            if len(fields) == 6 and len(fields[0]) == 32:
                addr = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
                if not addr.is_link_local:
                    found.setdefault(fields[5], []).append(str(addr))
    return found


def interface_addresses() -> dict[str, list[str]]:
    """Every network interface of this host and its addresses (IPv4 first).

    Linux only (ioctl and ``/proc``); elsewhere the names alone, with no
    addresses.
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    v6 = _ipv6_addresses()
    out: dict[str, list[str]] = {}
    for name in names:
        v4 = _ipv4_of(name)
        out[name] = ([v4] if v4 else []) + v6.get(name, [])
    return out


def advertised_host(hostname: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The host peers use to reach this process's servers.

    ``hostname`` (an argument) > ``FTDIST_ADVERTISE_ADDR`` >
    ``FTDIST_ADVERTISE_IFNAME``'s address > ``socket.gethostname()``.

    Raises:
        ValueError: ``FTDIST_ADVERTISE_IFNAME`` names an interface this host
            lacks or one without an address (the message lists those it has).
    """
    if hostname:
        return hostname
    env = os.environ if environ is None else environ
    addr = env.get("FTDIST_ADVERTISE_ADDR", "").strip().strip("[]")
    if addr:
        return addr
    ifname = env.get("FTDIST_ADVERTISE_IFNAME", "").strip()
    if ifname:
        interfaces = interface_addresses()
        addresses = interfaces.get(ifname)
        if not addresses:
            have = ", ".join(f"{n} ({', '.join(a) or 'no address'})" for n, a in interfaces.items())
            what = "has no address" if ifname in interfaces else "is not an interface of this host"
            raise ValueError(
                f"FTDIST_ADVERTISE_IFNAME={ifname!r} {what}; set it to one of: {have or 'none'} "
                "(or set FTDIST_ADVERTISE_ADDR to an address)"
            )
        return addresses[0]
    return socket.gethostname()


def describe(host: str) -> str:
    """``host`` as peers will dial it: the address it resolves to here and its interface."""
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"{host} (does not resolve here: {exc.strerror or exc})"
    resolved = sorted({str(info[4][0]).split("%")[0] for info in infos})
    owners = {a: name for name, addrs in interface_addresses().items() for a in addrs}
    parts = []
    for address in resolved:
        owner = owners.get(address)
        if owner is None and ipaddress.ip_address(address).is_loopback:
            owner = "lo"
        parts.append(f"{address} on {owner or 'no interface of this host'}")
    note = ""
    if all(ipaddress.ip_address(a).is_loopback for a in resolved):
        note = "; loopback: only this host reaches it, set FTDIST_ADVERTISE_ADDR for others"
    shown = host if resolved == [bare] else f"{host} = {', '.join(resolved)}"
    return f"{shown} ({'; '.join(parts)}{note})"


def log_advertised(server: str, host: str, port: int) -> None:
    """Log, at INFO, where ``server`` is advertised and over which interface peers reach it."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s advertised at port %d of %s", server, port, describe(host))
