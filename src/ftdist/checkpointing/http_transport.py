"""
HTTP checkpoint transport
=========================

The source replica serves its live state over HTTP; a recovering replica
pulls it. ``send_checkpoint`` only publishes a reference to the state (no
copy) and returns; the bytes are written straight from the tensors when a
peer asks. :meth:`HTTPTransport.disallow_checkpoint` (called by the Manager
after the commit vote, before the optimizer mutates the state) waits for
transfers in flight to finish, and cuts off any still running at its
deadline: a slow or hostile reader can delay the training loop by at most
the transport timeout and never fails it.

``GET /checkpoint/{step}/full`` streams everything; with ``num_chunks > 1``
the receiver fetches ``/checkpoint/{step}/{i}`` for each chunk in parallel.
A request for an older step than the one served gets 400 (a replica never
heals from the wrong step); one for a newer step waits, up to the timeout,
for this source to publish it (the peer asked first). The stream format is :mod:`._wire` (plain-data
header, CRC-32 checked); the server's bounds are :mod:`._http_server`.

Failures reach the caller as :class:`~ftdist.errors.CheckpointError`
subclasses that are also ``urllib.error`` errors, as torchft's callers
expect: :class:`CheckpointHTTPError` (an ``HTTPError``) for an answer other
than 200, :class:`CheckpointURLError` (a ``URLError``) when the source cannot
be reached, and :class:`CheckpointTimeoutError` (also a ``TimeoutError``)
when it stalls.
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import socket
import threading
import time
import urllib.error
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from email.message import Message
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import torch

from ftdist import _auth
from ftdist._advertise import advertised_host, log_advertised
from ftdist._gcpause import gc_paused
from ftdist.checkpointing import _direct, _receive, _wire, config
from ftdist.checkpointing._checksum import SegmentSum
from ftdist.checkpointing._codec import LeafMeta
from ftdist.checkpointing._http_server import CheckpointServer, Request, peer_credentials
from ftdist.checkpointing._rwlock import LockClosedError, RWLock
from ftdist.checkpointing._targets import in_place_targets, own_state
from ftdist.checkpointing.transport import CheckpointTransport, TransferProgress, TransferStats
from ftdist.errors import CheckpointError

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Writes below this size are coalesced into one send.
_SMALL_WRITE = 65536


class CheckpointURLError(CheckpointError, urllib.error.URLError):
    """The checkpoint source could not be reached (also a ``urllib.error.URLError``).

    Args:
        reason: what went wrong (an exception or a message).
    """

    def __init__(self, reason: str | BaseException) -> None:
        urllib.error.URLError.__init__(self, reason)

    def __str__(self) -> str:
        return f"<urlopen error {self.reason}>"


class CheckpointTimeoutError(CheckpointURLError, TimeoutError):
    """The checkpoint source stalled past the timeout (also a ``TimeoutError``)."""


class CheckpointHTTPError(CheckpointURLError, urllib.error.HTTPError):
    """The source answered with an error status (also a ``urllib.error.HTTPError``).

    ``str()`` reads ``HTTP Error 400: <the server's reason>``, as urllib's.

    Args:
        url: the URL fetched.
        code: the HTTP status.
        msg: the server's reason phrase.
        hdrs: the response headers.
        body: the start of the response body.
    """

    def __init__(self, url: str, code: int, msg: str, hdrs: Message, body: bytes) -> None:
        urllib.error.HTTPError.__init__(self, url, code, msg, hdrs, io.BytesIO(body))

    def __str__(self) -> str:
        return f"HTTP Error {self.code}: {self.msg}"


def _default_device(meta: LeafMeta) -> torch.device:
    if meta.device.startswith("cuda") and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Where metadata names a source's local socket: ``<address>#local=<name>``.
_LOCAL = "local="


class _LocalConnection(http.client.HTTPConnection):
    """HTTP over a source's abstract Unix socket (a peer on the same host)."""

    def __init__(self, name: str, host: str, port: int | None, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._name = name
        self.peer_pid = 0  # as the kernel names the server's process (0: not in our pid namespace)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect("\0" + self._name)
            # Abstract names are visible to every local user (/proc/net/unix),
            # and a dead source's name can be bound again by anyone: only a
            # server of this user gets the job token and the state's trust.
            pid, uid = peer_credentials(sock)
            if uid != os.getuid():
                raise PermissionError(f"the local socket belongs to uid {uid}, not this user")
            self.peer_pid = pid
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _connect(
    host: str, port: int | None, local: str | None, timeout: float
) -> http.client.HTTPConnection:
    """A connection to the source: over its local socket if it is on this host, else TCP.

    Raises:
        OSError: the source cannot be reached.
    """
    if local is not None and hasattr(socket, "AF_UNIX"):
        conn: http.client.HTTPConnection = _LocalConnection(local, host, port, timeout)
        try:
            conn.connect()
            return conn
        except (OSError, ValueError) as exc:
            # Refused: no such socket in this network namespace, the source is
            # elsewhere. Anything else (a sandbox that forbids Unix sockets, a
            # full accept queue, a socket of another user): TCP still works.
            conn.close()
            if not isinstance(exc, ConnectionRefusedError):
                logger.debug("local socket %r unusable (%s); fetching over TCP", local, exc)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        conn.close()
        raise
    return conn


def _route(conn: http.client.HTTPConnection, direct: bool) -> str:
    if direct:
        return "direct"
    return "local" if isinstance(conn, _LocalConnection) else "tcp"


class HTTPTransport(CheckpointTransport[T]):
    """Serves the live state dict over HTTP and fetches peers' states.

    Starts disallowed: nothing is served until :meth:`send_checkpoint` (or
    :meth:`allow_checkpoint`); a request that comes earlier waits for it, up
    to the timeout.

    Args:
        timeout: per-request socket timeout, how long a request waits for a
            state to be served, and how long :meth:`disallow_checkpoint`
            waits for transfers in flight before cutting them off.
        num_chunks: 0 or 1 for one stream; more for that many parallel
            streams (helps where one TCP stream cannot fill the link).
        hostname: the name peers use to reach this server (default:
            ``FTDIST_ADVERTISE_ADDR``, else ``FTDIST_ADVERTISE_IFNAME``'s
            address, else this host's name).
        token: the job token; peers must present it to fetch this rank's
            state, and it is presented to peers. Default: ``FTDIST_JOB_TOKEN``
            or ``FTDIST_JOB_TOKEN_FILE``; without any, the server is open (as
            torchft's is) and says so once in the log.
        state_dict: optional, as :class:`PGTransport`'s: returns the
            receiver's current state (or None), whose CPU tensors are
            overwritten in place where they match (no fresh memory to fault
            in, about 1.3x the speed). A fetch that fails half-way leaves
            them half overwritten.
        local_socket: also serve peers on this host over an abstract Unix
            socket (Linux), named in :meth:`metadata`; they fetch over it,
            for about 40% less CPU per byte than TCP over loopback. Default:
            ``FTDIST_CHECKPOINT_LOCAL_SOCKET`` (``1``/``0``), else on.
        direct_reads: over the local socket, let a peer copy the state
            straight out of this process's memory, and copy a peer's that
            way when fetching (``process_vm_readv``, where the kernel allows
            it; see :mod:`._direct`): one copy on the receiver's CPU instead
            of two socket copies, one of them the source's. Default:
            ``FTDIST_CHECKPOINT_DIRECT_READS`` (``1``/``0``), else on.

    Raises:
        ValueError: ``num_chunks`` is negative, the token is malformed,
            ``FTDIST_ADVERTISE_IFNAME`` names no interface with an address,
            or ``FTDIST_CHECKPOINT_LOCAL_SOCKET`` or
            ``FTDIST_CHECKPOINT_DIRECT_READS`` is not 1 or 0.
        TypeError: ``timeout`` is not a timedelta.
        OSError: the token file cannot be read.
    """

    def __init__(
        self,
        timeout: timedelta,
        num_chunks: int = 0,
        hostname: str | None = None,
        token: str | None = None,
        state_dict: Callable[[], object] | None = None,
        local_socket: bool | None = None,
        direct_reads: bool | None = None,
    ) -> None:
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
        if not isinstance(num_chunks, int) or num_chunks < 0:
            raise ValueError(f"num_chunks must be an int >= 0, got {num_chunks!r}")
        local = config.local_socket(local_socket)
        self._direct = config.direct_reads(direct_reads) and _direct.supported()
        self._timeout = timeout
        self._num_chunks = num_chunks
        self._receive_into = state_dict
        self._hostname = advertised_host(hostname)
        self._token = _auth.job_token(token)
        _auth.warn_if_open(self._token, "the checkpoint server")
        # torchft's names, which its tests read.
        self._checkpoint_lock = RWLock(timeout.total_seconds())
        self._disallowed = False
        self._step = -1
        self._state_dict: Any = None
        self._streams: list[_wire.Stream] = []
        self._published = threading.Condition()
        self._closed = False
        self.last_transfer: TransferStats | None = None
        self.disallow_checkpoint()  # nothing is served before send_checkpoint
        self._server = CheckpointServer(self._answer, timeout.total_seconds(), self._token, local)
        log_advertised("the checkpoint server", self._hostname, self._server.port)
        if self._server.local_name is not None:
            logger.info(
                "the checkpoint server also serves peers on this host at local socket %s",
                self._server.local_name,
            )

    # -- serving -------------------------------------------------------------
    def _answer(self, req: Request, step: int, key: str) -> None:
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            try:
                self._checkpoint_lock.r_acquire(timeout=max(0.0, deadline - time.monotonic()))
            except LockClosedError:
                req.reply(503, "the checkpoint server is shutting down")
                return
            except TimeoutError:
                req.reply(
                    503,
                    f"timed out after {self._timeout.total_seconds()} s waiting for a "
                    "checkpoint to be served",
                )
                return
            try:
                served = self._step
                if step == served:
                    self._serve(req, step, key)
                    return
                if step < served or time.monotonic() >= deadline:
                    req.reply(
                        400, f"invalid checkpoint requested, serving {served} but got step={step}"
                    )
                    return
            finally:
                self._checkpoint_lock.r_release()
            # A step newer than the one served: this source has not published
            # it yet (a peer asked first). Wait for it, off the lock.
            with self._published:
                self._published.wait_for(
                    lambda served=served: self._step != served or self._closed,  # type: ignore[misc]
                    deadline - time.monotonic(),
                )

    def _serve(self, req: Request, step: int, key: str) -> None:
        streams = self._streams
        if not streams:
            req.reply(503, f"no state is published for step {step}")
            return
        if key == "full":
            stream = streams[0] if len(streams) == 1 else _wire.plan(self._state_dict, step)[0]
        elif int(key) < len(streams):
            stream = streams[int(key)]
        else:
            req.reply(400, f"no chunk {key}: this source serves {len(streams)} chunks")
            return
        # Marked before anything is sent: disallow_checkpoint() cuts off only
        # the requests marked, and the state must not change under this one.
        req.streaming = True
        try:
            if (
                self._direct
                and req.headers.get(_direct.HEADER) == "1"
                and req.connection.family == socket.AF_UNIX
                and _direct.same_user(req.connection)
                and all(t.device.type == "cpu" for t in stream.tensors)
            ):
                self._write_direct(req, stream)
                return
            req.responded = True
            req.send_response(200)
            req.send_header("Content-Type", "application/octet-stream")
            req.send_header("Content-Length", str(stream.size))
            req.end_headers()
            self._write(req, _wire.chunks(stream))
        finally:
            req.streaming = False

    @classmethod
    @gc_paused()
    def _write_direct(cls, req: Request, stream: _wire.Stream) -> None:
        # Views of the live tensors (a copy for a tensor with gaps), held here
        # until the peer is done: the addresses sent must stay valid.
        flats = [_wire.flat_bytes(t) for t in stream.tensors]
        req.responded = True
        req.send_response(200)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header(_direct.HEADER, str(os.getpid()))
        req.end_headers()
        req.wfile.write(stream.head + _direct.manifest(flats))
        verdict = req.connection.recv(1)
        if verdict == _direct.STREAM:
            del flats
            pieces = _wire.chunks(stream)
            next(pieces)  # the head, sent already
            cls._write(req, pieces)
            return
        if verdict != _direct.GO:
            raise ConnectionAbortedError(f"the peer answered {verdict!r} to a direct read's offer")
        # Summed while the peer copies, on the other core.
        digest = _direct.source_digest(flats)
        _direct.wait_copied(req.connection)
        if req.aborted:
            raise ConnectionAbortedError("the state was revoked during a direct read")
        req.wfile.write(_wire.trailer_bytes(len(stream.head) + stream.body_len, digest))

    @staticmethod
    @gc_paused()
    def _write(req: Request, pieces: Generator[memoryview | bytes, None, None]) -> None:
        # Closed here, not whenever a traceback lets go of it: its summing
        # thread stops with the transfer.
        try:
            small = bytearray()
            for buf in pieces:
                if req.aborted:
                    raise ConnectionAbortedError("the state was revoked")
                # Coalesce small pieces into one write; stream big ones as is.
                if len(buf) < _SMALL_WRITE:
                    small += buf
                    continue
                if small:
                    req.wfile.write(small)
                    small = bytearray()
                req.wfile.write(buf)
            if small:
                req.wfile.write(small)
        finally:
            pieces.close()

    def address(self) -> str:
        """``http://host:port/checkpoint/``: append the step to fetch a state."""
        host = f"[{self._hostname}]" if ":" in self._hostname else self._hostname
        return f"http://{host}:{self._server.port}/checkpoint/"

    def metadata(self) -> str:
        """What peers pass to :meth:`recv_checkpoint`.

        :meth:`address`, and where this server also listens on a local
        socket, its name after ``#local=``: a peer on this host fetches over
        it, any other over TCP.
        """
        name = self._server.local_name
        return self.address() if name is None else f"{self.address()}#{_LOCAL}{name}"

    def allow_checkpoint(self, step: int) -> None:
        """Serve the published state as step ``step`` (idempotent)."""
        with self._published:
            self._step = step
            self._published.notify_all()
        if self._disallowed:
            self._disallowed = False
            self._checkpoint_lock.w_release()

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | None = None
    ) -> None:
        """Serve ``state_dict`` (by reference, not copied) as step ``step``.

        Returns at once; peers pull. The state must not change until
        :meth:`disallow_checkpoint` returns.

        Raises:
            TypeError: the state holds a leaf no transport can carry (the
                message names it).
            ValueError: the state has too many leaves for one header.
        """
        streams = _wire.plan(state_dict, step, max(1, self._num_chunks))
        self.disallow_checkpoint()
        self._state_dict = state_dict
        self._streams = streams
        self.allow_checkpoint(step)

    def disallow_checkpoint(self) -> None:
        """Stop serving; returns once no transfer reads the state (idempotent).

        Transfers in flight may finish within the transport timeout; any
        still running then is cut off (its peer gets an error and heals
        again). New requests wait for the next :meth:`allow_checkpoint`.
        Never raises because of a peer.
        """
        if self._disallowed:
            return
        self._disallowed = True
        try:
            self._checkpoint_lock.w_acquire()
        except LockClosedError:
            return
        except TimeoutError:
            cut = self._server.abort_transfers()
            logger.warning(
                "%d checkpoint transfer(s) of step %d still running after %s: cut off so the "
                "state can change (their peers will retry)",
                cut,
                self._step,
                self._timeout,
            )
            try:
                self._checkpoint_lock.w_acquire(timeout=min(1.0, self._timeout.total_seconds()))
            except TimeoutError:
                # A cut-off transfer can no longer complete: its peer sees a
                # truncated stream whatever it reads from now on.
                self._checkpoint_lock.w_force()
        self._streams = []
        self._state_dict = None

    # -- fetching ------------------------------------------------------------
    def _fetch(
        self,
        url: str,
        local: str | None,
        step: int,
        timeout: timedelta,
        own: object,
        progress: TransferProgress | None = None,
        sums: dict[int, SegmentSum] | None = None,
    ) -> tuple[_wire.Header, dict[int, torch.Tensor], int, str]:
        cpu = torch.device("cpu")
        parts = urlsplit(url)
        seconds = timeout.total_seconds()
        headers = {} if self._token is None else {"Authorization": _auth.bearer(self._token)}
        conn: http.client.HTTPConnection | None = None
        # The way back to the source for a direct read's verdict: http.client
        # hands its socket over to a response that ends with the connection.
        back: socket.socket | None = None
        resp: http.client.HTTPResponse | None = None
        try:
            conn = _connect(parts.hostname or "", parts.port, local, seconds)
            if self._direct and isinstance(conn, _LocalConnection) and conn.peer_pid > 0:
                headers[_direct.HEADER] = "1"
                back = conn.sock.dup()
            conn.request("GET", parts.path, headers=headers)
            resp = conn.getresponse()
            if resp.status != 200:
                body = resp.read(2000)
                raise CheckpointHTTPError(url, resp.status, resp.reason, resp.headers, body)
            reader = _wire.StreamReader(resp.readinto, url)
            offered = resp.getheader(_direct.HEADER)
            if progress is not None and resp.length:
                progress.expect(resp.length)
            direct: list[_direct.DirectBody] = []

            def direct_body(header: _wire.Header) -> _direct.DirectBody | None:
                if back is None or not isinstance(conn, _LocalConnection):
                    raise CheckpointError(f"{url} offered a direct read that was not asked for")
                entries = _direct.parse_manifest(
                    reader.read_exact, [header.leaves[i].nbytes for i in header.carried], url
                )
                if progress is not None:  # what a stream would have announced
                    progress.expect(reader.total + header.body_len + _wire.TRAILER_BYTES)
                source = _direct.DirectBody(conn.peer_pid, entries, reader, back.sendall)
                # Another pid than the socket's peer: not a process this one can address.
                if not source.start(offered == str(conn.peer_pid)):
                    return None
                direct.append(source)
                return source

            header, tensors = _receive.read_leaves(
                reader,
                step,
                _default_device,
                size=resp.length,
                targets=lambda header: in_place_targets(own, header, cpu),
                progress=progress.add if progress is not None else None,
                body=direct_body if offered is not None else None,
                reserve=self.receive_reserve,
                sums=sums,
            )
            return header, tensors, reader.total, _route(conn, bool(direct))
        except CheckpointError:
            raise
        except TimeoutError as exc:
            raise CheckpointTimeoutError(f"fetching {url} timed out after {seconds} s") from exc
        except OSError as exc:
            raise CheckpointURLError(exc) from exc
        except http.client.HTTPException as exc:
            raise CheckpointURLError(f"fetching {url} failed: {exc!r}") from exc
        finally:
            # The response holds the socket once http.client hands it over: a
            # source must not wait on it for its timeout after a failed read.
            if resp is not None:
                resp.close()
            if back is not None:
                back.close()
            if conn is not None:
                conn.close()

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None
    ) -> T:
        """Fetch the state of ``step`` from the source at ``metadata``.

        Raises:
            CheckpointHTTPError: the source refused (another step is served:
                ``serving {cur} but got step={step}``; no token: 401).
            CheckpointTimeoutError: the source stalled past ``timeout`` (a
                zero timeout, at once).
            CheckpointURLError: the source cannot be reached.
            CheckpointError: the stream was malformed, truncated or corrupted.
        """
        timeout = self._timeout if timeout is None else timeout
        if timeout.total_seconds() <= 0:
            # As urllib's: no time at all is a timeout, never a non-blocking
            # socket that may or may not hold the next bytes yet.
            raise CheckpointTimeoutError(
                f"fetching step {step} from {metadata} timed out: the timeout is {timeout}"
            )
        start = time.perf_counter()
        address, _, hint = metadata.partition("#")
        local = hint[len(_LOCAL) :] if hint.startswith(_LOCAL) else None
        base = f"{address}{step}"
        tracker = TransferProgress(self.progress) if self.progress is not None else None
        # Asked once, for every chunk: a user's state_dict() may be costly.
        own = own_state(self._receive_into, self.receive_into)
        sums: dict[int, SegmentSum] = {}  # chunks fill disjoint leaf indices
        if self._num_chunks <= 1:
            header, tensors, nbytes, route = self._fetch(
                f"{base}/full", local, step, timeout, own, tracker, sums
            )
        else:
            with ThreadPoolExecutor(self._num_chunks, thread_name_prefix="ftdist-fetch") as pool:
                parts = list(
                    pool.map(
                        lambda i: self._fetch(
                            f"{base}/{i}", local, step, timeout, own, tracker, sums
                        ),
                        range(self._num_chunks),
                    )
                )
            header = parts[0][0]
            for part in parts[1:]:
                _wire.same_state(header, part[0], metadata)
            tensors = {k: v for part in parts for k, v in part[1].items()}
            nbytes = sum(part[2] for part in parts)
            # The chunks' routes, "local+tcp" if some fell back to TCP.
            route = "+".join(sorted({part[3] for part in parts}))
        state = cast(T, _receive.assemble(header, tensors))
        self.last_transfer = TransferStats.of_receive(
            nbytes, time.perf_counter() - start, route, tensors, sums
        )
        return state

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server, cut off its connections (and join its threads if ``wait``)."""
        with self._published:
            self._closed = True
            self._published.notify_all()
        self._checkpoint_lock.close()
        self._server.shutdown(wait)
