"""No deserializer that runs code on bytes from the network.

The scan reads every module of ``src/ftdist`` as a syntax tree (comments and
strings do not count) and fails, naming file and line, on: ``pickle.load(s)``
and ``pickle.Unpickler`` (also ``_pickle``, ``cPickle``, ``dill``,
``cloudpickle``), ``marshal.load(s)``, ``shelve.open``, ``torch.load`` without
``weights_only=True``, ``numpy.load`` with ``allow_pickle=True``,
``yaml.load``/``unsafe_load``, ``eval``, ``exec``, and the stdlib's
pickling channels (``multiprocessing`` ``Pipe``, ``Listener``, ``Client``),
whose ``recv`` unpickles. Each allowed use is listed below with why it does
not take bytes from the network; an entry that no longer matches anything
fails too, so the list cannot go stale.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ftdist"

PICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle"}
# (module, attribute) calls that deserialize arbitrary objects.
DANGEROUS_ATTRS = {
    **{(m, "loads"): "unpickles" for m in PICKLERS},
    **{(m, "load"): "unpickles" for m in PICKLERS},
    **{(m, "Unpickler"): "unpickles" for m in PICKLERS},
    ("marshal", "loads"): "unmarshals code objects",
    ("marshal", "load"): "unmarshals code objects",
    ("shelve", "open"): "unpickles",
    ("yaml", "load"): "may construct arbitrary objects",
    ("yaml", "unsafe_load"): "constructs arbitrary objects",
}
BUILTINS = {"eval": "runs a string as code", "exec": "runs a string as code"}
# Channels whose recv() unpickles what the other end sent.
CHANNELS = {"Pipe", "Listener", "Client"}

# (path under src/ftdist, what was found) -> why it is safe.
ALLOWED: dict[tuple[str, str], str] = {
    (
        "process_group/_baby_proc.py",
        "Pipe",
    ): "the pipe between a Baby process group and the child process it forks itself "
    "(a socketpair both ends of which belong to one user's processes on one host); "
    "no network peer can write to it",
    (
        "launch/ranks.py",
        "Pipe",
    ): "the result pipe between the rank launcher and the ranks it forks (tests, "
    "benchmarks, the demo): local processes of one user",
    (
        "coordinator/group.py",
        "pickle.loads",
    ): "vLLM's GroupCoordinator contract: send_object/recv_object carry arbitrary Python "
    "objects between the ranks of one job over the job's own process group, as "
    "torch.distributed's *_object collectives do (they pickle too)",
    (
        "coordinator/mq_core.py",
        "pickle.loads",
    ): "vLLM's MessageQueue contract: it broadcasts Python objects from the job's writer rank "
    "to its readers; local readers share memory only this user can open, remote ones "
    "a CurveZMQ socket whose key is exchanged over the job's own process group",
}


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(
        kw.arg == name and isinstance(kw.value, ast.Constant) and kw.value.value is value
        for kw in call.keywords
    )


def _findings(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, what, why) for every dangerous call or import in ``tree``."""
    found: list[tuple[int, str, str]] = []
    # Names bound by `from pickle import loads` and the like.
    imported: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            for alias in node.names:
                key = (root, alias.name)
                if key in DANGEROUS_ATTRS or (
                    node.module.startswith("multiprocessing") and alias.name in CHANNELS
                ):
                    imported[alias.asname or alias.name] = key
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        parts = name.split(".")
        head, last = parts[0], parts[-1]
        what = why = None
        if name in BUILTINS:
            what, why = name, BUILTINS[name]
        elif name in imported:
            module, attr = imported[name]
            if (module, attr) in DANGEROUS_ATTRS:
                what, why = f"{module}.{attr}", DANGEROUS_ATTRS[(module, attr)]
            else:
                what, why = attr, "a multiprocessing channel: its recv() unpickles"
        elif len(parts) >= 2 and (head, last) in DANGEROUS_ATTRS:
            what, why = f"{head}.{last}", DANGEROUS_ATTRS[(head, last)]
        elif name in ("torch.load",) and not _keyword_is(node, "weights_only", True):
            what, why = "torch.load", "unpickles unless weights_only=True"
        elif name in ("np.load", "numpy.load") and _keyword_is(node, "allow_pickle", True):
            what, why = "numpy.load", "unpickles with allow_pickle=True"
        elif (
            len(parts) >= 2
            and last in CHANNELS
            and ("multiprocessing" in parts or "mp" in parts or "ctx" in parts or "mpc" in parts)
        ):
            what, why = last, "a multiprocessing channel: its recv() unpickles"
        if what is not None and why is not None:
            found.append((node.lineno, what, why))
    return found


def _scan() -> dict[tuple[str, str], list[tuple[int, str]]]:
    hits: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("_rpc/_proto/"):  # generated by protoc
            continue
        for line, what, why in _findings(ast.parse(path.read_text(), filename=str(path))):
            hits.setdefault((rel, what), []).append((line, why))
    return hits


def test_no_code_running_deserializer_outside_the_allowlist() -> None:
    hits = _scan()
    unexpected = [
        f"src/ftdist/{rel}:{line}: {what} ({why})"
        for (rel, what), places in sorted(hits.items())
        if (rel, what) not in ALLOWED
        for line, why in places
    ]
    assert not unexpected, (
        "deserializers that can run code on received bytes (use JSON, protobuf or "
        "torch.load(weights_only=True); or add a justified ALLOWED entry):\n"
        + "\n".join(unexpected)
    )


def test_allowlist_has_no_stale_entries() -> None:
    stale = sorted(set(ALLOWED) - set(_scan()))
    assert not stale, f"ALLOWED entries that match nothing any more; remove them: {stale}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import pickle\npickle.loads(b'')", "pickle.loads"),
        ("from pickle import loads as l\nl(b'')", "pickle.loads"),
        ("import torch\ntorch.load(f)", "torch.load"),
        ("import torch\ntorch.load(f, weights_only=False)", "torch.load"),
        ("eval('1')", "eval"),
        ("exec('x=1')", "exec"),
        ("import marshal\nmarshal.loads(b'')", "marshal.loads"),
        ("import multiprocessing as mp\nmp.Pipe()", "Pipe"),
        ("from multiprocessing.connection import Listener\nListener(('h', 1))", "Listener"),
        ("import numpy as np\nnp.load(f, allow_pickle=True)", "numpy.load"),
    ],
)
def test_the_scan_finds_each_pattern(source: str, expected: str) -> None:
    assert [what for _, what, _ in _findings(ast.parse(source))] == [expected]


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load(f, weights_only=True)",
        "import json\njson.loads('{}')",
        "# pickle.loads(data) in a comment\nx = 'eval(1)'",
        "model.eval()",
        "import numpy as np\nnp.load(f)",
    ],
)
def test_the_scan_passes_safe_code(source: str) -> None:
    assert _findings(ast.parse(source)) == []
