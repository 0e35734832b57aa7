"""torchft users' scripts, of both API generations, run on ftdist with only the
import changed: two replica groups under ``torchrun --max-restarts``, one
trainer SIGKILLed mid-run and restarted by torchrun; both groups end at the
same step with identical weights."""

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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HERE = Path(__file__).resolve().parent / "torchft_scripts"
REPO = HERE.parents[2]
# Enough steps after KILL_AT that the kill lands mid-run on a loaded machine.
STEPS = 40
KILL_AT = 6
FINAL = re.compile(r"^replica group (\d+): step (\d+) sha256 ([0-9a-f]{64})$", re.MULTILINE)
STEP = re.compile(r"^\[(\d+)\] loss = ", re.MULTILINE)
TAG = "FTDIST_TEST_TORCHFT_SCRIPT_TAG"


def _workers(tag: str, group: int) -> list[int]:
    """The trainer processes (not torchrun) of one replica group."""
    tagged = set(processes_with(f"{TAG}={tag}"))
    return sorted(
        tagged
        & set(processes_with(f"REPLICA_GROUP_ID={group}"))
        & set(processes_with("LOCAL_RANK=0"))
    )


def _stop(procs: list[subprocess.Popen[Any]], tag: str) -> None:
    _diagnostics.before_kill()
    for pid in processes_with(f"{TAG}={tag}"):
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


@pytest.mark.parametrize("script", ["seed_train_ddp.py", "today_train_ddp.py"])
def test_a_torchft_script_runs_unchanged_but_the_import(
    lh: Lighthouses, tmp_path: Path, script: str
) -> None:
    # min_replicas=2: the groups take every step together, so the one that
    # keeps running waits for the restarted one instead of finishing alone.
    lighthouse = lh.server(min_replicas=2, join_timeout_ms=200)
    tag = uuid.uuid4().hex
    procs: list[subprocess.Popen[Any]] = []
    outs: list[Path] = []
    errs: list[Path] = []
    try:
        for group in (0, 1):
            env = {
                **os.environ,
                TAG: tag,
                # torchft's variable: launch scripts stay as they are.
                "TORCHFT_LIGHTHOUSE": lighthouse.address(),
                "REPLICA_GROUP_ID": str(group),
                "NUM_REPLICA_GROUPS": "2",
                "STEPS": str(STEPS),
                "OMP_NUM_THREADS": "1",
            }
            env.pop("FTDIST_LIGHTHOUSE", None)
            outs.append(tmp_path / f"group{group}.out")
            errs.append(tmp_path / f"group{group}.err")
            _diagnostics.watch(outs[-1], f"replica group {group}: torchrun stdout")
            _diagnostics.watch(errs[-1], f"replica group {group}: torchrun stderr")
            with open(outs[-1], "wb") as stdout, open(errs[-1], "wb") as stderr:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", "1", "--max-restarts", "3", str(HERE / script)],
                        cwd=REPO, env=env, stdout=stdout, stderr=stderr,
                        start_new_session=True,
                    )
                )  # fmt: skip
        # SIGKILL group 1's trainer once it committed a few steps. Its pid is
        # found while it starts, not after: on a loaded machine the scan of
        # every process's environment took long enough for the trainer to
        # run its last steps and print its digest first, and torchrun then
        # restarted it into a job whose other group had finished (a hang).
        deadline = time.monotonic() + 120
        victims: list[int] = []
        while True:
            if not victims:
                found = _workers(tag, 1)
                # Exactly one: a short-lived child of the starting trainer
                # (a helper run through subprocess) carries its environment too.
                victims = found if len(found) == 1 else []
            steps = [int(s) for s in STEP.findall(outs[1].read_text(errors="replace"))]
            if victims and steps and max(steps) >= KILL_AT:
                break
            assert time.monotonic() < deadline, errs[1].read_text(errors="replace")[-3000:]
            assert procs[1].poll() is None, errs[1].read_text(errors="replace")[-3000:]
            time.sleep(0.05)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        assert not FINAL.search(outs[1].read_text(errors="replace")), (
            "group 1's trainer finished all its steps before the kill landed: the test was "
            "too slow to kill it mid-run"
        )

        for proc in procs:
            proc.wait(timeout=max(1.0, deadline + 60 - time.monotonic()))
        codes = [p.returncode for p in procs]
        tails = [e.read_text(errors="replace")[-3000:] for e in errs]
        assert codes == [0, 0], f"torchrun exit codes {codes}:\n" + "\n".join(tails)
        finals = {}
        for group, out in enumerate(outs):
            for g, step, digest in FINAL.findall(out.read_text()):
                assert int(g) == group
                finals[group] = (int(step), digest)
        assert sorted(finals) == [0, 1], finals
        assert {step for step, _ in finals.values()} == {STEPS}, finals
        assert len({digest for _, digest in finals.values()}) == 1, finals
        # The restarted trainer healed forward instead of starting over.
        restarted = [int(s) for s in STEP.findall(outs[1].read_text())]
        assert restarted.count(1) <= 1 or max(restarted) == STEPS, restarted
        # torchrun's restart logs at INFO, which it does not print; the
        # restarted trainer's heal line says it came back and healed forward.
        heals = [
            int(step)
            for step in re.findall(
                r"healed from replica rank\(s\) \[\d+\] at step (\d+)",
                errs[1].read_text(errors="replace"),
            )
        ]
        assert heals and max(heals) >= KILL_AT, tails[1]
    finally:
        _stop(procs, tag)
