"""
State fingerprints
==================

:func:`fingerprint` reduces a state to a few 64-bit word-sum digests
(:mod:`ftdist.checkpointing._checksum`), one per part (``default/model``,
``default/optim/state``, ...). Replicas at the same step must hold the same
consistency parts, and comparing fingerprints names the part that differs
instead of letting replicas drift apart silently (see
:func:`ftdist.manager.rule.find_divergence`).

A healed replica also checks that what it loaded is what its source had.
The source does not hash its state for that before serving it: the
consistency parts are mostly the very tensors the heal carries (the model's
parameters, the optimizer's state), and the receiver has just summed every
byte it received to check the transfer. So the source sends a
:func:`plan`: for each part, the sums of what the heal does not carry (the
non-tensor values, the tensor headers) and, for each tensor it does carry,
where that tensor sits in the user state. The receiver assembles the
source's fingerprint from the plan and its own sums of the received bytes
(:func:`planned`), which cost nothing more. The sums compose (see
:class:`~ftdist.checkpointing._checksum.SegmentSum`), so the result is the
same number :func:`fingerprint` gives on the source.
"""

from __future__ import annotations

import functools
import logging
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch.utils._pytree import tree_flatten_with_path

from ftdist._gcpause import gc_paused
from ftdist.checkpointing._checksum import SegmentSum, WordSum
from ftdist.checkpointing._wire import sum_tensor, tensor_sums
from ftdist.checkpointing.transport import sums_key

logger = logging.getLogger(__name__)

# Parts are named by this many leading path components, e.g.
# "user/default/optim/param_groups": fine enough to say what differs, coarse enough
# to stay a handful of numbers.
PART_DEPTH = 4
# Parts compared per group rank: each rank's fingerprint travels in the
# replica group's quorum request (the lighthouse takes 64 KiB of data).
MAX_PARTS = 48
# A plan's items: a run of sums, or a tensor of the user state by position,
# packed back to back in one bytes value per part. A part is one value of
# the heal's header, not a list of lists: a model of 3000 tensors made 6000
# items, whose encoding and parsing cost the heal tens of milliseconds on
# each side. Sources before the packing sent [tag, ...] lists, still read.
_RUN = "w"
_TENSOR = "t"
_RUN_ITEM = struct.Struct("<cQQQ")  # b"w", s1, s2, words
_TENSOR_ITEM = struct.Struct("<cQQ")  # b"t", position, nbytes


# Containers walked here, in torch's pytree order (dicts in insertion order);
# anything else that is not a plain leaf is left to torch's pytree.
_CONTAINERS = (dict, OrderedDict, list, tuple)
_LEAVES = (int, float, str, bool, bytes, type(None))


def named_leaves(state: Any) -> list[tuple[str, Any]]:
    """``state``'s leaves in ``tree_flatten`` order, each with its part name
    (its first :data:`PART_DEPTH` keys, as :func:`_path_name` spells them).

    The same as ``tree_flatten_with_path`` and :func:`_path_name` for every
    state, and several times as fast on the dicts, lists and tuples states
    are made of: a large model's fingerprint walks thousands of leaves.
    """
    out: list[tuple[str, Any]] = []

    def walk(node: Any, parts: tuple[str, ...]) -> None:
        kind = type(node)
        if kind in _CONTAINERS:
            items = node.items() if kind is dict or kind is OrderedDict else enumerate(node)
            deeper = len(parts) < PART_DEPTH
            for key, child in items:
                walk(child, (*parts, str(key)) if deeper else parts)
        elif kind in _LEAVES or isinstance(node, torch.Tensor):
            out.append(("/".join(parts), node))
        else:  # a named tuple, a registered class...: torch's pytree knows it
            for path, leaf in tree_flatten_with_path(node)[0]:
                names = (*parts, *(_component(entry) for entry in path))
                out.append(("/".join(names[:PART_DEPTH]), leaf))

    walk(state, ())
    return out


def _component(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _path_name(path: tuple[Any, ...]) -> str:
    return "/".join(_component(entry) for entry in path[:PART_DEPTH])


def fold_parts(parts: dict[str, int], max_parts: int) -> dict[str, int]:
    """Combine fine-grained parts into coarser ones until at most ``max_parts`` remain.

    A large model has hundreds of parameters; its fingerprint travels in
    every group rank's quorum request, within the lighthouse's data limit.
    Folding keeps the comparison exact and only makes the report coarser
    (``'model'`` instead of ``'model/layers.3.weight'``).
    """
    depth = PART_DEPTH
    while len(parts) > max_parts and depth > 1:
        depth -= 1
        folded: dict[str, int] = {}
        for name in sorted(parts):
            key = "/".join(name.split("/")[:depth])
            folded[key] = zlib.crc32(f"{name}={parts[name]}".encode(), folded.get(key, 0))
        parts = folded
    return parts


def differing_parts(a: dict[str, int], b: dict[str, int]) -> list[str]:
    """Names of the parts whose fingerprints differ (or exist on one side only)."""
    return sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p))


def _head(digest: WordSum, t: torch.Tensor) -> None:
    digest.add(_head_sums(t.dtype, tuple(t.shape)))


@functools.lru_cache(maxsize=1024)
def _head_sums(dtype: torch.dtype, shape: tuple[int, ...]) -> SegmentSum:
    # A model's tensors share a few shapes: each header is summed once.
    digest = WordSum()
    digest.update(f"{dtype}{shape}".encode())
    return digest.total()


def _feed(digest: WordSum, leaf: Any) -> None:
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach()
        _head(digest, t)
        sum_tensor(digest, t)
    else:
        digest.update(repr(leaf).encode())
        digest.end_segment()


@gc_paused()
def fingerprint(state: Any) -> dict[str, int]:
    """A 64-bit digest of each part of ``state`` (tensor bytes and non-tensor values).

    Cheap: word sums at cache speed, no copies for contiguous CPU tensors,
    small tensors summed together (see
    :func:`~ftdist.checkpointing._wire.tensor_sums`).
    """
    named = named_leaves(state)
    data = iter(tensor_sums([leaf for _, leaf in named if isinstance(leaf, torch.Tensor)]))
    digests: dict[str, WordSum] = {}
    for name, leaf in named:
        digest = digests.setdefault(name, WordSum())
        if isinstance(leaf, torch.Tensor):
            _head(digest, leaf)  # dtype and shape: no detached view needed
            digest.add(next(data))
        else:
            digest.update(repr(leaf).encode())
            digest.end_segment()
    return {name: digest.fold64() for name, digest in digests.items()}


@gc_paused()
def plan(parts: Any, user: Any) -> dict[str, bytes]:
    """The source's side of a heal's check: ``parts``' fingerprint, less the
    tensors ``user`` (the state the heal carries) holds too.

    Each part is a sequence of items (packed, see :func:`plan_items`): a
    run of segments summed here, or the bytes of the tensor at a position
    among ``user``'s leaves. Reads only what the heal does not carry.
    """
    where: dict[tuple[int, int], int] = {}
    for position, (_, leaf) in enumerate(named_leaves(user)):
        key = sums_key(leaf)
        if key is not None:
            where.setdefault(key, position)
    runs: dict[str, WordSum] = {}
    items: dict[str, bytearray] = {}

    def close_run(name: str) -> None:
        run = runs.pop(name, None)
        if run is not None:
            items.setdefault(name, bytearray()).extend(_RUN_ITEM.pack(b"w", *run.total()))

    for name, leaf in named_leaves(parts):
        key = sums_key(leaf)
        if key is None or key not in where:
            _feed(runs.setdefault(name, WordSum()), leaf)
            continue
        _head(runs.setdefault(name, WordSum()), leaf)
        close_run(name)
        items[name].extend(_TENSOR_ITEM.pack(b"t", where[key], key[1]))
    for name in list(runs):
        close_run(name)
    return {name: bytes(packed) for name, packed in items.items()}


def plan_items(entries: Any) -> Iterator[tuple[Any, ...]]:
    """A plan part's items, ``("w", s1, s2, words)`` or ``("t", position,
    nbytes)``, from the packed form or the lists of earlier sources.

    Raises:
        ValueError: an unknown item (``struct.error`` for a truncated one).
    """
    if not isinstance(entries, bytes | bytearray):
        yield from (tuple(entry) for entry in entries)
        return
    at = 0
    while at < len(entries):
        tag = entries[at : at + 1]
        if tag == b"w":
            yield (_RUN, *_RUN_ITEM.unpack_from(entries, at)[1:])
            at += _RUN_ITEM.size
        elif tag == b"t":
            yield (_TENSOR, *_TENSOR_ITEM.unpack_from(entries, at)[1:])
            at += _TENSOR_ITEM.size
        else:
            raise ValueError(f"unknown plan item {tag!r} at byte {at}")


@gc_paused()
def planned(
    the_plan: Any, user: Any, sums: Mapping[tuple[int, int], SegmentSum]
) -> dict[str, int] | None:
    """The receiver's side: the fingerprint a :func:`plan` describes, given
    the received user state and the transport's sums of its tensors.

    A tensor the transport has no sums for is summed here. None when the
    plan does not fit ``user`` (a malformed plan, or a state whose structure
    changed on the way): the check cannot be made, and a warning says so.
    """
    leaves = [leaf for _, leaf in named_leaves(user)]
    out: dict[str, int] = {}
    try:
        for name, entries in dict(the_plan).items():
            digest = WordSum()
            for entry in plan_items(entries):
                if entry[0] == _RUN:
                    digest.add(SegmentSum(*(int(v) for v in entry[1:4])))
                    continue
                position, nbytes = int(entry[1]), int(entry[2])
                leaf = leaves[position] if 0 <= position < len(leaves) else None
                key = sums_key(leaf)
                if entry[0] != _TENSOR or key is None or key[1] != nbytes:
                    raise ValueError(f"item {entry!r} names no carried tensor")
                run = sums.get(key)
                if run is None:
                    own = WordSum()
                    sum_tensor(own, cast(torch.Tensor, leaf))  # sums_key: a tensor
                    run = own.total()
                digest.add(run)
            out[str(name)] = digest.fold64()
    except (TypeError, ValueError, IndexError, KeyError, struct.error) as exc:
        logger.warning("the heal source's consistency plan does not fit what it sent: %s", exc)
        return None
    return fold_parts(out, MAX_PARTS)
