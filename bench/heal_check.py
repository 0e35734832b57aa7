"""A heal's consistency check: what it costs each side, before and after the plan.

A healed replica checks that its consistency parts, once loaded, equal its
source's. The source used to hash every byte of those parts (the model's
parameters, the optimizer's state) before it served the heal: the receiver
waited for that. Now the source sends a plan (:mod:`ftdist.manager.fingerprint`)
and the receiver rebuilds the same fingerprint from the sums it took of the
bytes it received. This script measures, in one run, on the state of
``bench/recovery.py`` (c) (a 2x2500x2500 MLP with SGD momentum: 100 MB):

* the source's work before serving: the full fingerprint (the baseline) and
  the plan, and their ratio;
* the receiver's work to rebuild the source's fingerprint from a real
  loopback ``HTTPTransport`` receive: with the transport's sums, and reading
  the received tensors again (what a transport without sums costs);
* that both sides' fingerprints agree (the run fails loudly if not).

Prints; asserts nothing about time. Run: ``python bench/heal_check.py [--reps 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ftdist.checkpointing import HTTPTransport
from ftdist.manager.fingerprint import MAX_PARTS, fingerprint, fold_parts, plan, planned

TIMEOUT = timedelta(seconds=60)


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _state(width: int) -> tuple[dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, width)).sum().backward()
    optim.step()
    user = {"model": model.state_dict(), "optim": optim.state_dict()}
    # What DDP and OptimizerWrapper register as consistency parts.
    parts = {"ddp": dict(model.named_parameters()), "optimizer": optim.state_dict()}
    return user, parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2500, help="MLP width (default 2500: 100 MB)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions (medians)")
    args = ap.parse_args()
    user, parts = _state(args.width)
    nbytes = sum(t.numel() * t.element_size() for t in user["model"].values()) * 2
    print(f"heal consistency check: {nbytes / 1e6:.1f} MB of parameters and momentum")

    full_ms = _median_ms(lambda: fold_parts(fingerprint(parts), MAX_PARTS), args.reps)
    plan_ms = _median_ms(lambda: plan(parts, user), args.reps)
    print(
        f"  source, before serving: full fingerprint {full_ms:.2f} ms (baseline), "
        f"plan {plan_ms:.2f} ms: {plan_ms / full_ms:.3f}x"
    )

    src = HTTPTransport[Any](TIMEOUT, hostname="127.0.0.1")
    dst = HTTPTransport[Any](TIMEOUT, hostname="127.0.0.1")
    try:
        the_plan = plan(parts, user)
        src.send_checkpoint([1], 1, {"user": user}, TIMEOUT)
        got = dst.recv_checkpoint(0, src.metadata(), 1, TIMEOUT)["user"]
        src.disallow_checkpoint()
        assert dst.last_transfer is not None
        sums = dst.last_transfer.tensor_sums
        route = dst.last_transfer.route
    finally:
        src.shutdown()
        dst.shutdown()
    want = fold_parts(fingerprint(parts), MAX_PARTS)
    if planned(the_plan, got, sums) != want or planned(the_plan, got, {}) != want:
        raise SystemExit("the rebuilt fingerprint differs from the source's: a bug")
    with_ms = _median_ms(lambda: planned(the_plan, got, sums), args.reps)
    again_ms = _median_ms(lambda: planned(the_plan, got, {}), args.reps)
    print(
        f"  receiver, rebuilding the source's fingerprint ({route} receive): with the "
        f"transport's sums {with_ms:.2f} ms, reading the tensors again {again_ms:.2f} ms "
        f"(baseline): {with_ms / again_ms:.3f}x"
    )


if __name__ == "__main__":
    main()
