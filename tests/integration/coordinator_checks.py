"""
Checks of every GroupCoordinator method, run inside rank processes.

Each check computes the expected value from every member's (deterministic)
input and compares exactly, the way vLLM's ``test_comm_ops.py`` does; a
mismatch raises, and the harness reports the rank's traceback.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from ftdist.coordinator import GroupCoordinator


def inp(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input of ``shape``: distinct values per rank and position."""
    return (torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) + 1000 * rank).to(
        dtype
    )


def tsum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum(tensors)`` typed as a tensor (``sum`` starts from the int 0)."""
    return functools.reduce(operator.add, tensors)


def eq(got: Any, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    )
    assert torch.equal(got, want), f"{what}: got {got}, want {want}"


def check_properties(g: GroupCoordinator) -> None:
    r, ranks = g.rank_in_group, g.ranks
    assert ranks[r] == g.rank and g.world_size == len(ranks)
    assert g.first_rank == ranks[0] and g.last_rank == ranks[-1]
    assert g.is_first_rank == (r == 0) and g.is_last_rank == (r == len(ranks) - 1)
    assert g.next_rank == ranks[(r + 1) % len(ranks)]
    assert g.prev_rank == ranks[(r - 1) % len(ranks)]


def check_tensor_collectives(g: GroupCoordinator) -> None:
    """all_reduce, all_gather(v), reduce_scatter(v), gather, broadcast: exact values."""
    members, r, ws = g.ranks, g.rank_in_group, g.world_size

    x = torch.arange(8, dtype=torch.float32) * (g.rank + 1)
    want = tsum(torch.arange(8, dtype=torch.float32) * (m + 1) for m in members)
    eq(g.all_reduce(x.clone()), want, "all_reduce")
    eq(g.all_reduce(x[::2]), want[::2], "all_reduce of a non-contiguous view")
    before = x.clone()
    eq(g._all_reduce_out_place(x), want, "_all_reduce_out_place")
    eq(x, before, "_all_reduce_out_place leaves its input alone")

    got: torch.Tensor | list[torch.Tensor] | None
    for dim in (0, 1, 2, -1, -2):
        got = g.all_gather(inp(g.rank, (2, 3, 4)), dim=dim)
        eq(got, torch.cat([inp(m, (2, 3, 4)) for m in members], dim=dim), f"all_gather dim {dim}")

    shape = (2 * ws, 3 * ws, 2 * ws)
    total = tsum(inp(m, shape) for m in members)
    for dim in (0, 1, 2, -1):
        got = g.reduce_scatter(inp(g.rank, shape), dim=dim)
        eq(got, total.chunk(ws, dim=dim)[r].contiguous(), f"reduce_scatter dim {dim}")
    # 4-D, dim -1 and 2: the axes upstream vLLM permutes wrongly.
    shape4 = (2, 3, 2 * ws, 3 * ws)
    total4 = tsum(inp(m, shape4) for m in members)
    for dim in (2, 3, -1):
        eq(
            g.reduce_scatter(inp(g.rank, shape4), dim=dim),
            total4.chunk(ws, dim=dim)[r],
            f"reduce_scatter 4-D dim {dim}",
        )

    sizes = [i + 1 for i in range(ws)]
    got = g.all_gatherv(inp(g.rank, (sizes[r], 3)), dim=0, sizes=sizes)
    eq(got, torch.cat([inp(m, (sizes[i], 3)) for i, m in enumerate(members)]), "all_gatherv dim 0")
    got = g.all_gatherv(inp(g.rank, (2, sizes[r])), dim=1, sizes=sizes)
    eq(
        got,
        torch.cat([inp(m, (2, sizes[i])) for i, m in enumerate(members)], 1),
        "all_gatherv dim 1",
    )
    pair = g.all_gatherv(
        [inp(g.rank, (sizes[r], 2)), inp(g.rank, (sizes[r],), torch.int64)], dim=0, sizes=sizes
    )
    assert isinstance(pair, list) and len(pair) == 2
    eq(
        pair[1],
        torch.cat([inp(m, (sizes[i],), torch.int64) for i, m in enumerate(members)]),
        "all_gatherv list",
    )
    eq(
        g.all_gatherv(inp(g.rank, (2, 2))),
        torch.cat([inp(m, (2, 2)) for m in members]),
        "all_gatherv sizes=None",
    )

    rows = sum(sizes)
    total_v = tsum(inp(m, (rows, 2)) for m in members)
    eq(
        g.reduce_scatterv(inp(g.rank, (rows, 2)), dim=0, sizes=sizes),
        total_v.split(sizes, 0)[r],
        "reduce_scatterv dim 0",
    )
    total_c = tsum(inp(m, (2, rows)) for m in members)
    eq(
        g.reduce_scatterv(inp(g.rank, (2, rows)), dim=-1, sizes=sizes),
        total_c.split(sizes, 1)[r].contiguous(),
        "reduce_scatterv dim -1",
    )

    dst = ws - 1
    got = g.gather(inp(g.rank, (2, 3)), dst=dst, dim=1)
    if r == dst:
        eq(got, torch.cat([inp(m, (2, 3)) for m in members], 1), "gather")
    else:
        assert got is None, "gather returns None off dst"

    t = inp(g.rank, (5,))
    out = g.broadcast(t, src=ws - 1)
    assert out is t, "broadcast is in place and returns its input"
    eq(t, inp(members[-1], (5,)), "broadcast")


def check_objects(g: GroupCoordinator) -> None:
    """broadcast_object (queue and CPU group), broadcast_object_list, send/recv_object."""
    members, r, ws = g.ranks, g.rank_in_group, g.world_size
    for src in range(ws):
        obj = {"from": members[src], "payload": list(range(src + 3))} if r == src else None
        assert g.broadcast_object(obj, src=src) == {
            "from": members[src],
            "payload": list(range(src + 3)),
        }
    big = bytes(range(256)) * 40000  # 10 MiB: larger than a queue chunk
    got = g.broadcast_object(big if r == 0 else None, src=0)
    assert got == big, "broadcast_object of an object larger than a chunk"

    lst: list[Any] = [members[-1], "x", None] if r == ws - 1 else [None, None, None]
    out = g.broadcast_object_list(lst, src=ws - 1)
    assert out is lst and lst == [members[-1], "x", None], lst

    if r == 0:
        g.send_object({"hello": members[0]}, dst=ws - 1)
    if r == ws - 1:
        assert g.recv_object(src=0) == {"hello": members[0]}


def check_broadcasters(g: GroupCoordinator) -> None:
    """create_mq_broadcaster with a writer other than rank 0; the same-host probe."""
    from ftdist.coordinator import in_the_same_node_as

    assert in_the_same_node_as(g.cpu_group, source_rank=g.world_size - 1) == [True] * g.world_size
    writer = g.world_size - 1
    mq = g.create_mq_broadcaster(writer_rank=writer)
    for i in range(3):
        obj = {"i": i, "from": g.ranks[writer]}
        assert mq.broadcast_object(obj if g.rank_in_group == writer else None) == obj
    g.barrier()
    mq.shutdown()


def check_point_to_point(g: GroupCoordinator) -> None:
    """send/recv along the group, default peers (prev/next), as vLLM's PP test does."""
    if not g.is_first_rank:
        got = g.recv(64, dtype=torch.float32)
        eq(got, torch.arange(64, dtype=torch.float32) + g.prev_rank, "recv")
    if not g.is_last_rank:
        g.send(torch.arange(64, dtype=torch.float32) + g.rank)
    if g.is_first_rank:
        got = g.recv(torch.Size([3]), dtype=torch.int64, src=g.world_size - 1)
        eq(got, torch.tensor([7, 8, 9]), "recv with explicit src")
    if g.is_last_rank:
        g.send(torch.tensor([7, 8, 9]), dst=0)


def vllm_dict(rank: int) -> dict[str, Any]:
    return {
        "a": torch.arange(8, dtype=torch.float32) + rank,
        "b": torch.arange(16, dtype=torch.int8),
        "c": "test",
        "d": [1, 2, 3],
        "e": {"a": 1, "b": 2},
        "f": torch.tensor([], dtype=torch.float32),
        "g": torch.arange(12).reshape(3, 4).t(),  # not contiguous
    }


def check_dict(got: Any, want: dict[str, Any], what: str) -> None:
    assert isinstance(got, dict) and list(got) == list(want), f"{what}: keys {list(got)}"
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            eq(got[k], v.contiguous(), f"{what}[{k!r}]")
        else:
            assert got[k] == v, f"{what}[{k!r}] = {got[k]!r}"


def check_tensor_dicts(g: GroupCoordinator, tp: GroupCoordinator | None = None) -> None:
    """broadcast_tensor_dict from every source; send/recv_tensor_dict along the group."""
    members, r, ws = g.ranks, g.rank_in_group, g.world_size
    for src in range(ws):
        want = vllm_dict(members[src])
        got = g.broadcast_tensor_dict(want if r == src else None, src=src)
        if r == src:
            assert got is want
        check_dict(got, want, f"broadcast_tensor_dict src {src}")

    def stage_dict(sender: int, tp_rank: int) -> dict[str, Any]:
        return {
            "hidden": torch.arange(24, dtype=torch.float32),  # the same on every TP rank
            "residual": torch.full((6,), float(sender)),  # differs across TP ranks
            "odd": torch.arange(7),  # not divisible: sent whole
            "empty": torch.empty(0, 3),
            "step": 5,
        }

    kw: dict[str, Any] = {}
    if tp is not None:
        kw = {"all_gather_group": tp, "all_gather_tensors": {"residual": False}}
    tp_rank = tp.rank_in_group if tp is not None else 0
    if not g.is_first_rank:
        got = g.recv_tensor_dict(**kw)
        check_dict(got, stage_dict(g.prev_rank, tp_rank), "recv_tensor_dict")
    if not g.is_last_rank:
        assert g.send_tensor_dict(stage_dict(g.rank, tp_rank), **kw) is None


def check_group_of_one(g: GroupCoordinator) -> None:
    """vLLM's world_size == 1 conventions, exactly."""
    assert g.world_size == 1 and g.device_communicator is None
    x = torch.ones(3)
    for got in (g.all_reduce(x), g.all_gather(x), g.reduce_scatter(x), g.gather(x), g.broadcast(x)):
        assert got is x
    obj, lst, d = object(), [1, 2], {"t": x}
    assert g.broadcast_object(obj) is obj
    assert g.broadcast_object_list(lst) is lst
    assert g.broadcast_tensor_dict(d) is d
    assert g.send_tensor_dict(d) is d
    assert g.recv_tensor_dict() is None
    for call in (
        lambda: g.all_gatherv(x),
        lambda: g.reduce_scatterv(x),
        lambda: g.send(x),
        lambda: g.recv(3, torch.float32),
        lambda: g._all_reduce_out_place(x),
        lambda: g._all_gather_out_place(x, 0),
        lambda: g._reduce_scatter_out_place(x, 0),
    ):
        with pytest.raises(ValueError, match="No device communicator"):
            call()
    assert g.is_first_rank and g.is_last_rank and g.next_rank == g.prev_rank == g.rank
    assert g.create_single_reader_mq_broadcasters() == (None, [])
    g.barrier()


def check_argument_errors(g: GroupCoordinator) -> None:
    """Misuse raises a clear error on every rank, before communicating (the group stays in step)."""
    ws, x = g.world_size, torch.ones(2, 3)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        g.all_reduce([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Invalid dim \(3\)"):
        g.all_gather(x, dim=3)
    with pytest.raises(ValueError, match="not divisible"):
        g.reduce_scatter(torch.ones(2 * ws + 1), dim=0)
    with pytest.raises(ValueError, match=rf"Invalid src rank \({ws}\)"):
        g.broadcast(x, src=ws)
    with pytest.raises(ValueError, match=r"Invalid dst rank \(-1\)"):
        g.gather(x, dst=-1)
    with pytest.raises(ValueError, match="same as the current rank"):
        g.send_object("x", dst=g.rank_in_group)
    with pytest.raises(TypeError, match="int"):
        g.recv_object(src="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="entries"):
        g.all_gatherv(x, sizes=[2] * (ws + 1))
    with pytest.raises(ValueError, match="rows"):
        g.all_gatherv(x, sizes=[x.shape[0] + 1] * ws)
    with pytest.raises(ValueError, match="add up"):
        g.reduce_scatterv(torch.ones(5), dim=0, sizes=[1] * ws)
    with pytest.raises(TypeError, match="list"):
        g.broadcast_object_list("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        g.prepare_communication_buffer_for_model("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GroupCoordinator"):
        g.send_tensor_dict({}, all_gather_group="tp")  # type: ignore[arg-type]
    g.barrier()  # still in step


def check_misc(g: GroupCoordinator) -> None:
    """graph_capture without CUDA, dispatch/combine, prepare_communication_buffer_for_model."""
    with g.graph_capture() as ctx:
        assert ctx.stream is None or torch.cuda.is_available()
    h, logits = torch.ones(2, 4), torch.zeros(2, 3)
    out = g.dispatch(h, logits)
    assert out[0] is h and out[1] is logits
    assert g.combine(h) is h
    g.prepare_communication_buffer_for_model(torch.nn.Linear(2, 2))


def run_all(g: GroupCoordinator, tp: GroupCoordinator | None = None) -> None:
    check_properties(g)
    if g.world_size == 1:
        check_group_of_one(g)
        return
    check_tensor_collectives(g)
    check_objects(g)
    check_broadcasters(g)
    check_point_to_point(g)
    check_tensor_dicts(g, tp)
    check_argument_errors(g)
    check_misc(g)
    g.barrier()
