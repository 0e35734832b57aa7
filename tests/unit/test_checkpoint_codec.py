"""The checkpoint header codec and stream format: real training states round-trip exactly,
anything else is refused when sending (naming the leaf) and when receiving (CheckpointError),
and nothing in the package unpickles."""

from __future__ import annotations

import ast
import collections
import io
import json
import random
import struct
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn

from ftdist.checkpointing import _receive, _wire
from ftdist.checkpointing._checksum import WordSum
from ftdist.errors import CheckpointError
from tests.unit.checkpoint_helpers import assert_identical, decode, round_trip, stream_bytes

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ftdist" / "checkpointing"


class Point(NamedTuple):
    x: int
    y: float


def _training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    for opt in (adamw, sgd):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    step_lr = torch.optim.lr_scheduler.StepLR(adamw, step_size=2, gamma=0.5)
    lam = torch.optim.lr_scheduler.LambdaLR(sgd, lambda epoch: 0.9**epoch)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(adamw, max_lr=0.1, total_steps=10)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd)
    for sched in (step_lr, lam, one_cycle):
        sched.step()
    plateau.step(1.0)
    return {
        "model": model.state_dict(),
        "optim": {"adamw": adamw.state_dict(), "sgd": sgd.state_dict()},
        "sched": [s.state_dict() for s in (step_lr, lam, one_cycle, plateau)],
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
        "torchft": {"step": 7, "batches_committed": 14},
        "sampler": {"epoch": 3, "index": 128, "seed": np.int64(5), "frac": np.float32(0.25)},
    }


def test_real_training_states_round_trip_exactly_and_load() -> None:
    state = _training_state()
    got = round_trip(state, step=3)
    assert_identical(state, got)
    # And the received state loads where it came from.
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))
    model.load_state_dict(got["model"])
    torch.optim.AdamW(model.parameters()).load_state_dict(got["optim"]["adamw"])
    torch.optim.SGD(model.parameters(), lr=1).load_state_dict(got["optim"]["sgd"])
    random.setstate(got["rng"]["python"])
    np.random.set_state(got["rng"]["numpy"])
    torch.set_rng_state(got["rng"]["torch"])
    assert got["model"]._metadata == state["model"]._metadata  # module versions travel


def test_plain_values_and_containers_round_trip() -> None:
    w = torch.randn(6, 5)
    state: dict[Any, Any] = {
        "none": None,
        "flags": [True, False],
        "ints": (0, -1, 2**70),
        "floats": [1.0, -0.0, float("inf"), float("nan"), 1e-310],
        "text": "héllo \udc80 \x00",
        "bytes": b"\x00\xff",
        "bytearray": bytearray(b"ab"),
        "complex": 1 - 2j,
        "set": {1, "a"},
        "frozenset": frozenset({(1, 2)}),
        "odict": collections.OrderedDict([("b", 1), ("a", 2)]),
        ("tuple", 1): "tuple keys",
        3: "int keys",
        None: "None key",
        "point": Point(1, 2.5),
        "size": torch.Size([2, 3]),
        "dtypes": [torch.bfloat16, torch.qint8],
        "device": torch.device("cuda", 1),
        "numpy": [np.bool_(True), np.uint16(7), np.float16(0.5), np.complex64(1j)],
        "array": np.arange(6, dtype=np.int16).reshape(2, 3),
        "tensors": {
            "w": w,
            "transposed": w.t(),
            "slice": w[:, 1:3],
            "expanded": torch.ones(3, 1).expand(3, 4),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 3),
            "bool": torch.tensor([True, False]),
            "complex": torch.randn(3, dtype=torch.complex64),
            "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
            "param": nn.Parameter(torch.randn(3)),
            "frozen": nn.Parameter(torch.randn(3), requires_grad=False),
            "conj": torch.randn(2, dtype=torch.complex64).conj(),
        },
    }
    got = round_trip(state, step=-5)
    state["tensors"]["slice"] = state["tensors"]["slice"].contiguous()  # gaps travel row-major
    state["tensors"]["expanded"] = state["tensors"]["expanded"].contiguous()
    state["tensors"]["conj"] = state["tensors"]["conj"].resolve_conj()
    assert_identical(state, got)
    assert type(got["point"]) is Point  # the receiver's own class, found without importing
    assert got["tensors"]["transposed"].stride() == (1, 5)  # arrived transposed, no copy


def test_chunks_carry_disjoint_tensors_and_merge() -> None:
    state = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(7)} | {"meta": [1, "x"]}
    streams = _wire.plan(state, 2, num_chunks=3)
    carried = [len(s.tensors) for s in streams]
    assert carried == [3, 2, 2]
    assert_identical(state, round_trip(state, step=2, num_chunks=3))


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize(
    ("state", "where", "what"),
    [
        ({"opt": {"sched": lambda: 0}}, "state_dict['opt']['sched']", "function"),
        ({"a": [1, object()]}, "state_dict['a'][1]", "object"),
        ({"t": torch.zeros(2).as_subclass(_Sub)}, "state_dict['t']", "_Sub"),
        ({"s": torch.zeros(3).to_sparse()}, "state_dict['s']", "sparse"),
        ({"k": {torch.zeros(1): 1}}, "state_dict['k']", "key"),
        ({"d": collections.defaultdict(list)}, "state_dict['d']", "defaultdict"),
        ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, "['q']", "tensor"),
        ({"m": torch.empty(2, device="meta")}, "state_dict['m']", "meta"),
        ({"a": np.array(["x"])}, "state_dict['a']", "numpy array"),
    ],
)
def test_send_refuses_what_cannot_travel_naming_the_leaf(state: Any, where: str, what: str) -> None:
    with pytest.raises(TypeError, match="cannot send") as info:
        _wire.plan(state, 1)
    assert where in str(info.value) and what in str(info.value)


def test_send_refuses_cycles_and_non_int_steps() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(TypeError, match="deeper than"):
        _wire.plan({"loop": loop}, 1)
    with pytest.raises(TypeError, match="step must be an int"):
        _wire.plan({}, 1.0)  # type: ignore[arg-type]


def _stream_with_header(doc: Any, body: bytes = b"", crc: int | None = None) -> bytes:
    raw = json.dumps(doc).encode()
    prefix = struct.pack(
        "<8sQQII", _wire.MAGIC, len(raw), len(body), zlib.crc32(raw) if crc is None else crc, 0
    )
    head = prefix + raw + body
    digest = WordSum()
    digest.update(body)  # one tensor at most: one segment
    return head + struct.pack("<QQQ", len(head), *digest.digest())


def _valid_doc() -> dict[str, Any]:
    data = stream_bytes({"w": torch.ones(2), "n": [1, "a"]})[0]
    (length,) = struct.unpack_from("<Q", data, 8)
    return dict(json.loads(data[_wire.PREFIX_BYTES : _wire.PREFIX_BYTES + length]))


_PAYLOAD = "cos\nsystem\n(S'echo pwned'\ntR."


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d["tree"][1].append(["x", ["pickle", _PAYLOAD]]), "unknown tag"),
        (lambda d: d["tree"][1].append(["x", {"__reduce__": _PAYLOAD}]), "without a tag"),
        (lambda d: d["tensors"][0].update(dtype="object"), "unknown dtype"),
        (lambda d: d["tensors"][0].update(shape=[-1]), "shape"),
        (lambda d: d["tensors"][0].update(shape=[2, 2], stride=[1, 1]), "densely"),
        (lambda d: d["tensors"][0].update(shape=[1 << 40, 1 << 40], stride=[1 << 40, 1]), "claims"),
        (lambda d: d["tensors"][0].update(kind="pickle"), "unknown kind"),
        (lambda d: d["tensors"][0].update(device="cuda:0; rm"), "device"),
        (lambda d: d["tensors"][0].update(extra=1), "fields"),
        (lambda d: d["tensors"].append(d["tensors"][0]), "not in the tree"),
        (lambda d: d["tree"][1].append(["y", ["T", 0]]), "repeated"),
        (lambda d: d["tree"][1].append(["z", ["T", 9]]), "invalid"),
        (lambda d: d.update(carried=[0, 0]), "repeats"),
        (lambda d: d.update(step="1"), "step"),
        (lambda d: d.update(format=2), "version-3"),
        (lambda d: d["tree"][1].append([["dict", []], 1]), "unhashable"),
        (lambda d: d["tree"][1].append([["bytes", "!!"], 1]), "bytes"),
        (lambda d: d["tree"][1].append([1, 2, 3]), "pair"),
        (lambda d: d["tree"][1].append(["n", 2]), "repeats a key"),
    ],
)
def test_receive_refuses_malformed_headers(change: Any, match: str) -> None:
    doc = _valid_doc()
    change(doc)
    body = b"" if doc["tensors"][0]["shape"] != [2] else b"\0" * 8
    with pytest.raises(CheckpointError, match=match):
        decode(_stream_with_header(doc, body))


def test_named_tuples_are_looked_up_never_imported_or_called() -> None:
    import os
    import sys

    doc = _valid_doc()
    tree = doc["tree"][1]
    tree.append(["nt", ["ntuple", "ftdist_never_imported", "Pair", ["a"], [["list", []]]]])
    tree.append(["sys", ["ntuple", "os", "system", ["cmd"], ["echo pwned"]]])
    header, tensors = decode(_stream_with_header(doc, b"\0" * 8))
    got = _receive.assemble(header, tensors)
    assert type(got["nt"]).__name__ == "Pair" and got["nt"].a == []
    assert "ftdist_never_imported" not in sys.modules
    # os.system is no named tuple class: an inert tuple is made in its place.
    assert tuple(got["sys"]) == ("echo pwned",) and type(got["sys"]) is not os.system


def test_the_header_crc_is_checked_before_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_parsing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the header was parsed before its CRC was checked")

    data = _stream_with_header(_valid_doc(), b"\0" * 8, crc=12345)
    monkeypatch.setattr(_wire.json, "loads", no_parsing)
    with pytest.raises(CheckpointError, match=r"header .* is corrupt"):
        decode(data)


def test_a_long_header_is_refused_before_it_is_read() -> None:
    prefix = struct.pack("<8sQQII", _wire.MAGIC, _wire.MAX_HEADER_BYTES + 1, 0, 0, 0)
    stream = io.BytesIO(prefix + b"x" * 100)
    reader = _wire.StreamReader(stream.readinto, "test")
    with pytest.raises(CheckpointError, match="at most"):
        reader.read_header()
    assert stream.tell() == len(prefix)  # nothing past the prefix was read


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"FTDSTCK1" + bytes(40), "older ftdist checkpoint format"),
        (b"FTDCKPT2" + bytes(40), "older ftdist checkpoint format"),
        (b"GET / HTTP/1.0\r\n\r\n" + bytes(40), "did not send an ftdist checkpoint"),
        (struct.pack("<8sQQII", _wire.MAGIC, 0, 0, 0, 0), "header of 0 bytes"),
    ],
)
def test_receive_refuses_other_streams(data: bytes, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        decode(data)


def test_stream_size_must_match_what_the_transport_announced() -> None:
    data = stream_bytes({"w": torch.ones(4)})[0]
    reader = _wire.StreamReader(io.BytesIO(data).readinto, "test")
    with pytest.raises(CheckpointError, match="prefix announces"):
        _receive.read_leaves(reader, 1, size=len(data) + 1)


def test_nothing_in_the_package_unpickles_or_evaluates() -> None:
    forbidden_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            assert not names & forbidden_modules, f"{path.name} imports {names}"
            if isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                assert func not in ("eval", "exec", "__import__"), f"{path.name} calls {func}"
                assert not func.endswith(("torch.load", "Unpickler", "import_module")), func
                assert "weights_only" not in ast.unparse(node), f"{path.name}: {ast.unparse(node)}"
