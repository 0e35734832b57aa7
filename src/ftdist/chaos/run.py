"""
Running the chaos suite
=======================

:func:`run_chaos` takes a :class:`ChaosConfig` (``ftdist chaos``'s flags),
builds the network namespaces (or says loudly why not), starts the
lighthouse (with ``--replicated-lighthouse``: three replicas on a local etcd
cluster, :mod:`ftdist.chaos.controlplane`, or says loudly why not), runs
:class:`~ftdist.chaos.supervisor.ChaosSupervisor`, tears everything down,
checks that nothing outlived the run and that no step was committed under
two quorums of one id (:mod:`ftdist.chaos.quorums`), then writes
``report.json`` and prints the report.

Exit status: 0 when the verdict passes, 1 when it fails, 130 after Ctrl-C.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from ftdist._procfs import start_time, state
from ftdist.chaos import schedule
from ftdist.demo.run import clear_events, log_to, machine_facts

__all__ = ["ChaosConfig", "run_chaos"]

HEARTBEAT_TIMEOUT_MS = 2000
JOIN_TIMEOUT_MS = 3000
EVENTS_DIR = "events"
CONTROL_DIR = "control-plane"
# A trainer's process is gone this long after the run at the latest.
REAP_S = 15.0


@dataclass(frozen=True)
class ChaosConfig:
    """The chaos suite's options (the CLI flags).

    Attributes:
        duration_s: training time under fire, in seconds.
        groups: replica groups.
        group_size: ranks per replica group.
        seed: seeds the data, the weights and the schedule.
        kinds: the injection kinds to use; empty for every kind of the run's
            lighthouse (:data:`~ftdist.chaos.schedule.KINDS`, or with a
            replicated lighthouse :data:`~ftdist.chaos.schedule.REPLICATED_KINDS`).
        gap_s: least and most seconds between two injections.
        ordered: strike each kind once first in the order of ``kinds``
            (else in a seeded order).
        ballast_mb: MiB of extra state per trainer (heals move it).
        step_interval_s: least wall time per training step.
        link_mbit: each group's link speed in Mbit/s (0: unlimited), so that
            a heal's transfer takes long enough to be struck in the middle.
        network: partition with network namespaces when the machine allows.
        replicated_lighthouse: three lighthouse replicas on a local
            three-member etcd cluster instead of one lighthouse; their kinds
            (:data:`~ftdist.chaos.schedule.CONTROL_PLANE`) replace ``lighthouse``.
        out: directory for ``report.json``, the logs and the events.

    Raises:
        ValueError: naming the bad option and a valid range.
    """

    duration_s: float = 600.0
    groups: int = 3
    group_size: int = 2
    seed: int = 0
    kinds: tuple[str, ...] = ()
    gap_s: tuple[float, float] = (5.0, 15.0)
    ordered: bool = False
    ballast_mb: float = 24.0
    step_interval_s: float = 0.2
    link_mbit: int = 400
    network: bool = True
    replicated_lighthouse: bool = False
    out: str = "ftdist-chaos"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and 10 <= self.duration_s <= 24 * 3600):
            raise ValueError(f"--duration {self.duration_s}: give 10 to 86400 seconds")
        if not 2 <= self.groups <= 8:
            raise ValueError(f"--groups {self.groups}: give 2 to 8 replica groups")
        if not 1 <= self.group_size <= 4:
            raise ValueError(f"--group-size {self.group_size}: give 1 to 4 ranks")
        usable = schedule.REPLICATED_KINDS if self.replicated_lighthouse else schedule.KINDS
        if not self.kinds:
            object.__setattr__(self, "kinds", usable)  # frozen: the default, resolved
        unknown = sorted(set(self.kinds) - set(schedule.ALL_KINDS))
        if unknown:
            raise ValueError(f"--kinds {','.join(self.kinds)}: give some of {','.join(usable)}")
        unusable = sorted(set(self.kinds) - set(usable))
        if unusable and self.replicated_lighthouse:
            raise ValueError(
                f"--kinds {','.join(unusable)}: no single lighthouse to restart with "
                f"--replicated-lighthouse; its kinds are {','.join(schedule.CONTROL_PLANE)}"
            )
        if unusable:
            raise ValueError(f"--kinds {','.join(unusable)}: needs --replicated-lighthouse")
        if not 0.5 <= self.gap_s[0] <= self.gap_s[1]:
            raise ValueError(f"--gap {self.gap_s}: give 0.5 <= least <= most seconds")
        if not 0 <= self.ballast_mb <= 1024:
            raise ValueError(f"--ballast {self.ballast_mb}: give 0 to 1024 MiB")
        if not 0 <= self.link_mbit <= 100_000:
            raise ValueError(f"--link-mbit {self.link_mbit}: give 0 to 100000")
        if not 0 <= self.step_interval_s <= 5:
            raise ValueError(f"--step-interval {self.step_interval_s}: give 0 to 5 seconds")
        if not self.out:
            raise ValueError("--out must name a directory")


def _alive(pid: int, started: str) -> bool:
    if not started or start_time(pid) != started:
        return False
    return state(pid) not in ("", "Z")


def find_leaks(
    processes: list[tuple[int, str]], network: Any, control: list[tuple[int, str]] | None = None
) -> list[str]:
    """What outlived the run: trainer processes, processes in the namespaces,
    and ``control``'s (etcd members, lighthouse replicas).

    Waits up to ``REAP_S`` for processes on their way out.
    """
    deadline = time.monotonic() + REAP_S
    while True:
        alive = [pid for pid, started in processes if _alive(pid, started)]
        servers = [pid for pid, started in control or [] if _alive(pid, started)]
        in_ns = {ns: p for ns, p in network.pids().items() if p} if network else {}
        if not alive and not in_ns and not servers:
            return []
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    leaks = [f"trainer pid {pid}" for pid in alive]
    leaks += [f"control-plane pid {pid}" for pid in servers]
    leaks += [f"pids {p} in namespace {ns}" for ns, p in in_ns.items()]
    return leaks


def _network(opts: ChaosConfig, say: Any) -> tuple[Any, str | None]:
    from ftdist.chaos import netns

    if not opts.network:
        return None, "turned off (--no-network)"
    why = netns.unavailable()
    if why is not None:
        say("!" * 78)
        say(f"NOTE: network partitions SKIPPED: {why}; everything runs on 127.0.0.1")
        say("!" * 78)
        return None, why
    removed = netns.remove_stale()
    if removed:
        say(f"removed leftovers of an earlier run: {', '.join(removed)}")
    import shutil

    rate = opts.link_mbit if shutil.which("tc") else 0
    if opts.link_mbit and not rate:
        say("note: no `tc` tool: group links are not rate-limited (heals are quicker)")
    return netns.ChaosNetwork(opts.groups, rate_mbit=rate).create(), None


def _control_plane(opts: ChaosConfig, host: str, say: Any) -> tuple[Any, str | None]:
    """The replicated lighthouse, started; or None and why not (said loudly)."""
    from ftdist.chaos import controlplane

    if not opts.replicated_lighthouse:
        return None, None
    why = controlplane.unavailable()
    if why is not None:
        say("!" * 78)
        say(f"NOTE: replicated lighthouse SKIPPED: {why}; one lighthouse, no control-plane kinds")
        say("!" * 78)
        return None, why
    folder = os.path.join(opts.out, CONTROL_DIR)
    if os.path.isdir(folder):
        # Its logs are appended to; an earlier run's are not this one's.
        for name in os.listdir(folder):
            if name.endswith(".log"):
                os.remove(os.path.join(folder, name))
    plane = controlplane.ControlPlane(
        host,
        min_replicas=opts.groups // 2 + 1,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        log_dir=folder,
    )
    return plane.start(), None


def run_chaos(opts: ChaosConfig, stream: TextIO | None = None) -> int:
    """Run the chaos suite; see the module docstring.

    Args:
        opts: the options.
        stream: where the progress lines and the report go (default stdout).

    Returns:
        The exit status: 0 (passed), 1 (failed) or 130 (Ctrl-C).

    Raises:
        OSError: the output directory cannot be written or no port bound.
        ValueError: ``--out`` holds files the suite did not write.
    """
    out = stream or sys.stdout

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    from ftdist.chaos import quorums
    from ftdist.chaos.lighthouse import RestartableLighthouse
    from ftdist.chaos.report import build_report, render_text
    from ftdist.chaos.supervisor import ChaosSupervisor
    from ftdist.chaos.worker import ChaosWorkerConfig
    from ftdist.demo.supervisor import Interrupt

    os.makedirs(opts.out, exist_ok=True)
    events = os.path.join(opts.out, EVENTS_DIR)
    clear_events(events, "the chaos suite")
    commits = os.path.join(opts.out, quorums.QUORUMS_DIR)
    clear_events(commits, "the chaos suite")
    os.makedirs(commits, exist_ok=True)
    interrupt = Interrupt()
    handler = log_to(os.path.join(opts.out, "supervisor.log"))
    logger = logging.getLogger("ftdist")
    level = logger.level
    logger.setLevel(logging.INFO)
    previous = signal.signal(signal.SIGINT, interrupt)
    network = None
    lighthouse = None
    control = None
    try:
        network, skipped = _network(opts, say)
        host = network.lighthouse_host if network else "127.0.0.1"
        control, control_skipped = _control_plane(opts, host, say)
        if control is None:
            lighthouse = RestartableLighthouse(
                host,
                min_replicas=opts.groups // 2 + 1,
                join_timeout_ms=JOIN_TIMEOUT_MS,
                heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
            )
            address = lighthouse.address
        else:
            address = control.address
        kinds = tuple(
            k
            for k in opts.kinds
            if (network or k not in schedule.PARTITIONS)
            and (control or k not in schedule.CONTROL_PLANE)
        )
        plan = schedule.plan(
            opts.seed,
            opts.duration_s,
            opts.groups,
            opts.group_size,
            kinds or opts.kinds,
            opts.gap_s,
            opts.ordered,
        )
        cfg = ChaosWorkerConfig(
            lighthouse=address,
            events_dir=events,
            seed=opts.seed,
            groups=opts.groups,
            group_size=opts.group_size,
            run=f"chaos-{uuid.uuid4().hex[:6]}-",
            control_host=network.control_host if network else "127.0.0.1",
            hosts=tuple(
                network.group_host(g) if network else "127.0.0.1" for g in range(opts.groups)
            ),
            namespaces=tuple(network.namespaces) if network else (),
            step_interval_s=opts.step_interval_s,
            ballast_mb=opts.ballast_mb,
            quorums_dir=commits,
        )
        if control is not None:
            say(control.describe())
        say(
            f"lighthouse {address} (quorum of at least {opts.groups // 2 + 1}, "
            f"heartbeat timeout {HEARTBEAT_TIMEOUT_MS} ms); "
            + (
                f"namespaces {', '.join(network.namespaces)} on {network.subnet}.0/24"
                if network
                else "no namespaces"
            )
        )
        say(
            f"{opts.groups} groups of {opts.group_size} ranks, {opts.duration_s:g} s, seed "
            f"{opts.seed}; plan: " + ", ".join(f"{i.kind}" for i in plan)
        )
        sup = ChaosSupervisor(
            cfg, plan, opts.duration_s, lighthouse, network, say, interrupt, control=control
        )
        record = sup.run()
        if lighthouse is not None:
            lighthouse.stop()
        servers: list[tuple[int, str]] = []
        restarts = lighthouse.restarts if lighthouse is not None else 0
        if control is not None:
            control.close()
            servers, restarts = control.processes, control.restarts
        leaks = find_leaks(record.processes, network, servers)
        if network is not None:
            leaks += [f"network {name}" for name in network.destroy()]
            network = None
        meta = {
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "groups": opts.groups,
            "group_size": opts.group_size,
            "seed": opts.seed,
            "clock_s": opts.duration_s,
            "options": asdict(opts),
            "machine": machine_facts(),
            "partitions_skipped": skipped,
            "replicated_lighthouse": control is not None,
            "replicated_lighthouse_skipped": control_skipped,
            "lighthouse_restarts": restarts,
            "plan": [asdict(i) for i in plan],
        }
        checked = quorums.check(
            quorums.read_commits(commits), opts.group_size, ids_unique=control is not None
        )
        report = build_report(record, leaks, meta, checked)
        path = os.path.join(opts.out, "report.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        say(render_text(report))
        say(f"report: {os.path.abspath(path)}")
        if interrupt.count:
            return 130
        return 0 if report["verdict"]["ok"] else 1
    finally:
        signal.signal(signal.SIGINT, previous)
        if lighthouse is not None:
            lighthouse.stop()
        if control is not None:
            control.close()
        if network is not None:
            network.destroy()
        logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(level)
        handler.close()
