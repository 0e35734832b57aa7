"""Lighthouse failover benchmark: how long training stalls when the lighthouse fails.

N replica groups (``--groups``, default 2, one rank each) train a small MLP
with ``ftdist.manager.Manager`` + ``ftdist.ddp.DistributedDataParallel`` +
``ftdist.optim.OptimizerWrapper`` over Gloo on 127.0.0.1, as real processes
(``ftdist.launch.ranks.Ranks``: forkserver children with torch preloaded).
Each trainer appends one JSON line per step to a file of its own: when the
step started and ended (``time.time()``; one machine, one clock), whether it
committed, and the quorum id and members it committed with. This parent
strikes the lighthouse and reads those files.

The **stall** of a strike is the time from the strike (``time.time()`` just
before the signal) until every group has committed the first step it started
after the strike; the worst group's is reported per strike, and the median
(and the largest) over ``--repeats`` strikes of each kind. It includes up to
one ordinary step (the "steady step" time printed), as a step already past
its quorum when the strike lands needs no lighthouse. Before each strike
every group has committed ``--steady-steps`` steps since the previous
strike's recovery (and, after a replica restart, the restarted replica
follows the leader again).

Two set-ups, one after the other, with the same trainers' code and the same
lighthouse flags (``ftdist lighthouse`` processes, each in its own session):

single lighthouse (the baseline)
    ``ftdist lighthouse --bind 127.0.0.1:PORT`` (no ``--etcd``): today's one
    lighthouse. Strike: SIGKILL, then start it again on the same port at
    once (``--restart-delay``, default 0 s: an operator or a supervisor
    restarting it immediately). Last, the host lost: SIGKILL without a
    restart, and count the steps committed in the next ``--host-lost-s``
    seconds (none: the job stops until someone starts a lighthouse).

replicated lighthouse
    A local three-member etcd (``ftdist.etcd.local.LocalEtcdCluster``) and
    three ``ftdist lighthouse --etcd ... --job ...`` replicas
    (``ftdist.lighthouse.local.LocalLighthouseReplicas``); the trainers are
    given the comma-separated list of the three. The strikes, in turn, on
    whichever replica leads at the time:

    1. SIGKILL of the leader. Its lease expires after ``--lease-ttl-ms``
       (default 2000) and a follower takes over. Goal: stall <= TTL + 1 s.
       The killed replica is started again (same port) once the groups have
       recovered.
    2. SIGTERM of the leader: it revokes its lease and a follower takes over
       within a poll. Goal: stall <= 0.5 s. Restarted as above.
    3. SIGSTOP of the leader for TTL + ``--stop-extra-s`` (default 1.5 s),
       then SIGCONT. The stall is counted from the SIGSTOP. After the SIGCONT
       the woken old leader's status is polled for ``--watch-s`` (default
       2 s): it must never say it leads and serves, and its log must show
       no quorum issued after it woke.

    At the end of each set-up the trainers' records are checked: per group,
    quorum ids never go backwards, and no quorum id was committed with two
    different memberships (a split brain would show as either).

Nothing is asserted: the script prints per-strike lines, the medians, ratios
against the single lighthouse's kill and restart, and PASS/MISS for the
goals and the checks. ``--json PATH`` writes the figures. Run
``python bench/lighthouse_failover.py`` (about 1.5 minutes on 2 cores, plus
a minute for each single-lighthouse restart after which a group waits out the
60 s collective timeout: a restarted lighthouse issues quorum ids again);
``--repeats 1`` for a shorter run; ``--only single|replicated``.
Everything it starts is stopped at the end, on Ctrl-C or SIGTERM too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftdist.launch.ranks import RankContext, Ranks

_SERVING = re.compile(rb"ftdist lighthouse serving on (\S+)")
# A lighthouse that issues a new quorum id logs "Quorum <id>: <n> members [...]".
_QUORUM_ISSUED = re.compile(r"\] - Quorum (\d+): ")
_STOPS_LEADING = re.compile(r"(stops leading: .*|stopped forming quorums: .*)")
_START_TIMEOUT_S = 60.0
# A single-lighthouse restart stalling longer than this waited out the 60 s collective timeout.
_SLOW_S = 30.0
_POLL_S = 0.01


# -- the trainer (a rank process; one replica group of one rank) -------------------------------


def trainer(
    ctx: RankContext,
    lighthouse: str,
    out_dir: str,
    width: int,
    depth: int,
    batch: int,
    pause_s: float,
    verbose: bool,
) -> None:
    """Train until ``out_dir/stop`` exists, one JSON line per step in ``out_dir/group<rank>.jsonl``."""
    from ftdist.ddp import DistributedDataParallel as FtDDP
    from ftdist.manager import Manager
    from ftdist.optim import OptimizerWrapper
    from ftdist.process_group import ProcessGroupGloo

    if not verbose:
        logging.getLogger("ftdist").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    torch.manual_seed(ctx.rank)
    layers: list[nn.Module] = []
    for i in range(depth):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(width, width))
    model = nn.Sequential(*layers)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    loss_fn = nn.MSELoss()

    # The group's own store (one rank: it is the group's rank 0).
    own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    pg = ProcessGroupGloo()
    manager = Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        replica_id=f"group{ctx.rank}",
        lighthouse_addr=lighthouse,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=own.port,
        hostname="127.0.0.1",
    )
    ddp = FtDDP(manager, model)
    opt = OptimizerWrapper(manager, inner)
    stop = os.path.join(out_dir, "stop")
    try:
        with open(os.path.join(out_dir, f"group{ctx.rank}.jsonl"), "a", encoding="utf-8") as log:
            while not os.path.exists(stop):
                step = manager.current_step()
                t0 = time.time()
                opt.zero_grad()
                loss_fn(ddp(x), y).backward()
                opt.step()
                record: dict[str, Any] = {"t0": t0, "t": time.time(), "step": step}
                if manager.current_step() > step:
                    record["qid"] = manager.quorum_id()
                    record["members"] = sorted(manager._membership.members)
                else:
                    err = manager.errored()
                    record["error"] = str(err).splitlines()[0][:300] if err else "vote failed"
                log.write(json.dumps(record) + "\n")
                log.flush()
                if pause_s:
                    time.sleep(pause_s)
    finally:
        manager.shutdown(wait=False)
        pg.shutdown()
        del own


# -- the parent's view of the trainers ---------------------------------------------------------


class Progress:
    """The trainers' step records, read as they are written."""

    def __init__(self, out_dir: str, groups: int) -> None:
        self.out_dir = out_dir
        self.groups = groups
        self.records: list[list[dict[str, Any]]] = [[] for _ in range(groups)]
        self._offsets = [0] * groups
        self._partial = [b""] * groups

    def poll(self) -> None:
        for g in range(self.groups):
            path = os.path.join(self.out_dir, f"group{g}.jsonl")
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[g])
                    data = f.read()
            except FileNotFoundError:
                continue
            self._offsets[g] += len(data)
            data = self._partial[g] + data
            *lines, self._partial[g] = data.split(b"\n")
            self.records[g].extend(json.loads(line) for line in lines if line.strip())

    def first_commit_after(self, g: int, t: float) -> dict[str, Any] | None:
        """Group ``g``'s first committed step that started at or after ``t``."""
        for record in self.records[g]:
            if record["t0"] >= t and "qid" in record:
                return record
        return None

    def commits_since(self, g: int, t: float) -> int:
        return sum(1 for r in self.records[g] if r["t0"] >= t and "qid" in r)

    def failed_between(self, t0: float, t1: float) -> int:
        return sum(
            1
            for rs in self.records
            for r in rs
            if "qid" not in r and t0 <= r["t"] and r["t0"] <= t1
        )

    def wait_steady(self, since: float, steps: int, timeout: float, ranks: Ranks) -> None:
        """Wait until every group committed ``steps`` steps started after ``since``."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if all(self.commits_since(g, since) >= steps for g in range(self.groups)):
                return
            for g in range(self.groups):
                code = ranks.exitcode(g)
                if code is not None:
                    raise RuntimeError(f"trainer {g} exited with {code}\n{self._tail(g)}")
            if time.monotonic() > deadline:
                counts = [self.commits_since(g, since) for g in range(self.groups)]
                raise TimeoutError(
                    f"the groups did not commit {steps} steps each within {timeout:g} s "
                    f"(committed: {counts})\n"
                    + "\n".join(self._tail(g) for g in range(self.groups))
                )
            time.sleep(_POLL_S)

    def wait_recovered(self, t_strike: float, timeout: float) -> list[float | None]:
        """Each group's stall after a strike at ``t_strike`` (None: not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            firsts = [self.first_commit_after(g, t_strike) for g in range(self.groups)]
            if all(firsts) or time.monotonic() > deadline:
                return [None if f is None else f["t"] - t_strike for f in firsts]
            time.sleep(_POLL_S)

    def steady_step_s(self) -> float:
        """Median time between consecutive commits (all groups)."""
        gaps = []
        for rs in self.records:
            ts = [r["t"] for r in rs if "qid" in r][-40:]
            gaps += [b - a for a, b in itertools.pairwise(ts)]
        return statistics.median(gaps) if gaps else float("nan")

    def check_quorum_ids(self) -> list[str]:
        """Problems: a group's quorum id going backwards, one id with two memberships."""
        problems: list[str] = []
        seen: dict[int, tuple[str, ...]] = {}
        for g, rs in enumerate(self.records):
            last = -1
            for r in rs:
                if "qid" not in r:
                    continue
                qid, members = int(r["qid"]), tuple(r["members"])
                if len(members) > self.groups:
                    problems.append(f"quorum id {qid} has {len(members)} members: {members}")
                if qid < last:
                    problems.append(f"group {g}: quorum id {last} -> {qid} at step {r['step']}")
                last = max(last, qid)
                if seen.setdefault(qid, members) != members:
                    problems.append(
                        f"quorum id {qid} committed with two memberships: {seen[qid]} and {members}"
                    )
        return problems

    def _tail(self, g: int) -> str:
        errors = [r["error"] for r in self.records[g][-3:] if "error" in r]
        return f"group {g}: {len(self.records[g])} steps; last errors: {errors}"


def _start_trainers(args: argparse.Namespace, lighthouse: str, out_dir: str) -> Ranks:
    os.makedirs(out_dir, exist_ok=True)
    # Not started here: entering its ``with`` block starts it.
    return Ranks(
        trainer,
        args.groups,
        args=(
            lighthouse,
            out_dir,
            args.width,
            args.depth,
            args.batch,
            args.step_pause_ms / 1e3,
            args.verbose,
        ),
    )


def _stop_trainers(ranks: Ranks, out_dir: str, timeout: float = 10.0) -> None:
    with open(os.path.join(out_dir, "stop"), "w", encoding="utf-8"):
        pass
    ranks.join(timeout=timeout)  # kills whoever is still running after that


# -- the single lighthouse -----------------------------------------------------------------------


class SingleLighthouse:
    """``ftdist lighthouse`` without ``--etcd``, in its own session, restartable on its port."""

    def __init__(self, log_path: str, min_replicas: int, extra: Sequence[str]) -> None:
        self.log_path = log_path
        self.port = 0
        self.address = ""
        self._min_replicas = min_replicas
        self._extra = list(extra)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = _START_TIMEOUT_S) -> None:
        """Start it (on its old port once it has one), retrying while the port is taken."""
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log_path, "ab") as log:
                offset = log.tell()
                self._proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ftdist",
                        "lighthouse",
                        "--bind",
                        f"127.0.0.1:{self.port}",
                        "--http-port",
                        "-1",
                        "--min-replicas",
                        str(self._min_replicas),
                        *self._extra,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            while True:
                with open(self.log_path, "rb") as f:
                    f.seek(offset)
                    match = _SERVING.search(f.read())
                if match is not None:
                    self.address = match.group(1).decode()
                    self.port = int(self.address.rsplit(":", 1)[1])
                    return
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
            if self._proc.poll() is None or self._proc.returncode != 1:
                self.close()
                raise RuntimeError(f"the single lighthouse did not start; see {self.log_path}")
            if time.monotonic() > deadline:  # exit 1: the port was still taken
                raise RuntimeError(f"port {self.port} stayed taken; see {self.log_path}")
            time.sleep(0.05)

    def kill(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.wait(timeout=10)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


# -- the set-ups ---------------------------------------------------------------------------------


def _lighthouse_flags(args: argparse.Namespace) -> list[str]:
    return [] if args.join_timeout_ms is None else ["--join-timeout-ms", str(args.join_timeout_ms)]


def _strike_line(
    args: argparse.Namespace, kind: str, rep: int, stalls: list[float | None], extra: str
) -> str:
    shown = " / ".join("none" if s is None else f"{s:.2f}" for s in stalls)
    worst = _worst(stalls)
    head = f"    {kind} {rep + 1}: worst stall " + (
        f"{worst:.2f} s" if worst is not None else f"> {args.recover_timeout:.0f} s"
    )
    return f"{head} (groups {shown} s){extra}"


def _worst(stalls: Sequence[float | None]) -> float | None:
    return None if any(s is None for s in stalls) else max(s for s in stalls if s is not None)


def run_single(args: argparse.Namespace, work: str, result: dict[str, Any]) -> None:
    print(
        f"\nsingle lighthouse (`ftdist lighthouse`, no --etcd): SIGKILL, restart on the same port "
        f"after {args.restart_delay:g} s"
    )
    out_dir = os.path.join(work, "single")
    lighthouse = SingleLighthouse(
        os.path.join(work, "single-lighthouse.log"), args.min_replicas, _lighthouse_flags(args)
    )
    strikes: list[dict[str, Any]] = []
    result["single"] = {"strikes": strikes}
    try:
        lighthouse.start()
        ranks = _start_trainers(args, lighthouse.address, out_dir)
        with ranks:
            progress = Progress(out_dir, args.groups)
            progress.wait_steady(0.0, args.warmup_steps, _START_TIMEOUT_S, ranks)
            print(
                f"    {args.groups} groups training; steady step {progress.steady_step_s() * 1e3:.0f} ms"
            )
            since = time.time()
            for rep in range(args.repeats):
                progress.wait_steady(since, args.steady_steps, args.recover_timeout, ranks)
                progress.poll()
                last_id = max(int(r["qid"]) for rs in progress.records for r in rs if "qid" in r)
                t_strike = time.time()
                lighthouse.kill()
                time.sleep(args.restart_delay)
                lighthouse.start()
                t_up = time.time() - t_strike
                stalls = progress.wait_recovered(t_strike, args.recover_timeout)
                since = time.time()
                failed = progress.failed_between(t_strike, since)
                # A restarted lighthouse counts quorum ids from 1 again: ids
                # the groups already used come back, with other members.
                reissued = sorted(
                    {
                        int(r["qid"])
                        for rs in progress.records
                        for r in rs
                        if "qid" in r and r["t0"] >= t_strike and int(r["qid"]) <= last_id
                    }
                )
                strikes.append(
                    {
                        "stalls_s": stalls,
                        "worst_s": _worst(stalls),
                        "restarted_s": t_up,
                        "failed_steps": failed,
                        "reissued_ids": reissued,
                    }
                )
                print(
                    _strike_line(
                        args,
                        "SIGKILL + restart",
                        rep,
                        stalls,
                        f"; serving again +{t_up:.2f} s; {failed} step(s) failed"
                        + (f"; quorum ids {reissued} issued again" if reissued else ""),
                    )
                )
            if args.host_lost_s > 0:
                progress.wait_steady(since, args.steady_steps, args.recover_timeout, ranks)
                t_strike = time.time()
                lighthouse.kill()
                time.sleep(args.host_lost_s)
                progress.poll()
                committed = sum(progress.commits_since(g, t_strike) for g in range(args.groups))
                result["single"]["host_lost"] = {
                    "seconds": args.host_lost_s,
                    "committed": committed,
                }
                print(
                    f"    host lost (SIGKILL, no restart): {committed} step(s) committed in the "
                    f"next {args.host_lost_s:g} s"
                )
            problems = progress.check_quorum_ids()
            result["single"]["quorum_id_problems"] = problems
            backwards = sum("->" in p for p in problems)
            print(
                "    quorum ids across the restarts: a group's id went backwards "
                f"{backwards} time(s); {len(problems) - backwards} id(s) committed with two "
                "memberships (a restarted lighthouse goes on above the ids its members used)"
            )
            # Trainers without a lighthouse wait in their quorum: no point waiting for them.
            _stop_trainers(ranks, out_dir, 1.0 if args.host_lost_s > 0 else 10.0)
    finally:
        lighthouse.close()


def _wait_follower(replicas: Any, i: int, timeout: float) -> bool:
    """Wait until replica ``i`` answers as a follower of a leader."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replication = (replicas.status(i) or {}).get("replication") or {}
        if replication.get("role") == "follower":
            return True
        time.sleep(0.1)
    return False


def _elected_at(replicas: Any, leader: int | None) -> float | None:
    """When (time.time()) the current leader was elected, from its status."""
    if leader is None:
        return None
    asked = time.time()
    replication = (replicas.status(leader) or {}).get("replication") or {}
    leading = replication.get("leading_for_s")
    return None if leading is None else asked - float(leading)


def _log_since(path: str, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def run_replicated(args: argparse.Namespace, work: str, result: dict[str, Any]) -> None:
    from ftdist.etcd.local import LocalEtcdCluster
    from ftdist.lighthouse.local import LocalLighthouseReplicas

    ttl_s = args.lease_ttl_ms / 1e3
    stop_s = ttl_s + args.stop_extra_s
    print(
        f"\nreplicated lighthouse: 3 replicas on a local 3-member etcd, lease TTL {ttl_s:g} s; "
        f"strikes on the leader: SIGKILL, SIGTERM, SIGSTOP {stop_s:g} s + SIGCONT"
    )
    out_dir = os.path.join(work, "replicated")
    log_dir = os.path.join(work, "lighthouses")
    extra = ["--lease-ttl-ms", str(args.lease_ttl_ms), *_lighthouse_flags(args)]
    if args.takeover_grace_ms is not None:
        extra += ["--takeover-grace-ms", str(args.takeover_grace_ms)]
    strikes: list[dict[str, Any]] = []
    result["replicated"] = {"strikes": strikes, "log_dir": log_dir}
    etcd = LocalEtcdCluster(members=3, log_dir=os.path.join(work, "etcd"))
    replicas: Any = None
    try:
        etcd.start()
        replicas = LocalLighthouseReplicas(
            etcd.endpoint_arg,
            "failover-bench",
            3,
            min_replicas=args.min_replicas,
            log_dir=log_dir,
            extra_args=extra,
        ).start()
        ranks = _start_trainers(args, replicas.address_arg, out_dir)
        with ranks:
            progress = Progress(out_dir, args.groups)
            progress.wait_steady(0.0, args.warmup_steps, _START_TIMEOUT_S, ranks)
            print(
                f"    {args.groups} groups training; steady step {progress.steady_step_s() * 1e3:.0f} ms"
            )
            since = time.time()
            for rep in range(args.repeats):
                for kind in ("SIGKILL", "SIGTERM", "SIGSTOP"):
                    progress.wait_steady(since, args.steady_steps, args.recover_timeout, ranks)
                    leader = replicas.wait_leader(timeout=args.recover_timeout)
                    record: dict[str, Any] = {"kind": kind, "rep": rep, "old_leader": leader}
                    t_strike = time.time()
                    if kind == "SIGSTOP":
                        replicas.signal(leader, signal.SIGSTOP)
                        time.sleep(stop_s)
                        # A stopped process writes nothing: what its log holds past
                        # here, it wrote after waking.
                        wake_offset = os.path.getsize(replicas.log_path(leader))
                        t_wake = time.time()
                        replicas.signal(leader, signal.SIGCONT)
                        # The woken old leader: never leading and serving again.
                        led_again: list[float] = []
                        roles: set[str] = set()
                        while time.time() < t_wake + args.watch_s:
                            replication = (replicas.status(leader) or {}).get("replication") or {}
                            roles.add(str(replication.get("role")))
                            if replication.get("role") == "leader" and replication.get("serving"):
                                led_again.append(time.time() - t_wake)
                            time.sleep(0.05)
                        record["woken_roles"] = sorted(roles)
                        record["woken_led_at_s"] = led_again
                    else:
                        replicas.signal(leader, getattr(signal, kind))
                    stalls = progress.wait_recovered(t_strike, args.recover_timeout)
                    since = time.time()
                    new_leader = replicas.leader()
                    elected = _elected_at(replicas, new_leader)
                    record.update(
                        stalls_s=stalls,
                        worst_s=_worst(stalls),
                        new_leader=new_leader,
                        elected_s=None if elected is None else elected - t_strike,
                        failed_steps=progress.failed_between(t_strike, since),
                    )
                    extra_text = (
                        f"; leader {leader} -> {new_leader}"
                        + (f" elected +{elected - t_strike:.2f} s" if elected is not None else "")
                        + f"; {record['failed_steps']} step(s) failed"
                    )
                    if kind == "SIGSTOP":
                        woke = _log_since(replicas.log_path(leader), wake_offset)
                        issued = _QUORUM_ISSUED.findall(woke)
                        stepped = _STOPS_LEADING.search(woke)
                        record["woken_issued_quorums"] = issued
                        record["woken_stepped_down"] = stepped.group(1) if stepped else None
                        ok = not record["woken_led_at_s"] and not issued
                        record["woken_ok"] = ok
                        extra_text += (
                            f"; woken old leader: roles {'/'.join(record['woken_roles'])}, "
                            + ("formed no quorum" if ok else "LED AGAIN or issued a quorum")
                        )
                    else:
                        replicas.restart(leader)
                        record["restarted_follower"] = _wait_follower(replicas, leader, 15.0)
                    strikes.append(record)
                    label = {
                        "SIGKILL": "SIGKILL leader",
                        "SIGTERM": "SIGTERM leader",
                        "SIGSTOP": f"SIGSTOP leader {stop_s:g} s",
                    }[kind]
                    print(_strike_line(args, label, rep, stalls, extra_text))
                    if kind == "SIGSTOP":
                        # The woken replica must follow before it may be struck again.
                        record["woken_follower"] = _wait_follower(replicas, leader, 15.0)
                    since = max(since, time.time())
            result["replicated"]["quorum_id_problems"] = progress.check_quorum_ids()
            _stop_trainers(ranks, out_dir)
    finally:
        if replicas is not None:
            replicas.close()
        etcd.close()


# -- the report ----------------------------------------------------------------------------------


def _median_worst(strikes: Sequence[dict[str, Any]]) -> tuple[float, float, int]:
    """Median and largest worst-group stall; a strike never recovered counts as infinite."""
    worst = [math.inf if s["worst_s"] is None else s["worst_s"] for s in strikes]
    if not worst:
        return math.nan, math.nan, 0
    return statistics.median(worst), max(worst), len(worst)


def _ratio(value: float) -> str:
    return f"{value:.2f}x" if value >= 0.1 else f"{value:.2g}x"


def _secs(value: float, timeout: float) -> str:
    return f"> {timeout:.0f} s (never recovered)" if math.isinf(value) else f"{value:.2f} s"


def report(args: argparse.Namespace, result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    ttl_s = args.lease_ttl_ms / 1e3
    stop_s = ttl_s + args.stop_extra_s
    lines: list[str] = []
    targets: list[tuple[str, bool, str]] = []
    base: float | None = None
    fast: float | None = None
    summary: dict[str, Any] = {}
    if "single" in result:
        single = result["single"]["strikes"]
        med, top, k = _median_worst(single)
        base = None if math.isinf(med) else med
        summary["single_sigkill_restart_s"] = base
        text = (
            f"single lighthouse, SIGKILL + restart: worst stall {_secs(med, args.recover_timeout)}"
            f" (median of {k}; max {_secs(top, args.recover_timeout)})"
        )
        quick = [
            s["worst_s"] for s in single if s["worst_s"] is not None and s["worst_s"] < _SLOW_S
        ]
        fast = statistics.median(quick) if quick else None
        summary["single_sigkill_restart_under_30s_s"] = fast
        if fast is not None and fast != base:
            text += f"; {len(quick)} under {_SLOW_S:.0f} s: median {fast:.2f} s"
        reissued = [s for s in single if s.get("reissued_ids")]
        if reissued:
            text += (
                f"; in {len(reissued)} of {k} the restarted lighthouse issued used quorum ids "
                "again (worst stalls "
                + ", ".join(
                    _secs(math.inf if s["worst_s"] is None else s["worst_s"], args.recover_timeout)
                    for s in reissued
                )
                + ")"
            )
        lines.append(text)
        lost = result["single"].get("host_lost")
        if lost is not None:
            lines.append(
                "single lighthouse, host lost (no restart): the job stops "
                f"({lost['committed']} steps committed in {lost['seconds']:g} s)"
            )
        else:
            lines.append("single lighthouse, host lost (no restart): the job stops")
    if "replicated" in result:
        strikes = result["replicated"]["strikes"]
        for kind, label, goal in (
            ("SIGKILL", "SIGKILL leader", ttl_s + 1.0),
            ("SIGTERM", "SIGTERM leader", 0.5),
            ("SIGSTOP", f"SIGSTOP leader {stop_s:g} s, then SIGCONT", None),
        ):
            chosen = [s for s in strikes if s["kind"] == kind]
            med, top, k = _median_worst(chosen)
            summary[f"replicated_{kind.lower()}_s"] = None if math.isinf(med) else med
            text = (
                f"replicated, {label}: worst stall {_secs(med, args.recover_timeout)} "
                f"(median of {k}; max {_secs(top, args.recover_timeout)})"
            )
            if base and not math.isinf(med):
                text += f" = {_ratio(med / base)} the single lighthouse's restart"
                if fast is not None and fast != base:
                    text += f" ({_ratio(med / fast)} its restarts under {_SLOW_S:.0f} s)"
            lines.append(text)
            if goal is not None:
                targets.append(
                    (
                        f"replicated, {label}: worst stall <= {goal:g} s (median)",
                        med <= goal,
                        f"{_secs(med, args.recover_timeout)} (max {_secs(top, args.recover_timeout)})",
                    )
                )
            if kind == "SIGSTOP" and chosen:
                bad = [s for s in chosen if not s.get("woken_ok")]
                targets.append(
                    (
                        "replicated, woken old leader never led or issued a quorum",
                        not bad,
                        "ok" if not bad else f"{len(bad)} of {len(chosen)} strikes",
                    )
                )
        problems = result["replicated"].get("quorum_id_problems", [])
        targets.append(
            (
                "replicated, quorum ids never backwards, one membership per id",
                not problems,
                "ok" if not problems else "; ".join(problems[:3]),
            )
        )
    result["summary"] = summary
    print()
    for line in lines:
        print(line)
    return targets


def _machine() -> str:
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:
        nproc = os.cpu_count() or 0
    return (
        f"machine: nproc={nproc}, torch {torch.__version__}, python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )


def _load() -> str:
    return "loadavg " + " ".join(f"{v:.2f}" for v in os.getloadavg())


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM must not interrupt the clean-up the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="How long training stalls when the lighthouse fails: a replicated "
        "lighthouse (3 replicas on etcd) losing its leader, against one lighthouse killed "
        "and restarted. Prints; asserts nothing."
    )
    parser.add_argument("--repeats", type=int, default=3, help="strikes of each kind (default 3)")
    parser.add_argument(
        "--groups", type=int, default=2, help="replica groups of 1 rank (default 2)"
    )
    parser.add_argument(
        "--lease-ttl-ms", type=int, default=2000, help="the replicas' etcd lease TTL (default 2000)"
    )
    parser.add_argument(
        "--takeover-grace-ms",
        type=int,
        default=None,
        help="the replicas' --takeover-grace-ms (default: the lighthouse's, 1000)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=None,
        help="every lighthouse's --join-timeout-ms (default: the lighthouse's)",
    )
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="every lighthouse's --min-replicas (default 1)"
    )
    parser.add_argument(
        "--stop-extra-s",
        type=float,
        default=1.5,
        help="SIGSTOP lasts the lease TTL plus this (default 1.5 s)",
    )
    parser.add_argument(
        "--watch-s",
        type=float,
        default=2.0,
        help="how long the woken old leader's status is watched (default 2 s)",
    )
    parser.add_argument(
        "--restart-delay",
        type=float,
        default=0.0,
        help="single lighthouse: seconds from SIGKILL to its restart (default 0)",
    )
    parser.add_argument(
        "--host-lost-s",
        type=float,
        default=10.0,
        help="single lighthouse: seconds watched after a SIGKILL without restart; 0 skips",
    )
    parser.add_argument(
        "--recover-timeout",
        type=float,
        default=90.0,
        help="seconds a strike's recovery is awaited (default 90: past the 60 s collective "
        "timeout)",
    )
    parser.add_argument(
        "--only", choices=("single", "replicated"), default=None, help="run one set-up only"
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=10, help="steps every group commits first (default 10)"
    )
    parser.add_argument(
        "--steady-steps",
        type=int,
        default=5,
        help="steps every group commits between strikes (default 5)",
    )
    parser.add_argument(
        "--step-pause-ms",
        type=float,
        default=10.0,
        help="trainers sleep this long between steps, leaving CPU to the lighthouses (default 10)",
    )
    parser.add_argument("--width", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument("--depth", type=int, default=2, help="MLP layers (default 2)")
    parser.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the figures here")
    parser.add_argument(
        "--log-dir",
        default=None,
        help="keep the lighthouses', etcd's and trainers' files here (default: a temporary "
        "folder, removed unless something failed)",
    )
    parser.add_argument("--verbose", action="store_true", help="let ftdist log its warnings")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.groups < 1:
        parser.error("--repeats and --groups must be at least 1")
    if not args.verbose:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        logging.getLogger("ftdist").setLevel(logging.ERROR)
    signal.signal(signal.SIGTERM, _on_sigterm)

    work = args.log_dir or tempfile.mkdtemp(prefix="ftdist-lighthouse-failover-")
    os.makedirs(work, exist_ok=True)
    print("ftdist lighthouse failover benchmark")
    print(_machine())
    print(
        f"{args.groups} replica groups x 1 rank, {args.depth}x{args.width} MLP, batch {args.batch}, "
        f"{args.step_pause_ms:g} ms pause between steps; min_replicas {args.min_replicas}; "
        f"{args.repeats} strike(s) of each kind; stall = strike -> every group's commit of "
        f"its first step started after it; start {_load()}"
    )
    result: dict[str, Any] = {"args": vars(args), "work_dir": work}
    start = time.monotonic()
    keep = args.log_dir is not None
    parts: list[tuple[str, Callable[[argparse.Namespace, str, dict[str, Any]], None]]] = [
        ("single", run_single),
        ("replicated", run_replicated),
    ]
    targets: list[tuple[str, bool, str]] = []
    try:
        for name, fn in parts:
            if args.only in (None, name):
                t = time.monotonic()
                fn(args, work, result)
                print(f"    [{time.monotonic() - t:.0f} s, {_load()}]")
        targets = report(args, result)
    except BaseException:
        keep = True
        raise
    finally:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
        if not all(ok for _, ok, _ in targets):
            keep = True
        if keep:
            print(f"files (lighthouse and etcd logs, trainers' records): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\ngoals and checks (total {time.monotonic() - start:.0f} s):")
    for what, ok, value in targets:
        print(f"  {'PASS' if ok else 'MISS'}  {what:<62} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
