"""Process states from /proc (ftdist._procfs): a stopped process is seen
stopped in every thread, a gone one reads as nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ftdist import _procfs

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc"),
]

# A child with a few threads busy on the CPU: the case in which kill()
# returns before every thread has stopped.
_BUSY = """
import threading
def spin():
    while True:
        pass
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
spin()
"""


def test_await_stopped_returns_once_every_thread_is_stopped() -> None:
    child = subprocess.Popen([sys.executable, "-c", _BUSY], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        assert _procfs.start_time(child.pid) != ""
        for _ in range(20):
            os.kill(child.pid, signal.SIGSTOP)
            _procfs.await_stopped(child.pid, time.monotonic() + 10)
            states = _procfs.thread_states(child.pid)
            assert len(states) >= 4 and set(states) == {"T"}, states
            assert _procfs.state(child.pid) == "T"
            os.kill(child.pid, signal.SIGCONT)
        with pytest.raises(TimeoutError, match=f"process {child.pid} did not stop"):
            _procfs.await_stopped(child.pid, time.monotonic() + 0.05)  # running: never stops
    finally:
        child.kill()
        child.wait(timeout=10)
    # Reaped: /proc has nothing to say of it.
    assert _procfs.state(child.pid) == "" and _procfs.start_time(child.pid) == ""
    assert _procfs.thread_states(child.pid) == []
    _procfs.await_stopped(child.pid, time.monotonic())  # nothing runs
