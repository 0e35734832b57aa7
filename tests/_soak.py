"""The soak: test tiers run again and again on a fresh clone, beside CPU burners.

A failure that shows once in fifty runs on a loaded machine is still a bug.
``make soak`` (``python -m tests._soak``) clones this repository's HEAD into a
temporary folder, starts CPU burners, and runs a selection of tests there
repeatedly; every run keeps its JUnit XML, its console output and the
diagnostics of each failure (``tests/_diagnostics.py``: stacks of every live
process, tails of their outputs). At the end, or on Ctrl-C, it prints how
often each test passed and failed, and where each failure's report is.

Examples::

    python -m tests._soak --preset recovery --runs 20
    python -m tests._soak --preset whole --duration 2h --burners 2
    python -m tests._soak --select tests/integration/test_recovery.py -k "3-1" --until-failure

The clone tests HEAD: uncommitted changes are not in it. It runs with this
interpreter (``.venv``), with the clone's ``src`` and tests first on
``PYTHONPATH`` (checked before the first run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests._procs import processes_with

REPO = Path(__file__).resolve().parents[1]
# Set in every process of a run (inherited): found and killed at the end,
# even those that left the run's process group (torchrun, the demo).
TOKEN_ENV = "FTDIST_SOAK_TOKEN"
PRESETS: dict[str, list[str]] = {
    # The integration and slow tiers, as `make pytest` runs them.
    "whole": ["tests", "-m", "integration or slow"],
    "recovery": [
        "tests/integration/test_recovery.py",
        "tests/integration/test_torchft_scripts.py",
    ],
    "localsgd-chaos": [
        "tests/integration/test_local_sgd.py",
        "tests/integration/test_chaos.py::test_short_chaos_run_passes_with_every_kind_struck",
    ],
}
# A burner checks every ~0.1 s that the soak is still its parent, so that
# none outlives a soak that was SIGKILLed.
BURNER = (
    "import os\n"
    "parent = os.getppid()\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(200_000):\n"
    "        pass\n"
)


INTERRUPTED = "interrupted (Ctrl-C)"
# How long a run's processes get to exit after pytest did before they count
# as left behind.
LEFTOVER_GRACE_S = 10.0


@dataclass
class Failure:
    """One failed (or errored) test in one run."""

    run: int
    test: str
    kind: str  # "failure" or "error"
    message: str
    report: str  # the file with its whole report and diagnostics


@dataclass
class RunResult:
    """What one run of the selection did."""

    run: int
    seconds: float
    exit_code: int | None
    outcomes: dict[str, str] = field(default_factory=dict)  # test -> passed/failed/error/skipped
    note: str = ""


def _duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``2h``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 600, 15m, 2h)")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests._soak",
        description="Run test tiers repeatedly on a fresh clone of HEAD beside CPU burners.",
        epilog="Arguments after -- go to pytest as they are.",
    )
    what = parser.add_argument_group("what to run (a preset, or --select; -k/-m narrow either)")
    what.add_argument("--preset", choices=sorted(PRESETS), help="a named selection")
    what.add_argument("--select", nargs="+", default=[], metavar="TEST", help="test ids or paths")
    what.add_argument("-k", dest="keyword", help="pytest -k expression")
    what.add_argument("-m", dest="markers", help="pytest -m expression (replaces the preset's)")
    how = parser.add_argument_group("how long and how hard")
    how.add_argument(
        "--runs", type=int, help="number of runs (default 5; unlimited with --duration)"
    )
    how.add_argument("--duration", type=_duration, help="start no run after this (600, 15m, 2h)")
    how.add_argument("--until-failure", action="store_true", help="stop after a run with a failure")
    how.add_argument("--burners", type=int, default=2, help="CPU burner processes (default 2)")
    how.add_argument("--workers", type=int, default=3, help="pytest-xdist workers (0: none)")
    how.add_argument(
        "--run-timeout", type=_duration, default=3600.0, help="kill a run after this (default 1h)"
    )
    where = parser.add_argument_group("where")
    where.add_argument("--out", type=Path, help="results folder (default: a new one in /tmp)")
    where.add_argument("--keep-clone", action="store_true", help="leave the clone in --out")
    where.add_argument("--rev", default="HEAD", help="the commit to test (default HEAD)")
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    args.pytest_extra = extra
    if args.preset is None and not args.select:
        parser.error("give --preset or --select")
    if args.runs is None:
        args.runs = 0 if args.duration is not None else 5
    return args


def pytest_args(args: argparse.Namespace) -> list[str]:
    """The selection, as pytest arguments (without the output and worker options)."""
    selection = list(PRESETS[args.preset]) if args.preset else []
    if args.markers is not None:
        if "-m" in selection:
            i = selection.index("-m")
            del selection[i : i + 2]
        selection += ["-m", args.markers]
    selection += args.select
    if args.keyword:
        selection += ["-k", args.keyword]
    return [*selection, *args.pytest_extra]


def _git(*argv: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *argv], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def clone(rev: str, into: Path) -> str:
    """Clone this repository into ``into`` at ``rev``; returns the commit."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    _git("clone", "--quiet", "--no-checkout", str(REPO), str(into))
    _git("checkout", "--quiet", "--detach", commit, cwd=into)
    # Byte-compile it once: where PYTHONDONTWRITEBYTECODE is set, every fresh
    # process (each fork server, each Baby group's child server) would
    # otherwise compile all of ftdist again, tens of seconds on a loaded
    # machine (a soak failure: a Baby group's constructor outwaited its test).
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "src", "tests"],
        cwd=into,
        check=True,
        capture_output=True,
    )
    return commit


def run_env(clone_dir: Path, token: str) -> dict[str, str]:
    """The environment of a run: the clone's code first, and the run's token."""
    env = {
        k: v
        for k, v in os.environ.items()
        # A pytest session this soak may run in must not leak into the
        # run's: its conftest makes its own stacks folder and owner.
        if not k.startswith(
            ("FTDIST_STACKS_DIR", "FTDIST_TEST_", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_")
        )
    }
    env["PYTHONPATH"] = os.pathsep.join([str(clone_dir / "src"), str(clone_dir)])
    env[TOKEN_ENV] = token
    return env


def check_imports(clone_dir: Path, env: dict[str, str]) -> None:
    """Fail unless ``ftdist`` and ``tests`` import from the clone (not this checkout).

    Raises:
        RuntimeError: they do not.
    """
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ftdist, tests; print(ftdist.__file__); print(tests.__file__)",
        ],
        cwd=clone_dir,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not all(Path(p).resolve().is_relative_to(clone_dir.resolve()) for p in out):
        raise RuntimeError(f"the clone's code is not what gets imported: {out}")


@contextlib.contextmanager
def burners(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` busy-looping processes for the duration of the block."""
    # Sessions of their own: a Ctrl-C at the terminal reaches the soak, which
    # stops them, not them (no KeyboardInterrupt tracebacks).
    procs = [
        subprocess.Popen([sys.executable, "-c", BURNER], start_new_session=True)
        for _ in range(count)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def _kill_run(proc: subprocess.Popen[bytes], token: str, grace: float) -> list[int]:
    """Stop a run: SIGINT first (pytest then runs its teardown, which stops the
    tests' processes), then SIGKILL for its process group; then every process
    that carries its token and is still there after a few seconds (a fork
    server exits shortly after its worker: not a leftover) is killed.

    Returns:
        The pids of the processes that outlived the run and were killed.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while processes_with(f"{TOKEN_ENV}={token}") and time.monotonic() < deadline:
        time.sleep(0.2)
    return sweep(token)


def sweep(token: str) -> list[int]:
    """SIGKILL every process that carries the run's token; returns their pids."""
    found = processes_with(f"{TOKEN_ENV}={token}")
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found


def _key(classname: str, name: str) -> str:
    return f"{classname}::{name}"


def _key_of_nodeid(nodeid: str) -> str:
    """The JUnit-style name of a pytest node id (``a/b.py::C::t[x]`` -> ``a.b.C::t[x]``)."""
    parts = nodeid.split("::")
    module = parts[0].removesuffix(".py").replace("/", ".")
    return _key(".".join([module, *parts[1:-1]]), parts[-1])


def read_junit(path: Path) -> dict[str, tuple[str, str, str]]:
    """Each test's outcome in a JUnit file: key -> (outcome, message, full text)."""
    results: dict[str, tuple[str, str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):
            continue  # what an interrupted session writes for itself
        key = _key(case.get("classname", ""), case.get("name", ""))
        outcome, message, texts = "passed", "", []
        for child in case:
            if child.tag in ("failure", "error"):
                # An error after a failure (a teardown's) keeps "failed".
                outcome = "failed" if child.tag == "failure" or outcome == "failed" else "error"
                if not message:
                    message = (child.get("message") or "").strip().split("\n", 1)[0]
                texts.append(f"[{child.tag}] {child.get('message', '')}\n{child.text or ''}")
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
            elif child.tag in ("system-out", "system-err") and child.text:
                texts.append(f"[{child.tag}]\n{child.text}")
        results[key] = (outcome, message, "\n\n".join(texts))
    return results


def _diagnostics_by_key(folder: Path) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            first = path.read_text(errors="replace").split("\n", 1)[0]
            nodeid = first.rsplit(" (", 1)[0]
            found.setdefault(_key_of_nodeid(nodeid), []).append(path)
    return found


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-\[\]]+", "_", text)[-150:]


def one_run(
    n: int,
    args: argparse.Namespace,
    clone_dir: Path,
    out: Path,
    token: str,
) -> tuple[RunResult, list[Failure]]:
    """Run the selection once in the clone; keep its output, JUnit XML and diagnostics."""
    run_dir = out / f"run-{n:03d}"
    run_dir.mkdir(parents=True)
    junit = run_dir / "junit.xml"
    env = run_env(clone_dir, token)
    env["FTDIST_TEST_DIAGNOSTICS_DIR"] = str(run_dir / "diagnostics")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE"]
    if args.workers > 0:
        cmd += ["-n", str(args.workers), "--dist", "loadgroup"]
    # Captured output of failing tests into the XML as well (not of passing ones).
    cmd += [f"--junitxml={junit}", "-o", "junit_logging=all", "-o", "junit_log_passing_tests=false"]
    cmd += pytest_args(args)
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    started = time.monotonic()
    with open(run_dir / "output.log", "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=clone_dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        note = ""
        try:
            proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            note = f"run killed after {args.run_timeout:.0f} s"
        except KeyboardInterrupt:
            # Still stop the run and keep what it did; main() stops after it.
            note = INTERRUPTED
        finally:
            left = _kill_run(proc, token, grace=60)
            if left:
                note += f" (processes left behind and killed: {left})"
    result = RunResult(n, time.monotonic() - started, proc.returncode, note=note.strip())
    if not junit.exists():
        result.note = (result.note + "; no JUnit XML: the run did not finish").strip("; ")
        return result, []
    failures = []
    diagnostics = _diagnostics_by_key(run_dir / "diagnostics")
    reports = run_dir / "failures"
    for key, (outcome, message, text) in sorted(read_junit(junit).items()):
        result.outcomes[key] = outcome
        if outcome not in ("failed", "error"):
            continue
        reports.mkdir(exist_ok=True)
        report = reports / f"{_safe(key)}.txt"
        extra = [
            f"=== {p.name} ===\n{p.read_text(errors='replace')}" for p in diagnostics.get(key, [])
        ]
        report.write_text(
            f"{key}: {outcome} in run {n} (see {run_dir / 'output.log'})\n\n{text}\n\n"
            + "\n\n".join(extra)
            + "\n"
        )
        failures.append(Failure(n, key, outcome, message, str(report)))
    return result, failures


def summary(results: list[RunResult], failures: list[Failure], wall: float, commit: str) -> str:
    """The end-of-soak report: runs, per-test counts, every failure."""
    counts: dict[str, Counter[str]] = {}
    for r in results:
        for test, outcome in r.outcomes.items():
            counts.setdefault(test, Counter())[outcome] += 1
    lines = [
        f"soak of {commit[:12]}: {len(results)} run(s) in {wall / 60:.1f} min",
        *(
            f"  run {r.run}: exit {r.exit_code}, {r.seconds:.0f} s, "
            + ", ".join(f"{c} {o}" for o, c in sorted(Counter(r.outcomes.values()).items()))
            + (f" [{r.note}]" if r.note else "")
            for r in results
        ),
    ]
    flaky = {t: c for t, c in counts.items() if c["failed"] or c["error"]}
    lines.append(f"{len(counts)} test(s); {len(flaky)} with failures:")
    width = max((len(t) for t in flaky), default=0)
    for test, c in sorted(flaky.items()):
        lines.append(
            f"  {test:<{width}}  passed {c['passed']}, failed {c['failed']}, error {c['error']}"
        )
    if failures:
        lines.append("failures (each report holds the traceback, output and diagnostics):")
        for f in failures:
            lines.append(f"  run {f.run}: {f.test}: {f.kind}: {f.message[:160]}")
            lines.append(f"    {f.report}")
    elif results:
        lines.append("no failures")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak; returns 0 without failures, 1 with, 130 on Ctrl-C."""
    args = _parse(argv)
    out = args.out or Path(tempfile.gettempdir()) / f"ftdist-soak-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ftdist-soak-clone-"))
    clone_dir = work / "ftdist"
    token = uuid.uuid4().hex
    results: list[RunResult] = []
    failures: list[Failure] = []
    started = time.monotonic()
    commit = "?"
    code = 0

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # the same cleanup as Ctrl-C

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        commit = clone(args.rev, clone_dir)
        if _git("status", "--porcelain", "--untracked-files=no"):
            print(f"note: uncommitted changes are not soaked; testing {commit[:12]}")
        env = run_env(clone_dir, token)
        check_imports(clone_dir, env)
        print(f"soak of {commit[:12]} in {clone_dir}; results in {out}", flush=True)
        print(f"pytest {' '.join(pytest_args(args))}", flush=True)
        with burners(args.burners):
            n = 0
            while True:
                n += 1
                if args.runs and n > args.runs:
                    break
                if args.duration is not None and time.monotonic() - started > args.duration:
                    break
                result, new = one_run(n, args, clone_dir, out, token)
                results.append(result)
                failures += new
                tally = Counter(result.outcomes.values())
                print(
                    f"run {n}: {result.seconds:.0f} s, "
                    + ", ".join(f"{c} {o}" for o, c in sorted(tally.items()))
                    + (f" [{result.note}]" if result.note else ""),
                    flush=True,
                )
                for f in new:
                    print(f"  {f.kind}: {f.test}\n    {f.report}", flush=True)
                if result.note.startswith(INTERRUPTED):
                    raise KeyboardInterrupt
                if args.until_failure and (new or result.note):
                    break
        code = 1 if failures or any(r.note for r in results) else 0
        # (A run's note: it was killed at its timeout or left processes behind.)
    except KeyboardInterrupt:
        print("interrupted: stopping", flush=True)
        code = 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        sweep(token)
        if args.keep_clone and clone_dir.exists():
            shutil.move(str(clone_dir), str(out / "clone"))
        shutil.rmtree(work, ignore_errors=True)
        text = summary(results, failures, time.monotonic() - started, commit)
        (out / "summary.txt").write_text(text + "\n")
        (out / "summary.json").write_text(
            json.dumps(
                {
                    "commit": commit,
                    "args": pytest_args(args),
                    "runs": [asdict(r) for r in results],
                    "failures": [asdict(f) for f in failures],
                },
                indent=1,
            )
        )
        print(text)
        print(f"results: {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
