"""
Reachability probes
===================

After a step failed, a replica group's manager server asks whether the
failure was a partition: it tries a TCP connect to the manager server of
every other member of its last quorum, all at once, each bounded by
:data:`PROBE_TIMEOUT`. The peers whose connect timed out (or found no route)
are reported to the lighthouse with the next quorum request
(:mod:`ftdist.lighthouse.partition` decides whom to leave out).

Why a connect, and why only its timeout counts: a partition makes packets
vanish, so a connect across it times out; a connect that is refused reached
the peer's host, so the path works and the peer merely died, which the
lighthouse learns from its heartbeats. Dead processes are thus never
reported, only unreachable hosts.
"""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Mapping
from urllib.parse import urlsplit

__all__ = ["PROBE_TIMEOUT_S", "unreachable_peers"]

# Long enough for a connect on a loaded but working network (a SYN is
# answered in well under a millisecond on a LAN); short, because the group's
# next quorum waits for it.
PROBE_TIMEOUT_S = 1.0

# Errors that say the packets found no way to the peer's host.
_NO_PATH = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT}


def _host_port(address: str) -> tuple[str, int] | None:
    parts = urlsplit(address if "://" in address else f"//{address}")
    if parts.hostname is None or parts.port is None:
        return None
    return parts.hostname, parts.port


def _reachable(address: str, timeout_s: float) -> bool:
    target = _host_port(address)
    if target is None:
        return True  # nothing to probe: never report what cannot be checked
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return True
    except TimeoutError:
        return False
    except OSError as exc:
        return exc.errno not in _NO_PATH


def unreachable_peers(
    peers: Mapping[str, str], timeout_s: float = PROBE_TIMEOUT_S
) -> dict[str, str]:
    """The peers whose manager server cannot be reached: replica id to address.

    Args:
        peers: replica id to manager address (``http://host:port``).
        timeout_s: how long each connect may take; all run at once, so the
            call takes at most about this long.

    Returns:
        The unreachable subset of ``peers``.
    """
    results: dict[str, bool] = {}

    def probe(replica_id: str, address: str) -> None:
        results[replica_id] = _reachable(address, timeout_s)

    threads = [
        threading.Thread(target=probe, args=item, name="ftdist-probe", daemon=True)
        for item in peers.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        # A thread still connecting past its bound counts as unreachable.
        thread.join(timeout_s + 0.5)
    return {rid: addr for rid, addr in peers.items() if not results.get(rid, False)}
