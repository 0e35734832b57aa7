"""
One check per ``torch.distributed`` function, run over an ftdist group.

Each check calls the public torch API with ``group=pg`` and asserts the
values it gets (inputs are ``rank + 1``), so "works" in the compatibility table
means "gives the right answer", not "did not raise". The table test and the
per-kind collective tests both run these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

Check = Callable[[dist.ProcessGroup, int, int], None]
CHECKS: dict[str, Check] = {}


def check(name: str) -> Callable[[Check], Check]:
    def deco(fn: Check) -> Check:
        CHECKS[name] = fn
        return fn

    return deco


def _val(rank: int, n: int = 4) -> torch.Tensor:
    return torch.full((n,), float(rank + 1))


def _close(got: torch.Tensor, want: float | torch.Tensor) -> None:
    want_t = want if isinstance(want, torch.Tensor) else torch.full_like(got, want)
    assert torch.allclose(got, want_t), f"got {got.tolist()}, want {want_t.tolist()}"


def _reduce(op: dist.ReduceOp, name: str) -> None:
    def fn(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
        vals = [float(r + 1) for r in range(ws)]
        want = {
            "SUM": sum(vals),
            "AVG": sum(vals) / ws,
            "MIN": min(vals),
            "MAX": max(vals),
            "PRODUCT": float(torch.tensor(vals).prod()),
        }[name]
        t = _val(rank)
        dist.all_reduce(t, op=op, group=pg)
        _close(t, want)

    CHECKS[f"all_reduce ({name})"] = fn


for _op in ("SUM", "AVG", "MIN", "MAX", "PRODUCT"):
    _reduce(getattr(dist.ReduceOp, _op), _op)


@check("reduce (AVG)")
def _reduce_avg(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    t = _val(rank)
    dist.reduce(t, dst=0, op=dist.ReduceOp.AVG, group=pg)
    if rank == 0:
        _close(t, sum(range(1, ws + 1)) / ws)


@check("reduce_scatter_tensor (AVG)")
def _reduce_scatter_avg(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out = torch.zeros(4)
    dist.reduce_scatter_tensor(out, torch.cat([_val(rank)] * ws), op=dist.ReduceOp.AVG, group=pg)
    _close(out, sum(range(1, ws + 1)) / ws)


@check("all_reduce_coalesced (AVG)")
def _all_reduce_coalesced_avg(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    ts = [_val(rank), _val(rank) * 3]
    dist.all_reduce_coalesced(ts, op=dist.ReduceOp.AVG, group=pg)
    _close(ts[1], 3 * sum(range(1, ws + 1)) / ws)


@check("all_gather_into_tensor (coalesced)")
def _all_gather_coalesced(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    outs = [torch.zeros(ws * 4), torch.zeros(ws * 2)]
    ins = [_val(rank), _val(rank, 2) * 10]
    with dist._coalescing_manager(group=pg, async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], ins[0], group=pg)
        dist.all_gather_into_tensor(outs[1], ins[1], group=pg)
    cm.wait()
    _close(outs[1], torch.arange(1, ws + 1, dtype=torch.float).repeat_interleave(2) * 10)


@check("reduce_scatter_tensor (coalesced)")
def _reduce_scatter_coalesced(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    outs = [torch.zeros(4), torch.zeros(2)]
    ins = [torch.cat([_val(rank)] * ws), torch.cat([_val(rank, 2)] * ws)]
    with dist._coalescing_manager(group=pg, async_ops=True) as cm:
        dist.reduce_scatter_tensor(outs[0], ins[0], group=pg)
        dist.reduce_scatter_tensor(outs[1], ins[1], group=pg)
    cm.wait()
    _close(outs[1], sum(range(1, ws + 1)))


@check("all_reduce (async_op=True)")
def _all_reduce_async(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    t = _val(rank)
    work = dist.all_reduce(t, group=pg, async_op=True)
    assert work is not None
    fut = work.get_future()
    work.wait()
    fut.wait()
    _close(t, sum(range(1, ws + 1)))


@check("all_reduce_coalesced")
def _all_reduce_coalesced(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    ts = [_val(rank), _val(rank) * 2]
    dist.all_reduce_coalesced(ts, group=pg)
    s = sum(range(1, ws + 1))
    _close(ts[0], s)
    _close(ts[1], 2 * s)


@check("all_gather")
def _all_gather(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out = [torch.zeros(4) for _ in range(ws)]
    dist.all_gather(out, _val(rank), group=pg)
    for r, o in enumerate(out):
        _close(o, r + 1)


@check("all_gather_into_tensor")
def _all_gather_into_tensor(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out = torch.zeros(ws * 4)
    dist.all_gather_into_tensor(out, _val(rank), group=pg)
    _close(out, torch.arange(1, ws + 1, dtype=torch.float).repeat_interleave(4))


@check("reduce_scatter")
def _reduce_scatter(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out = torch.zeros(4)
    dist.reduce_scatter(out, [_val(rank) * (i + 1) for i in range(ws)], group=pg)
    _close(out, sum(range(1, ws + 1)) * (rank + 1))


@check("reduce_scatter_tensor")
def _reduce_scatter_tensor(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out = torch.zeros(4)
    inp = torch.cat([_val(rank) * (i + 1) for i in range(ws)])
    dist.reduce_scatter_tensor(out, inp, group=pg)
    _close(out, sum(range(1, ws + 1)) * (rank + 1))


@check("broadcast")
def _broadcast(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    t = _val(rank)
    dist.broadcast(t, src=ws - 1, group=pg)
    _close(t, ws)


@check("reduce")
def _reduce_(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    t = _val(rank)
    dist.reduce(t, dst=0, group=pg)
    if rank == 0:
        _close(t, sum(range(1, ws + 1)))


@check("gather")
def _gather(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out = [torch.zeros(4) for _ in range(ws)] if rank == 0 else None
    dist.gather(_val(rank), out, dst=0, group=pg)
    if rank == 0:
        assert out is not None
        for r, o in enumerate(out):
            _close(o, r + 1)


@check("scatter")
def _scatter(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out = torch.zeros(4)
    ins = [_val(r) * 10 for r in range(ws)] if rank == 0 else None
    dist.scatter(out, ins, src=0, group=pg)
    _close(out, (rank + 1) * 10)


@check("all_to_all_single")
def _all_to_all_single(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    inp = torch.arange(ws, dtype=torch.float) + rank * ws
    out = torch.zeros(ws)
    dist.all_to_all_single(out, inp, group=pg)
    _close(out, torch.tensor([float(r * ws + rank) for r in range(ws)]))


@check("all_to_all")
def _all_to_all(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    ins = [torch.full((2,), float(rank * ws + r)) for r in range(ws)]
    outs = [torch.zeros(2) for _ in range(ws)]
    dist.all_to_all(outs, ins, group=pg)
    for r, o in enumerate(outs):
        _close(o, r * ws + rank)


@check("send / recv")
def _send_recv(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    if rank == 0:
        for dst in range(1, ws):
            dist.send(_val(dst) * 7, dst=dst, group=pg)
    else:
        t = torch.zeros(4)
        dist.recv(t, src=0, group=pg)
        _close(t, (rank + 1) * 7)


@check("isend / irecv")
def _isend_irecv(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    # A ring exchange: every rank posts its receive before its send.
    right, left = (rank + 1) % ws, (rank - 1) % ws
    got = torch.zeros(4)
    rw = dist.irecv(got, src=left, group=pg)
    sw = dist.isend(_val(rank), dst=right, group=pg)
    assert rw is not None and sw is not None  # None only for a rank outside the group
    sw.wait()
    rw.wait()
    _close(got, left + 1)


@check("batch_isend_irecv")
def _batch(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    right, left = (rank + 1) % ws, (rank - 1) % ws
    got = torch.zeros(4)
    ops = [
        dist.P2POp(dist.irecv, got, group=pg, group_peer=left),
        dist.P2POp(dist.isend, _val(rank), group=pg, group_peer=right),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    _close(got, left + 1)


@check("barrier")
def _barrier(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    dist.barrier(group=pg)


@check("monitored_barrier")
def _monitored_barrier(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    dist.monitored_barrier(group=pg)


@check("all_gather_object")
def _all_gather_object(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out: list[object] = [None] * ws
    dist.all_gather_object(out, {"rank": rank}, group=pg)
    assert out == [{"rank": r} for r in range(ws)], out


@check("broadcast_object_list")
def _broadcast_object_list(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    objs: list[object] = [{"from": rank}, "x"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0, group=pg)
    assert objs == [{"from": 0}, "x"], objs


@check("gather_object")
def _gather_object(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out: list[object] | None = [None] * ws if rank == 0 else None
    dist.gather_object(("r", rank), out, dst=0, group=pg)
    if rank == 0:
        assert out == [("r", r) for r in range(ws)], out


@check("scatter_object_list")
def _scatter_object_list(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out: list[object] = [None]
    ins = [f"to-{r}" for r in range(ws)] if rank == 0 else None
    dist.scatter_object_list(out, ins, src=0, group=pg)
    assert out == [f"to-{rank}"], out


@check("send_object_list / recv_object_list")
def _send_object_list(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    if rank == 0:
        for dst in range(1, ws):
            dist.send_object_list([{"to": dst}], dst=dst, group=pg)
    else:
        objs: list[object] = [None]
        dist.recv_object_list(objs, src=0, group=pg)
        assert objs == [{"to": rank}], objs


@check("functional all_reduce (after register)")
def _funcol_all_reduce(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out = funcol.all_reduce(_val(rank), "sum", pg)
    _close(funcol.wait_tensor(out), sum(range(1, ws + 1)))


@check("functional all_gather_tensor (after register)")
def _funcol_all_gather(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    out = funcol.wait_tensor(funcol.all_gather_single(_val(rank), 0, pg))
    _close(out, torch.arange(1, ws + 1, dtype=torch.float).repeat_interleave(4))


@check("functional reduce_scatter_tensor (after register)")
def _funcol_reduce_scatter(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    inp = torch.cat([_val(rank) * (i + 1) for i in range(ws)])
    out = funcol.wait_tensor(funcol.reduce_scatter_tensor(inp, "sum", 0, pg))
    _close(out, sum(range(1, ws + 1)) * (rank + 1))


@check("torch.compile'd functional all_reduce")
def _compiled(pg: dist.ProcessGroup, rank: int, ws: int) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        reduced: torch.Tensor = funcol.all_reduce(x * 2, "sum", pg)
        return reduced + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    _close(compiled(_val(rank)), 2 * sum(range(1, ws + 1)) + 1)


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, short enough for a table cell."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:160]
