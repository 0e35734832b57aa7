"""Adding an ftdist group to a DeviceMesh as a new dimension."""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from ftdist.process_group.base import ProcessGroup


def extend_device_mesh(
    mesh: DeviceMesh, pg: ProcessGroup, name: str = "dp", dim: int = 0
) -> DeviceMesh:
    """Return ``mesh`` with ``pg`` added as dimension ``dim`` named ``name``.

    DeviceMesh cannot describe a group whose size changes, so the new
    dimension has size 1 in the mesh; scaling by the true number of replicas
    is the group's job (e.g. :class:`ManagedProcessGroup`'s averaging).
    ``pg`` must be registered (:meth:`ProcessGroup.register`) so that
    DeviceMesh-based code can resolve it by name.

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh or ``pg`` not an ftdist group.
        ValueError: ``dim`` is out of range, ``name`` is already a dimension
            name, or ``pg`` is not registered.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if not isinstance(pg, ProcessGroup):
        raise TypeError(f"pg must be an ftdist ProcessGroup, got {type(pg).__name__}")
    if not 0 <= dim <= mesh.ndim:
        raise ValueError(f"dim must be in [0, {mesh.ndim}], got {dim}")
    names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])
    if name in names:
        raise ValueError(f"mesh already has a dimension named {name!r}")
    pg.group_name  # noqa: B018 - raises ValueError if unregistered
    groups: list[Any] = [mesh.get_group(i) for i in range(mesh.ndim)]
    groups.insert(dim, pg)
    names.insert(dim, name)
    return DeviceMesh.from_group(
        groups, mesh.device_type, mesh=mesh.mesh.unsqueeze(dim), mesh_dim_names=tuple(names)
    )
