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
