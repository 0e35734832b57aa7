"""Recovery benchmark: what fault tolerance costs per step, and how fast it recovers.

Everything runs on this machine in one go, as real processes started by
``ftdist.testing.Ranks`` (forkserver children with torch preloaded, meeting on
TCPStores on 127.0.0.1), with a real :class:`ftdist.coordination.LighthouseServer`
in this (the parent) process. Numbers are absolute and, where there is a
baseline, side by side with it.

(a) **Per-step overhead.** Two replica groups of one rank each train the same
    MLP (same batch, same steps, SGD with momentum) two ways in the same
    processes: plain ``torch.nn.parallel.DistributedDataParallel`` over
    ``init_process_group("gloo")`` with a plain optimizer, and ftdist
    (``Manager`` + ``ftdist.ddp.DistributedDataParallel`` +
    ``OptimizerWrapper``: a quorum and a commit vote every step). After a
    warm-up the two take turns in blocks of K steps (order alternating each
    round, so both see the same noise of this shared machine); steps/s is K
    over the median block time, the ratio is the median of the per-round
    ratios. A several-ms-per-step model is the fair row; a tiny model
    (protocol cost only) is printed too.

(b) **Failure detection to next commit.** Two replica groups with the
    default collective timeout (60 s) and the default lighthouse heartbeat
    timeout (5 s). The victim stops in step ``--kill-step`` after its quorum,
    before its backward; the survivor signals when it enters that step's
    backward (whose gradient allreduce then waits on the victim); this parent
    waits a little more, records ``time.time()`` and SIGKILLs the victim. The
    survivor records ``time.time()`` of each commit. Reported: SIGKILL to the
    survivor's failed allreduce (the step aborts), and SIGKILL to its next
    committed step, each of ``--failover-reps`` runs and their median.

(c) **Replacement start to first commit** with ~100 MB of state (an MLP of
    8.39 M float32 params with Adam: params + exp_avg + exp_avg_sq). Two
    groups train; one is SIGKILLed; once the survivor trains alone, the
    parent records ``time.time()`` and asks the harness for a new process. The
    new process records when its function starts, when its Manager is ready,
    and when its first step commits; the heal phases come from
    ``manager.heal_timelines``. The harness forks the new process from a fork
    server that has torch preloaded, so "process start" here is much shorter
    than a cold ``python`` start; a cold start is measured for reference.

(d) **Checkpoint transports, 1 GiB over loopback**, between two processes:
    ``HTTPTransport`` (one stream, and ``num_chunks=4``) and ``PGTransport`` over
    ``ftdist.process_group.ProcessGroupGloo`` (2 ranks). The state is 64 tensors
    of 16 MiB. Each transfer is timed by the receiver (``last_transfer``);
    PGTransport transfers start after a barrier so both sides start
    together. A raw TCP loopback copy of the same bytes between the same two
    processes is shown for reference (the ceiling on this machine).

Nothing is asserted: the script prints, and ends with PASS/MISS per target.
Run ``python bench/recovery.py`` (about 3-4 minutes on 2 cores) or
``--quick`` for a rough smoke run; ``--parts`` picks sections.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftdist.testing import RankContext, Ranks

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30
CTL_TIMEOUT = timedelta(seconds=120)


# -- shared helpers (run in the ranks) ------------------------------------------------------


def _coord(port: int, prefix: str) -> dist.Store:
    """A client of the parent's coordination store."""
    tcp = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                        timeout=CTL_TIMEOUT)
    return dist.PrefixStore(prefix, tcp)


def _store_barrier(store: dist.Store, name: str, n: int = 2) -> None:
    """Wait until ``n`` processes have reached this point."""
    store.add(name, 1)
    deadline = time.monotonic() + CTL_TIMEOUT.total_seconds()
    while int(store.add(name, 0)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name!r} timed out")
        time.sleep(0.001)


def mlp(width: int, depth: int, seed: int) -> nn.Sequential:
    """``depth`` Linear(width, width) layers with ReLU between them."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(depth):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


def n_params(width: int, depth: int) -> int:
    return depth * (width * width + width)


def _make_manager(lighthouse: str, replica_id: str, model: nn.Module, optim: torch.optim.Optimizer,
                  pg: Any, timeout: timedelta | None) -> tuple[Any, Any]:
    """A Manager for a replica group of one rank, hosting its own TCPStore."""
    from ftdist.manager import Manager

    own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])

    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    manager = Manager(
        pg=pg, load_state_dict=load,
        state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        min_replica_size=1, replica_id=replica_id, lighthouse_addr=lighthouse,
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=own.port,
        hostname="127.0.0.1", **kwargs,
    )
    return manager, own


def _batch(width: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


# -- (a) per-step overhead --------------------------------------------------------------------


def overhead_rank(ctx: RankContext, lighthouse: str, width: int, depth: int, batch: int,
                  threads: int, warmup: int, block_s: float, seconds: float) -> dict[str, Any]:
    from ftdist.ddp import DistributedDataParallel as FtDDP
    from ftdist.optim import OptimizerWrapper
    from ftdist.process_group import ProcessGroupGloo

    torch.set_num_threads(threads)
    loss_fn = nn.MSELoss()
    x, y = _batch(width, batch, seed=ctx.rank)

    # Plain torch: default group over Gloo, torch DDP, plain optimizer.
    dist.init_process_group("gloo", store=dist.PrefixStore("plain", ctx.store()),
                            rank=ctx.rank, world_size=ctx.world_size)
    plain_model = mlp(width, depth, seed=1)
    plain = nn.parallel.DistributedDataParallel(plain_model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3, momentum=0.9)

    # ftdist: Manager + ftdist DDP + OptimizerWrapper, same model and optimizer.
    ft_model = mlp(width, depth, seed=100 + ctx.rank)
    ft_inner = torch.optim.SGD(ft_model.parameters(), lr=1e-3, momentum=0.9)
    pg = ProcessGroupGloo()
    manager, own = _make_manager(lighthouse, f"overhead{ctx.rank}", ft_model, ft_inner, pg, None)
    ft = FtDDP(manager, ft_model)
    ft_opt = OptimizerWrapper(manager, ft_inner)

    def plain_step() -> None:
        plain_opt.zero_grad()
        loss_fn(plain(x), y).backward()
        plain_opt.step()

    failed = 0

    def ft_step() -> None:
        nonlocal failed
        before = manager.current_step()
        ft_opt.zero_grad()
        loss_fn(ft(x), y).backward()
        ft_opt.step()
        if manager.current_step() == before:
            failed += 1

    steps = {"plain": plain_step, "ftdist": ft_step}
    # Both Managers are up before the first quorum, so it holds both groups.
    _store_barrier(ctx.store(), "managers_ready")

    def block(name: str, k: int) -> float:
        fn = steps[name]
        start = time.perf_counter()
        for _ in range(k):
            fn()
        return time.perf_counter() - start

    try:
        warm = {}
        for name in ("plain", "ftdist", "plain", "ftdist"):
            warm[name] = block(name, warmup) / warmup
        # Rank 0 decides the block length and the number of rounds for both.
        per_step = max(warm.values())
        k = max(1, round(block_s / per_step))
        rounds = max(3, round(seconds / (k * sum(warm.values()))))
        agreed = torch.tensor([float(k), float(rounds)])
        dist.broadcast(agreed, 0)
        k, rounds = int(agreed[0]), int(agreed[1])
        failed = 0
        times: dict[str, list[float]] = {"plain": [], "ftdist": []}
        for r in range(rounds):
            order = ("plain", "ftdist") if r % 2 == 0 else ("ftdist", "plain")
            for name in order:
                times[name].append(block(name, k))
        committed = manager.current_step()
        dist.barrier()
    finally:
        manager.shutdown()
        pg.shutdown()
        dist.destroy_process_group()
        del own
    return {"k": k, "rounds": rounds, "times": times, "warm": warm, "failed": failed,
            "committed": committed, "threads": torch.get_num_threads()}


# -- (b) failure detection to next commit ------------------------------------------------------


def failover_rank(ctx: RankContext, lighthouse: str, coord_port: int, coord_prefix: str,
                  kill_step: int, end_step: int, width: int, depth: int, batch: int,
                  threads: int) -> dict[str, Any]:
    from ftdist.ddp import DistributedDataParallel as FtDDP
    from ftdist.optim import OptimizerWrapper
    from ftdist.process_group import ProcessGroupGloo

    torch.set_num_threads(threads)
    coord = _coord(coord_port, coord_prefix)
    victim = ctx.rank == 1
    model = mlp(width, depth, seed=ctx.rank)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    pg = ProcessGroupGloo()  # default timeout
    manager, own = _make_manager(lighthouse, f"failover{ctx.rank}", model, inner, pg, None)
    ddp = FtDDP(manager, model)
    opt = OptimizerWrapper(manager, inner)
    loss_fn = nn.MSELoss()
    x, y = _batch(width, batch, seed=ctx.rank)
    attempts: list[dict[str, Any]] = []
    _store_barrier(coord, "managers_ready")
    armed = True
    try:
        while manager.current_step() < end_step:
            step = manager.current_step()
            t0 = time.time()
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            if step >= kill_step and armed:
                armed = False
                if victim:
                    manager.wait_quorum()
                    coord.set("victim_ready", "1")
                    time.sleep(600)  # the parent SIGKILLs this process
                else:
                    coord.set("survivor_in_backward", "1")
            loss.backward()  # returns once the gradient allreduce is done (or failed)
            t_backward = time.time()
            opt.step()
            t_end = time.time()
            err = manager.errored()
            attempts.append({"step": step, "t_start": t0, "t_backward": t_backward,
                             "t_end": t_end, "committed": manager.current_step() > step,
                             "error": str(err).splitlines()[0][:160] if err else None})
        return {"attempts": attempts,
                "timeout_s": manager._settings.timeout.total_seconds(),
                "pg_timeout_s": pg._timeout.total_seconds()}
    finally:
        manager.shutdown()
        pg.shutdown()
        del own


# -- (c) replacement start to first commit -------------------------------------------------------


def replace_rank(ctx: RankContext, lighthouse: str, coord_port: int, coord_prefix: str,
                 width: int, depth: int, batch: int, threads: int, t_request: float | None = None,
                 attempt: int = 0) -> dict[str, Any]:
    t_enter = time.time()
    preloaded = "ftdist.manager" in sys.modules
    import ftdist.manager  # noqa: F401  (timed: the fork server does not preload it)
    from ftdist.ddp import DistributedDataParallel as FtDDP
    from ftdist.optim import OptimizerWrapper
    from ftdist.process_group import ProcessGroupGloo

    t_imported = time.time()
    torch.set_num_threads(threads)
    coord = _coord(coord_port, coord_prefix)
    t_coord = time.time()
    model = mlp(width, depth, seed=10 * ctx.rank + attempt)
    t_built = time.time()
    inner = torch.optim.Adam(model.parameters(), lr=1e-4)
    t_model = time.time()
    pg = ProcessGroupGloo()
    manager, own = _make_manager(lighthouse, f"replace{ctx.rank}", model, inner, pg, None)
    t_ready = time.time()
    ddp = FtDDP(manager, model)
    opt = OptimizerWrapper(manager, inner)
    loss_fn = nn.MSELoss()
    x, y = _batch(width, batch, seed=ctx.rank)
    first_commit: float | None = None
    first_step: int | None = None
    t_backward_first: float | None = None
    stop_step = 1 << 30
    if attempt == 0:
        _store_barrier(coord, "managers_ready")
    try:
        while manager.current_step() < stop_step:
            step = manager.current_step()
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            if first_commit is None:
                t_backward_first = time.time()
            opt.step()
            if manager.current_step() > step:
                coord.set(f"step/{ctx.rank}", str(manager.current_step()))
                if first_commit is None:
                    first_commit = time.time()
                    first_step = step
                    if attempt > 0:
                        # Both replicas stop together a couple of steps later.
                        coord.set("stop_step", str(manager.current_step() + 2))
            if coord.check(["stop_step"]):
                stop_step = int(coord.get("stop_step"))
        coord.add("done", 1)
        deadline = time.monotonic() + 60
        while int(coord.add("done", 0)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        for st in inner.state_dict()["state"].values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    state_bytes += v.numel() * v.element_size()
        return {"attempt": attempt, "t_request": t_request, "t_enter": t_enter,
                "t_imported": t_imported, "t_coord": t_coord, "t_built": t_built,
                "t_model": t_model,
                "preloaded": preloaded, "t_ready": t_ready,
                "t_backward_first": t_backward_first, "t_first_commit": first_commit,
                "first_step": first_step, "state_bytes": state_bytes,
                "heals": [t.as_dict() | {"gbps": t.transfer_gbps} for t in manager.heal_timelines],
                "final_step": manager.current_step()}
    finally:
        manager.shutdown()
        pg.shutdown()
        del own


# -- (d) transports ------------------------------------------------------------------------------


def _state_1gib(n: int, tensor_bytes: int) -> dict[str, torch.Tensor]:
    numel = tensor_bytes // 4
    return {f"layer{i}": torch.full((numel,), float(i)) for i in range(n)}


def transport_rank(ctx: RankContext, n_tensors: int, tensor_bytes: int, reps: int,
                   chunk_rows: tuple[int, ...]) -> dict[str, Any]:
    from ftdist.checkpointing import HTTPTransport, PGTransport
    from ftdist.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    store = ctx.store(CTL_TIMEOUT)
    src = ctx.rank == 0
    timeout = timedelta(seconds=60)
    out: dict[str, Any] = {}
    state = _state_1gib(n_tensors, tensor_bytes) if src else None
    total = n_tensors * tensor_bytes

    def barrier(name: str) -> None:
        store.add(name, 1)
        while int(store.add(name, 0)) < 2:
            time.sleep(0.001)

    def check(got: Any) -> None:
        for i in (0, n_tensors - 1):
            t = got[f"layer{i}"]
            if t.numel() != tensor_bytes // 4 or float(t[-1]) != float(i):
                raise RuntimeError(f"transfer delivered wrong data for layer{i}")

    # Raw TCP loopback copy of the same bytes: the ceiling for a socket transport.
    if src:
        server = socket.create_server(("127.0.0.1", 0))
        store.set("raw_port", str(server.getsockname()[1]))
        conn, _ = server.accept()
        with conn:
            for _ in range(reps):
                assert state is not None
                for t in state.values():
                    conn.sendall(memoryview(t.numpy()).cast("B"))
                conn.recv(1)
        server.close()
    else:
        port = int(store.get("raw_port"))
        # First touch of fresh memory, then the socket ceiling into touched memory.
        start = time.perf_counter()
        buf = torch.empty(total, dtype=torch.uint8).fill_(0)
        out["_touch_gbps"] = total / (time.perf_counter() - start) / GB
        view = memoryview(buf.numpy()).cast("B")
        with socket.create_connection(("127.0.0.1", port)) as conn:
            raw = []
            for _ in range(reps):
                start = time.perf_counter()
                got = 0
                while got < total:
                    n = conn.recv_into(view[got:], min(total - got, 16 * MiB))
                    if not n:
                        raise RuntimeError("raw stream ended early")
                    got += n
                raw.append({"bytes": total, "s": time.perf_counter() - start})
                conn.sendall(b"x")
        del buf, view
        out["raw TCP loopback, reused buffer"] = raw
        # zlib.crc32 throughput on this machine (both transports CRC every byte).
        data = torch.ones(256 * MiB, dtype=torch.uint8)
        start = time.perf_counter()
        zlib.crc32(memoryview(data.numpy()).cast("B"))
        out["_crc_gbps"] = data.numel() / (time.perf_counter() - start) / GB
        del data

    for chunks in chunk_rows:
        label = f"HTTPTransport num_chunks={chunks}"
        tr = HTTPTransport(timeout, num_chunks=chunks, hostname="127.0.0.1")
        try:
            if src:
                tr.send_checkpoint([1], 7, state, timeout)
                store.set(f"url/{chunks}", tr.metadata())
                barrier(f"http_done/{chunks}")
                tr.disallow_checkpoint()
            else:
                url = store.get(f"url/{chunks}").decode()
                rows = []
                for _ in range(reps):
                    got = tr.recv_checkpoint(0, url, 7, timeout)
                    stats = tr.last_transfer
                    assert stats is not None
                    rows.append({"bytes": stats.nbytes, "s": stats.seconds})
                    check(got)
                    del got
                out[label] = rows
                barrier(f"http_done/{chunks}")
        finally:
            tr.shutdown()

    pg = ProcessGroupGloo(timeout=timeout)
    pg.configure(ctx.addr("pgtransport"), ctx.rank, 2)
    tr_pg = PGTransport(pg, timeout)
    rows = []
    try:
        for rep in range(reps):
            barrier(f"pg/{rep}")
            if src:
                tr_pg.send_checkpoint([1], 7, state, timeout)
            else:
                got = tr_pg.recv_checkpoint(0, "<n/a>", 7, timeout)
                stats = tr_pg.last_transfer
                assert stats is not None
                rows.append({"bytes": stats.nbytes, "s": stats.seconds})
                check(got)
                del got
        if not src:
            out["PGTransport (ProcessGroupGloo)"] = rows
        barrier("pg/end")
    finally:
        pg.shutdown()
    return out


# -- report helpers ------------------------------------------------------------------------------


def _machine() -> str:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:
        nproc = os.cpu_count() or 0
    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                    break
    except OSError:
        pass
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    return (f"machine: nproc={nproc}, cpu={model!r}, memory {mem}, torch {torch.__version__}, "
            f"python {platform.python_version()}, loadavg {load}")


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _lighthouse(min_replicas: int = 1) -> Any:
    """A lighthouse with default timeouts (join 100 ms, heartbeat 5 s), no dashboard."""
    from ftdist.coordination import LighthouseServer

    return LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, http_port=-1)


def _fail(outcomes: Sequence[Any], what: str) -> None:
    bad = [o for o in outcomes if not o.ok]
    if bad:
        msg = "\n".join(f"rank {o.rank}: exit {o.exitcode}\n{o.error}" for o in bad)
        raise RuntimeError(f"{what} failed:\n{msg}")


# -- the parts (parent side) ---------------------------------------------------------------------


def part_overhead(args: argparse.Namespace, targets: list[tuple[str, bool, str]]) -> None:
    print("\n(a) per-step overhead: ftdist (Manager + ftdist DDP + OptimizerWrapper) vs plain "
          "torch DDP over Gloo")
    print(f"    2 replica groups x 1 rank, {args.threads} torch thread(s) per process, SGD "
          "momentum 0.9, same model/batch/steps; blocks of K steps alternate")
    rows = [("big", args.width, args.depth, args.batch, args.overhead_seconds),
            ("tiny", 32, 2, args.batch, args.tiny_seconds)]
    print("    note: ftdist DDP always sets find_unused_parameters=True (torch warns: an extra "
          "autograd-graph traversal per step); plain DDP uses torch's default (False)")
    print(f"    {'model':<26} {'ms/step plain':>13} {'ms/step ftdist':>14} {'steps/s plain':>13} "
          f"{'steps/s ftdist':>14} {'ratio ft/plain':>14} {'ratio p10-p90':>14}  blocks")
    for label, width, depth, batch, seconds in rows:
        # Both groups take every step (no quorum of one while the other runs a plain block).
        server = _lighthouse(min_replicas=2)
        try:
            with Ranks(overhead_rank, 2, args=(server.address(), width, depth, batch, args.threads,
                                               args.warmup, args.block_s, seconds)) as ranks:
                outcomes = ranks.join(timeout=seconds * 3 + 120)
        finally:
            server.shutdown()
        _fail(outcomes, f"(a) {label}")
        r0 = outcomes[0].value
        tp, tf = r0["times"]["plain"], r0["times"]["ftdist"]
        k = r0["k"]
        ratios = [p / f for p, f in zip(tp, tf, strict=True)]  # steps/s ftdist / plain
        ratio = statistics.median(ratios)
        mp, mf = statistics.median(tp) / k, statistics.median(tf) / k
        name = f"{label} {depth}x{width}x{width} ({n_params(width, depth) / 1e6:.2f}M) b{batch}"
        print(f"    {name:<26} {mp * 1e3:>13.2f} {mf * 1e3:>14.2f} {1 / mp:>13.1f} {1 / mf:>14.1f} "
              f"{ratio:>13.3f}x {_pct(ratios, 10):>6.2f}-{_pct(ratios, 90):<6.2f}  "
              f"{r0['rounds']}x{k} steps")
        if r0["failed"]:
            print(f"      note: {r0['failed']} ftdist steps did not commit")
        if label == "big":
            targets.append(("(a) ftdist steps/s >= 0.9x plain DDP (big model)", ratio >= 0.9,
                            f"{ratio:.3f}x"))


def part_failover(args: argparse.Namespace, targets: list[tuple[str, bool, str]]) -> None:
    print("\n(b) failure detection to next commit: SIGKILL one of 2 replica groups mid-allreduce")
    print("    default collective timeout and default lighthouse heartbeat timeout; times on "
          "this host's clock (time.time())")
    coord = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=CTL_TIMEOUT)
    totals = []
    for rep in range(args.failover_reps):
        prefix = f"failover/{uuid.uuid4().hex[:8]}"
        client = dist.PrefixStore(prefix, coord)
        server = _lighthouse()  # heartbeat timeout: default
        hb = server.config.heartbeat_timeout.total_seconds()
        try:
            with Ranks(failover_rank, 2, args=(server.address(), coord.port, prefix,
                                               args.kill_step, args.kill_step + 4, 256, 4, 64,
                                               args.threads)) as ranks:
                client.wait(["victim_ready", "survivor_in_backward"], timedelta(seconds=60))
                # The survivor's backward is now blocked in its gradient
                # allreduce, waiting for the victim.
                time.sleep(args.kill_delay)
                t_kill = time.time()
                ranks.kill(1)
                outcomes = ranks.join(timeout=90, only=[0])
        finally:
            server.shutdown()
        _fail(outcomes[:1], "(b) survivor")
        res = outcomes[0].value
        attempts = res["attempts"]
        failed = [a for a in attempts if not a["committed"] and a["t_end"] > t_kill]
        after = [a for a in attempts if a["committed"] and a["t_end"] > t_kill]
        if not after:
            print(f"    run {rep + 1}: survivor never committed after the kill")
            continue
        total = after[0]["t_end"] - t_kill
        totals.append(total)
        abort = f"{failed[0]['t_backward'] - t_kill:6.3f} s" if failed else "  n/a  "
        why = failed[0]["error"] if failed else "(no failed step)"
        if rep == 0:
            print(f"    collective timeout {res['timeout_s']:.0f} s (ProcessGroupGloo "
                  f"{res['pg_timeout_s']:.0f} s), lighthouse heartbeat timeout {hb:.0f} s, "
                  f"kill {args.kill_delay * 1e3:.0f} ms after the survivor entered the allreduce")
        print(f"    run {rep + 1}: SIGKILL -> survivor's allreduce aborted {abort}, -> next commit "
              f"(step {after[0]['step']}) {total:6.3f} s   [{why}]")
    coord = None
    if totals:
        med = statistics.median(totals)
        print(f"    median SIGKILL -> next commit: {med:.3f} s over {len(totals)} runs "
              f"(min {min(totals):.3f}, max {max(totals):.3f})")
        targets.append(("(b) SIGKILL -> survivor's next commit <= 2 s (median)", med <= 2.0,
                        f"{med:.3f} s"))
    else:
        targets.append(("(b) SIGKILL -> survivor's next commit <= 2 s (median)", False, "no data"))


def _cold_start() -> float | None:
    """A cold interpreter that imports torch and the ftdist Manager stack."""
    code = "import torch, torch.distributed, ftdist.manager, ftdist.ddp, ftdist.optim"
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    return time.time() - start if proc.returncode == 0 else None


def part_replace(args: argparse.Namespace, targets: list[tuple[str, bool, str]]) -> None:
    width, depth = args.replace_width, 2
    params = n_params(width, depth)
    print(f"\n(c) replacement start -> first committed step, {params / 1e6:.2f}M float32 params "
          f"+ Adam (2 moments): {3 * params * 4 / 1e6:.1f} MB of state")
    print("    the harness forks the new process from a fork server with torch (and "
          "ftdist.process_group) preloaded; Manager stack imported in the child")
    coord = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=CTL_TIMEOUT)
    prefix = f"replace/{uuid.uuid4().hex[:8]}"
    client = dist.PrefixStore(prefix, coord)
    server = _lighthouse()
    rargs = (server.address(), coord.port, prefix, width, depth, args.batch, args.threads)
    try:
        with Ranks(replace_rank, 2, args=rargs) as ranks:
            deadline = time.monotonic() + 120

            def step_of(rank: int) -> int:
                return int(client.get(f"step/{rank}")) if client.check([f"step/{rank}"]) else 0

            while step_of(1) < 3:
                if time.monotonic() > deadline or ranks.exitcode(1) is not None:
                    raise RuntimeError("(c) the victim did not reach step 3")
                time.sleep(0.01)
            ranks.kill(1)
            while ranks.exitcode(1) is None:
                time.sleep(0.01)
            # Let the survivor go on alone for two commits, then replace.
            base = step_of(0)
            while step_of(0) < base + 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("(c) the survivor stopped committing")
                time.sleep(0.01)
            t_request = time.time()
            ranks.restart(1, *rargs, t_request=t_request, attempt=1)
            outcomes = ranks.join(timeout=120)
    finally:
        server.shutdown()
        coord = None
    _fail(outcomes, "(c)")
    new, survivor = outcomes[1].value, outcomes[0].value
    recv = [h for h in new["heals"] if h["role"] == "receive"]
    sent = [h for h in survivor["heals"] if h["role"] == "send" and h["step"] > 0]
    if not recv or new["t_first_commit"] is None:
        print("    the replacement did not heal/commit; heals:", new["heals"])
        targets.append(("(c) replacement dominated by process start", False, "no heal"))
        return
    h = recv[0]
    t0 = new["t_request"]
    total = new["t_first_commit"] - t0
    spawn = new["t_enter"] - t0
    imports = new["t_imported"] - new["t_enter"]
    coord_s = new["t_coord"] - new["t_imported"]
    build = new["t_built"] - new["t_coord"]
    adam = new["t_model"] - new["t_built"]
    mgr = new["t_ready"] - new["t_model"]
    start_phase = new["t_ready"] - t0
    heal_s = h["quorum_s"] + h["reconfigure_s"] + h["transfer_s"] + h["load_s"]
    rest = new["t_first_commit"] - new["t_ready"] - heal_s
    phases = [
        ("process start: request -> Manager ready", start_phase, ""),
        ("  fork from fork server -> function entry", spawn, ""),
        ("  import ftdist Manager/DDP/optim", imports, ""),
        ("  benchmark's own store client (not ftdist)", coord_s, ""),
        ("  build the model", build, ""),
        ("  torch.optim.Adam()", adam, "the first optimizer imports torch._dynamo"),
        ("  Manager() (store, server, lighthouse)", mgr, ""),
        ("quorum wait", h["quorum_s"], ""),
        ("process-group reconfigure", h["reconfigure_s"], ""),
        ("state transfer", h["transfer_s"],
         f"{h['transfer_bytes'] / 1e6:.1f} MB, {h['gbps']:.2f} GB/s"),
        ("load (+ fingerprint check)", h["load_s"], ""),
        ("first commit (rest: fwd/bwd/allreduce/vote/step)", rest, ""),
    ]
    print(f"    healed to step {h['step']} from replica rank(s) {h['peers']} "
          f"(state {new['state_bytes'] / 1e6:.1f} MB in the model and Adam after the step)")
    for name, secs, extra in phases:
        share = f"{secs / total * 100:5.1f}%" if not name.startswith("  ") else "      "
        print(f"    {name:<50} {secs * 1e3:8.1f} ms {share}  {extra}")
    print(f"    {'total: request -> first commit':<50} {total * 1e3:8.1f} ms")
    if sent:
        s = sent[0]
        print(f"    survivor (send): quorum {s['quorum_s'] * 1e3:.0f} ms, reconfigure "
              f"{s['reconfigure_s'] * 1e3:.0f} ms, send_checkpoint {s['transfer_s'] * 1e3:.1f} ms "
              "(HTTP: publishes the live state; the receiver pulls)")
    if args.cold_start:
        cold = _cold_start()
        if cold is not None:
            print(f"    for reference, a cold `python -c 'import torch, ftdist.manager, ...'` "
                  f"takes {cold:.2f} s on this machine (not on the path measured above)")
    top = max(phases[1:], key=lambda p: p[1] if not p[0].startswith("  ") else -1)
    dominated = start_phase >= top[1]
    targets.append(("(c) replacement dominated by process start", dominated,
                    f"start {start_phase * 1e3:.0f} ms of {total * 1e3:.0f} ms; largest other "
                    f"phase: {top[0]} {top[1] * 1e3:.0f} ms"))
    targets.append(("(c) heal transfer >= 1 GB/s", h["gbps"] >= 1.0, f"{h['gbps']:.2f} GB/s"))


def part_transport(args: argparse.Namespace, targets: list[tuple[str, bool, str]]) -> None:
    n, size = args.transport_tensors, args.transport_tensor_mib * MiB
    print(f"\n(d) checkpoint transports over loopback, 2 processes: {n} x "
          f"{args.transport_tensor_mib} MiB = {n * size / GiB:.2f} GiB float32, "
          f"{args.transport_reps} transfers each, GB/s = 1e9 bytes/s")
    chunk_rows = (0, 4)
    with Ranks(transport_rank, 2, args=(n, size, args.transport_reps, chunk_rows)) as ranks:
        outcomes = ranks.join(timeout=300)
    _fail(outcomes, "(d)")
    res = outcomes[1].value
    print(f"    {'transport':<38} {'median GB/s':>11} {'best GB/s':>10} {'median s':>9}  all GB/s")
    for label, rows in res.items():
        if label.startswith("_"):
            continue
        rates = [r["bytes"] / r["s"] / GB for r in rows]
        secs = statistics.median(r["s"] for r in rows)
        med = statistics.median(rates)
        print(f"    {label:<38} {med:>11.2f} {max(rates):>10.2f} {secs:>9.3f}  "
              + " ".join(f"{v:.2f}" for v in rates))
        if label in ("HTTPTransport num_chunks=0", "PGTransport (ProcessGroupGloo)"):
            targets.append((f"(d) {label} >= 1 GB/s (median)", med >= 1.0, f"{med:.2f} GB/s"))
    print(f"    this machine: zlib.crc32 {res['_crc_gbps']:.2f} GB/s (both transports CRC every "
          f"byte on each side); allocating + first touch of 1 GiB {res['_touch_gbps']:.2f} GB/s "
          "(the receivers fill fresh tensors)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Recovery benchmark: per-step overhead of ftdist vs plain torch DDP, failure "
                    "detection, replacement heal, checkpoint transport throughput "
                    "(all on this machine).")
    parser.add_argument("--quick", action="store_true", help="short smoke run (numbers rough)")
    parser.add_argument("--parts", default="abcd",
                        help="which sections to run, any of a,b,c,d (default abcd)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank process (default 1: 2 ranks on 2 cores)")
    parser.add_argument("--width", type=int, default=1024, help="(a) MLP width (default 1024)")
    parser.add_argument("--depth", type=int, default=4, help="(a) MLP depth (default 4)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--warmup", type=int, default=None, help="(a) warm-up steps per impl")
    parser.add_argument("--block-s", type=float, default=0.25,
                        help="(a) target seconds of one block of steps (default 0.25)")
    parser.add_argument("--overhead-seconds", type=float, default=None,
                        help="(a) timed seconds for the big model, both impls (default 40)")
    parser.add_argument("--tiny-seconds", type=float, default=None,
                        help="(a) timed seconds for the tiny model (default 10)")
    parser.add_argument("--failover-reps", type=int, default=3, help="(b) runs (default 3)")
    parser.add_argument("--kill-step", type=int, default=5, help="(b) step killed (default 5)")
    parser.add_argument("--kill-delay", type=float, default=0.2,
                        help="(b) seconds between the survivor entering the allreduce and the "
                             "SIGKILL (default 0.2)")
    parser.add_argument("--replace-width", type=int, default=2048,
                        help="(c) width of the 2-layer MLP (default 2048: 8.39M params)")
    parser.add_argument("--no-cold-start", dest="cold_start", action="store_false",
                        help="(c) skip the cold interpreter start reference")
    parser.add_argument("--transport-tensors", type=int, default=64,
                        help="(d) number of tensors (default 64)")
    parser.add_argument("--transport-tensor-mib", type=int, default=16,
                        help="(d) MiB per tensor (default 16)")
    parser.add_argument("--transport-reps", type=int, default=None,
                        help="(d) transfers per transport (default 3, quick 1)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.warmup = args.warmup or (3 if quick else 10)
    args.overhead_seconds = args.overhead_seconds or (3.0 if quick else 40.0)
    args.tiny_seconds = args.tiny_seconds or (1.5 if quick else 10.0)
    args.transport_reps = args.transport_reps or (1 if quick else 3)
    if quick:
        args.failover_reps = min(args.failover_reps, 1)
        args.transport_tensors = min(args.transport_tensors, 16)
    # The rank processes (forked from a fork server started after this) log at
    # warning level: no per-run C++/gRPC info lines between the table rows.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parts = set(args.parts.lower())
    if not parts <= set("abcd"):
        parser.error("--parts takes letters from 'abcd'")

    print("ftdist recovery benchmark" + (" (--quick: rough numbers)" if quick else ""))
    print(_machine())
    import ftdist

    print(f"ftdist: {os.path.dirname(ftdist.__file__)}; ranks are forkserver children "
          "(ftdist.testing.Ranks); lighthouse in this process")
    targets: list[tuple[str, bool, str]] = []
    start = time.monotonic()
    for letter, fn in (("a", part_overhead), ("b", part_failover), ("c", part_replace),
                       ("d", part_transport)):
        if letter in parts:
            t = time.monotonic()
            fn(args, targets)
            print(f"    [{time.monotonic() - t:.0f} s]")
    print(f"\ntargets (wall {time.monotonic() - start:.0f} s, loadavg "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}):")
    for what, ok, value in targets:
        print(f"  {_verdict(ok)}  {what:<58} {value}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
