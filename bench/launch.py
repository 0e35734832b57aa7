"""Launcher benchmark: from SIGKILL of a replica group's process to its replacement's first commit.

Two replica groups of one rank train a small MLP (``bench/launch_worker.py``)
under a Manager, with a lighthouse in this process (``min_replicas=1``, join
timeout 100 ms, for both libraries). Once both commit steady, this script
records ``time.time()`` and SIGKILLs group 1's process; the launcher restarts
it; the replacement heals from group 0 and commits. Measured, per kill: kill to
the replacement's start (its script's first line; for launch_subprocesses the
function's entry, after torch.distributed, the parallel groups and the Manager
are up), to its Manager being ready, and to its first commit (event times written by the processes; one
machine, one clock). Three launchers, the same job:

* ``torchrun + torchft``: one ``python -m torch.distributed.run --standalone
  --max-restarts`` per replica group, running the script with torchft
  (``torchft-nightly``) -- the baseline.
* ``ftdist run``: one ``python -m ftdist run --replica-groups 2`` running the
  same script with ftdist; replacements fork from a server with torch imported.
* ``launch_subprocesses``: ``ftdist.launch.launch_subprocesses(fault_tolerant=...)``
  running the same training loop as a function.

The baseline needs torchft (``torchft-nightly``, as in the development venv);
without it that row is reported as failed and no ratio is printed.

Nothing is asserted: the script prints per-kill times, the medians, the ratio
torchrun+torchft / ftdist, and PASS/MISS against the 1 s target. Run
``python bench/launch.py`` (about a minute on 2 cores; ``--reps`` kills per
launcher, ``--only`` picks launchers).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "launch_worker.py")
REPO = os.path.dirname(HERE)
TARGET_S = 1.0
WAIT_S = 90.0
WARM_COMMITS = 10


def _events(out: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for path in glob.glob(os.path.join(out, "events.*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n"):
                    found.append(json.loads(line))
    return sorted(found, key=lambda e: e["t"])


def _wait_for(out: str, what: str, test: Any, timeout: float = WAIT_S) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = _events(out)
        if test(events):
            return events
        time.sleep(0.02)
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


def _pid_of(events: list[dict[str, Any]], group: int) -> int:
    starts = [e for e in events if e["kind"] == "start" and e["group"] == group]
    return int(starts[-1]["pid"])


def _commits(events: list[dict[str, Any]], pid: int) -> int:
    return sum(1 for e in events if e["kind"] == "commit" and e["pid"] == pid)


def _measure(out: str, reps: int, log: list[str]) -> list[dict[str, float]]:
    """Kill group 1's process ``reps`` times; per kill, the times to start, ready, commit."""

    def warm(events: list[dict[str, Any]]) -> bool:
        groups = {e["group"] for e in events if e["kind"] == "start"}
        return groups == {0, 1} and all(
            _commits(events, _pid_of(events, g)) >= WARM_COMMITS for g in (0, 1)
        )

    results = []
    for rep in range(reps):
        events = _wait_for(out, "steady commits of both groups", warm)
        victim = _pid_of(events, 1)
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)

        def recovered(events: list[dict[str, Any]], t_kill: float = t_kill) -> bool:
            return any(
                e["kind"] == "commit" and e["group"] == 1 and e["t"] > t_kill for e in events
            )

        events = _wait_for(out, f"commit of the replacement (kill {rep + 1})", recovered)
        new = [e for e in events if e["group"] == 1 and e["pid"] != victim and e["t"] > t_kill]
        if not all(any(e["kind"] == k for e in new) for k in ("start", "ready")):
            raise RuntimeError(f"kill {rep + 1}: group 1 committed without a new process")
        first = {kind: next(e for e in new if e["kind"] == kind) for kind in ("start", "ready")}
        commit = next(e for e in new if e["kind"] == "commit")
        row = {
            "start": first["start"]["t_start"] - t_kill,
            "ready": first["ready"]["t"] - t_kill,
            "commit": commit["t"] - t_kill,
        }
        results.append(row)
        log.append(
            f"  kill {rep + 1}: started {row['start']:.3f} s, Manager ready "
            f"{row['ready']:.3f} s, first commit {row['commit']:.3f} s"
        )
    return results


def _stop(out: str) -> None:
    with open(os.path.join(out, "stop"), "w"):
        pass


def _env(out: str, lib: str, lighthouse: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        LAUNCH_BENCH_OUT=out,
        LAUNCH_BENCH_LIB=lib,
        TORCHFT_LIGHTHOUSE=lighthouse,
        FTDIST_LIGHTHOUSE=lighthouse,
        PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), env.get("PYTHONPATH", "")]),
    )
    return env


def _end(procs: list[subprocess.Popen[bytes]], out: str) -> None:
    _stop(out)
    deadline = time.monotonic() + 60
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Workers torchrun left behind (it starts them in sessions of their own).
    for event in _events(out):
        if event["kind"] == "start":
            try:
                os.kill(int(event["pid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def bench_torchrun(out: str, reps: int, log: list[str]) -> list[dict[str, float]]:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse logs every quorum tick
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    procs = []
    try:
        for group in (0, 1):
            env = _env(out, "torchft", lighthouse.address())
            env["REPLICA_GROUP_ID"] = str(group)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc-per-node", "1", "--max-restarts", str(reps + 1), WORKER]
            procs.append(_popen(cmd, env, out, f"torchrun{group}"))
        return _measure(out, reps, log)
    finally:
        _end(procs, out)
        lighthouse.shutdown()


def _popen(cmd: list[str], env: dict[str, str], out: str, name: str) -> subprocess.Popen[bytes]:
    logfile = open(os.path.join(out, f"{name}.log"), "wb")
    return subprocess.Popen(
        cmd, env=env, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True
    )


def bench_ftdist_run(out: str, reps: int, log: list[str]) -> list[dict[str, float]]:
    from ftdist.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, http_port=-1
    )
    procs = []
    try:
        cmd = [sys.executable, "-m", "ftdist", "run", "--nproc-per-node", "2"]
        cmd += ["--replica-groups", "2", "--max-restarts", str(reps + 1), WORKER]
        procs.append(_popen(cmd, _env(out, "ftdist", lighthouse.address()), out, "ftdist_run"))
        return _measure(out, reps, log)
    finally:
        _end(procs, out)
        lighthouse.shutdown()


def bench_function(out: str, reps: int, log: list[str]) -> list[dict[str, float]]:
    sys.path.insert(0, HERE)
    import launch_worker

    from ftdist.coordination import LighthouseServer
    from ftdist.launch import MultiprocessConfig, launch_subprocesses
    from ftdist.launch.config import FaultTolerance

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, http_port=-1
    )
    failure: list[BaseException] = []

    def run() -> None:
        try:
            launch_subprocesses(
                launch_worker.launched,
                MultiprocessConfig(world_size=2, backend="gloo"),
                None,
                0,
                out,
                fault_tolerant=FaultTolerance(
                    max_restarts=reps + 1,
                    lighthouse=lighthouse.address(),
                    timeout=timedelta(seconds=10),
                ),
            )
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="launch_subprocesses")
    thread.start()
    try:
        return _measure(out, reps, log)
    finally:
        _stop(out)
        thread.join(timeout=60)
        lighthouse.shutdown()
        if failure:
            log.append(f"  launch_subprocesses raised: {failure[0]!r}")


LAUNCHERS = {
    "torchrun": ("torchrun + torchft", bench_torchrun),
    "ftdist-run": ("ftdist run", bench_ftdist_run),
    "function": ("launch_subprocesses", bench_function),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3, help="kills per launcher (default 3)")
    p.add_argument(
        "--only", nargs="+", choices=sorted(LAUNCHERS), default=list(LAUNCHERS), metavar="NAME"
    )
    args = p.parse_args(argv)
    import torch
    from _bytecode import compile_ftdist

    compile_ftdist()  # as pip compiles torchft's wheel: see _bytecode.py

    started = time.monotonic()
    print(
        f"ftdist launcher benchmark: SIGKILL of replica group 1's process -> its replacement's "
        f"first commit; 2 replica groups of 1 rank, {args.reps} kills per launcher; "
        f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}",
        flush=True,
    )
    medians: dict[str, dict[str, float]] = {}
    for name in args.only:
        label, bench = LAUNCHERS[name]
        out = tempfile.mkdtemp(prefix=f"ftdist-bench-launch-{name}-")
        log: list[str] = []
        try:
            rows = bench(out, args.reps, log)
        except Exception as exc:
            print(f"{label}: failed: {exc!r} (logs in {out})", flush=True)
            for line in log:
                print(line, flush=True)
            continue
        print(f"{label}:", flush=True)
        for line in log:
            print(line, flush=True)
        medians[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        shutil.rmtree(out, ignore_errors=True)
    print()
    print(f"{'launcher':<22} {'started':>11} {'Manager ready':>14} {'first commit':>13}")
    for name, m in medians.items():
        print(
            f"{LAUNCHERS[name][0]:<22} {m['start']:>9.3f} s {m['ready']:>12.3f} s "
            f"{m['commit']:>11.3f} s"
        )
    base = medians.get("torchrun")
    for name in ("ftdist-run", "function"):
        if name not in medians:
            continue
        ours = medians[name]["commit"]
        verdict = "PASS" if ours < TARGET_S else "MISS"
        ratio = f"{base['commit'] / ours:.1f}x faster than torchrun + torchft" if base else ""
        print(
            f"{LAUNCHERS[name][0]}: kill -> first commit {ours:.3f} s (median) {ratio}; "
            f"target < {TARGET_S:.0f} s: {verdict}"
        )
    print(f"Total {time.monotonic() - started:.0f} s.")


if __name__ == "__main__":
    main()
