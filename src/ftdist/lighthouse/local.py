"""
Local lighthouse replicas
=========================

:class:`LocalLighthouseReplicas` runs a replicated lighthouse on this machine:
``count`` ``ftdist lighthouse --etcd ... --job ...`` processes on 127.0.0.1,
each on a port from the kernel, with its output in a log file. ``ftdist
demo --replicated-lighthouse``, ``ftdist chaos``, ``bench/lighthouse_failover.py``
and the integration tests use it to start replicas, find the leader, and kill,
stop or restart one, which is what they measure. A production job starts its
replicas on different hosts instead (docs/fault-tolerance.md).

Every process is in its own session (a test can signal it without touching
the caller) and is ended by :meth:`LocalLighthouseReplicas.close`, which an
``atexit`` hook also runs, so no replica outlives its caller.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from ftdist._auth import job_token
from ftdist._durations import to_seconds
from ftdist.errors import CoordinationError

__all__ = ["LocalLighthouseReplicas"]

_SERVING = re.compile(rb"ftdist lighthouse serving on (\S+) \(dashboard: (\S+)\)")
_STATUS_TIMEOUT_S = 1.0
_TERM_WAIT_S = 5.0


class LocalLighthouseReplicas:
    """``count`` lighthouse replicas of one job, electing a leader through ``etcd``.

    Args:
        etcd: the etcd endpoints, comma-separated.
        job: the job's name.
        count: how many replicas (1 to 7).
        min_replicas: the lighthouses' ``--min-replicas``.
        log_dir: where each replica's output goes (``lighthouse-<i>.log``);
            default a new temporary folder.
        extra_args: more ``ftdist lighthouse`` flags, e.g.
            ``["--join-timeout-ms", "100", "--lease-ttl-ms", "2000"]``.
        env: extra environment variables for the replicas.
        host: the address each replica binds (and clients dial).

    Raises:
        ValueError: ``count`` out of range.
    """

    def __init__(
        self,
        etcd: str,
        job: str,
        count: int = 3,
        *,
        min_replicas: int = 1,
        log_dir: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 7:
            raise ValueError(f"count must be 1 to 7 replicas, got {count!r}")
        self.etcd = etcd
        self.job = job
        self.count = count
        self.host = host
        self._min_replicas = min_replicas
        self.log_dir = (
            os.fspath(log_dir)
            if log_dir is not None
            else tempfile.mkdtemp(prefix="ftdist-lighthouses-")
        )
        os.makedirs(self.log_dir, exist_ok=True)
        self._extra = list(extra_args)
        self._env = {**os.environ, **(env or {})}
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self._ports: list[int] = [0] * count
        self.addresses: list[str] = [""] * count
        self.dashboards: list[str] = [""] * count
        self._offsets = [0] * count
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout: timedelta | float = 30.0) -> LocalLighthouseReplicas:
        """Start every replica and wait until each serves and one leads.

        Returns:
            Itself.

        Raises:
            TimeoutError: a replica did not serve, or no leader was elected,
                within ``timeout`` (the logs' tails in the message).
            RuntimeError: a replica exited at start.
        """
        atexit.register(self.close)
        deadline = time.monotonic() + to_seconds(timeout, "timeout")
        try:
            for i in range(self.count):
                self._spawn(i)
            for i in range(self.count):
                self._await_serving(i, deadline)
            self.wait_leader(timeout=max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """SIGTERM every replica (SIGKILL after 5 s). Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for proc in self._procs:
            if proc is not None and proc.poll() is None:
                _signal(proc, signal.SIGCONT)
                _signal(proc, signal.SIGTERM)
        for proc in self._procs:
            if proc is None:
                continue
            try:
                proc.wait(timeout=_TERM_WAIT_S)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(timeout=_TERM_WAIT_S)

    def __enter__(self) -> LocalLighthouseReplicas:
        return self.start() if self._procs[0] is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what clients need ---------------------------------------------------------------

    @property
    def address_arg(self) -> str:
        """Every replica's address, comma-separated: what ``FTDIST_LIGHTHOUSE`` takes."""
        return ",".join(self.addresses)

    def pid(self, i: int) -> int | None:
        """Replica ``i``'s process id, or None when it is not running."""
        proc = self._procs[i]
        return proc.pid if proc is not None and proc.poll() is None else None

    def log_path(self, i: int) -> str:
        """Where replica ``i`` writes its output."""
        return os.path.join(self.log_dir, f"lighthouse-{i}.log")

    def status(self, i: int) -> dict[str, Any] | None:
        """Replica ``i``'s status document, or None when it does not answer."""
        from ftdist.lighthouse.client import LighthouseClient

        if self.pid(i) is None:
            return None
        try:
            token = job_token(None, self._env)
            with LighthouseClient(self.addresses[i], _STATUS_TIMEOUT_S, token=token) as client:
                return client.status(_STATUS_TIMEOUT_S)
        except (CoordinationError, TimeoutError):
            return None

    def leader(self) -> int | None:
        """The index of the replica that leads and serves now, or None."""
        for i in range(self.count):
            document = self.status(i)
            replication = (document or {}).get("replication") or {}
            if replication.get("role") == "leader" and replication.get("serving"):
                return i
        return None

    def wait_leader(self, timeout: float = 30.0, *, other_than: int | None = None) -> int:
        """Wait until a replica (not ``other_than``) leads and serves.

        Returns:
            Its index.

        Raises:
            TimeoutError: none did within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self.leader()
            if found is not None and found != other_than:
                return found
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no lighthouse replica leads after {timeout:g} s\n{self.log_tails()}"
                )
            time.sleep(0.05)

    # -- faults --------------------------------------------------------------------------

    def signal(self, i: int, sig: signal.Signals) -> None:
        """Send ``sig`` to replica ``i`` (SIGKILL, SIGTERM, SIGSTOP, SIGCONT)."""
        proc = self._procs[i]
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"lighthouse replica {i} is not running")
        _signal(proc, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            try:
                proc.wait(timeout=_TERM_WAIT_S)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(timeout=_TERM_WAIT_S)

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start replica ``i`` again on its old port (its address does not change).

        Raises:
            RuntimeError: it is still running, or exited at start.
            TimeoutError: it did not serve within ``timeout`` seconds.
        """
        if self.pid(i) is not None:
            raise RuntimeError(f"lighthouse replica {i} is still running")
        self._spawn(i, port=self._ports[i])
        self._await_serving(i, time.monotonic() + timeout)

    def log_tails(self, limit: int = 2000) -> str:
        """The end of every replica's log, for error messages."""
        parts = []
        for i in range(self.count):
            try:
                with open(self.log_path(i), "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - limit))
                    text = f.read().decode("utf-8", "replace")
            except OSError:
                text = "(no log)"
            parts.append(f"--- lighthouse replica {i} ({self.log_path(i)}):\n{text}")
        return "\n".join(parts)

    # -- plumbing --------------------------------------------------------------------------

    def _spawn(self, i: int, port: int = 0) -> None:
        cmd = [
            sys.executable,
            "-m",
            "ftdist",
            "lighthouse",
            "--bind",
            f"{self.host}:{port}",
            "--http-port",
            "0",
            "--min-replicas",
            str(self._min_replicas),
            "--etcd",
            self.etcd,
            "--job",
            self.job,
            *self._extra,
        ]
        path = self.log_path(i)
        with open(path, "ab") as log:
            self._offsets[i] = log.tell()
            self._procs[i] = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
            )

    def _await_serving(self, i: int, deadline: float) -> None:
        proc = self._procs[i]
        assert proc is not None
        while True:
            with open(self.log_path(i), "rb") as f:
                f.seek(self._offsets[i])
                match = _SERVING.search(f.read())
            if match is not None:
                address = match.group(1).decode()
                self.addresses[i] = address
                self._ports[i] = int(address.rsplit(":", 1)[1])
                dashboard = match.group(2).decode()
                self.dashboards[i] = "" if dashboard == "off" else dashboard
                return
            if proc.poll() is not None:
                raise RuntimeError(
                    f"lighthouse replica {i} exited with {proc.returncode} at start\n"
                    f"{self.log_tails()}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(f"lighthouse replica {i} did not serve\n{self.log_tails()}")
            time.sleep(0.02)


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass
