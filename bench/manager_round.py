"""The control plane as a training step meets it: the Manager's round, ftdist against torchft.

``bench/lighthouse.py`` times a lighthouse and one lighthouse client. A step
waits on more: ``start_quorum`` / ``wait_quorum`` (the rank's Manager asks its
replica group's manager server, which asks the lighthouse) and then
``should_commit`` (the group's vote). This runs N replica groups of one rank
(``--group-size R``: R ranks), each rank a process of its own as real ones are, looping those three calls with an
empty state and ``init_sync=False`` (no heal, no model: only the control
plane), for both stacks in turn:

* ftdist: ``ftdist.manager.Manager``, ftdist's manager server and ``ftdist
  lighthouse``;
* torchft: ``torchft.manager.Manager``, its Rust manager server and its Rust
  ``torchft_lighthouse``.

The worker code is the same for both; only the package imported differs
(ftdist's import compatibility). Each group's median per phase is taken over
its steps after the first fifth; a stack's figure is the mean of every rank's
medians. In a group of one rank ftdist's vote is local; with more, it is a
round trip to the group's manager server in both stacks. The stacks alternate (ftdist first, then torchft first) so that a
drift of this shared machine cancels out. The ``ratio`` line is ftdist's
per-step sum (quorum + vote) over torchft's.

Run it: ``python bench/manager_round.py [--sizes 2,4,8] [--steps 500] [--repeats 2]
[--group-size 1]``.
Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lighthouse as lighthouse_bench  # noqa: E402  (bench/lighthouse.py: servers, ports)

STACKS = ("ftdist", "torchft")


def worker(
    stack: str,
    lighthouse: str,
    replica_id: str,
    steps: int,
    groups: int,
    group_rank: int,
    group_size: int,
    store_port: int,
) -> None:
    """One rank of a replica group: ``steps`` control-plane rounds; prints one JSON line.

    Group rank 0 hosts the group's store on ``store_port``; the others join it.
    """
    import torch.distributed as dist

    manager_cls = importlib.import_module(f"{stack}.manager").Manager
    pg_cls = importlib.import_module(f"{stack}.process_group").ProcessGroupGloo
    store = None
    if group_rank == 0:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    manager = manager_cls(
        pg=pg_cls(),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        min_replica_size=groups,
        replica_id=replica_id,
        lighthouse_addr=lighthouse,
        rank=group_rank,
        world_size=group_size,
        store_addr="127.0.0.1",
        store_port=store_port,
        hostname="127.0.0.1",
        init_sync=False,
    )
    quorum_s: list[float] = []
    vote_s: list[float] = []
    failed = 0
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            manager.start_quorum()
            manager.wait_quorum()
            t1 = time.perf_counter()
            failed += not manager.should_commit()
            t2 = time.perf_counter()
            quorum_s.append(t1 - t0)
            vote_s.append(t2 - t1)
        skip = steps // 5
        print(
            json.dumps(
                {
                    "replica_id": replica_id,
                    "group_rank": group_rank,
                    "quorum_ms": statistics.median(quorum_s[skip:]) * 1e3,
                    "vote_ms": statistics.median(vote_s[skip:]) * 1e3,
                    "failed": failed,
                    "step": manager.current_step(),
                }
            ),
            flush=True,
        )
    finally:
        manager.shutdown()
        del store


def _server_cmd(stack: str, port: int, groups: int) -> list[str]:
    if stack == "ftdist":
        template = lighthouse_bench._DEFAULT_SERVER
    else:
        found = lighthouse_bench._torchft_server_cmd()
        if found is None:
            raise SystemExit("torchft_lighthouse not found: pip install torchft-nightly")
        template = found
    return shlex.split(template.format(port=port, n=groups))


def run_stack(
    stack: str, groups: int, group_size: int, steps: int, timeout_s: float
) -> dict[str, float]:
    """One run of ``groups`` replica groups of ``group_size`` ranks on ``stack``; the mean
    of every rank's medians."""
    port = lighthouse_bench._free_port()
    server = subprocess.Popen(
        _server_cmd(stack, port, groups), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    workers: list[tuple[subprocess.Popen[str], Any]] = []
    try:
        lighthouse_bench._wait_ready(f"127.0.0.1:{port}", server, 30)
        env = dict(os.environ, RUST_LOG="error")
        for i in range(groups):
            store_port = lighthouse_bench._free_port()
            for rank in range(group_size):
                log = tempfile.TemporaryFile(mode="w+")
                cmd = [sys.executable, __file__, "--worker", stack, f"http://127.0.0.1:{port}"]
                cmd += [f"group{i}", str(steps), str(groups), str(rank), str(group_size)]
                cmd += [str(store_port)]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
                workers.append((proc, log))
        deadline = time.monotonic() + timeout_s
        rows = []
        failed: list[str] = []
        for index, (proc, log) in enumerate(workers):
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out = ""
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                log.seek(0)
                where = f"group{index // group_size} rank {index % group_size}"
                failed.append(f"--- {where} (exit {proc.returncode}):\n{log.read()[-2500:]}")
            else:
                rows.append(json.loads(lines[-1]))
        if failed:
            # Every failed rank's output: the first to fail is not always the first listed.
            raise SystemExit(f"{stack}: {len(failed)} worker(s) failed\n" + "\n".join(failed))
    finally:
        for proc, log in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return {
        "quorum_ms": statistics.fmean(r["quorum_ms"] for r in rows),
        "vote_ms": statistics.fmean(r["vote_ms"] for r in rows),
        "failed": sum(r["failed"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4,8", help="replica groups (default 2,4,8)")
    parser.add_argument("--steps", type=int, default=500, help="steps per group (default 500)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per stack (default 2)")
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="ranks per replica group (default 1: the vote is local in ftdist; more make it "
        "a round trip to the group's manager server in both stacks)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        stack, lighthouse, replica_id, *numbers = args.worker
        steps, groups, group_rank, group_size, store_port = (int(n) for n in numbers)
        worker(stack, lighthouse, replica_id, steps, groups, group_rank, group_size, store_port)
        return
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if any(n < 1 for n in sizes) or args.steps < 5 or args.repeats < 1 or args.group_size < 1:
        raise SystemExit(
            f"give --sizes >= 1, --steps >= 5, --repeats >= 1, --group-size >= 1 (got {vars(args)})"
        )
    print(
        f"Manager round: start_quorum + wait_quorum, then should_commit; replica groups of "
        f"{args.group_size} rank(s), one process per rank; {args.steps} steps, medians after "
        "the first fifth"
    )
    for groups in sizes:
        got: dict[str, list[dict[str, float]]] = {s: [] for s in STACKS}
        for rep in range(args.repeats):
            for stack in STACKS if rep % 2 == 0 else STACKS[::-1]:
                got[stack].append(
                    run_stack(stack, groups, args.group_size, args.steps, args.timeout)
                )
        sums = {}
        for stack in STACKS:
            runs = got[stack]
            quorum = statistics.fmean(r["quorum_ms"] for r in runs)
            vote = statistics.fmean(r["vote_ms"] for r in runs)
            sums[stack] = quorum + vote
            failed = sum(int(r["failed"]) for r in runs)
            print(
                f"  N={groups:<3} {stack:<8} quorum {quorum:7.3f} ms  vote {vote:7.3f} ms  "
                f"step {quorum + vote:7.3f} ms  (runs: "
                + ", ".join(f"{r['quorum_ms'] + r['vote_ms']:.3f}" for r in runs)
                + f"; steps not committed: {failed})"
            )
        print(
            f"  N={groups:<3} ratio ftdist / torchft per step: {sums['ftdist'] / sums['torchft']:.2f}x"
        )


if __name__ == "__main__":
    main()
