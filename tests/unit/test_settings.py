"""Every environment variable ftdist reads is spelled out, read in a config
module, and listed in docs/configuration.md (the house rule for settings)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "ftdist"
DOC = ROOT / "docs" / "configuration.md"
NAME = re.compile(r"^(FTDIST|TORCHFT)_[A-Z0-9_]+$")
# The modules that may touch os.environ, and why: each package's config
# module reads its settings; the others write a child's environment or are
# top-level modules whose one variable is read where it is used.
READERS = {
    "manager/config.py": "the Manager's settings",
    "lighthouse/config.py": "the lighthouse's settings and the lighthouse address",
    "launch/config.py": "the launcher's settings",
    "process_group/config.py": "the process groups' settings",
    "local_sgd/config.py": "LocalSGD's settings",
    "checkpointing/config.py": "the checkpoint transports' settings",
    "coordinator/config.py": "the coordinator's settings",
    "_auth.py": "the job token and TLS files (read in one place for every server)",
    "_advertise.py": "the advertised address (read in one place for every server)",
    "futures.py": "the watchdog interval",
    "otel.py": "OpenTelemetry export",
    "launch/dist_env.py": "torch.distributed's variables of a launched child (read and set)",
    "launch/children.py": "sets a child's environment",
    "launch/launcher.py": "saves and restores the environment around a launch",
    "launch/process.py": "sets TORCHELASTIC_RESTART_COUNT in a restarted child",
    "launch/ranks.py": "sets a rank's environment",
    "chaos/worker.py": "sets GLOO_SOCKET_IFNAME and TORCHELASTIC_RESTART_COUNT in a trainer",
    "etcd/local.py": "FTDIST_ETCD_BIN (which etcd server to run); a member's environment",
    "lighthouse/local.py": "passes its environment to the lighthouse replicas it starts",
}


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _names_in_code() -> set[str]:
    names = set()
    for text in _sources().values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if NAME.match(node.value):
                    names.add(node.value)
    return names


def test_every_variable_in_the_code_is_documented_and_back() -> None:
    documented = set(re.findall(r"`((?:FTDIST|TORCHFT)_[A-Z0-9_]+)`", DOC.read_text()))
    in_code = _names_in_code()
    assert not in_code - documented, f"add to docs/configuration.md: {sorted(in_code - documented)}"
    assert not documented - in_code, f"documented but never read: {sorted(documented - in_code)}"


def test_no_variable_name_is_built_by_concatenation() -> None:
    prefixes = ("FTDIST_", "TORCHFT_")
    offenders = []
    for module, text in _sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and node.value in prefixes:
                offenders.append(f"{module}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.JoinedStr) and node.values:
                first = node.values[0]
                if (
                    isinstance(first, ast.Constant)
                    and isinstance(first.value, str)
                    and first.value.startswith(prefixes)
                    and len(node.values) > 1
                    and not any(c in first.value for c in " =/:.(")
                ):
                    offenders.append(f"{module}:{node.lineno} f-string {first.value!r}...")
    assert not offenders, offenders


def test_only_config_modules_read_the_environment() -> None:
    touching = {
        module
        for module, text in _sources().items()
        if "os.environ" in text.replace("``os.environ``", "") or "getenv(" in text
    }
    assert touching <= set(READERS), (
        f"read settings in the package's config module instead: {sorted(touching - set(READERS))}"
    )
    assert not set(READERS) - touching, f"no longer touch os.environ: {set(READERS) - touching}"
