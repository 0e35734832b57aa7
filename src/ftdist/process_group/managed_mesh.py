"""A DeviceMesh whose replicate dimension is the Manager's fault-tolerant group.

torchft's early-2025 HSDP API: :func:`ft_init_device_mesh` builds a real
DeviceMesh over the dimensions inside one replica group and adds the
replicate dimension virtually, as a :class:`ManagedProcessGroup` whose size is
the number of replica groups in the current quorum. Code written for a
DeviceMesh (``fully_shard(model, mesh=...)``, DTensor placements) sees a mesh
with that dimension in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ftdist.process_group.managed import ManagedProcessGroup

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = ["ManagedDeviceMesh", "_FlattenDeviceMesh", "ft_init_device_mesh"]


def _replicate_rank(pg: ManagedProcessGroup) -> int:
    """This replica group's coordinate on the replicate dimension."""
    rank = pg._manager.participating_rank()
    if isinstance(rank, int):
        return rank
    # Not participating (healing, spare, before the first quorum): its rank
    # in the manager's group, as ManagedProcessGroup.rank() answers.
    return int(pg._manager._pg.rank())


class ManagedDeviceMesh(DeviceMesh):
    """A DeviceMesh with a virtual, resizable replicate dimension.

    Only the other dimensions are a real DeviceMesh (:attr:`inner_mesh`); the
    replicate dimension is :attr:`replicate_pg`, whose size is the number of
    participating replica groups (1 while there are none yet). ``mesh``
    (the rank tensor) has size 1 on the replicate dimension: ranks of other
    replica groups are not in this job's world.

    Built by :func:`ft_init_device_mesh`; slicing builds the others.

    Attributes:
        replicate_pg_singleton: the replicate group of the last
            :func:`ft_init_device_mesh`; unpickled meshes use it.

    Args:
        mesh: the real mesh of the other dimensions, or None for the
            replicate dimension alone (then ``parent`` is required).
        mesh_dim_names: every dimension's name, the replicate one included.
        replicate_pg: the replicate dimension's group.
        replicate_dim: the replicate dimension's index in ``mesh_dim_names``.
        parent: the mesh this one was sliced from, or None for a root.

    Raises:
        ValueError: both ``mesh`` and ``parent`` are None, ``replicate_dim``
            is out of range, or the names do not match the mesh's dimensions.
    """

    replicate_pg_singleton: ClassVar[ManagedProcessGroup | None] = None

    def __init__(
        self,
        mesh: DeviceMesh | None,
        mesh_dim_names: tuple[str, ...],
        replicate_pg: ManagedProcessGroup,
        replicate_dim: int,
        parent: ManagedDeviceMesh | None,
    ) -> None:
        if mesh is None and parent is None:
            raise ValueError("ManagedDeviceMesh needs a mesh or a parent; both are None")
        names = tuple(mesh_dim_names)
        if not 0 <= replicate_dim < len(names):
            raise ValueError(f"replicate_dim must be in [0, {len(names)}), got {replicate_dim}")
        inner_ndim = 0 if mesh is None else mesh.ndim
        if len(names) != inner_ndim + 1:
            raise ValueError(
                f"mesh_dim_names {names} must name the mesh's {inner_ndim} dimensions "
                "and the replicate one"
            )
        self.inner_mesh = mesh
        self.replicate_pg = replicate_pg
        self.replicate_dim = replicate_dim
        self.replicate_dim_name: str = names[replicate_dim]
        self.parent = parent
        self.flatten_meshes: dict[str, DeviceMesh] = {}
        if mesh is None:
            assert parent is not None  # checked above
            device_type = parent.device_type
            ranks = torch.tensor([parent._rank], dtype=torch.int)
            inner_groups: list[GroupName] = []
        else:
            device_type = mesh.device_type
            ranks = mesh.mesh.unsqueeze(replicate_dim)
            inner_groups = list(mesh._dim_group_names)
        # The base holds a size-1 replicate dimension, so DeviceMesh internals
        # (layout, rank map, hashing, coordinates) are all in place.
        super().__init__(device_type, ranks, mesh_dim_names=names, _init_backend=False)
        inner_groups.insert(replicate_dim, replicate_pg.group_name)
        self._dim_group_names = inner_groups
        self._pg_registry[replicate_pg.group_name] = replicate_pg
        if mesh is not None:
            self._pg_registry.update(mesh._get_root_mesh()._pg_registry)

    # -- pickling --------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["replicate_pg"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled mesh; its replicate group is the current singleton.

        Raises:
            RuntimeError: no :func:`ft_init_device_mesh` ran in this process.
        """
        pg = ManagedDeviceMesh.replicate_pg_singleton
        if pg is None:
            raise RuntimeError(
                "unpickling a ManagedDeviceMesh needs a replicate group: call "
                "ft_init_device_mesh in this process first"
            )
        super().__setstate__(state)
        self.replicate_pg = pg
        self._pg_registry[pg.group_name] = pg

    # -- identity --------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ManagedDeviceMesh)
            and other.replicate_dim == self.replicate_dim
            and super().__eq__(other)
        )

    def __hash__(self) -> int:
        return hash((super().__hash__(), "ftdist-managed", self.replicate_dim))

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self._names, self.shape, strict=True))
        return f"ManagedDeviceMesh(({dims}), {self.device_type!r}, replicate={self.replicate_dim_name!r})"

    # -- dimensions ------------------------------------------------------------
    @property
    def _names(self) -> tuple[str, ...]:
        names = self._mesh_dim_names
        assert names is not None  # always set by __init__
        return names

    def _dim_index(self, mesh_dim: int | str | None) -> int:
        if mesh_dim is None:
            return self.replicate_dim
        if isinstance(mesh_dim, str):
            if mesh_dim not in self._names:
                raise KeyError(f"no dimension named {mesh_dim!r} in {self._names}")
            return self._names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh_dim {mesh_dim} out of range for {self.ndim} dimensions")
        return mesh_dim % self.ndim

    def _inner_dim(self, dim: int) -> int:
        return dim - 1 if dim > self.replicate_dim else dim

    def _replicate_size(self) -> int:
        # Before the first quorum there are no participants: count this group.
        return max(1, int(self.replicate_pg.size()))

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        """Slice by name: the replicate name gives a managed 1-D mesh.

        Raises:
            KeyError: a name is not a dimension or flattened dimension.
        """
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if names == self._names:
            return self
        root = self.parent or self
        if len(names) == 1 and names[0] in root.flatten_meshes:
            return root.flatten_meshes[names[0]]
        unknown = [n for n in names if n not in self._names]
        if unknown:
            raise KeyError(f"no dimension named {unknown[0]!r} in {self._names}")
        if self.replicate_dim_name not in names:
            assert self.inner_mesh is not None  # a replicate-only mesh has no other names
            return self.inner_mesh[names]
        others = tuple(n for n in names if n != self.replicate_dim_name)
        inner = None
        if others:
            assert self.inner_mesh is not None
            inner = self.inner_mesh[others]
        return ManagedDeviceMesh(
            inner, names, self.replicate_pg, names.index(self.replicate_dim_name), parent=root
        )

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """The group of ``mesh_dim``; the replicate dimension's (also for None) is :attr:`replicate_pg`.

        Raises:
            KeyError: ``mesh_dim`` names no dimension.
            IndexError: ``mesh_dim`` is out of range.
        """
        dim = self._dim_index(mesh_dim)
        if dim == self.replicate_dim:
            return self.replicate_pg
        assert self.inner_mesh is not None
        return self.inner_mesh.get_group(self._inner_dim(dim))

    def get_all_groups(self) -> list[Any]:
        """Every dimension's group, in dimension order."""
        return [self.get_group(i) for i in range(self.ndim)]

    def size(self, mesh_dim: int | None = None) -> int:
        """The number of ranks in ``mesh_dim``, or in the whole mesh.

        The replicate dimension counts the participating replica groups.

        Raises:
            IndexError: ``mesh_dim`` is out of range.
        """
        if mesh_dim is None:
            inner = 1 if self.inner_mesh is None else self.inner_mesh.size()
            return inner * self._replicate_size()
        dim = self._dim_index(mesh_dim)
        if dim == self.replicate_dim:
            return self._replicate_size()
        assert self.inner_mesh is not None
        return self.inner_mesh.size(self._inner_dim(dim))

    @property
    def shape(self) -> tuple[int, ...]:
        """Every dimension's size (see :meth:`size`)."""
        return tuple(self.size(i) for i in range(self.ndim))

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim``; for None, in the flattened mesh.

        Raises:
            KeyError: ``mesh_dim`` names no dimension.
            IndexError: ``mesh_dim`` is out of range.
        """
        coordinate = self.get_coordinate()
        assert coordinate is not None  # this rank is always in its own mesh
        if mesh_dim is None:
            index = 0
            for size, coord in zip(self.shape, coordinate, strict=True):
                index = index * size + coord
            return index
        return coordinate[self._dim_index(mesh_dim)]

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along every dimension, the replicate one included."""
        inner: tuple[int, ...] | None = ()
        if self.inner_mesh is not None:
            inner = self.inner_mesh.get_coordinate()
        if inner is None:
            return None
        coordinate = list(inner)
        coordinate.insert(self.replicate_dim, _replicate_rank(self.replicate_pg))
        return tuple(coordinate)

    def _sym_get_coordinate(self, index: int) -> int:
        coordinate = self.get_coordinate()
        assert coordinate is not None
        return coordinate[index]

    def _flatten(
        self, mesh_dim_name: str | None = None, backend_override: Any = None
    ) -> DeviceMesh:
        """One dimension over the whole mesh, found afterwards as ``mesh[mesh_dim_name]``.

        Raises:
            ValueError: ``backend_override`` is given (the replicate group is
                the Manager's).
        """
        if backend_override is not None:
            raise ValueError("ManagedDeviceMesh._flatten takes no backend_override")
        name = mesh_dim_name or "_".join(self._names)
        flat = _FlattenDeviceMesh(self, name)
        (self.parent or self).flatten_meshes[name] = flat
        return flat


class _FlattenDeviceMesh(DeviceMesh):
    """A :class:`ManagedDeviceMesh` seen as one dimension: its size and local rank.

    No single group spans it (part of it is the Manager's), so it answers
    only sizes and ranks; the rest raises NotImplementedError.

    Args:
        managed_mesh: the mesh it flattens.
        name: its dimension's name.
    """

    def __init__(self, managed_mesh: ManagedDeviceMesh, name: str = "flat") -> None:
        # No base __init__: there is no rank tensor for a dimension whose
        # size changes with the quorum.
        self.managed_mesh = managed_mesh
        self._flat_name = name

    @property
    def device_type(self) -> str:
        """The flattened mesh's device type."""
        return self.managed_mesh.device_type

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The one dimension's name."""
        return (self._flat_name,)

    @property
    def ndim(self) -> int:
        """Always 1."""
        return 1

    @property
    def shape(self) -> tuple[int, ...]:
        """``(size(),)``."""
        return (self.size(),)

    def size(self, mesh_dim: int | None = None) -> int:
        """The flattened mesh's size.

        Raises:
            IndexError: ``mesh_dim`` is neither None nor 0.
        """
        if mesh_dim not in (None, 0):
            raise IndexError(f"a flattened mesh has one dimension, got mesh_dim={mesh_dim}")
        return self.managed_mesh.size()

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index in the flattened mesh.

        Raises:
            IndexError: ``mesh_dim`` is neither None, 0 nor the dimension's name.
        """
        if mesh_dim not in (None, 0, self._flat_name):
            raise IndexError(f"a flattened mesh has one dimension, got mesh_dim={mesh_dim!r}")
        return self.managed_mesh.get_local_rank()

    def get_coordinate(self) -> tuple[int, ...] | None:
        """``(get_local_rank(),)``."""
        return (self.get_local_rank(),)

    def get_rank(self) -> int:
        """This process's global rank."""
        return self.managed_mesh.get_rank()

    def _unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"a flattened ManagedDeviceMesh has no {what}")

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        """Not available on a flattened mesh.

        Raises:
            NotImplementedError: a flattened mesh cannot be sliced.
        """
        raise self._unsupported("slices")

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """Not available on a flattened mesh.

        Raises:
            NotImplementedError: no single group spans the flattened mesh.
        """
        raise self._unsupported("single group")

    def get_all_groups(self) -> list[Any]:
        """Not available on a flattened mesh.

        Raises:
            NotImplementedError: no single group spans the flattened mesh.
        """
        raise self._unsupported("groups")

    def _flatten(
        self, mesh_dim_name: str | None = None, backend_override: Any = None
    ) -> DeviceMesh:
        raise self._unsupported("further flattening")

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"_FlattenDeviceMesh({self._flat_name!r}, of {self.managed_mesh!r})"


def _check_manager(manager: Any) -> None:
    missing = [
        name
        for name in ("allreduce", "num_participants", "participating_rank")
        if not callable(getattr(manager, name, None))
    ]
    if missing:
        raise TypeError(
            f"manager must be an ftdist Manager, got {type(manager).__name__} "
            f"(no {', '.join(missing)})"
        )
    pg = getattr(manager, "_pg", None)
    if not isinstance(pg, torch.distributed.ProcessGroup):
        raise TypeError(f"manager._pg must be the Manager's process group, got {type(pg).__name__}")


def ft_init_device_mesh(
    *,
    device_type: str,
    mesh_shape: tuple[int, ...],
    mesh_dim_names: tuple[str, ...],
    replicate_dim: int,
    manager: Any,
) -> ManagedDeviceMesh:
    """A device mesh whose ``replicate_dim`` spans replica groups through ``manager``.

    The other dimensions are built with ``init_device_mesh`` over this
    replica group's ranks (their product must be its world size); the
    replicate dimension's size in ``mesh_shape`` is ignored, since the
    number of replica groups changes with the quorum. Its group is a
    :class:`ManagedProcessGroup` registered under the replicate dimension's
    name, so ``mesh.get_group(name)`` and functional collectives find it; it
    replaces the group of an earlier call made with the same name.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ...
        mesh_shape: every dimension's size, the replicate one included.
        mesh_dim_names: every dimension's name (unique).
        replicate_dim: the index of the replicate dimension.
        manager: the :class:`~ftdist.manager.Manager` of this rank.

    Returns:
        The mesh; pass it to ``fully_shard`` for HSDP.

    Raises:
        TypeError: ``manager`` is not a Manager (or lacks its process group),
            or an argument has the wrong type.
        ValueError: ``mesh_shape`` and ``mesh_dim_names`` differ in length,
            have fewer than two dimensions, a size is not positive, a name is
            repeated, or ``replicate_dim`` is out of range.
    """
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(f"device_type must be a non-empty str, got {device_type!r}")
    shape, names = tuple(mesh_shape), tuple(mesh_dim_names)
    if len(shape) != len(names):
        raise ValueError(f"mesh_shape {shape} and mesh_dim_names {names} must have the same length")
    if len(shape) < 2:
        raise ValueError(f"mesh_shape {shape} needs the replicate dimension and at least one other")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
        raise ValueError(f"mesh_shape sizes must be positive ints, got {shape}")
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names must be unique non-empty strs, got {names}")
    if isinstance(replicate_dim, bool) or not isinstance(replicate_dim, int):
        raise TypeError(f"replicate_dim must be an int, got {replicate_dim!r}")
    if not 0 <= replicate_dim < len(shape):
        raise ValueError(f"replicate_dim must be in [0, {len(shape)}), got {replicate_dim}")
    _check_manager(manager)
    inner_shape = shape[:replicate_dim] + shape[replicate_dim + 1 :]
    inner_names = names[:replicate_dim] + names[replicate_dim + 1 :]
    mesh = init_device_mesh(device_type, inner_shape, mesh_dim_names=inner_names)

    previous = ManagedDeviceMesh.replicate_pg_singleton
    if previous is not None and previous._registered_as is not None:
        if previous._registered_as[0].endswith(f":{names[replicate_dim]}"):
            previous.unregister()
    replicate_pg = ManagedProcessGroup(manager)
    replicate_pg.register(names[replicate_dim])
    ManagedDeviceMesh.replicate_pg_singleton = replicate_pg
    return ManagedDeviceMesh(mesh, names, replicate_pg, replicate_dim, parent=None)
