"""``examples/train_ddp.py`` as the README runs it: one real torchrun per
replica group, two groups of two ranks each, against a real lighthouse."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests import _diagnostics
from tests._procs import processes_with
from tests.integration.lighthouse_helpers import Lighthouses

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_ddp.py"
STEPS = 20
LINE = re.compile(
    r"^replica group (\d+) rank (\d+): step (\d+) sha256 ([0-9a-f]{64})$", re.MULTILINE
)
# torchrun starts each worker in a session of its own, so killing torchrun's
# process group misses them; the workers are found by this variable instead.
TAG = "FTDIST_TEST_EXAMPLE_TAG"


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries ``TAG=tag``."""
    return processes_with(f"{TAG}={tag}")


def _kill_all(procs: list[subprocess.Popen[Any]], tag: str) -> None:
    _diagnostics.before_kill()
    # Workers first: killed torchruns would leave them orphaned, not dead.
    for pid in _tagged(tag):
        if pid not in {p.pid for p in procs}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)


def test_two_replica_groups_of_two_ranks_end_bit_identical(lh: Lighthouses, tmp_path: Path) -> None:
    # min_replicas=2: both groups take every step together, so a group that
    # starts late cannot make the other train (and finish) alone.
    lighthouse = lh.server(min_replicas=2, join_timeout_ms=200)
    tag = uuid.uuid4().hex
    procs: list[subprocess.Popen[Any]] = []
    logs: list[tuple[Path, Path]] = []
    try:
        for group in (0, 1):
            env = {
                **os.environ,
                TAG: tag,
                "FTDIST_LIGHTHOUSE": lighthouse.address(),
                "REPLICA_GROUP_ID": str(group),
                "NUM_REPLICA_GROUPS": "2",
                "OMP_NUM_THREADS": "1",
            }
            out, err = tmp_path / f"group{group}.out", tmp_path / f"group{group}.err"
            logs.append((out, err))
            _diagnostics.watch(out, f"replica group {group}: torchrun stdout")
            _diagnostics.watch(err, f"replica group {group}: torchrun stderr")
            with open(out, "wb") as stdout, open(err, "wb") as stderr:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "torch.distributed.run",
                            "--standalone",
                            "--nproc-per-node",
                            "2",
                            str(EXAMPLE),
                            "--steps",
                            str(STEPS),
                        ],
                        cwd=REPO,
                        env=env,
                        stdout=stdout,
                        stderr=stderr,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + 90
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [proc.returncode for proc in procs]
        stderr_tails = [err.read_text(errors="replace")[-3000:] for _, err in logs]
        assert codes == [0, 0], f"torchrun exit codes {codes}; stderr:\n" + "\n".join(stderr_tails)
        # torchrun reaps its workers before it exits.
        assert _tagged(tag) == []

        reports = {}
        for group, (out, _) in enumerate(logs):
            for g, rank, step, digest in LINE.findall(out.read_text()):
                assert int(g) == group
                reports[(group, int(rank))] = (int(step), digest)
        assert sorted(reports) == [(0, 0), (0, 1), (1, 0), (1, 1)], reports
        assert {step for step, _ in reports.values()} == {STEPS}, reports
        # Gradients are averaged across the groups and then within each
        # group, so every rank of every group holds the same bits, not only
        # rank r of each group.
        assert len({digest for _, digest in reports.values()}) == 1, reports
    finally:
        _kill_all(procs, tag)
