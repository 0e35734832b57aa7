"""Property tests of the checkpoint stream decoder (Hypothesis).

Valid states round-trip exactly; random, mutated and truncated bytes, and
headers that pass their CRC but say anything at all, fail with
CheckpointError and nothing else, and never make the decoder allocate more
than the stream it was given.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftdist.checkpointing import _receive, _wire
from ftdist.errors import CheckpointError
from tests.unit.checkpoint_helpers import assert_identical, round_trip, stream_bytes

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_DTYPES = [torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool, torch.bfloat16]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    t = (torch.rand(shape, generator=g) * 100).to(dtype)
    if t.dim() == 2 and draw(st.booleans()):
        t = t.t()  # a dense non-contiguous layout travels as is
    return t


_keys = st.one_of(st.text(max_size=8), st.integers(-(2**70), 2**70))
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.complex_numbers(allow_nan=False),
)
states = st.recursive(
    st.one_of(_scalars, tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_keys, children, max_size=4),
    ),
    max_leaves=20,
)


@contextmanager
def counting_allocations() -> Iterator[list[int]]:
    """Record the bytes of every tensor the decoder allocates."""
    sizes: list[int] = []
    original = _receive.allocate

    def allocate(meta: Any, device: torch.device, reserve: Any = None) -> torch.Tensor:
        sizes.append(meta.nbytes)
        return original(meta, device, reserve)

    _receive.allocate = allocate
    try:
        yield sizes
    finally:
        _receive.allocate = original


def _decode_only_checkpoint_errors(data: bytes, step: int = 1, size: int | None = None) -> Any:
    reader = _wire.StreamReader(io.BytesIO(data).readinto, "fuzz")
    try:
        header, got = _receive.read_leaves(reader, step, size=size)
        return _receive.assemble(header, got)
    except CheckpointError:
        return None


@SETTINGS
@given(state=states, step=st.integers(-(2**63), 2**63 - 1), chunks=st.integers(1, 3))
def test_valid_states_round_trip_exactly(state: Any, step: int, chunks: int) -> None:
    assert_identical({"s": state}, round_trip({"s": state}, step, chunks))


@SETTINGS
@given(data=st.binary(max_size=4096), magic=st.booleans())
def test_random_bytes_fail_with_checkpoint_error_only(data: bytes, magic: bool) -> None:
    if magic:  # get past the magic check, into the length and header parsing
        data = _wire.MAGIC + data
    with counting_allocations() as sizes:
        assert _decode_only_checkpoint_errors(data) is None
    assert sizes == []


@SETTINGS
@given(
    state=states,
    kind=st.sampled_from(["flip", "truncate", "insert", "delete"]),
    where=st.floats(0, 1),
    byte=st.integers(1, 255),
)
def test_mutated_streams_fail_with_checkpoint_error_only(
    state: Any, kind: str, where: float, byte: int
) -> None:
    original = stream_bytes({"s": state})[0]
    at = min(int(where * len(original)), len(original) - 1)
    data = bytearray(original)
    if kind == "flip":
        data[at] ^= byte
    elif kind == "truncate":
        del data[at:]
    elif kind == "insert":
        data[at:at] = bytes([byte])
    else:
        del data[at : at + byte]
    with counting_allocations() as sizes:
        got = _decode_only_checkpoint_errors(bytes(data))
    assert got is None, "a damaged stream was accepted"
    assert sum(sizes) <= len(original)


def _json_values() -> st.SearchStrategy[Any]:
    return st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**64), 2**64),
            st.floats(),
            st.text(max_size=10),
            st.sampled_from(["T", "dict", "odict", "list", "tuple", "set", "ntuple", "bytes",
                             "size", "dtype", "device", "np", "complex", "float32", "cpu"]),
        ),
        lambda children: st.one_of(
            st.lists(children, max_size=5),
            st.dictionaries(st.text(max_size=6), children, max_size=4),
        ),
        max_leaves=25,
    )  # fmt: skip


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, list):
        for i, child in enumerate(node):
            out += _paths(child, (*path, i))
    elif isinstance(node, dict):
        for k, child in node.items():
            out += _paths(child, (*path, k))
    return out


def _replace(node: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node[path[0]] = _replace(node[path[0]], path[1:], value)
    return node


def _with_valid_crcs(header: bytes, body: bytes, sums: tuple[int, int]) -> bytes:
    prefix = struct.pack("<8sQQII", _wire.MAGIC, len(header), len(body), zlib.crc32(header), 0)
    head = prefix + header + body
    return head + struct.pack("<QQQ", len(head), *sums)


@SETTINGS
@given(state=states, pick=st.floats(0, 1), value=_json_values())
def test_headers_with_valid_crcs_saying_anything_fail_cleanly(
    state: Any, pick: float, value: Any
) -> None:
    original = stream_bytes({"s": state})[0]
    (length, body_len) = struct.unpack_from("<QQ", original, 8)
    doc = json.loads(original[_wire.PREFIX_BYTES : _wire.PREFIX_BYTES + length])
    paths = _paths(doc)
    doc = _replace(doc, paths[min(int(pick * len(paths)), len(paths) - 1)], value)
    body = original[_wire.PREFIX_BYTES + length : _wire.PREFIX_BYTES + length + body_len]
    # The body is unchanged: its sums in the original trailer still hold.
    sums = struct.unpack_from("<QQ", original, len(original) - 16)
    data = _with_valid_crcs(json.dumps(doc).encode(), body, sums)
    with counting_allocations() as sizes:
        _decode_only_checkpoint_errors(data)  # any outcome but another exception
    assert sum(sizes) <= len(data)


@SETTINGS
@given(
    sizes=st.lists(
        st.one_of(
            st.integers(0, 64),
            st.integers(0, _wire.SMALL_TENSOR_BYTES - 1),
            st.integers(_wire.SMALL_TENSOR_BYTES, 3 * _wire.BATCH_BYTES),
        ),
        max_size=3000,
    )
)
def test_runs_batch_small_tensors_and_leave_large_ones_alone(sizes: list[int]) -> None:
    # The process-group wire: both ends must cut the same runs, and each run
    # must fit a staging buffer of BATCH_BYTES + SMALL_TENSOR_BYTES.
    lengths = _wire.runs(sizes)
    assert sum(lengths) == len(sizes) and all(n >= 1 for n in lengths)
    pos = 0
    for k, n in enumerate(lengths):
        run = sizes[pos : pos + n]
        pos += n
        if run[0] >= _wire.SMALL_TENSOR_BYTES:
            assert n == 1
            continue
        assert all(size < _wire.SMALL_TENSOR_BYTES for size in run)
        assert n <= _wire.MOST_BATCHED
        assert sum(run) < _wire.BATCH_BYTES + _wire.SMALL_TENSOR_BYTES
        assert sum(run[:-1]) < _wire.BATCH_BYTES and n - 1 < _wire.MOST_BATCHED
        # A batch ends early only at a large tensor or at the end.
        full = sum(run) >= _wire.BATCH_BYTES or n == _wire.MOST_BATCHED
        assert full or pos == len(sizes) or sizes[pos] >= _wire.SMALL_TENSOR_BYTES, k


_SUM_SHAPES = st.sampled_from(
    [(0,), (3,), (5, 7), (128,), (2048,), (1024, 2), (4096,), (3, 2048), (70000,), (300,)]
)


@SETTINGS
@given(
    shapes=st.lists(
        st.tuples(_SUM_SHAPES, st.booleans(), st.sampled_from(["f32", "f32", "f16", "i8"])),
        min_size=2,
        max_size=16,
    ),
    piece=st.sampled_from([1, 3 * 8192, 4 << 20]),
    stack_most=st.sampled_from([0, 8192, 1 << 20]),
    join_below=st.sampled_from([0, 64, 64 << 10]),
)
def test_tensor_sums_equal_each_tensors_own_whatever_the_grouping(
    shapes: list[tuple[tuple[int, ...], bool, str]], piece: int, stack_most: int, join_below: int
) -> None:
    # tensor_sums groups plain host tensors by size, wherever they stand:
    # small ones joined, same-size ones side by side, the rest one by one.
    # Each tensor's sums must be its own, in the list's order.
    from unittest import mock

    from ftdist.checkpointing._checksum import WordSum

    dtypes = {"f32": torch.float32, "f16": torch.float16, "i8": torch.int8}
    g = torch.Generator().manual_seed(len(shapes))
    tensors = []
    for shape, transposed, dtype in shapes:
        t = (torch.randn(shape, generator=g) * 50).to(dtypes[dtype])
        tensors.append(t.t() if transposed and t.dim() == 2 else t)
    want = []
    for t in tensors:
        digest = WordSum()
        _wire.sum_tensor(digest, t)
        want.append(digest.total())
    with (
        mock.patch.object(_wire, "PIECE_BYTES", piece),
        mock.patch.object(_wire, "STACK_MOST", stack_most),
        mock.patch.object(_wire, "JOIN_BELOW", join_below),
    ):
        assert _wire.tensor_sums(tensors) == want


def test_tensor_sums_of_alternating_layers_are_each_tensors_own() -> None:
    # A model's order: weights of one size side by side, biases joined, a
    # large tensor alone, every list position kept.
    from ftdist.checkpointing._checksum import WordSum

    g = torch.Generator().manual_seed(3)
    tensors = []
    for _ in range(40):
        tensors += [torch.randn(128, 128, generator=g), torch.randn(128, generator=g)]
    tensors += [torch.randn(400_000, generator=g), torch.randn(128, 128, generator=g)]
    want = []
    for t in tensors:
        digest = WordSum()
        _wire.sum_tensor(digest, t)
        want.append(digest.total())
    assert _wire.tensor_sums(tensors) == want
