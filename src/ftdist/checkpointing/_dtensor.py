"""
DTensor leaves as plain data
============================

A DTensor travels as its local tensor's bytes plus its spec written out as
plain data: the placements (``Shard``, ``_StridedShard``, ``Replicate``,
``Partial``), the shard order, the global shape, strides and dtype, and the
device mesh (device type, rank map, layout, dimension names and the names of
its process groups).

On the receiving side the mesh is one this process already has when it can
be found (a mesh seen in a state sent from here, or in an in-place target),
else it is rebuilt without creating process groups: the same mesh that
unpickling would give (equal to the sender's, its group names resolved here
when this process has groups of those names).

``torch.distributed.tensor`` is imported only when a DTensor is met.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import torch

from ftdist.errors import CheckpointError

# Looked up in a fixed table, never with getattr on a peer's word.
_DTYPES = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_PARTIAL_OPS = ("sum", "avg", "max", "min", "product", "prod", "band", "bor", "bxor")
_MAX_RANKS = 1 << 20


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor (without importing the DTensor machinery)."""
    kind = type(obj)
    # Plain tensors without the MRO walk: a state holds thousands of them,
    # and the walk took a few microseconds each.
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return False
    found = _DTENSOR_TYPES.get(kind)
    if found is None:
        found = any(
            c.__name__ == "DTensor" and c.__module__.startswith("torch.distributed.tensor")
            for c in kind.__mro__
        )
        if len(_DTENSOR_TYPES) < _MOST_TYPES:
            _DTENSOR_TYPES[kind] = found
    return found


# Tensor types seen, and whether each is a DTensor; bounded, so that types
# made on the fly are not all kept alive.
_DTENSOR_TYPES: dict[type, bool] = {}
_MOST_TYPES = 256


def local_tensor(dt: Any) -> torch.Tensor:
    """The DTensor's local shard (a plain tensor)."""
    return dt._local_tensor  # type: ignore[no-any-return]


def _layout_of(mesh: Any) -> list[list[list[int]]]:
    layout = getattr(mesh, "_layout", None)
    if layout is not None:
        return [[list(a.shape), list(a.stride)] for a in layout]
    m = mesh.mesh
    return [[[s], [st]] for s, st in zip(m.shape, m.stride(), strict=True)]


def encode_mesh(mesh: Any) -> dict[str, Any]:
    """A device mesh as plain data."""
    rank_map = getattr(mesh, "_rank_map", None)
    ranks = rank_map.tolist() if rank_map is not None else mesh.mesh.flatten().tolist()
    return {
        "device_type": str(mesh.device_type),
        "ranks": [int(r) for r in ranks],
        "layout": _layout_of(mesh),
        "names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "groups": [str(g) for g in getattr(mesh, "_dim_group_names", [])],
    }


def _mesh_key(plain: dict[str, Any]) -> str:
    # What DeviceMesh.__eq__ compares (group names are local detail).
    return json.dumps([plain["device_type"], plain["ranks"], plain["layout"], plain["names"]])


class _Meshes:
    """Meshes this process already has, by what makes two meshes equal (weakly held)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

    def remember(self, mesh: Any) -> dict[str, Any]:
        plain = encode_mesh(mesh)
        with self._lock:
            self._known.setdefault(_mesh_key(plain), mesh)
        return plain

    def find(self, plain: dict[str, Any]) -> Any:
        with self._lock:
            return self._known.get(_mesh_key(plain))


MESHES = _Meshes()


def remember_targets(leaves: list[Any]) -> None:
    """Note the meshes of the DTensors among ``leaves`` (a receiver's own state)."""
    for leaf in leaves:
        if is_dtensor(leaf):
            MESHES.remember(leaf._spec.mesh)


def encode_spec(dt: Any, where: str) -> dict[str, Any]:
    """A DTensor's spec as plain data.

    Raises:
        TypeError: it has a placement that cannot travel as plain data.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    spec = dt._spec
    placements: list[list[Any]] = []
    for p in spec.placements:
        if isinstance(p, _StridedShard):
            placements.append(["sshard", int(p.dim), int(p.split_factor)])
        elif isinstance(p, Shard):
            placements.append(["shard", int(p.dim)])
        elif type(p) is Replicate:
            placements.append(["replicate"])
        elif type(p) is Partial and p.reduce_op in _PARTIAL_OPS:
            placements.append(["partial", p.reduce_op])
        else:
            raise TypeError(f"cannot send {where}: a DTensor placed by {p!r}")
    order = getattr(spec, "shard_order", None)
    meta = spec.tensor_meta
    return {
        "mesh": MESHES.remember(spec.mesh),
        "placements": placements,
        "shard_order": (
            None if order is None else [[int(e.tensor_dim), list(e.mesh_dims)] for e in order]
        ),
        "strided_order": getattr(spec, "use_strided_shard_as_shard_order", None),
        "global": None
        if meta is None
        else {
            "shape": list(meta.shape),
            "stride": list(meta.stride),
            "dtype": str(meta.dtype).removeprefix("torch."),
        },
    }


def _bad(msg: str) -> CheckpointError:
    return CheckpointError(f"malformed checkpoint header: DTensor spec: {msg}")


def _ints(v: Any, what: str, lo: int = 0, hi: int = 1 << 62, most: int = 64) -> list[int]:
    if (
        type(v) is not list
        or len(v) > most
        or any(type(x) is not int or not lo <= x <= hi for x in v)
    ):
        raise _bad(f"{what} must be a list of at most {most} ints in [{lo}, {hi}]")
    return v


def check_spec(spec: Any) -> dict[str, Any]:
    """Check a spec read from a header (shape of the data only; nothing is built).

    Raises:
        CheckpointError: it is not what :func:`encode_spec` writes.
    """
    keys = {"mesh", "placements", "shard_order", "strided_order", "global"}
    if type(spec) is not dict or set(spec) != keys:
        raise _bad("not an object with the expected fields")
    mesh = spec["mesh"]
    if type(mesh) is not dict or set(mesh) != {"device_type", "ranks", "layout", "names", "groups"}:
        raise _bad("the mesh is not an object with the expected fields")
    if type(mesh["device_type"]) is not str or not mesh["device_type"].isidentifier():
        raise _bad("bad mesh device type")
    _ints(mesh["ranks"], "mesh ranks", most=_MAX_RANKS)
    if type(mesh["layout"]) is not list or len(mesh["layout"]) > 64:
        raise _bad("bad mesh layout")
    for axis in mesh["layout"]:
        if type(axis) is not list or len(axis) != 2:
            raise _bad("bad mesh layout axis")
        _ints(axis[0], "layout sizes")
        _ints(axis[1], "layout strides")
    for field in ("names", "groups"):
        names = mesh[field]
        if field == "names" and names is None:
            continue
        if type(names) is not list or len(names) > 64:
            raise _bad(f"bad mesh {field}")
        if any(type(n) is not str or len(n) > 256 for n in names):
            raise _bad(f"bad mesh {field}")
    if type(spec["placements"]) is not list or len(spec["placements"]) > 64:
        raise _bad("bad placements")
    for p in spec["placements"]:
        ok = (
            type(p) is list
            and bool(p)
            and (
                (p[0] == "replicate" and len(p) == 1)
                or (p[0] == "shard" and len(p) == 2 and type(p[1]) is int and -64 <= p[1] < 64)
                or (p[0] == "partial" and len(p) == 2 and p[1] in _PARTIAL_OPS)
                or (
                    p[0] == "sshard"
                    and len(p) == 3
                    and type(p[1]) is int
                    and -64 <= p[1] < 64
                    and type(p[2]) is int
                    and 1 <= p[2] <= 1 << 30
                )
            )
        )
        if not ok:
            raise _bad(f"bad placement {p!r:.60}")
    order = spec["shard_order"]
    if order is not None:
        if type(order) is not list or len(order) > 64:
            raise _bad("bad shard order")
        for entry in order:
            if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not int:
                raise _bad("bad shard order entry")
            _ints(entry[1], "shard order mesh dims")
    if spec["strided_order"] not in (None, True, False):
        raise _bad("bad strided-order flag")
    meta = spec["global"]
    if meta is not None:
        if type(meta) is not dict or set(meta) != {"shape", "stride", "dtype"}:
            raise _bad("bad global tensor metadata")
        _ints(meta["shape"], "global shape")
        _ints(meta["stride"], "global stride")
        if type(meta["dtype"]) is not str or meta["dtype"] not in _DTYPES:
            raise _bad("bad global dtype")
    return spec


def _rebuild_mesh(plain: dict[str, Any]) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    names = tuple(plain["names"]) if plain["names"] else None
    rank_map = torch.tensor(plain["ranks"], dtype=torch.int)
    try:
        from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout

        layout = _MeshLayout([_FlatLayout(tuple(s), tuple(d)) for s, d in plain["layout"]])
        mesh = DeviceMesh(
            plain["device_type"],
            mesh_dim_names=names,
            _init_backend=False,
            _layout=layout,
            _rank_map=rank_map,
        )
    except ImportError:  # torch without mesh layouts: the rank map is the mesh
        sizes = [s[0] for s, _ in plain["layout"]]
        mesh = DeviceMesh(
            plain["device_type"], rank_map.reshape(sizes), mesh_dim_names=names, _init_backend=False
        )
    # What __init__ skips without a backend, as unpickling the sender's mesh
    # would give it: this process's rank and the sender's group names,
    # resolved here when this process has groups of those names.
    mesh._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if hasattr(mesh, "_compute_coordinate_on_dim"):
        mesh._coordinate_on_dim = mesh._compute_coordinate_on_dim()
    mesh._dim_group_names = list(plain["groups"])
    registry = getattr(mesh, "_pg_registry", None)
    if registry is not None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        for name in mesh._dim_group_names:
            try:
                registry[name] = _resolve_process_group(name)
            except Exception:  # torch raises several kinds for unknown names
                continue
    MESHES.remember(mesh)
    return mesh


def build(local: torch.Tensor, spec: dict[str, Any], grad: bool, param: bool, where: str) -> Any:
    """The DTensor around ``local`` that ``spec`` (checked) describes.

    Raises:
        CheckpointError: the spec does not make a valid DTensor here.
    """
    try:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh = MESHES.find(spec["mesh"])
        if mesh is None:
            mesh = _rebuild_mesh(spec["mesh"])
        placements: list[Any] = []
        for p in spec["placements"]:
            if p[0] == "shard":
                placements.append(Shard(p[1]))
            elif p[0] == "sshard":
                placements.append(_StridedShard(p[1], split_factor=p[2]))
            elif p[0] == "replicate":
                placements.append(Replicate())
            else:
                placements.append(Partial(p[1]))
        meta = spec["global"]
        tensor_meta = (
            None
            if meta is None
            else TensorMeta(
                torch.Size(meta["shape"]), tuple(meta["stride"]), _DTYPES[meta["dtype"]]
            )
        )
        kwargs: dict[str, Any] = {}
        if spec["strided_order"] is not None and hasattr(DTensorSpec, "__dataclass_fields__"):
            fields = DTensorSpec.__dataclass_fields__
            if "use_strided_shard_as_shard_order" in fields:
                kwargs["use_strided_shard_as_shard_order"] = spec["strided_order"]
            if spec["shard_order"] is not None and "shard_order" in fields:
                from torch.distributed.tensor._dtensor_spec import ShardOrderEntry

                kwargs["shard_order"] = tuple(
                    ShardOrderEntry(tensor_dim=d, mesh_dims=tuple(m))
                    for d, m in spec["shard_order"]
                )
        dspec = DTensorSpec(mesh, tuple(placements), tensor_meta=tensor_meta, **kwargs)
        dt = DTensor(local, dspec, requires_grad=grad and not param)
        return torch.nn.Parameter(dt, requires_grad=grad) if param else dt
    except CheckpointError:
        raise
    except Exception as exc:  # torch validates specs with many exception types
        raise CheckpointError(f"cannot rebuild the DTensor at {where}: {exc}") from exc
