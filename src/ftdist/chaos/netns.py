"""
Network namespaces for the chaos suite
======================================

:class:`ChaosNetwork` gives each replica group a network of its own on this
machine, so that network partitions can be made between real processes:

* a bridge in the root namespace holds two addresses: ``.1`` for the
  supervisor's control store (never cut) and ``.2`` for the lighthouse;
* replica group ``g`` lives in namespace ``ftdist-chaos-<pid>-g<g>``, joined
  to the bridge by a veth pair, at address ``.1<g>`` (``.10``, ``.11``, ...);
* every namespace also holds a *sink*: a veth pair whose far end answers
  nothing. A partition routes the addresses it cuts into the sink, so packets
  vanish silently, as on a real network, instead of failing fast (a
  ``blackhole`` route would make ``connect`` fail at once, and this kernel
  has neither iptables nor netem).

A group's processes enter their namespace with :func:`enter` before they
open any socket. Names carry the supervisor's pid, so :func:`remove_stale`
can clean up after a run that was SIGKILLed.

Everything needs root and the ``ip`` tool; :func:`unavailable` says why not.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field

NS_PREFIX = "ftdist-chaos-"
LINK_PREFIX = "ftc"
CLONE_NEWNET = 0x40000000
# The interface name inside every group's namespace (Gloo is pointed at it).
INNER_IFNAME = "veth0"
SINK_IFNAME = "sink0"
SINK_MAC = "02:00:00:00:00:01"
IP_TIMEOUT_S = 10.0
# How long a deleted link may linger while the kernel tears down its pair.
LINK_GONE_S = 5.0


class NetworkError(RuntimeError):
    """An ``ip`` command failed (the message carries its stderr)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _tc(namespace: str, *args: str) -> None:
    proc = subprocess.run(
        ["tc", "-n", namespace, *args],
        capture_output=True,
        text=True,
        timeout=IP_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise NetworkError(f"tc {' '.join(args)}: {proc.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = f"{NS_PREFIX}probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces and links of chaos runs whose supervisor is gone.

    Returns:
        The names removed.
    """
    removed = []
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(re.escape(NS_PREFIX) + r"(\d+)-g\d+", name)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    links = _ip("-o", "link", "show", check=False).stdout
    for m in re.finditer(r"^\d+: (" + LINK_PREFIX + r"(\d+)[a-z]\w*)[@:]", links, re.M):
        if not _alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


def _free_subnet() -> str:
    used = set(re.findall(r"inet 10\.213\.(\d+)\.", _ip("-4", "addr", check=False).stdout))
    # Start from a subnet derived from the pid: two runs creating their
    # networks at the same moment (parallel test workers) both see the same
    # free list, and a random pick could collide.
    start = os.getpid() % 254
    for n in (1 + (start + i) % 254 for i in range(254)):
        if str(n) not in used:
            return f"10.213.{n}"
    raise NetworkError("no free 10.213.N.0/24 subnet on this machine")


@dataclass
class ChaosNetwork:
    """The namespaces, bridge and partitions of one chaos run.

    Args:
        groups: replica groups (one namespace each).
        rate_mbit: limit what each group sends to this many Mbit/s (a token
            bucket on its link), so that a heal takes as long as on a modest
            network; 0 for no limit.

    Attributes:
        subnet: the run's ``10.213.N`` prefix.
        control_host: the supervisor's address, reachable from every group.
        lighthouse_host: the lighthouse's address.
        namespaces: each group's namespace name.
        cuts: each group's partitioned addresses.
    """

    groups: int
    rate_mbit: int = 0
    owner: int = field(default_factory=os.getpid)
    subnet: str = ""
    namespaces: list[str] = field(default_factory=list)
    cuts: dict[int, set[str]] = field(default_factory=dict)
    _links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        """The bridge's name."""
        return f"{LINK_PREFIX}{self.owner}br"

    @property
    def control_host(self) -> str:
        """The supervisor's address on the bridge."""
        return f"{self.subnet}.1"

    @property
    def lighthouse_host(self) -> str:
        """The lighthouse's address on the bridge."""
        return f"{self.subnet}.2"

    def group_host(self, group: int) -> str:
        """Replica group ``group``'s address."""
        return f"{self.subnet}.{10 + group}"

    def create(self) -> ChaosNetwork:
        """Build the bridge and one namespace per group.

        Raises:
            NetworkError: an ``ip`` command failed (what was built is removed).
        """
        self.subnet = _free_subnet()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._links.append(self.bridge)
            _ip("addr", "add", f"{self.control_host}/24", "dev", self.bridge)
            _ip("addr", "add", f"{self.lighthouse_host}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for g in range(self.groups):
                self._add_group(g)
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_group(self, g: int) -> None:
        ns = f"{NS_PREFIX}{self.owner}-g{g}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        self.cuts[g] = set()
        outer, inner = f"{LINK_PREFIX}{self.owner}g{g}", f"{LINK_PREFIX}{self.owner}p{g}"
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._links.append(outer)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("-n", ns, "link", "set", inner, "name", INNER_IFNAME)
        _ip("-n", ns, "addr", "add", f"{self.group_host(g)}/24", "dev", INNER_IFNAME)
        _ip("-n", ns, "link", "set", INNER_IFNAME, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        # Both ends of the sink stay inside the namespace; nothing listens.
        _ip("-n", ns, "link", "add", SINK_IFNAME, "type", "veth", "peer", "name", "sink1")
        _ip("-n", ns, "link", "set", SINK_IFNAME, "up")
        _ip("-n", ns, "link", "set", "sink1", "up")
        if self.rate_mbit:
            _tc(ns, "qdisc", "add", "dev", INNER_IFNAME, "root", "tbf", "rate",
                f"{self.rate_mbit}mbit", "burst", "256kb", "latency", "100ms")  # fmt: skip

    def cut(self, group: int, hosts: list[str]) -> None:
        """Make ``hosts`` unreachable from (and to) ``group``: packets vanish.

        Raises:
            NetworkError: an ``ip`` command failed.
        """
        ns = self.namespaces[group]
        for host in hosts:
            if host in self.cuts[group]:
                continue
            _ip("-n", ns, "neigh", "replace", host, "lladdr", SINK_MAC, "dev", SINK_IFNAME)
            _ip("-n", ns, "route", "add", f"{host}/32", "dev", SINK_IFNAME)
            self.cuts[group].add(host)

    def heal(self, group: int) -> None:
        """Lift every cut of ``group``.

        Raises:
            NetworkError: an ``ip`` command failed.
        """
        ns = self.namespaces[group]
        for host in sorted(self.cuts[group]):
            _ip("-n", ns, "route", "del", f"{host}/32", "dev", SINK_IFNAME)
            _ip("-n", ns, "neigh", "del", host, "dev", SINK_IFNAME, check=False)
        self.cuts[group].clear()

    def pids(self) -> dict[str, list[int]]:
        """The processes still inside each namespace."""
        out = {}
        for ns in self.namespaces:
            text = _ip("netns", "pids", ns, check=False).stdout
            out[ns] = [int(p) for p in text.split()]
        return out

    def destroy(self) -> list[str]:
        """Remove the namespaces and links (idempotent).

        Returns:
            What could not be removed, for the leak report.
        """
        left = []
        # Links first: deleting an outer veth takes its peer in the namespace
        # with it. The other order races: `ip netns del` returns before the
        # kernel's cleanup of the namespace has removed the peer, and with it
        # the outer end, so a `link del` issued meanwhile finds no device and
        # an existing link can vanish between our `show` and our `del`.
        for link in self._links:
            if _ip("link", "show", link, check=False).returncode == 0:
                _ip("link", "del", link, check=False)
                if not _link_gone(link, LINK_GONE_S):
                    left.append(link)
        for ns in self.namespaces:
            if _ip("netns", "del", ns, check=False).returncode != 0:
                left.append(ns)
        self.namespaces, self._links = [], []
        return left


def _link_gone(link: str, within_s: float) -> bool:
    """Whether ``link`` is gone, waiting up to ``within_s`` for the kernel's
    asynchronous namespace cleanup to finish removing it."""
    deadline = time.monotonic() + within_s
    while _ip("link", "show", link, check=False).returncode == 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def enter(namespace: str) -> None:
    """Move the calling thread (a fresh process) into ``namespace``.

    Call before any socket is opened; threads started afterwards inherit it.

    Raises:
        OSError: the namespace does not exist or ``setns`` failed.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


__all__ = ["ChaosNetwork", "NetworkError", "enter", "remove_stale", "unavailable"]
