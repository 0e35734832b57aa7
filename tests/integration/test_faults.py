"""Faults never hang: dead, stopped and reconfigured peers, in real processes over Gloo.

Group timeouts here are far shorter than the tests' own timeouts, and the
"prompt" cases use a 60 s group timeout with a 30 s test timeout: a wait that
fell back on the collective timeout would fail the test, without the test
asserting any duration.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from ftdist.errors import (
    BackendProcessError,
    CollectiveTimeoutError,
    CommunicationError,
    ProcessGroupAbortedError,
)
from ftdist.launch.ranks import RankContext, Ranks, run_ranks
from ftdist.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupGloo,
)

KINDS = ["gloo", "baby-gloo"]


def _make(kind: str, timeout: float) -> ProcessGroup:
    return ProcessGroupGloo(timeout=timeout) if kind == "gloo" else ProcessGroupBabyGloo(timeout)


def _works_alone(pg: ProcessGroup, ctx: RankContext, suffix: str) -> float:
    """Reconfigure to a group of one and prove it works."""
    pg.configure(ctx.addr(suffix), 0, 1)
    t = torch.full((3,), 5.0)
    pg.allreduce([t]).wait()
    return float(t[0])


def _reconfigure_in_flight(ctx: RankContext, kind: str) -> tuple[str, float] | None:
    pg = _make(kind, timeout=60)
    store = ctx.store()
    pg.configure(ctx.addr("both"), ctx.rank, ctx.world_size)
    if ctx.rank == 1:
        store.wait(["done"])  # never joins the allreduce
        pg.shutdown()
        return None
    work = pg.allreduce([torch.ones(4)])
    timer = threading.Timer(0.3, lambda: pg.configure(ctx.addr("solo"), 0, 1))
    timer.start()
    try:
        work.wait()
        error = "no error"
    except ProcessGroupAbortedError as exc:
        error = str(exc)
    timer.join()
    value = _works_alone(pg, ctx, "solo-again")
    store.set("done", "1")
    pg.shutdown()
    return error, value


# A Baby group's rank starts a fork server of its own (torch imported cold):
# seconds here, tens of seconds on a machine loaded several times over (the
# soak). The faults themselves take a few seconds.
@pytest.mark.timeout(70)
@pytest.mark.parametrize("kind", KINDS)
def test_configure_fails_in_flight_work_promptly(kind: str) -> None:
    error, value = run_ranks(_reconfigure_in_flight, 2, kind, timeout=60)[0]
    assert "reconfigured" in error
    assert value == 5.0


def _peer_dies(ctx: RankContext, kind: str, sig: int) -> tuple[str, str, float]:
    pg = _make(kind, timeout=4)
    pg.configure(ctx.addr("pair"), ctx.rank, ctx.world_size)
    t = torch.ones(1 << 16)
    pg.allreduce([t]).wait()  # both ranks healthy once
    if ctx.rank == 1:
        os.kill(os.getpid(), sig)
        time.sleep(60)
    try:
        pg.allreduce([t]).wait()
        error_type, error = "none", "no error"
    except CommunicationError as exc:
        error_type, error = type(exc).__name__, str(exc)
    value = _works_alone(pg, ctx, "alone")
    pg.shutdown()
    return error_type, error, value


@pytest.mark.timeout(70)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_dead_or_stopped_peer_raises_and_group_recovers(kind: str, sig: int) -> None:
    with Ranks(_peer_dies, 2, args=(kind, sig)) as ranks:
        outcomes = ranks.join(timeout=60, only=[0])
    survivor = outcomes[0]
    assert survivor.ok, survivor.error
    error_type, error, value = survivor.value
    assert error_type != "none", "the survivor's allreduce succeeded with a dead peer"
    assert "allreduce" in error or "Timed out" in error or "Connection" in error, error
    assert value == 5.0


def _send_to_the_dead(ctx: RankContext) -> list[str]:
    pg = ProcessGroupGloo(timeout=10)
    pg.configure(ctx.addr("dead"), ctx.rank, ctx.world_size)
    t = torch.ones(4)
    pg.allreduce([t]).wait()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    # Rank 0 touches the pair once Gloo's loop has seen it close: Gloo's send
    # and recv then raise at once (a RuntimeError) instead of failing their work.
    time.sleep(1.0)
    out = []
    for op in (pg.send, pg.recv):
        try:
            op([t], 1, 0).wait()
            out.append("no error")
        except CommunicationError as exc:
            out.append(str(exc))
    pg.shutdown()
    return out


@pytest.mark.timeout(60)
def test_send_and_recv_to_a_peer_that_died_meanwhile_raise_communication_errors() -> None:
    """Not Gloo's bare RuntimeError: a step's fault, which makes should_commit() vote no."""
    with Ranks(_send_to_the_dead, 2) as ranks:
        outcomes = ranks.join(timeout=40, only=[0])
    survivor = outcomes[0]
    assert survivor.ok, survivor.error
    sent, received = survivor.value
    assert "send failed" in sent and "recv failed" in received, survivor.value


def _baby_child_dies(ctx: RankContext, how: str) -> tuple[str, bool, float]:
    pg = ProcessGroupBabyGloo(timeout=3 if how == "stop" else 60)
    pg.configure(ctx.addr("b0"), ctx.rank, ctx.world_size)
    child = pg._child
    assert child is not None
    if ctx.rank == 1:
        ctx.store().wait(["done"])
        pg.shutdown()
        return "", True, 0.0
    if how == "stop":
        os.kill(child.proc.pid, signal.SIGSTOP)
    work = pg.allreduce([torch.ones(4)])  # rank 1 never joins: stays in flight
    if how == "kill":
        time.sleep(0.2)
        os.kill(child.proc.pid, signal.SIGKILL)
    try:
        work.wait()
        kind = "none"
    except (BackendProcessError, CollectiveTimeoutError) as exc:
        kind = type(exc).__name__
    child.proc.join(timeout=5)
    child_gone = child.proc.exitcode is not None
    value = _works_alone(pg, ctx, "b1")
    ctx.store().set("done", "1")
    pg.shutdown()
    return kind, child_gone, value


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("how", "expected"), [("kill", "BackendProcessError"), ("stop", "CollectiveTimeoutError")]
)
def test_baby_child_crash_or_hang_is_an_op_error(how: str, expected: str) -> None:
    # Generous limits: a loaded machine starts the replacement child slowly.
    kind, child_gone, value = run_ranks(_baby_child_dies, 2, how, timeout=80)[0]
    assert kind == expected
    assert child_gone, "the hung or crashed child must be killed"
    assert value == 5.0


def _hosts(ctx: RankContext, kind: str) -> list[float]:
    pg = _make(kind, timeout=10)
    out = []
    for i, host in enumerate(["localhost", "[::1]", "127.0.0.1"]):
        pg.configure(f"{host}:{ctx.store_port}/{ctx.prefix}/h{i}", ctx.rank, ctx.world_size)
        t = torch.full((2,), float(ctx.rank + 1))
        pg.allreduce([t]).wait()
        out.append(float(t[0]))
    pg.shutdown()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_configure_accepts_hostname_ipv6_and_ipv4_store_addresses(kind: str) -> None:
    assert run_ranks(_hosts, 2, kind, timeout=50) == [[3.0] * 3] * 2


def _swallow(ctx: RankContext) -> tuple[Any, ...]:
    inner = ProcessGroupGloo(timeout=3)
    inner.configure(ctx.addr("s0"), ctx.rank, ctx.world_size)
    pg = ErrorSwallowingProcessGroupWrapper(inner)
    topology = (pg.rank(), pg.size())  # the wrapper reports the true rank
    pg.allreduce([torch.ones(2)]).wait()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    failed = torch.ones(2)
    ok = pg.allreduce([failed]).wait()  # the peer is dead: swallowed
    first = pg.error()
    pg.report_error(RuntimeError("a later error"))
    had_error = first is not None and pg.error() is first
    untouched = torch.full((2,), 7.0)
    fut = pg.allreduce([untouched]).get_future()
    skipped_done = fut.done()
    pg.configure(ctx.addr("s1"), 0, 1)
    cleared = pg.error() is None
    t = torch.full((1,), 2.0)
    pg.allreduce([t]).wait()
    pg.shutdown()
    return (
        ok,
        had_error,
        failed.tolist(),
        untouched.tolist(),
        skipped_done and cleared,
        float(t[0]),
        topology,
    )


@pytest.mark.timeout(40)
def test_error_swallowing_wrapper_records_first_error_and_skips_until_configure() -> None:
    with Ranks(_swallow, 2) as ranks:
        outcome = ranks.join(timeout=30, only=[0])[0]
    assert outcome.ok, outcome.error
    ok, had_error, _failed, untouched, skipped_and_cleared, value, topology = outcome.value
    assert topology == (0, 2)
    assert ok is True
    assert had_error
    assert untouched == [7.0, 7.0]
    assert skipped_and_cleared
    assert value == 2.0
