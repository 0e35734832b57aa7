"""extend_device_mesh: the ftdist group becomes a usable DeviceMesh dimension."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ftdist.launch.ranks import RankContext, run_ranks


def _mesh(ctx: RankContext) -> tuple[tuple[str, ...], list[int], bool, float, float]:
    from torch.distributed.device_mesh import init_device_mesh

    from ftdist.process_group import ProcessGroupGloo, extend_device_mesh

    dist.init_process_group("gloo", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
    try:
        mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("shard",))
        ft = ProcessGroupGloo(timeout=10)
        # The cross-replica group of this test: the same two processes.
        ft.configure(ctx.addr("ft"), ctx.rank, ctx.world_size)
        ft.register("dp")
        extended = extend_device_mesh(mesh, ft, name="dp", dim=0)
        # DeviceMesh-based collectives find the ftdist group by dimension name.
        via_dim = funcol.wait_tensor(
            funcol.all_reduce(torch.full((2,), float(ctx.rank + 1)), "sum", (extended, 0))
        )
        via_shard = funcol.wait_tensor(
            funcol.all_reduce(torch.full((2,), float(ctx.rank + 1)), "sum", (extended, 1))
        )
        result = (
            extended.mesh_dim_names or (),
            list(extended.mesh.shape),
            extended.get_group("dp") is ft,
            float(via_dim[0]),
            float(via_shard[0]),
        )
        ft.unregister()
        ft.shutdown()
        return result
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_extend_device_mesh_adds_a_usable_dimension() -> None:
    for names, shape, same_group, via_dim, via_shard in run_ranks(_mesh, 2, timeout=50):
        assert names == ("dp", "shard")
        assert shape == [1, 2]
        assert same_group
        assert via_dim == 3.0
        assert via_shard == 3.0


def test_extend_device_mesh_rejects_bad_input() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    from ftdist.process_group import ProcessGroupDummy, extend_device_mesh

    with pytest.raises(TypeError, match="mesh must be a DeviceMesh"):
        extend_device_mesh("mesh", ProcessGroupDummy(0, 1))  # type: ignore[arg-type]
    fake_mesh = DeviceMesh.__new__(DeviceMesh)
    with pytest.raises(TypeError, match="pg must be an ftdist ProcessGroup"):
        extend_device_mesh(fake_mesh, object())  # type: ignore[arg-type]


# -- ft_init_device_mesh: 2 replica groups x 2 shards, the Manager as replicate dim ---------

_GROUPS, _SHARDS = 2, 2


def _batch(global_rank: int) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(100 + global_rank))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def _hsdp(ctx: RankContext) -> dict[str, object]:
    import io
    from datetime import timedelta

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ftdist.manager import Manager
    from ftdist.process_group import (
        ManagedDeviceMesh,
        ManagedProcessGroup,
        ProcessGroupGloo,
        ft_init_device_mesh,
    )
    from ftdist.testing import FakeManagerClient, quorum_result

    group, group_rank = divmod(ctx.rank, _SHARDS)
    # Each replica group is its own torch world, as under torchrun.
    store = dist.PrefixStore(f"group{group}", ctx.store())
    dist.init_process_group("gloo", store=store, rank=group_rank, world_size=_SHARDS)
    client = FakeManagerClient()
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=20)), None, None, min_replica_size=1,
        rank=group_rank, world_size=_SHARDS, client=client, timeout=timedelta(seconds=20),
        # With a client the Manager joins no store; the address only satisfies its config.
        store_addr="127.0.0.1", store_port=ctx.store_port,
    )  # fmt: skip
    out: dict[str, object] = {}
    try:
        mesh = ft_init_device_mesh(
            device_type="cpu",
            mesh_shape=(_GROUPS, _SHARDS),
            mesh_dim_names=("dp_replicate", "dp_shard"),
            replicate_dim=0,
            manager=manager,
        )
        replicate = mesh.get_group("dp_replicate")
        out["replicate_is_managed"] = isinstance(replicate, ManagedProcessGroup)
        out["sliced_group_same"] = mesh["dp_replicate"].get_group() is replicate
        out["shard_group_size"] = mesh.get_group("dp_shard").size()
        flat = mesh._flatten("dp")
        out["flat_lookup_same"] = mesh["dp"] is flat
        # Before the first quorum there are no participants: the mesh counts one group.
        out["size_before"] = (mesh.size(), flat.size(), mesh.shape)

        client.push_quorum(
            quorum_result(
                quorum_id=1, replica_rank=group, replica_world_size=_GROUPS,
                max_replica_rank=group, max_world_size=_GROUPS,
                store_address=f"127.0.0.1:{ctx.store_port}/{ctx.prefix}",
                replica_ids=[f"group{g}" for g in range(_GROUPS)],
            )
        )  # fmt: skip
        manager.start_quorum()
        out["size_after"] = (mesh.size(), flat.size(), mesh.shape, mesh.size(0))
        out["coordinate"] = mesh.get_coordinate()
        sub = mesh["dp_replicate"]
        swapped = mesh["dp_shard", "dp_replicate"]
        out["slices"] = (
            sub.size(),
            sub.get_local_rank(),
            swapped.get_coordinate(),
            swapped.get_group(1) is replicate,
            mesh["dp_shard"].get_group() is mesh.get_group(1),
        )
        out["local_ranks"] = (
            flat.get_local_rank(),
            mesh.get_local_rank(),
            mesh.get_local_rank("dp_replicate"),
            mesh.get_local_rank("dp_shard"),
        )

        buf = io.BytesIO()
        torch.save(mesh, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        out["loaded"] = (
            isinstance(loaded, ManagedDeviceMesh),
            loaded == mesh and hash(loaded) == hash(mesh),
            loaded.get_group("dp_replicate") is replicate,
            loaded.size(),
        )

        # HSDP: shard over dp_shard, average gradients over both dimensions.
        model = _model()
        fully_shard(model, mesh=mesh)
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        model(_batch(ctx.rank)).pow(2).mean().backward()
        out["committed"] = manager.should_commit()
        optim.step()
        # Plain lists: full_tensor() may be an AsyncCollectiveTensor, which does not unpickle.
        params: dict[str, object] = {}
        for n, p in model.named_parameters():
            assert isinstance(p, DTensor)  # fully_shard made it one
            params[n] = p.full_tensor().tolist()
        out["params"] = params
        return out
    finally:
        manager.shutdown()
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_ft_init_device_mesh_hsdp_over_two_replica_groups() -> None:
    results = run_ranks(_hsdp, _GROUPS * _SHARDS, timeout=80)

    reference = _model()
    # Every rank's batch, averaged: what HSDP over 2 groups x 2 shards computes.
    loss = sum(reference(_batch(r)).pow(2).mean() for r in range(len(results))) / len(results)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    with torch.no_grad():
        expected = {
            n: p - 0.5 * p.grad for n, p in reference.named_parameters() if p.grad is not None
        }

    for rank, out in enumerate(results):
        group, group_rank = divmod(rank, _SHARDS)
        assert out["replicate_is_managed"] and out["sliced_group_same"]
        assert out["shard_group_size"] == _SHARDS
        assert out["flat_lookup_same"]
        assert out["size_before"] == (_SHARDS, _SHARDS, (1, _SHARDS))
        assert out["size_after"] == (4, 4, (_GROUPS, _SHARDS), _GROUPS)
        assert out["coordinate"] == (group, group_rank)
        assert out["slices"] == (_GROUPS, group, (group_rank, group), True, True)
        assert out["local_ranks"] == (rank, rank, group, group_rank)
        assert out["loaded"] == (True, True, True, 4)
        assert out["committed"] is True
        params = out["params"]
        assert isinstance(params, dict) and params.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(torch.tensor(params[name]), value, rtol=1e-5, atol=1e-6)


def test_ft_init_device_mesh_rejects_bad_input_before_communicating() -> None:
    from ftdist.process_group import ft_init_device_mesh

    class _NotAManager:
        pass

    good: dict[str, object] = {
        "device_type": "cpu",
        "mesh_shape": (2, 2),
        "mesh_dim_names": ("dp_replicate", "dp_shard"),
        "replicate_dim": 0,
        "manager": _NotAManager(),
    }
    cases: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"replicate_dim": 2}, ValueError, "replicate_dim must be in"),
        ({"replicate_dim": -1}, ValueError, "replicate_dim must be in"),
        ({"replicate_dim": "0"}, TypeError, "replicate_dim must be an int"),
        ({"mesh_shape": (2, 2, 2)}, ValueError, "same length"),
        ({"mesh_shape": (2,), "mesh_dim_names": ("r",)}, ValueError, "at least one other"),
        ({"mesh_shape": (2, 0)}, ValueError, "positive ints"),
        ({"mesh_dim_names": ("dp", "dp")}, ValueError, "unique"),
        ({}, TypeError, "manager must be an ftdist Manager"),
    ]
    for change, error, message in cases:
        with pytest.raises(error, match=message):
            ft_init_device_mesh(**{**good, **change})  # type: ignore[arg-type]
    # Validation ran before init_device_mesh could start a default group.
    assert not dist.is_initialized()
