"""
The checkpoint header codec: a state dict as plain JSON data
============================================================

A state dict becomes a JSON tree in which every tensor is a reference to an
entry of a tensor table (dtype, shape, strides, device, kind); the tensors'
bytes travel apart from the header. Nothing on the wire names a Python class
to import or a function to call: the decoder knows a closed set of node tags
and builds only these types:

- ``None``, ``bool``, ``int``, ``float`` (NaN and infinities too), ``str``,
  ``complex``, ``bytes``, ``bytearray``;
- ``dict``, ``collections.OrderedDict`` (with a module state dict's
  ``_metadata``), ``list``, ``tuple``, ``set``, ``frozenset``, named tuples;
- ``torch.Size``, ``torch.dtype``, ``torch.device``, numpy scalars;
- tensors: ``torch.Tensor``, ``torch.nn.Parameter``, ``DTensor`` (local
  tensor plus its placement and mesh as plain data) and numpy arrays.

That covers ``nn.Module.state_dict()``, ``torch.optim`` optimizers and LR
schedulers, RNG states (torch, Python, numpy) and the Manager's own state.
Anything else is refused when sending, with a ``TypeError`` naming the leaf,
so the mistake shows up on the first heal rather than in a peer's log.

A named tuple is rebuilt as the class of that name when the receiver has
already imported it (looked up, never imported), else as an equal named
tuple made on the spot.
"""

from __future__ import annotations

import base64
import collections
import functools
import re
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ftdist.checkpointing import _dtensor
from ftdist.errors import CheckpointError

# Deeper nesting than this is refused both ways (and catches reference cycles
# when sending); real training states nest fewer than ten levels.
MAX_DEPTH = 100
_MAX_DIMS = 64
_MAX_NBYTES = 1 << 62
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,5})?")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,255}")

# dtypes whose bytes travel as they are (no quantised or sub-byte types).
_TENSOR_DTYPE_NAMES = (
    "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 "
    "float64 complex32 complex64 complex128 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
    "float8_e5m2fnuz float8_e8m0fnu"
).split()
TENSOR_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n)
    for n in _TENSOR_DTYPE_NAMES
    if isinstance(getattr(torch, n, None), torch.dtype)
}
_DTYPE_NAMES = {dt: n for n, dt in TENSOR_DTYPES.items()}
# Any dtype may be a *value* (a config entry), looked up in this fixed table.
VALUE_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_NUMPY_SCALARS = (
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
    "complex64 complex128"
).split()


# Values that are their own encoding (None aside).
_PLAIN = frozenset({bool, int, float, str})


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a tensor dtype (``"float32"``).

    Raises:
        TypeError: the dtype's bytes cannot travel (quantised, sub-byte).
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"tensors of dtype {dtype} cannot be sent") from None


def where(path: tuple[Any, ...]) -> str:
    """``state_dict['model']['w']``: a leaf's path for messages (long ones elided)."""
    keys = [f"[{k!r:.60}]" for k in path]
    if len(keys) > 12:
        keys = [*keys[:6], f"...{len(keys) - 10} more...", *keys[-4:]]
    return "state_dict" + "".join(keys)


@functools.lru_cache(maxsize=4096)
def dense_stride(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``shape`` out without gaps or overlaps (any dim order).

    Cached: a model's tensors share a few layouts, and both ends of a heal
    ask for each tensor.
    """
    dims = sorted((st, sz) for sz, st in zip(shape, stride, strict=True) if sz != 1)
    expected = 1
    for st, sz in dims:
        if sz == 0:
            return True
        if st != expected:
            return False
        expected *= sz
    return True


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    out, step = [], 1
    for sz in reversed(shape):
        out.append(step)
        step *= max(sz, 1)
    return tuple(reversed(out))


class Encoded(NamedTuple):
    """A state dict split for the wire.

    Attributes:
        tree: the JSON-able tree; tensors are ``["T", i]``.
        metas: JSON-able metadata of tensor ``i``.
        tensors: tensor ``i`` as a plain strided tensor (a DTensor's local
            tensor, a numpy array's view) whose bytes travel.
    """

    tree: Any
    metas: list[dict[str, Any]]
    tensors: list[torch.Tensor]


def encode(state: Any) -> Encoded:
    """Split ``state`` into a plain-data tree and its tensors (no copies).

    Raises:
        TypeError: a leaf is of a type the header cannot carry (the message
            names its path), or the state nests deeper than :data:`MAX_DEPTH`.
    """
    metas: list[dict[str, Any]] = []
    tensors: list[torch.Tensor] = []
    tree = _Encoder(metas, tensors).value(state, (), 0)
    return Encoded(tree, metas, tensors)


class _Encoder:
    def __init__(self, metas: list[dict[str, Any]], tensors: list[torch.Tensor]) -> None:
        self.metas = metas
        self.tensors = tensors

    def pairs(self, d: dict[Any, Any], path: tuple[Any, ...], depth: int) -> list[Any]:
        # Plain keys and values (most of a state) skip the call and the path
        # tuple it would build: a model's state has thousands of them.
        return [
            [
                k if type(k) in _PLAIN else self.key(k, path, depth),
                v if v is None or type(v) in _PLAIN else self.value(v, (*path, k), depth + 1),
            ]
            for k, v in d.items()
        ]

    def key(self, k: Any, path: tuple[Any, ...], depth: int) -> Any:
        if isinstance(k, torch.Tensor) or _is_ndarray(k):
            raise TypeError(f"cannot send {where(path)}: a tensor is one of its keys")
        return self.value(k, (*path, k), depth + 1)

    def value(self, obj: Any, path: tuple[Any, ...], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(
                f"cannot send {where(path)}: the state nests deeper than {MAX_DEPTH} levels "
                "(a reference cycle?)"
            )
        kind = type(obj)
        if obj is None or kind in (bool, int, float, str):
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if kind is dict:
            return ["dict", self.pairs(obj, path, depth)]
        if kind is collections.OrderedDict:
            meta = getattr(obj, "_metadata", None)
            extra = [] if meta is None else [self.value(meta, (*path, "_metadata"), depth + 1)]
            return ["odict", self.pairs(obj, path, depth), *extra]
        if kind in (list, tuple, set, frozenset):
            items = [
                v if v is None or type(v) in _PLAIN else self.value(v, (*path, i), depth + 1)
                for i, v in enumerate(obj)
            ]
            return [kind.__name__, items]
        if kind is torch.Size:
            return ["size", list(obj)]
        fields = getattr(kind, "_fields", None)
        if issubclass(kind, tuple) and isinstance(fields, tuple):
            values = [
                self.value(v, (*path, f), depth + 1) for f, v in zip(fields, obj, strict=True)
            ]
            return ["ntuple", kind.__module__, kind.__qualname__, list(fields), values]
        if kind in (bytes, bytearray):
            return [kind.__name__, base64.b64encode(obj).decode("ascii")]
        if kind is complex:
            return ["complex", obj.real, obj.imag]
        if kind is torch.dtype:
            return ["dtype", str(obj).removeprefix("torch.")]
        if kind is torch.device:
            return ["device", str(obj)]
        if _is_ndarray(obj):
            return self.ndarray(obj, path)
        if kind.__module__ == "numpy" and type(obj).__name__ in _NUMPY_SCALARS:
            item = obj.item()
            return [
                "np",
                kind.__name__,
                [item.real, item.imag] if isinstance(item, complex) else item,
            ]
        raise TypeError(
            f"cannot send {where(path)}: a {kind.__module__}.{kind.__qualname__}. A checkpoint "
            "carries tensors, DTensors, numpy arrays and scalars, numbers, strings, bytes, None, "
            "dtypes, devices and dicts/lists/tuples/sets/named tuples of them; store its "
            "state_dict() or another plain form instead"
        )

    def add(self, t: torch.Tensor, meta: dict[str, Any]) -> list[Any]:
        self.metas.append(meta)
        self.tensors.append(t)
        return ["T", len(self.tensors) - 1]

    def tensor(self, obj: torch.Tensor, path: tuple[Any, ...]) -> list[Any]:
        kind = type(obj)
        extra: dict[str, Any] = {}
        if _dtensor.is_dtensor(obj):
            local = _dtensor.local_tensor(obj)
            extra["spec"] = _dtensor.encode_spec(obj, where(path))
            extra["param"] = isinstance(obj, torch.nn.Parameter)
            name, t = "dtensor", local
        elif kind is torch.Tensor or kind is torch.nn.Parameter:
            name, t = ("tensor" if kind is torch.Tensor else "parameter"), obj
        else:
            raise TypeError(
                f"cannot send {where(path)}: a {kind.__qualname__} (a tensor subclass other "
                "than Parameter or DTensor); convert it to a plain tensor in the state_dict "
                "function"
            )
        t = t.detach()
        if t.layout != torch.strided or t.is_quantized or t.is_meta:
            raise TypeError(
                f"cannot send {where(path)}: a {t.layout} tensor on {t.device}; only dense "
                "tensors with data travel (densify it or move it to a real device)"
            )
        try:
            dt = dtype_name(t.dtype)
        except TypeError as exc:
            raise TypeError(f"cannot send {where(path)}: {exc}") from None
        t = t.resolve_conj().resolve_neg()
        stride = tuple(t.stride())
        if not dense_stride(tuple(t.shape), stride):
            # Gaps or overlaps (a slice, an expand): the bytes travel row-major.
            stride = contiguous_stride(tuple(t.shape))
        meta = {
            "dtype": dt,
            "shape": list(t.shape),
            "stride": list(stride),
            "device": "cpu" if t.is_cpu else str(t.device),
            "kind": name,
            "grad": bool(obj.requires_grad),
            **extra,
        }
        return self.add(t, meta)

    def ndarray(self, a: Any, path: tuple[Any, ...]) -> list[Any]:
        import numpy as np

        if a.dtype.name not in _NUMPY_SCALARS or a.dtype.byteorder not in "=|":
            raise TypeError(
                f"cannot send {where(path)}: a numpy array of dtype {a.dtype}; only numeric "
                "and bool arrays in native byte order travel"
            )
        arr = np.ascontiguousarray(a)
        if not arr.flags.writeable:
            arr = arr.copy()
        t = torch.from_numpy(arr)
        meta = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "stride": list(contiguous_stride(tuple(t.shape))),
            "device": "cpu",
            "kind": "ndarray",
            "grad": False,
        }
        return self.add(t, meta)


def _is_ndarray(obj: Any) -> bool:
    kind = type(obj)
    return kind.__name__ == "ndarray" and kind.__module__ == "numpy"


# -- decoding --------------------------------------------------------------------------------


class LeafMeta(NamedTuple):
    """A tensor leaf as the header describes it, checked (a named tuple: a
    header describes thousands, and a frozen dataclass took 2.8 us to build
    each).

    Attributes:
        table_index: its entry in the tensor table.
        path: keys from the root of the state dict.
        dtype: element type.
        shape: shape (a DTensor's local shape).
        stride: strides, dense in some dimension order.
        device: the sender's device (``"cuda:0"``).
        kind: ``tensor``, ``parameter``, ``dtensor`` or ``ndarray``.
        grad: whether it required grad.
        spec: a DTensor's placement and mesh (plain data), else None.
        param: a DTensor that was an ``nn.Parameter``.
        nbytes: bytes of the tensor on the wire.
    """

    table_index: int
    path: tuple[Any, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: str
    kind: str
    grad: bool
    spec: dict[str, Any] | None
    param: bool
    nbytes: int


def _bad(msg: str) -> CheckpointError:
    return CheckpointError(f"malformed checkpoint header: {msg}")


def _int(v: Any, what: str, lo: int = 0, hi: int = _MAX_NBYTES) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(f"{what} must be an int in [{lo}, {hi}], got {v!r:.80}")
    return v


def _ints(v: Any, what: str, n: int | None = None) -> tuple[int, ...]:
    if type(v) is not list or len(v) > _MAX_DIMS or (n is not None and len(v) != n):
        raise _bad(f"{what} must be a list of at most {_MAX_DIMS} ints")
    if all(type(x) is int and 0 <= x <= _MAX_NBYTES for x in v):
        return tuple(v)
    return tuple(_int(x, what) for x in v)  # raises, naming the bad one


@functools.lru_cache(maxsize=256)
def _valid_device(device: str) -> bool:
    return _DEVICE.fullmatch(device) is not None


_TENSOR_FIELDS = frozenset({"dtype", "shape", "stride", "device", "kind", "grad"})
_DTENSOR_FIELDS = _TENSOR_FIELDS | {"spec", "param"}


def _meta(index: int, m: Any, path: tuple[Any, ...]) -> LeafMeta:
    if type(m) is not dict:
        raise _bad(f"tensor {index} is described by a {type(m).__name__}, not an object")
    kind = m.get("kind")
    if kind == "dtensor":
        allowed = _DTENSOR_FIELDS
    elif kind in ("tensor", "parameter", "ndarray"):
        allowed = _TENSOR_FIELDS
    else:
        raise _bad(f"tensor {index} has unknown kind {kind!r:.40}")
    if m.keys() != allowed:
        raise _bad(f"tensor {index} has fields {sorted(m)!r:.200}, expected {sorted(allowed)}")
    dtype = TENSOR_DTYPES.get(m["dtype"]) if type(m["dtype"]) is str else None
    if dtype is None:
        raise _bad(f"tensor {index} has unknown dtype {m['dtype']!r:.40}")
    shape = _ints(m["shape"], "shape")
    stride = _ints(m["stride"], "stride", len(shape))
    if not dense_stride(shape, stride):
        raise _bad(f"tensor {index} has strides {stride} that do not lay out shape {shape} densely")
    device = m["device"]
    if type(device) is not str or not _valid_device(device):
        raise _bad(f"tensor {index} has device {device!r:.40}")
    if type(m["grad"]) is not bool or type(m.get("param", False)) is not bool:
        raise _bad(f"tensor {index} has non-bool flags")
    nbytes = dtype.itemsize
    for size in shape:
        nbytes *= size
    if nbytes > _MAX_NBYTES:
        raise _bad(f"tensor {index} claims {nbytes} bytes")
    return LeafMeta(
        index, path, dtype, shape, stride, device, kind, m["grad"],
        _dtensor.check_spec(m["spec"]) if kind == "dtensor" else None,
        bool(m.get("param", False)), nbytes,
    )  # fmt: skip


def check(tree: Any, metas: Any) -> list[LeafMeta]:
    """Check a decoded header's tree and tensor table; the leaves, in table order.

    Every tensor of the table must appear exactly once in the tree.

    Raises:
        CheckpointError: anything in them is not what :func:`encode` writes.
    """
    if type(metas) is not list:
        raise _bad("the tensor table is not a list")
    paths: dict[int, tuple[Any, ...]] = {}

    def record(index: Any, path: tuple[Any, ...]) -> None:
        if type(index) is not int or not 0 <= index < len(metas) or index in paths:
            raise _bad(f"tensor reference {index!r:.40} at {where(path)} is invalid or repeated")
        paths[index] = path

    _Decoder(record).value(tree, (), 0)
    if len(paths) != len(metas):
        raise _bad(f"{len(metas) - len(paths)} tensors of the table are not in the tree")
    return [_meta(i, m, paths[i]) for i, m in enumerate(metas)]


def build(tree: Any, leaf: Callable[[int], Any]) -> Any:
    """Build the state from a tree :func:`check` accepted; ``leaf(i)`` gives tensor ``i``.

    Raises:
        CheckpointError: the tree is malformed.
    """
    return _Decoder(lambda index, path: None, leaf).value(tree, (), 0)


class _Decoder:
    def __init__(
        self,
        record: Callable[[Any, tuple[Any, ...]], None],
        leaf: Callable[[int], Any] | None = None,
    ) -> None:
        self.record = record
        self.leaf = leaf

    def items(self, v: Any, path: tuple[Any, ...], depth: int) -> list[Any]:
        if type(v) is not list:
            raise _bad(f"{where(path)} has a {type(v).__name__} where a list belongs")
        return [
            x if x is None or type(x) in _PLAIN else self.value(x, (*path, i), depth + 1)
            for i, x in enumerate(v)
        ]

    def mapping(self, v: Any, path: tuple[Any, ...], depth: int) -> list[tuple[Any, Any]]:
        if type(v) is not list:
            raise _bad(f"{where(path)} has a {type(v).__name__} where key-value pairs belong")
        out = []
        for pair in v:
            if type(pair) is not list or len(pair) != 2:
                raise _bad(f"{where(path)} has a malformed key-value pair")
            k = pair[0]
            if type(k) not in _PLAIN:
                k = self.value(k, path, depth + 1)
                _hashable(k, path)
            v = pair[1]
            if v is not None and type(v) not in _PLAIN:
                v = self.value(v, (*path, k), depth + 1)
            out.append((k, v))
        return out

    def value(self, node: Any, path: tuple[Any, ...], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _bad(f"{where(path)} nests deeper than {MAX_DEPTH} levels")
        kind = type(node)
        if node is None or kind in (bool, int, float, str):
            return node
        if kind is not list or not node or type(node[0]) is not str:
            raise _bad(f"{where(path)} is a {kind.__name__} without a tag")
        tag, args = node[0], node[1:]
        try:
            return self.tagged(tag, args, path, depth)
        except CheckpointError:
            raise
        except (TypeError, ValueError, OverflowError) as exc:
            raise _bad(f"{where(path)} ({tag!r:.20}): {exc}") from None

    def tagged(self, tag: str, args: list[Any], path: tuple[Any, ...], depth: int) -> Any:
        n = len(args)
        if tag == "T" and n == 1:
            self.record(args[0], path)
            return None if self.leaf is None else self.leaf(args[0])
        if tag == "dict" and n == 1:
            return dict(_unique(self.mapping(args[0], path, depth), path))
        if tag == "odict" and n in (1, 2):
            od = collections.OrderedDict(_unique(self.mapping(args[0], path, depth), path))
            if n == 2:
                od._metadata = self.value(args[1], (*path, "_metadata"), depth + 1)  # type: ignore[attr-defined]
            return od
        if tag in ("list", "tuple", "set", "frozenset") and n == 1:
            items = self.items(args[0], path, depth)
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "size" and n == 1:
            return torch.Size(_ints(args[0], "torch.Size"))
        if tag == "ntuple" and n == 4:
            return self.ntuple(args, path, depth)
        if tag in ("bytes", "bytearray") and n == 1 and type(args[0]) is str:
            raw = base64.b64decode(args[0].encode("ascii"), validate=True)
            return raw if tag == "bytes" else bytearray(raw)
        if tag == "complex" and n == 2 and all(type(x) in (int, float) for x in args):
            return complex(args[0], args[1])
        if tag == "dtype" and n == 1 and args[0] in VALUE_DTYPES:
            return VALUE_DTYPES[args[0]]
        if tag == "device" and n == 1 and type(args[0]) is str and _DEVICE.fullmatch(args[0]):
            return torch.device(args[0])
        if tag == "np" and n == 2 and args[0] in _NUMPY_SCALARS:
            import numpy as np

            v = args[1]
            if type(v) is list and len(v) == 2:
                v = complex(*v)
            if type(v) not in (bool, int, float, complex):
                raise _bad(f"{where(path)} is a numpy scalar of {type(v).__name__}")
            return np.dtype(args[0]).type(v)
        raise _bad(f"{where(path)} has unknown tag {tag!r:.20} with {n} arguments")

    def ntuple(self, args: list[Any], path: tuple[Any, ...], depth: int) -> Any:
        module, qualname, fields, values = args
        if (
            type(module) is not str
            or type(qualname) is not str
            or not _MODULE.fullmatch(module)
            or not _MODULE.fullmatch(qualname)
            or type(fields) is not list
            or len(fields) > 256
            or not all(type(f) is str and _IDENT.fullmatch(f) for f in fields)
        ):
            raise _bad(f"{where(path)} is a malformed named tuple")
        items = self.items(values, path, depth)
        cls = _namedtuple(module, qualname, tuple(fields))
        if len(items) != len(fields):
            raise _bad(f"{where(path)}: {len(items)} values for {len(fields)} fields")
        return cls(*items)


def _unique(pairs: list[tuple[Any, Any]], path: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    if len({k for k, _ in pairs}) != len(pairs):
        raise _bad(f"{where(path)} repeats a key")
    return pairs


def _hashable(k: Any, path: tuple[Any, ...]) -> None:
    try:
        hash(k)
    except TypeError:
        raise _bad(f"{where(path)} has an unhashable key") from None


@functools.lru_cache(maxsize=256)
def _namedtuple(module: str, qualname: str, fields: tuple[str, ...]) -> Any:
    # Only classes already imported here; nothing is imported on a peer's word.
    # vars() rather than getattr, so no module __getattr__ hook runs.
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = vars(obj).get(part) if obj is not None and hasattr(obj, "__dict__") else None
    if isinstance(obj, type) and issubclass(obj, tuple) and getattr(obj, "_fields", None) == fields:
        return obj
    name = qualname.rsplit(".", 1)[-1]
    if not name.isidentifier() or name.startswith("_"):
        name = "NamedTuple"
    return collections.namedtuple(name, fields)


def as_int(v: Any, what: str, lo: int = 0, hi: int = _MAX_NBYTES) -> int:
    """A checked int in ``[lo, hi]``.

    Raises:
        CheckpointError: ``v`` is not one.
    """
    return _int(v, what, lo, hi)


def bad(msg: str) -> CheckpointError:
    """The error for a malformed header."""
    return _bad(msg)
