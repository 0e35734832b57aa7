"""GroupCoordinator benchmark: the coordinator against the plain torch.distributed calls.

Real rank processes on this machine (``ftdist.launch.ranks.run_ranks``) build one
:class:`ftdist.coordinator.GroupCoordinator` over torch Gloo groups, with its
shared-memory message queue, and measure side by side, in one run:

1. ``broadcast_object`` of a 1 KiB and a 1 MiB ``bytes`` through the queue,
   against ``dist.broadcast_object_list`` over Gloo (the coordinator's own
   CPU group);
2. ``broadcast_tensor_dict`` of a decode-step dict (CPU tensors for 256
   sequences plus scalars), against ``dist.broadcast_object_list`` of the
   same dict (pickled whole);
3. ``all_reduce`` (float32, 1 and 16 MiB) and ``all_gather`` (1 MiB per
   rank) through the coordinator, against ``dist.all_reduce`` (in place) and
   ``dist.all_gather_into_tensor`` on the same device group.

Method: the pair takes turns in rounds; in a round each side runs a batch of
back-to-back operations followed by a barrier on a separate control group
(so that every rank has finished; batches last long enough that the
barrier is about 1% of them), and a batch's time on rank 0's clock divided
by its count is that round's time per op. The
ratio is the median over rounds of the per-round ratio, with the 10th-90th
percentile of those ratios: this machine is shared, and rounds that run
within milliseconds of each other see the same noise. ``--json PATH`` saves
every sample. Nothing is asserted; the script prints.

Run ``python bench/coordinator.py`` (about a minute on 2 cores), or
``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ftdist.coordinator.communicator import _all_gather_flat
from ftdist.launch.ranks import RankContext, run_ranks

KiB, MiB = 1 << 10, 1 << 20


def _decode_step_dict(rank: int) -> dict[str, Any]:
    """What a vLLM driver broadcasts to its TP workers before a decode step (256 sequences)."""
    n = 256
    return {
        "input_tokens": torch.arange(n, dtype=torch.int64) + rank,
        "input_positions": torch.arange(n, dtype=torch.int64) * 7,
        "slot_mapping": torch.arange(n, dtype=torch.int64) * 16,
        "seq_lens": torch.full((n,), 517, dtype=torch.int32),
        "block_tables": torch.arange(n * 64, dtype=torch.int32).reshape(n, 64),
        "num_prefills": 0,
        "num_decode_tokens": n,
        "virtual_engine": 0,
        "sampling": {"temperature": 0.7, "top_p": 0.95, "seeds": list(range(16))},
    }


def _cases(ctx: RankContext, g: Any) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """name -> (coordinator op, baseline op); each call runs one operation."""
    src = ctx.rank == 0
    small, large = bytes(KiB), bytes(MiB)
    step = _decode_step_dict(0)

    def bol(obj: Any) -> Callable[[], Any]:
        def run() -> Any:
            objs = [obj if src else None]
            dist.broadcast_object_list(objs, group=g.cpu_group, group_src=0)
            return objs[0]

        return run

    def coord_obj(obj: Any) -> Callable[[], Any]:
        return lambda: g.broadcast_object(obj if src else None, src=0)

    a1, a16 = torch.zeros(MiB // 4), torch.zeros(16 * MiB // 4)
    gin = torch.zeros(MiB // 4)

    def raw_all_gather() -> torch.Tensor:
        # The same job done by hand: a new output per call, as the coordinator returns.
        out = torch.empty(g.world_size * gin.numel())
        _all_gather_flat(out, gin, group=g.device_group)
        return out

    return {
        "broadcast_object 1 KiB": (coord_obj(small), bol(small)),
        "broadcast_object 1 MiB": (coord_obj(large), bol(large)),
        "broadcast_tensor_dict decode step": (
            lambda: g.broadcast_tensor_dict(step if src else None, src=0),
            bol(step),
        ),
        "all_reduce 1 MiB": (
            lambda: g.all_reduce(a1),
            lambda: dist.all_reduce(a1, group=g.device_group),
        ),
        "all_reduce 16 MiB": (
            lambda: g.all_reduce(a16),
            lambda: dist.all_reduce(a16, group=g.device_group),
        ),
        "all_gather 1 MiB/rank": (lambda: g.all_gather(gin, 0), raw_all_gather),
    }


def _check(ctx: RankContext, g: Any) -> None:
    """Untimed: both sides give the same answer."""
    step = _decode_step_dict(0)
    got = g.broadcast_tensor_dict(step if ctx.rank == 0 else None, src=0)
    assert (
        torch.equal(got["block_tables"], step["block_tables"])
        and got["sampling"] == step["sampling"]
    )
    x = torch.full((8,), float(ctx.rank + 1))
    assert torch.equal(g.all_reduce(x), torch.full((8,), float(sum(range(1, g.world_size + 1)))))
    assert g.broadcast_object(b"x" * KiB if ctx.rank == 0 else None) == b"x" * KiB


def _batch(op: Callable[[], Any], n: int, ctl: Any) -> float:
    start = time.perf_counter()
    for _ in range(n):
        op()
    dist.barrier(group=ctl)
    return (time.perf_counter() - start) / n


def _per_op_estimate(op: Callable[[], Any], ctl: Any) -> float:
    """Time per op from batches doubled until one lasts 50 ms on rank 0 (who decides for all)."""
    n = 1
    while True:
        t = _batch(op, n, ctl) * n
        done = torch.tensor([int(t > 0.05 or n >= 4096)])
        dist.broadcast(done, src=0, group=ctl)  # every rank must run the same batches
        if done.item():
            return t / n
        n *= 2


def _bench(ctx: RankContext, rounds: int, seconds_per_case: float) -> dict[str, Any]:
    from ftdist.coordinator import GroupCoordinator

    dist.init_process_group("gloo", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
    ranks = list(range(ctx.world_size))
    g = GroupCoordinator(
        [ranks],
        ctx.rank,
        "gloo",
        use_device_communicator=True,
        use_message_queue_broadcaster=True,
        group_name="bench",
    )
    ctl = dist.new_group(ranks, backend="gloo")
    _check(ctx, g)
    out: dict[str, Any] = {}
    for name, (coord, base) in _cases(ctx, g).items():
        # Warm-up, then size the batches from it (rank 0 decides for all).
        # Batches of the same count on both sides, sized from the slower side
        # (rank 0 decides for all).
        per_op = max(_per_op_estimate(coord, ctl), _per_op_estimate(base, ctl))
        n = torch.tensor([max(3, int(seconds_per_case / rounds / 2 / per_op))])
        dist.broadcast(n, src=0, group=ctl)
        samples: dict[str, list[float]] = {"coordinator": [], "baseline": []}
        for r in range(rounds):
            order = [("coordinator", coord), ("baseline", base)]
            for side, op in order if r % 2 == 0 else order[::-1]:
                samples[side].append(_batch(op, int(n.item()), ctl))
        out[name] = {"batch": int(n.item()), **samples}
    g.destroy()
    dist.destroy_process_group()
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seconds-per-case", type=float, default=8.0)
    p.add_argument("--quick", action="store_true", help="a rough smoke run")
    p.add_argument("--json", type=str, default=None, help="save every sample here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds_per_case = 6, 1.0
    started = time.monotonic()
    res = run_ranks(_bench, args.ranks, args.rounds, args.seconds_per_case, timeout=1200)[0]
    print(
        f"ftdist GroupCoordinator benchmark: {args.ranks} ranks on {os.cpu_count()} cores, "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}; {args.rounds} rounds per case"
    )
    print(
        f"{'operation':<36} {'coordinator':>13} {'baseline':>13} {'ratio':>7} "
        f"{'p10-p90':>13}  baseline"
    )
    baselines = {
        "broadcast_object": "dist.broadcast_object_list over Gloo",
        "broadcast_tensor_dict": "dist.broadcast_object_list of the dict over Gloo",
        "all_reduce": "dist.all_reduce (in place) on the same group",
        "all_gather": "dist.all_gather_into_tensor (new output per call) on the same group",
    }
    for name, s in res.items():
        ratios = [b / c for c, b in zip(s["coordinator"], s["baseline"], strict=True)]
        c_us = statistics.median(s["coordinator"]) * 1e6
        b_us = statistics.median(s["baseline"]) * 1e6
        speed = statistics.median(ratios)
        label = baselines[name.split()[0]]
        print(
            f"{name:<36} {c_us:>10.1f} us {b_us:>10.1f} us {speed:>6.2f}x "
            f"{_pct(ratios, 0.1):>5.2f}-{_pct(ratios, 0.9):<5.2f}x  {label}"
        )
    print(
        "ratio = baseline time / coordinator time per op (above 1: the coordinator is faster); "
        f"median over rounds. Total {time.monotonic() - started:.0f} s."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
