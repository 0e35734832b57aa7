"""Running ``ftdist chaos`` as a subprocess from a test, as ``make chaos`` runs it.

Every process of the run carries a unique token in its environment, so that
the test can prove afterwards that none outlived it; the suite's output goes
to a file (not a pipe), so that it is still there for the failure report
when the run hangs (``tests/_diagnostics.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests import _diagnostics
from tests._procs import processes_with

TOKEN_ENV = "FTDIST_CHAOS_TEST_TOKEN"


@dataclass
class ChaosRun:
    """A finished ``ftdist chaos`` run.

    Attributes:
        returncode: the suite's exit status.
        stdout: what it printed.
        out: its ``--out`` folder (``report.json``, logs, events).
        pid: the suite's process id (its namespaces carry it).
        token: the environment token of its processes.
    """

    returncode: int
    stdout: str
    out: Path
    pid: int
    token: str

    def report(self) -> dict[str, Any]:
        """The run's ``report.json``."""
        report: dict[str, Any] = json.loads((self.out / "report.json").read_text())
        return report

    def logs(self, tail: int = 3000) -> str:
        """The tail of every trainer's log, for assertion messages."""
        return "\n".join(
            f"--- {p.name} (tail) ---\n{p.read_text(errors='replace')[-tail:]}"
            for p in sorted((self.out / "events").glob("*.log"))
        )

    def leftovers(self, within_s: float = 15) -> list[int]:
        """Processes of the run still alive after ``within_s`` (trainers exit with the suite)."""
        deadline = time.monotonic() + within_s
        while processes_with(f"{TOKEN_ENV}={self.token}") and time.monotonic() < deadline:
            time.sleep(0.1)
        return processes_with(f"{TOKEN_ENV}={self.token}")


def run_chaos(args: list[str], tmp_path: Path, timeout_s: float) -> ChaosRun:
    """Run ``ftdist chaos ARGS --out tmp_path/chaos`` and wait for it; kill what is left."""
    token = uuid.uuid4().hex
    env = {**os.environ, TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "chaos"
    log = tmp_path / "chaos.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftdist.cli", "chaos", *args, "--out", str(out)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    _diagnostics.watch(log, "ftdist chaos output")
    _diagnostics.watch_glob(out, "**/*.log", "chaos log")
    try:
        proc.wait(timeout=timeout_s)
    finally:
        _diagnostics.before_kill()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in processes_with(f"{TOKEN_ENV}={token}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return ChaosRun(proc.returncode, log.read_text(errors="replace"), out, proc.pid, token)
