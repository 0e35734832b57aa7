"""The failure diagnostics themselves (tests/_diagnostics.py): a hung process's
stack names the function it hangs in, forked ranks and grandchildren
included; a process that took SIGUSR1 for itself is left alone; and a pytest
run whose test times out or fails reports its children's stacks and output."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ftdist.launch.ranks import RankContext, RankFailure, Ranks
from tests import _diagnostics

REPO = Path(__file__).resolve().parents[2]

# A child (and, with an argument, a grandchild of its own) that says it is
# ready and then hangs in a function with a name nothing else has.
HANGS = textwrap.dedent(
    """
    import subprocess, sys, time

    def hangs_in_a_function_with_a_unique_name():
        print("ready", flush=True)
        time.sleep(600)

    if len(sys.argv) > 1:
        grandchild = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    hangs_in_a_function_with_a_unique_name()
    """
)
OWN_HANDLER = textwrap.dedent(
    """
    import signal, time

    def mine(signum, frame):
        print("MY SIGUSR1 HANDLER RAN", flush=True)

    signal.signal(signal.SIGUSR1, mine)
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    """Start a Python child with its output in a file; wait for a "ready" from it (and from
    its child, with one); kill them after."""
    procs: list[subprocess.Popen[bytes]] = []

    def run(code: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        out = tmp_path / f"child{len(procs)}.out"
        with open(out, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=f, stderr=f)
        procs.append(proc)
        deadline = time.monotonic() + 30
        while out.read_text().count("ready") < 1 + len(args):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.02)
        return proc, out

    yield run
    for proc in procs:
        for pid in reversed(_diagnostics.process_tree(proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_a_hung_child_and_its_child_show_where_they_hang(start: Any) -> None:
    proc, _ = start(HANGS, HANGS)
    grandchild = _diagnostics.process_tree(proc.pid)[1]
    text = _diagnostics.snapshot("a test of the diagnostics")
    for pid in (proc.pid, grandchild):
        block = text.split(f"--- pid {pid} ", 1)[1].split("\n--- pid ", 1)[0]
        assert "in hangs_in_a_function_with_a_unique_name\n" in block, text
        assert " state " in block and " wchan " in block, block


def test_a_stopped_child_is_described_not_signalled(start: Any) -> None:
    proc, _ = start(HANGS)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while getattr(_diagnostics._proc(proc.pid), "state", "T") != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        text = _diagnostics.snapshot("a stopped child")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert f"--- pid {proc.pid} " in text and "(stopped" in text, text
    assert "in hangs_in_a_function_with_a_unique_name\n" not in text


def test_a_process_with_its_own_sigusr1_handler_is_left_alone(start: Any) -> None:
    proc, out = start(OWN_HANDLER)
    text = _diagnostics.snapshot("a child that owns SIGUSR1")
    assert f"--- pid {proc.pid} " in text and "does not (yet) write one" in text, text
    time.sleep(0.3)
    assert "MY SIGUSR1 HANDLER RAN" not in out.read_text()
    assert proc.poll() is None


def hung_rank(ctx: RankContext) -> None:
    """Rank 1 says it is ready (the store's "ready" key) and hangs where its stack says."""
    if ctx.rank == 1:
        ctx.store().set("ready", "1")
        rank_one_hangs_in_a_function_with_a_unique_name()


def rank_one_hangs_in_a_function_with_a_unique_name() -> None:
    time.sleep(600)


@pytest.mark.timeout(120)
def test_a_hung_rank_s_stack_is_in_the_rank_failure_and_the_snapshot() -> None:
    # The join starts once rank 1 hangs: on a loaded machine (the soak) a
    # rank can still be importing after a fixed few seconds, and its stack
    # would show the import instead.
    with pytest.raises(RankFailure) as info, Ranks(hung_rank, 2) as ranks:
        ranks.parent_store().wait(["ready"], timedelta(seconds=30))
        time.sleep(0.5)  # out of the store call, into the function
        ranks.results(timeout=5)
    message = str(info.value)
    assert "rank 1 was still running and was killed; its stack:" in message, message
    assert "in rank_one_hangs_in_a_function_with_a_unique_name" in message, message
    # The fork server's own frames under the rank's function are left out.
    assert "multiprocessing/forkserver.py" not in message, message

    with Ranks(hung_rank, 2) as ranks:
        ranks.parent_store().wait(["ready"], timedelta(seconds=30))
        time.sleep(0.5)  # out of the store call, into the function
        # The snapshot finds the rank under the fork server, by its own pid.
        text = _diagnostics.snapshot("a hung rank")
        block = text.split(f"--- pid {ranks.pids[1]} ", 1)[1]
        assert "rank_one_hangs_in_a_function_with_a_unique_name" in block, text


@pytest.mark.timeout(60)
def test_an_exception_leaving_ranks_carries_their_stacks() -> None:
    with pytest.raises(AssertionError) as info, Ranks(hung_rank, 2) as ranks:
        ranks.parent_store().wait(["ready"], timedelta(seconds=30))
        time.sleep(0.5)  # out of the store call, into the function
        assert ranks.exitcode(1) is not None, "rank 1 is still running"
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "--- rank 1:" in notes and "rank_one_hangs_in_a_function_with_a_unique_name" in notes


INNER = textwrap.dedent(
    """
    import subprocess, sys, time

    import pytest

    from tests import _diagnostics

    CHILD = '''
    import time
    def waits_for_a_reply_that_never_comes():
        time.sleep(600)
    print("the child says hello", flush=True)
    waits_for_a_reply_that_never_comes()
    '''


    def start(tmp_path):
        out = tmp_path / "child.out"
        with open(out, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=f, stderr=f)
        _diagnostics.watch(out, "the child's output")
        while b"hello" not in out.read_bytes():
            time.sleep(0.02)
        return proc


    @pytest.mark.timeout(6)
    def test_times_out(tmp_path):
        proc = start(tmp_path)
        try:
            proc.wait()
        finally:
            # No before_kill: the watchdog took the stacks in time.
            proc.kill()
            proc.wait()


    def test_fails(tmp_path):
        proc = start(tmp_path)
        try:
            assert proc.poll() == 0, "the child should have finished"
        finally:
            _diagnostics.before_kill()
            proc.kill()
            proc.wait()
    """
)


@pytest.mark.timeout(90)
def test_a_failing_and_a_timing_out_test_report_stacks_and_output(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    saved = tmp_path / "saved"
    env = {
        **os.environ,
        "PYTHONPATH": _diagnostics.pythonpath(REPO, os.environ.get("PYTHONPATH", "")),
        _diagnostics.SAVE_ENV: str(saved),
    }
    done = _diagnostics.run(
        [
            *[sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"],
            *["--rootdir", str(tmp_path), "test_inner.py"],
        ],
        timeout=75,
        cwd=tmp_path,
        env=env,
    )
    out = done.stdout
    assert done.returncode == 1 and "2 failed" in out, out[-3000:]
    sections = out.split("ftdist diagnostics (call)")[1:]
    assert len(sections) == 2, out[-6000:]
    timed_out = next(s for s in sections if "watchdog:" in s)
    failed = next(s for s in sections if "before the harness kills" in s)
    for section in (timed_out, failed):
        assert "in waits_for_a_reply_that_never_comes" in section, section
        assert "the child's output" in section and "the child says hello" in section, section
    # The watchdog also shows where the test itself waited.
    assert "this pytest process" in timed_out and "proc.wait()" in timed_out, timed_out
    assert "AssertionError: the child should have finished" in failed, failed
    files = sorted(p.name for p in saved.iterdir())
    assert len(files) == 2 and all(".call." in f for f in files), files
