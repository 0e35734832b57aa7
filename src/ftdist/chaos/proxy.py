"""
A TCP proxy that cuts one process off
=====================================

:class:`CutProxy` listens on a local port for each of its targets (the
members of an etcd cluster) and forwards every connection to its target.
:meth:`CutProxy.cut` blackholes the connections of one client process:
nothing it sends is passed on and nothing comes back, in both directions,
yet its connections stay open, as when a network drops a host's packets
(a refused or reset connection would tell the client at once); a new
connection from it is accepted and held, not forwarded.
:meth:`CutProxy.lift` resumes them: what waited flows on, as a real
network's retransmissions would deliver it.

The chaos suite puts one in front of the etcd cluster of its replicated
lighthouse and gives every replica the proxy's ports as ``--etcd``, so that
one replica can be cut off from etcd while its groups still reach it.

Which process a connection comes from is read from the kernel (Linux): the
socket tables (``/proc/net/tcp``, and ``tcp6`` for an IPv6 socket dialing an
IPv4 address, as gRPC's do) give the inode of the client's end, and
``/proc/<pid>/fd`` the inodes of the sockets a process holds. The clients
must run on this machine and in this network namespace.

One thread (``ftdist-chaos-proxy``) serves every listener and connection
with a selector; :meth:`CutProxy.close` joins it. At most
``MAX_CONNECTIONS`` connections are open at once (a new one past that is
closed at once) and each holds at most ``BUFFER_BYTES`` per direction.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field

__all__ = ["CutProxy", "socket_inodes"]

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
BUFFER_BYTES = 256 * 1024
_CHUNK = 64 * 1024
_SELECT_S = 0.5
_APPLY_WAIT_S = 5.0
_JOIN_S = 5.0


def _hex_address(address: tuple[str, int], v6: bool) -> str:
    """An IPv4 ``address`` as ``/proc/net/tcp`` (or, IPv4-mapped, ``tcp6``) writes it:
    each 32-bit word of the address in host order."""
    if v6:
        raw = socket.inet_pton(socket.AF_INET6, f"::ffff:{address[0]}")
    else:
        raw = socket.inet_aton(address[0])
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    return "".join(f"{w:08X}" for w in words) + f":{address[1]:04X}"


def _client_inode(conn: socket.socket) -> int | None:
    """The inode of the far end of ``conn`` (an accepted loopback connection), or None.

    The client's socket may be IPv6 with an IPv4-mapped address (gRPC's
    are): both tables are read.
    """
    try:
        mine, theirs = conn.getsockname(), conn.getpeername()
        for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
            local, remote = _hex_address(theirs, v6), _hex_address(mine, v6)
            with open(table, encoding="ascii") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) > 9 and parts[1] == local and parts[2] == remote:
                        return int(parts[9])
    except (OSError, ValueError):
        pass
    return None


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds (empty when it is gone)."""
    found: set[int] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[8:-1]))
    return found


@dataclass(eq=False)
class _Conn:
    """One proxied connection: the client's end, and its target's once connected."""

    client: socket.socket
    target: tuple[str, int]
    inode: int | None
    upstream: socket.socket | None = None
    connecting: bool = False
    held: bool = False
    # Bytes read from one side, waiting to be written to the other.
    to_upstream: bytearray = field(default_factory=bytearray)
    to_client: bytearray = field(default_factory=bytearray)


class CutProxy:
    """Forwards a local port to each target; cuts chosen client processes off.

    Args:
        targets: the ``(host, port)`` each listener forwards to.
        host: the address the listeners bind (loopback: the socket table
            is read for IPv4 only).

    Raises:
        OSError: a listener could not be bound.
    """

    def __init__(self, targets: list[tuple[str, int]], host: str = "127.0.0.1") -> None:
        self._sel = selectors.DefaultSelector()
        self._listeners: list[socket.socket] = []
        self._targets: dict[socket.socket, tuple[str, int]] = {}
        try:
            for target in targets:
                sock = socket.create_server((host, 0))
                sock.setblocking(False)
                self._listeners.append(sock)
                self._targets[sock] = target
            self._wake_r, self._wake_w = socket.socketpair()
        except OSError:
            for sock in self._listeners:
                sock.close()
            raise
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._conns: list[_Conn] = []
        self._owner: dict[socket.socket, _Conn] = {}
        self._masks: dict[socket.socket, int] = {}
        self._lock = threading.Condition()
        self._cut: set[int] = set()  # pids; written under the lock
        self._wanted = 0  # the generation of ``_cut`` asked for ...
        self._applied = 0  # ... and the one the loop applied
        self._closing = False
        self.refused = 0  # connections closed at once: too many open
        self._thread = threading.Thread(target=self._run, name="ftdist-chaos-proxy", daemon=True)
        self._thread.start()

    # -- the caller's side -------------------------------------------------------------------
    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Each listener's ``(host, port)``, in the order of the targets."""
        return [sock.getsockname()[:2] for sock in self._listeners]

    def cut(self, pid: int) -> None:
        """Blackhole every connection of process ``pid``, open and new, until :meth:`lift`.

        Returns once the cut is in force.

        Raises:
            TimeoutError: the proxy's thread did not apply it within 5 s.
        """
        self._change(pid, True)

    def lift(self, pid: int) -> None:
        """Forward process ``pid``'s connections again (what waited flows on).

        Raises:
            TimeoutError: the proxy's thread did not apply it within 5 s.
        """
        self._change(pid, False)

    def held(self) -> int:
        """How many connections are held by a cut now."""
        with self._lock:
            return sum(c.held for c in self._conns)

    def close(self) -> None:
        """Close every connection and listener; join the thread. Idempotent."""
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join(timeout=_JOIN_S)

    def __enter__(self) -> CutProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _change(self, pid: int, cut: bool) -> None:
        with self._lock:
            if cut:
                self._cut.add(pid)
            else:
                self._cut.discard(pid)
            self._wanted += 1
            wanted = self._wanted
        self._wake()
        with self._lock:
            if not self._lock.wait_for(
                lambda: self._applied >= wanted or self._closing, _APPLY_WAIT_S
            ):
                raise TimeoutError("the proxy's thread did not apply the cut within 5 s")

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # full (a wake is pending anyway) or closed

    # -- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for sock in self._listeners:
                self._arm(sock, selectors.EVENT_READ)
            self._arm(self._wake_r, selectors.EVENT_READ)
            while True:
                with self._lock:
                    if self._closing:
                        return
                    cut, wanted = set(self._cut), self._wanted
                if wanted != self._applied:
                    self._apply(cut)
                    with self._lock:
                        self._applied = wanted
                        self._lock.notify_all()
                for conn in list(self._conns):
                    self._arm_conn(conn)
                for key, mask in self._sel.select(_SELECT_S):
                    ready = key.fileobj
                    if not isinstance(ready, socket.socket):
                        continue  # only sockets are registered
                    if ready is self._wake_r:
                        self._drain_wake()
                    elif ready in self._targets:
                        self._accept(ready, cut)
                    elif ready in self._owner:
                        self._serve(self._owner[ready], ready, mask)
        except Exception:  # the loop must not die silently: the clients would hang
            logger.exception("chaos proxy failed")
        finally:
            self._shutdown()

    def _apply(self, cut: set[int]) -> None:
        inodes = set().union(*(socket_inodes(pid) for pid in cut))
        for conn in list(self._conns):
            hold = conn.inode is not None and conn.inode in inodes
            if conn.held and not hold:
                conn.held = False
                if conn.upstream is None:
                    self._connect(conn)
            conn.held = hold

    def _accept(self, listener: socket.socket, cut: set[int]) -> None:
        try:
            client, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            logger.warning("chaos proxy: accept failed: %s", exc)
            return
        if len(self._conns) >= MAX_CONNECTIONS:
            self.refused += 1
            client.close()
            return
        client.setblocking(False)
        conn = _Conn(client, self._targets[listener], _client_inode(client))
        if cut and conn.inode is not None:
            conn.held = conn.inode in set().union(*(socket_inodes(pid) for pid in cut))
        with self._lock:
            self._conns.append(conn)
        self._owner[client] = conn
        if not conn.held:
            self._connect(conn)

    def _connect(self, conn: _Conn) -> None:
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setblocking(False)
        err = upstream.connect_ex(conn.target)
        if err not in (0, errno.EINPROGRESS):
            upstream.close()
            self._drop(conn)  # a dead target: the client sees its connection end
            return
        conn.upstream, conn.connecting = upstream, err != 0
        self._owner[upstream] = conn

    def _arm_conn(self, conn: _Conn) -> None:
        client_mask = upstream_mask = 0
        if not conn.held:
            if len(conn.to_upstream) < BUFFER_BYTES:
                client_mask |= selectors.EVENT_READ
            if conn.to_client:
                client_mask |= selectors.EVENT_WRITE
            if conn.connecting or conn.to_upstream:
                upstream_mask |= selectors.EVENT_WRITE
            if not conn.connecting and len(conn.to_client) < BUFFER_BYTES:
                upstream_mask |= selectors.EVENT_READ
        self._arm(conn.client, client_mask)
        if conn.upstream is not None:
            self._arm(conn.upstream, upstream_mask)

    def _arm(self, sock: socket.socket, mask: int) -> None:
        old = self._masks.get(sock, 0)
        if mask == old:
            return
        if not mask:
            self._sel.unregister(sock)
            del self._masks[sock]
        elif not old:
            self._sel.register(sock, mask)
            self._masks[sock] = mask
        else:
            self._sel.modify(sock, mask)
            self._masks[sock] = mask

    def _serve(self, conn: _Conn, sock: socket.socket, mask: int) -> None:
        if conn.held:
            return  # cut since the select
        upstream = sock is conn.upstream
        try:
            if upstream and conn.connecting:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    self._drop(conn)
                    return
                conn.connecting = False
            if mask & selectors.EVENT_READ:
                into = conn.to_client if upstream else conn.to_upstream
                data = sock.recv(_CHUNK)
                if not data:
                    self._drop(conn)  # one side ended: end the other
                    return
                into += data
            if mask & selectors.EVENT_WRITE:
                out = conn.to_upstream if upstream else conn.to_client
                if out:
                    del out[: sock.send(out)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        for sock in (conn.client, conn.upstream):
            if sock is None:
                continue
            self._arm(sock, 0)
            self._owner.pop(sock, None)
            sock.close()
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _shutdown(self) -> None:
        for conn in list(self._conns):
            self._drop(conn)
        for sock in [*self._listeners, self._wake_r, self._wake_w]:
            sock.close()
        self._sel.close()
        with self._lock:
            self._closing = True
            self._lock.notify_all()
