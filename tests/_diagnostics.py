"""What a failing or hanging test that runs processes puts in its report.

A rare failure must explain itself the first time it happens, so when a test
fails or is about to time out the report gets, for every live process the
test started: its pid, parent, state, kernel wait channel, command line and
every thread's Python stack; and the tail of every process output that the
test registered with :func:`watch`.

How the stacks are taken: ``tests/conftest.py`` calls :func:`install`, which
puts ``tests/_stacks`` (a ``sitecustomize``) first on ``PYTHONPATH`` and
points ``FTDIST_STACKS_DIR`` at a folder of this session. Every Python
process the tests start then writes its stacks to ``<folder>/<pid>`` on
SIGUSR1 (faulthandler), forked children included (fork servers' ranks).
:func:`snapshot` signals each such process and reads what it wrote;
``py-spy dump`` is used, where it is on ``PATH``, for a Python process that
cannot answer (not registered, stopped, or silent).

When it runs (``tests/conftest.py``): a watchdog a few seconds before a
test's pytest-timeout deadline; at the report of any failed phase while test
processes are alive; and in every harness's cleanup, through
:func:`before_kill`, which snapshots only while an exception (a failed
assert, a timeout) is on its way out, so that the stacks are taken before
the harness kills the processes. Nothing runs for a test that passes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ftdist.launch.stacks import STACKS_ENV, take
from tests._procs import processes_with

# Set to this pytest process's pid in every process it starts: finds the
# test's processes even after their parent died (orphans adopted by init).
OWNER_ENV = "FTDIST_TEST_OWNER"
# Where a run (the soak) wants each failure's diagnostics as a file, too.
SAVE_ENV = "FTDIST_TEST_DIAGNOSTICS_DIR"
SITE_DIR = Path(__file__).resolve().parent / "_stacks"
TAIL_BYTES = 4000
# How long the signalled processes get to write their stacks. Each writes
# from its signal handler at once; a loaded machine may take a second to
# schedule them all.
DUMP_WAIT_S = 3.0
WATCHDOG_THREAD = "ftdist-test-watchdog"

Source = Path | str | Callable[[], str | bytes | None]


def install() -> None:
    """Make every Python process started from here on dump its stacks on SIGUSR1.

    Idempotent; called by ``tests/conftest.py`` before anything is started.
    The stacks folder is shared with the processes this one starts (pytest-xdist
    workers, nested pytest runs): files are named by pid.
    """
    if not os.path.isdir(os.environ.get(STACKS_ENV) or "/nonexistent"):
        folder = tempfile.mkdtemp(prefix="ftdist-stacks-")
        os.environ[STACKS_ENV] = folder
        creator = os.getpid()

        def remove() -> None:
            if os.getpid() == creator:  # not in a forked child
                shutil.rmtree(folder, ignore_errors=True)

        import atexit

        atexit.register(remove)
    os.environ["PYTHONPATH"] = pythonpath(os.environ.get("PYTHONPATH", ""))
    os.environ[OWNER_ENV] = str(os.getpid())


def pythonpath(*entries: str | os.PathLike[str]) -> str:
    """A ``PYTHONPATH`` value of ``entries`` that keeps the stack-dump ``sitecustomize`` first.

    For tests that set ``PYTHONPATH`` for a child: without this, the child's
    stacks could not be taken.
    """
    parts = [str(SITE_DIR)]
    for entry in entries:
        for part in str(entry).split(os.pathsep):
            if part and part not in parts:
                parts.append(part)
    return os.pathsep.join(parts)


# -- per-test record ------------------------------------------------------------------------------


@dataclass
class _Record:
    nodeid: str
    snapshots: list[str] = field(default_factory=list)
    watched: list[tuple[str, Any]] = field(default_factory=list)  # Source or _Glob
    reported: int = 0  # snapshots already put in a report
    tails_reported: bool = False


_lock = threading.Lock()
_current: _Record | None = None


def begin(nodeid: str) -> None:
    """Start recording for the test ``nodeid`` (conftest, at the start of each test)."""
    global _current
    with _lock:
        _current = _Record(nodeid)


def end() -> None:
    """Forget the current test's record (conftest, after its last report)."""
    global _current
    with _lock:
        _current = None


def watch(source: Source, label: str) -> None:
    """Register a process output for the current test's report: its tail is shown on failure.

    Args:
        source: a file the process writes, or a function returning what was
            read from it so far (a pipe a harness reads).
        label: what the output is, e.g. ``"group 1 stderr"``.
    """
    with _lock:
        if _current is not None:
            _current.watched.append((label, source))


@dataclass(frozen=True)
class _Glob:
    folder: Path
    pattern: str
    limit: int
    max_files: int


def watch_glob(
    folder: str | os.PathLike[str],
    pattern: str,
    label: str,
    limit: int = 2000,
    max_files: int = 12,
) -> None:
    """Register the files matching ``pattern`` under ``folder`` (found at report time).

    For processes that write logs of their own (one per replica attempt,
    say): the tail of each of the ``max_files`` most recently written ones
    goes in the report, ``limit`` characters each.
    """
    with _lock:
        if _current is not None:
            _current.watched.append((label, _Glob(Path(folder), pattern, limit, max_files)))


def _expand(watched: Iterable[tuple[str, Any]]) -> list[tuple[str, Source, int]]:
    out: list[tuple[str, Source, int]] = []
    for label, source in watched:
        if not isinstance(source, _Glob):
            out.append((label, source, TAIL_BYTES))
            continue
        try:
            files = sorted(source.folder.glob(source.pattern), key=lambda p: p.stat().st_mtime)
        except OSError:
            continue
        for path in files[-source.max_files :]:
            out.append((f"{label}: {path}", path, source.limit))
    return out


def tail(source: Source, limit: int = TAIL_BYTES) -> str:
    """The last ``limit`` characters of an output (file or function); never raises."""
    try:
        if callable(source):
            data = source()
        else:
            path = Path(source)
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - limit))
                data = f.read()
    except Exception as exc:
        return f"(unreadable: {exc!r})"
    if data is None:
        return "(nothing)"
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    if not text:
        return "(empty)"
    return text if len(text) <= limit else "[...]" + text[-limit:]


def tails(sources: Iterable[tuple[str, Any]], limit: int = TAIL_BYTES) -> str:
    """Every output's tail under a header of its label (:func:`watch_glob`'s folders expanded)."""
    return "\n".join(
        f"--- {label} (last {min(n, limit)} chars) ---\n{tail(source, min(n, limit))}"
        for label, source, n in _expand(sources)
    )


# -- processes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    """One process as /proc shows it."""

    pid: int
    ppid: int
    state: str
    cmdline: str


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def _proc(pid: int) -> Proc | None:
    try:
        stat = _read(f"/proc/{pid}/stat")
        cmdline = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip().replace("\n", "\\n")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    name = stat[stat.find("(") + 1 : stat.rfind(")")]
    return Proc(pid, int(fields[1]), fields[0], cmdline or f"[{name}]")


def _all_procs() -> dict[int, Proc]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (p := _proc(int(entry))) is not None:
            found[p.pid] = p
    return found


def _session_pids() -> set[int]:
    """The fork server and resource tracker: they serve the session, not one test."""
    pids = set()
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver, resource_tracker

        for pid in (
            getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None),
        ):
            if pid:
                pids.add(int(pid))
    return pids


def live_processes(extra: Iterable[int] = ()) -> list[Proc]:
    """Live processes of this test: descendants of this process, orphans that carry
    this process's :data:`OWNER_ENV`, and ``extra`` pids; parents before children.

    The fork server and resource tracker are left out (their children are not).
    """
    me = os.getpid()
    procs = _all_procs()
    kids: dict[int, list[int]] = {}
    for p in procs.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    roots = [me, *extra, *processes_with(f"{OWNER_ENV}={me}")]
    skip = _session_pids()
    seen: set[int] = set()
    order: list[Proc] = []

    def visit(pid: int) -> None:
        if pid in seen:
            return
        seen.add(pid)
        p = procs.get(pid)
        if p is not None and pid != me and pid not in skip and p.state != "Z":
            order.append(p)
        for child in sorted(kids.get(pid, [])):
            visit(child)

    for root in roots:
        visit(root)
    return order


def process_tree(root: int) -> list[int]:
    """``root`` and its live descendants, parents first."""
    kids: dict[int, list[int]] = {}
    for p in _all_procs().values():
        kids.setdefault(p.ppid, []).append(p.pid)
    order, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        order.append(pid)
        todo += sorted(kids.get(pid, []))
    return order


def _wchan(pid: int) -> str:
    try:
        return _read(f"/proc/{pid}/wchan") or "-"
    except OSError:
        return "?"


def _py_spy(pid: int) -> str | None:
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "dump", "--nonblocking", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(py-spy failed: {exc!r})"
    return f"(py-spy)\n{done.stdout}{done.stderr}".rstrip()


def dump_stacks(pids: Sequence[int], wait: float = DUMP_WAIT_S) -> dict[int, str]:
    """Every thread's Python stack of each process in ``pids``, or why there is none.

    Signals (SIGUSR1) only processes that registered a dump file in
    ``$FTDIST_STACKS_DIR`` and still catch SIGUSR1 (``ftdist.launch.stacks``);
    one that does not (not Python, not started by the tests, stopped, or one
    that took SIGUSR1 for itself) is never signalled: py-spy is tried
    instead, where installed.
    """
    folder = os.environ.get(STACKS_ENV, "/nonexistent")
    # A fork-server rank's frames under ftdist.launch.ranks._child_main are
    # the same in every rank: left out.
    out = take({pid: pid for pid in pids}, folder, wait, below="_child_main")
    for pid, text in out.items():
        if text.startswith("(") and (spy := _py_spy(pid)) is not None:
            out[pid] = f"{text}\n{spy}"
    return out


_RUNNER_PARTS = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}", f"{os.sep}pytest_timeout")


def _own_threads() -> str:
    """Every thread of this (pytest) process but the calling one, with its stack."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        # pytest's and pluggy's own frames (the runner's call chain) say nothing.
        entries = [
            e
            for e in traceback.extract_stack(frame)
            if not any(part in e.filename for part in _RUNNER_PARTS)
        ]
        stack = "".join(traceback.format_list(entries)).rstrip()
        parts.append(f"Thread {names.get(ident, '?')} ({ident}):\n{stack}")
    return "\n".join(parts)


def snapshot(
    reason: str, extra: Iterable[int] = (), include_self: bool = False, nodeid: str | None = None
) -> str:
    """Stacks and states of every live process of the current test, now.

    The text is also kept for the current test's failure report.

    Args:
        reason: why (a heading for the report).
        extra: pids to include besides the test's own descendants.
        include_self: also every other thread of this pytest process (the
            watchdog's view of a hang: where the test itself waits).
        nodeid: keep it only if this test is still the current one (the
            watchdog's snapshot may end after its test did).
    """
    started = time.monotonic()
    procs = live_processes(extra)
    stacks = dump_stacks([p.pid for p in procs])
    lines = [f"=== {reason}: {len(procs)} live process(es), at {time.strftime('%H:%M:%S')} ==="]
    for p in procs:
        lines.append(
            f"--- pid {p.pid} (parent {p.ppid}) state {p.state} wchan {_wchan(p.pid)}: "
            f"{p.cmdline[:300]}"
        )
        lines.append(stacks.get(p.pid, "(no stack)"))
    if include_self:
        lines.append(f"--- this pytest process (pid {os.getpid()}), other threads:")
        lines.append(_own_threads() or "(none)")
    lines.append(f"=== ({time.monotonic() - started:.1f} s to take)")
    text = "\n".join(lines)
    with _lock:
        if _current is not None and nodeid in (None, _current.nodeid):
            _current.snapshots.append(text)
    return text


# Exceptions that end a test without a failure to explain.
_NOT_FAILURES = (KeyboardInterrupt, GeneratorExit, pytest.skip.Exception, pytest.xfail.Exception)


def before_kill(
    what: str = "before the harness kills its processes", extra: Iterable[int] = ()
) -> None:
    """Snapshot the test's processes if an exception is on its way out; call it first in cleanup.

    Harnesses kill their processes in ``finally`` blocks and context-manager
    exits, which run before pytest sees the failure: by then the stacks are
    gone. A normal exit (no exception in flight) costs nothing.
    """
    exc = sys.exc_info()[1]
    if exc is None or isinstance(exc, _NOT_FAILURES):
        return
    first = str(exc).strip().splitlines()[:1]
    snapshot(f"{what} ({type(exc).__name__}: {first[0][:200] if first else ''})", extra)


def report(phase: str) -> str | None:
    """The current test's diagnostics for a failed ``phase``, or None if there are none.

    Takes one more snapshot when test processes are still alive (fixtures
    still hold them), then returns the snapshots not reported yet and, the
    first time, the tails of the watched outputs.
    """
    if live_processes():
        snapshot(f"at the {phase} report")
    with _lock:
        record = _current
        if record is None:
            return None
        parts = record.snapshots[record.reported :]
        record.reported = len(record.snapshots)
        watched = [] if record.tails_reported else list(record.watched)
        record.tails_reported = True
    if watched:
        parts.append(tails(watched))
    return "\n\n".join(parts) if parts else None


def save(nodeid: str, phase: str, text: str) -> None:
    """Write a failure's diagnostics under ``$FTDIST_TEST_DIAGNOSTICS_DIR`` (the soak sets it)."""
    folder = os.environ.get(SAVE_ENV)
    if not folder:
        return
    safe = "".join(c if c.isalnum() or c in "-_.[]" else "_" for c in nodeid)[-180:]
    name = f"{safe}.{phase}.{os.getpid()}.{time.strftime('%Y%m%dT%H%M%S')}.txt"
    with contextlib.suppress(OSError):
        os.makedirs(folder, exist_ok=True)
        Path(folder, name).write_text(f"{nodeid} ({phase})\n\n{text}\n")


# -- the watchdog ---------------------------------------------------------------------------------


class _Watchdog:
    """One thread for the session: runs a snapshot when a test nears its deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: tuple[float, str, str] | None = None
        self._busy = False
        self._thread: threading.Thread | None = None

    def arm(self, after: float, reason: str, nodeid: str) -> None:
        """Snapshot (with this process's threads) in ``after`` seconds unless disarmed first."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=WATCHDOG_THREAD, daemon=True)
                self._thread.start()
            self._due = (time.monotonic() + after, reason, nodeid)
            self._cond.notify()

    def disarm(self) -> None:
        """Cancel the armed snapshot (the test ended in time)."""
        with self._cond:
            self._due = None
            self._cond.notify()

    def settle(self, timeout: float = DUMP_WAIT_S + 20) -> None:
        """Wait for a snapshot in progress to finish."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._due is None or time.monotonic() < self._due[0]:
                    self._cond.wait(None if self._due is None else self._due[0] - time.monotonic())
                _, reason, nodeid = self._due
                self._due, self._busy = None, True
            try:
                snapshot(reason, include_self=True, nodeid=nodeid)
            except Exception:
                traceback.print_exc()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


watchdog = _Watchdog()


def watchdog_margin(timeout: float) -> float:
    """How long before a test's timeout the watchdog snapshots: time to signal and read
    every process before pytest-timeout fails the test and its cleanup kills them."""
    return min(10.0, max(2.0, 0.1 * timeout))


def run(cmd: Sequence[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)`` that, on timeout,
    snapshots the process tree before killing it and raises with its output's tail.

    Raises:
        subprocess.TimeoutExpired: the command ran past ``timeout``; its
            message carries the stacks and the output so far.
    """
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            tree = process_tree(proc.pid)
            stacks = snapshot(f"{list(cmd)[:4]} ran past {timeout} s", extra=[proc.pid])
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate()
            _note(exc, stacks)
            _note(exc, tails([("stdout", lambda: out), ("stderr", lambda: err)]))
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _note(exc: BaseException, text: str) -> None:
    # Exception notes (3.11+) print under the exception in pytest's report.
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(text)
