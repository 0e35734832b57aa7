"""Heal transfers of a state made of many small tensors, against torchft.

A deep model's state is thousands of tensors (weights, biases, norms, and as
many optimizer buffers), where ``bench/recovery.py`` (d) moves 64 large ones:
here the per-tensor costs show, not the bytes. Each run starts two fresh
processes: a source that publishes the state with ``HTTPTransport``, and a
receiver that fetches it once (a replacement's first and only receive, into
fresh memory, with a heap of 3000 small modules beside it as a trainer has).
Runs alternate between ftdist (its default route on one host, a direct read
of the source's memory, then TCP) and torchft's ``HTTPTransport``, then
between the two stacks' ``PGTransport`` over a two-rank Gloo group (the
receiver's time from a barrier to its state); each line gives the medians,
and the last ones the ratios against torchft measured in the same run.

Run it: ``python bench/many_tensors.py [--tensors 3000] [--total-mb 50] [--reps 3]``.
Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch

_TIMEOUT = timedelta(seconds=120)
# Environment of each ftdist variant (the receiver and the source read it).
_VARIANTS = {
    "ftdist (direct read)": {},
    "ftdist (TCP)": {
        "FTDIST_CHECKPOINT_LOCAL_SOCKET": "0",
        "FTDIST_CHECKPOINT_DIRECT_READS": "0",
    },
}


def _state(tensors: int, total: int) -> dict[str, Any]:
    numel = max(1, total // 4 // tensors)
    g = torch.Generator().manual_seed(0)
    return {
        "model": {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(tensors)},
        "optim": {"step": 3, "lr": 0.1},
    }


def _transport(stack: str) -> Any:
    if stack == "torchft":
        from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

        return TorchftHTTP(_TIMEOUT, num_chunks=0)
    from ftdist.checkpointing import HTTPTransport

    return HTTPTransport(_TIMEOUT, num_chunks=0, hostname="127.0.0.1")


def _source(stack: str, tensors: int, total: int, queue: Any, done: Any) -> None:
    torch.set_num_threads(1)
    state = _state(tensors, total)
    transport = _transport(stack)
    start = time.perf_counter()
    transport.send_checkpoint([1], 1, state, _TIMEOUT)
    queue.put((transport.metadata(), time.perf_counter() - start))
    done.wait(300)
    transport.shutdown()


def _once(stack: str, env: dict[str, str], tensors: int, total: int) -> tuple[float, float]:
    """(seconds to publish, seconds of the receiver's first fetch)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_source, args=(stack, tensors, total, queue, done))
    try:
        proc.start()
        metadata, publish_s = queue.get(timeout=120)
        receiver = ctx.Process(target=_receiver, args=(stack, metadata, queue))
        receiver.start()
        fetch_s = queue.get(timeout=120)
        receiver.join(60)
    finally:
        done.set()
        proc.join(60)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return publish_s, fetch_s


def _receiver(stack: str, metadata: str, queue: Any) -> None:
    torch.set_num_threads(1)
    heap = [torch.nn.Linear(4, 4) for _ in range(3000)]  # a trainer's live objects
    transport = _transport(stack)
    try:
        start = time.perf_counter()
        transport.recv_checkpoint(0, metadata, 1, _TIMEOUT)
        queue.put(time.perf_counter() - start)
    finally:
        transport.shutdown()
    del heap


def _pg_rank(stack: str, rank: int, port: int, tensors: int, total: int, queue: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if stack == "torchft":
        from torchft.checkpointing.pg_transport import PGTransport
    else:
        from ftdist.checkpointing import PGTransport
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=_TIMEOUT)
    pg: Any = dist.ProcessGroupGloo(store, rank, 2, _TIMEOUT)
    cpu = torch.device("cpu")
    if rank == 0:
        state = _state(tensors, total)
        transport = PGTransport(pg, _TIMEOUT, cpu)
        pg.barrier().wait()
        transport.send_checkpoint([1], 1, state, _TIMEOUT)
    else:
        heap = [torch.nn.Linear(4, 4) for _ in range(3000)]  # a trainer's live objects
        transport = PGTransport(pg, _TIMEOUT, cpu)
        pg.barrier().wait()
        start = time.perf_counter()
        transport.recv_checkpoint(0, "<n/a>", 1, _TIMEOUT)
        queue.put(time.perf_counter() - start)
        del heap
    pg.barrier().wait()


def _once_pg(stack: str, tensors: int, total: int) -> tuple[float, float]:
    """(0, seconds of the receiver's receive over a fresh two-rank Gloo group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_pg_rank, args=(stack, rank, port, tensors, total, queue))
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    try:
        return 0.0, queue.get(timeout=180)
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tensors", type=int, default=3000, help="tensors in the state")
    parser.add_argument("--total-mb", type=float, default=50.0, help="MB in all (1e6 bytes)")
    parser.add_argument("--reps", type=int, default=3, help="runs of each")
    args = parser.parse_args()
    total = int(args.total_mb * 1e6)
    stacks = [(name, "ftdist", env) for name, env in _VARIANTS.items()]
    have_torchft = importlib.util.find_spec("torchft") is not None
    if have_torchft:
        stacks.append(("torchft", "torchft", {}))
    print(
        f"{args.tensors} float32 tensors of {total // args.tensors} bytes, "
        f"{total / 1e6:.0f} MB; two fresh processes per run; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    pg_stacks = ["ftdist", "torchft"] if have_torchft else ["ftdist"]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in stacks}
    results.update({f"{stack} (process group)": [] for stack in pg_stacks})
    for _ in range(args.reps):
        for name, stack, env in stacks:
            results[name].append(_once(stack, env, args.tensors, total))
        for stack in pg_stacks:
            results[f"{stack} (process group)"].append(_once_pg(stack, args.tensors, total))
    medians = {}
    for name, runs in results.items():
        publish = statistics.median(r[0] for r in runs)
        fetch = statistics.median(r[1] for r in runs)
        medians[name] = fetch
        print(
            f"  {name:24s} publish {publish * 1e3:7.1f} ms   first fetch {fetch * 1e3:7.1f} ms "
            f"(runs: {', '.join(f'{r[1] * 1e3:.0f}' for r in runs)})   "
            f"{total / fetch / 1e9:.2f} GB/s"
        )
    if have_torchft:
        for name in _VARIANTS:
            print(
                f"  {name}: {medians[name] / medians['torchft']:.2f}x torchft's first fetch "
                "(medians, same run)"
            )
        pg = medians["ftdist (process group)"] / medians["torchft (process group)"]
        print(f"  ftdist (process group): {pg:.2f}x torchft's (medians, same run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
