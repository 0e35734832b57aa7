"""Heals between processes on one host that copy straight from the source's memory.

Real processes, real abstract Unix sockets and the real kernel call
(``process_vm_readv``); where a source must misbehave, a hand-written one
speaks the exchange over a real socket.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from ftdist.checkpointing import HTTPTransport, _direct, _wire
from ftdist.errors import CheckpointError
from ftdist.launch.ranks import RankContext, run_ranks

TIMEOUT = timedelta(seconds=10)
State = dict[str, Any]

pytestmark = pytest.mark.skipif(
    not _direct.supported(), reason="process_vm_readv is Linux's (this platform has none)"
)


def _state(seed: int = 0) -> State:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(300, 257, generator=g)
    return {
        "w": weight,
        "w_t": weight.t(),  # dense, transposed: read as laid out
        "gappy": torch.randn(40, 60, generator=g)[:, ::2],  # not dense: read from a copy
        "b": torch.randn(257, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: several pieces
        "step": 7,
    }


def _assert_same(a: State, b: State) -> None:
    assert list(a) == list(b)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert b[key].dtype == value.dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key
    assert b["w_t"].stride() == (1, 257)  # as laid out at the source


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# -- between two real processes --------------------------------------------------------------


def _drop_ptrace_capability() -> None:
    """Take CAP_SYS_PTRACE out of this process's capability sets (where it has it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two words of (effective, permitted, inheritable)
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    bit = 1 << 19  # CAP_SYS_PTRACE
    data[0] &= ~bit
    data[1] &= ~bit
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _heal(ctx: RankContext, how: str) -> dict[str, Any]:
    store = ctx.store()
    handler = _Lines()
    logging.getLogger("ftdist.checkpointing.http").addHandler(handler)
    logging.getLogger("ftdist.checkpointing.http").setLevel(logging.INFO)
    chunks = 3 if how == "chunks" else 0
    mine = _state(99) if how == "in-place" else None
    transport = HTTPTransport[State](
        TIMEOUT,
        num_chunks=chunks,
        hostname="127.0.0.1",
        state_dict=(lambda: mine) if mine is not None else None,
    )
    try:
        if ctx.rank == 0:
            if how == "refused":
                # A non-dumpable source: only CAP_SYS_PTRACE may read it.
                ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
            transport.send_checkpoint([1], 5, _state(), TIMEOUT)
            store.set("metadata", transport.metadata())
            store.wait(["done"], timedelta(seconds=30))
            return {}
        if how == "refused":
            _drop_ptrace_capability()
        got = transport.recv_checkpoint(0, store.get("metadata").decode(), 5, TIMEOUT)
        _assert_same(_state(), got)
        assert transport.last_transfer is not None
        out = {
            "route": transport.last_transfer.route,
            "nbytes": transport.last_transfer.nbytes,
            "logs": handler.lines,
            "in_place": mine is not None and got["big"].data_ptr() == mine["big"].data_ptr(),
        }
        store.set("done", "1")
        return out
    finally:
        transport.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["fresh", "in-place", "chunks"])
def test_a_heal_on_this_host_reads_the_source_memory(how: str) -> None:
    result = run_ranks(_heal, 2, how, timeout=80)[1]
    assert result["route"] == "direct"
    assert result["in_place"] is (how == "in-place")
    assert result["nbytes"] > (3 << 20) * 4


@pytest.mark.timeout(90)
def test_a_source_the_kernel_will_not_let_us_read_streams_instead() -> None:
    result = run_ranks(_heal, 2, "refused", timeout=80)[1]
    assert result["route"] == "local"  # the same exchange, the bytes over the socket
    said = [line for line in result["logs"] if "does not let this process read" in line]
    assert len(said) == 1, result["logs"]


# -- sources that misbehave, written by hand -------------------------------------------------


def _read_head(conn: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        piece = conn.recv(4096)
        if not piece:
            raise ConnectionError("the peer closed before its head ended")
        head += piece
    return head


Source = Callable[..., str]


@pytest.fixture
def fake_source() -> Iterator[Source]:
    """``start(answer, asks=True)`` serves one request on an abstract socket with
    ``answer(conn)``, after checking whether the request asked for a direct read;
    returns the metadata that names it."""
    servers: list[tuple[socket.socket, threading.Thread]] = []
    errors: list[BaseException] = []

    def start(answer: Callable[[socket.socket], None], asks: bool = True) -> str:
        name = f"ftdist-test-direct-{uuid.uuid4().hex}"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind("\0" + name)
        server.listen(1)
        server.settimeout(10)

        def run() -> None:
            try:
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(10)
                    assert (b"X-Ftdist-Direct: 1" in _read_head(conn)) is asks
                    answer(conn)
            except BaseException as exc:  # reported by the fixture
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:9/checkpoint/#local={name}"

    yield start
    for server, thread in servers:
        thread.join(timeout=10)
        server.close()
    assert not errors, errors


def _offer(
    state: State,
    pid: int | None = None,
    entries: bytes | None = None,
    change: Callable[[], None] | None = None,
    verdicts: list[bytes] | None = None,
) -> Callable[[socket.socket], None]:
    """A source's answer: offers ``state`` for a direct read, then acts on the verdict."""
    stream = _wire.plan(state, 3)[0]
    flats = [_wire.flat_bytes(t) for t in stream.tensors]

    def answer(conn: socket.socket) -> None:
        digest = _direct.source_digest(flats)
        if change is not None:
            change()  # the state moves on after it was summed
        conn.sendall(
            b"HTTP/1.0 200 OK\r\n"
            + f"X-Ftdist-Direct: {os.getpid() if pid is None else pid}\r\n\r\n".encode()
        )
        conn.sendall(stream.head + (_direct.manifest(flats) if entries is None else entries))
        verdict = conn.recv(1)
        if verdicts is not None:
            verdicts.append(verdict)
        if verdict == _direct.GO:
            _direct.wait_copied(conn)
            conn.sendall(_wire.trailer_bytes(len(stream.head) + stream.body_len, digest))
        elif verdict == _direct.STREAM:
            pieces = _wire.chunks(stream)
            next(pieces)
            for piece in pieces:
                conn.sendall(piece)

    return answer


@pytest.fixture
def receiver() -> Iterator[HTTPTransport[State]]:
    dst = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1")
    yield dst
    dst.shutdown()


@pytest.mark.timeout(30)
def test_an_offer_from_another_pid_than_the_sockets_peer_is_streamed(
    fake_source: Source, receiver: HTTPTransport[State]
) -> None:
    # A source in another pid namespace names a pid this process cannot address.
    verdicts: list[bytes] = []
    state = _state()
    got = receiver.recv_checkpoint(0, fake_source(_offer(state, pid=1, verdicts=verdicts)), 3)
    assert verdicts == [_direct.STREAM]
    _assert_same(state, got)
    assert receiver.last_transfer is not None and receiver.last_transfer.route == "local"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "lie, message",
    [
        ("count", "offered 1 tensors to read directly, its header carries 6"),
        ("length", "offered a tensor of 1 bytes to read directly"),
        ("address", "reading .* memory failed"),
    ],
)
def test_a_manifest_that_lies_is_an_error(
    fake_source: Source,
    receiver: HTTPTransport[State],
    lie: str,
    message: str,
) -> None:
    state = _state()
    stream = _wire.plan(state, 3)[0]
    flats = [_wire.flat_bytes(t) for t in stream.tensors]
    entries = [(f.data_ptr(), f.numel()) for f in flats]
    if lie == "count":
        entries = entries[:1]
    elif lie == "length":
        entries[0] = (entries[0][0], 1)
    else:
        entries = [(4096, n) for _, n in entries]  # the first page: never mapped
    raw = struct.pack("<Q", len(entries)) + b"".join(struct.pack("<QQ", *e) for e in entries)
    with pytest.raises(CheckpointError, match=message):
        receiver.recv_checkpoint(0, fake_source(_offer(state, entries=raw)), 3)


@pytest.mark.timeout(30)
def test_a_state_that_changes_under_the_read_is_an_error(
    fake_source: Source, receiver: HTTPTransport[State]
) -> None:
    state = _state()
    with pytest.raises(CheckpointError, match="corrupt"):
        receiver.recv_checkpoint(
            0, fake_source(_offer(state, change=lambda: state["big"].add_(1))), 3
        )


@pytest.mark.timeout(30)
def test_an_offer_that_was_not_asked_for_is_an_error(fake_source: Source) -> None:
    dst = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1", direct_reads=False)
    try:
        with pytest.raises(CheckpointError, match="offered a direct read that was not asked for"):
            dst.recv_checkpoint(0, fake_source(_offer(_state()), asks=False), 3)
    finally:
        dst.shutdown()


# -- the real source, against clients that misbehave -----------------------------------------


def _ask(src: HTTPTransport[State], step: int) -> tuple[socket.socket, list[tuple[int, int]]]:
    """A raw client: asks for a direct read and reads up to the manifest."""
    name = src.metadata().split("#local=")[1]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect("\0" + name)
    conn.sendall(f"GET /checkpoint/{step}/full HTTP/1.0\r\nX-Ftdist-Direct: 1\r\n\r\n".encode())
    data = _read_head(conn)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert f"X-Ftdist-Direct: {os.getpid()}".encode() in head
    buf = bytearray(rest)

    def take(n: int) -> bytes:
        while len(buf) < n:
            piece = conn.recv(65536)
            if not piece:
                raise ConnectionError("closed")
            buf.extend(piece)
        out = bytes(buf[:n])
        del buf[:n]
        return out

    header_len = _wire.parse_prefix(take(_wire.PREFIX_BYTES), "source")[0]
    take(header_len)
    (count,) = struct.unpack("<Q", take(8))
    entries = [struct.unpack("<QQ", take(16)) for _ in range(count)]
    return conn, entries


@pytest.mark.timeout(30)
@pytest.mark.parametrize("verdict", [b"X", b""])
def test_a_client_that_garbles_its_verdict_costs_its_connection_only(
    receiver: HTTPTransport[State], verdict: bytes
) -> None:
    src = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1")
    try:
        state = _state()
        src.send_checkpoint([1], 3, state, TIMEOUT)
        conn, entries = _ask(src, 3)
        assert len(entries) == 6 and entries[-1][1] == (3 << 20) * 4
        with conn:
            if verdict:
                conn.sendall(verdict)
            else:
                conn.shutdown(socket.SHUT_WR)  # gone without a word
            assert conn.recv(100) == b""  # no trailer: the source hung up
        _assert_same(state, receiver.recv_checkpoint(0, src.metadata(), 3, TIMEOUT))
        assert receiver.last_transfer is not None and receiver.last_transfer.route == "direct"
    finally:
        src.shutdown()


@pytest.mark.timeout(60)
def test_a_reader_that_never_answers_cannot_hold_the_state() -> None:
    quick = timedelta(seconds=1)
    src = HTTPTransport[State](quick, hostname="127.0.0.1")
    try:
        state = _state()
        src.send_checkpoint([1], 3, state, quick)
        conn, _ = _ask(src, 3)
        with conn:
            done = threading.Event()

            def disallow() -> None:
                src.disallow_checkpoint()
                done.set()

            threading.Thread(target=disallow).start()
            assert done.wait(20), "disallow_checkpoint hung behind a direct reader"
            state["big"].zero_()  # the optimizer step
            # Too late: the source hung up, so no trailer ever vouches for what
            # this reader might have copied.
            try:
                conn.sendall(_direct.COPIED)
            except OSError:
                pass
            try:
                rest = conn.recv(100)
            except ConnectionResetError:
                # COPIED reached a socket the source had already closed, and
                # the kernel answered with a reset: hung up all the same.
                rest = b""
            assert rest == b""
    finally:
        src.shutdown()


@pytest.mark.timeout(60)
def test_a_slow_copy_that_keeps_going_outlasts_the_source_timeout() -> None:
    # The source waits for each progress byte within its timeout, as for a
    # stream's writes, not for the whole copy.
    src = HTTPTransport[State](timedelta(seconds=1.5), hostname="127.0.0.1")
    dst = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1")
    try:
        state = {f"t{i}": torch.full((16 << 20,), float(i)) for i in range(3)}  # 3 x 64 MiB
        src.send_checkpoint([1], 2, state, TIMEOUT)
        dst.progress = lambda done, total: time.sleep(0.04)  # 48 pieces: about 2 s in all
        got = dst.recv_checkpoint(0, src.metadata(), 2, TIMEOUT)
        assert dst.last_transfer is not None and dst.last_transfer.route == "direct"
        assert all(torch.equal(got[k], v) for k, v in state.items())
    finally:
        src.shutdown()
        dst.shutdown()


@pytest.mark.timeout(60)
def test_a_receive_that_fails_lets_go_of_the_source_at_once() -> None:
    src = HTTPTransport[State](timedelta(seconds=30), hostname="127.0.0.1")
    dst = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1")
    try:
        src.send_checkpoint([1], 2, _state(), TIMEOUT)

        def fail(done: int, total: int) -> None:
            raise RuntimeError("the receiver gave up")

        dst.progress = fail
        with pytest.raises(RuntimeError, match="gave up") as failed:
            dst.recv_checkpoint(0, src.metadata(), 2, TIMEOUT)
        # The error (and its traceback) still alive, as a Manager keeps it
        # until the next quorum: the source must not wait out its timeout.
        assert failed.value is not None
        done = threading.Event()

        def disallow() -> None:
            src.disallow_checkpoint()
            done.set()

        threading.Thread(target=disallow).start()
        assert done.wait(15), "the source waited on a receiver that had failed"
    finally:
        src.shutdown()
        dst.shutdown()


# -- the kernel call ---------------------------------------------------------------------------


def test_read_memory_names_the_kernels_refusal() -> None:
    here = torch.arange(16, dtype=torch.uint8)
    there = torch.zeros(16, dtype=torch.uint8)
    _direct.read_memory(os.getpid(), there.data_ptr(), here.data_ptr(), 16)
    assert torch.equal(here, there)
    with pytest.raises(OSError) as bad:
        _direct.read_memory(os.getpid(), there.data_ptr(), 4096, 16)
    assert bad.value.errno == errno.EFAULT and not _direct.refused(bad.value)
    child = subprocess.Popen(["true"])
    child.wait(timeout=10)
    with pytest.raises(OSError) as gone:  # a reaped pid: no such process
        _direct.read_memory(child.pid, there.data_ptr(), here.data_ptr(), 16)
    assert gone.value.errno == errno.ESRCH and _direct.refused(gone.value)


@pytest.mark.timeout(30)
def test_many_spans_copy_in_calls_of_at_most_iov_max_and_a_bad_address_says_so() -> None:
    # 3000 spans of a child process's memory (more than IOV_MAX, with empty
    # ones among them), read in as few system calls as the kernel takes.
    sources = [torch.arange(n % 37, dtype=torch.int32) + n for n in range(3000)]
    child_r, parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child keeps its copy of the tensors until told to go
        os.close(parent_w)
        os.read(child_r, 1)
        os._exit(0)
    os.close(child_r)
    try:
        targets = [torch.zeros_like(t) for t in sources]
        spans = [
            (d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())
            for d, s in zip(targets, sources, strict=True)
        ]
        _direct.read_memory_many(pid, spans)
        assert all(torch.equal(d, s) for d, s in zip(targets, sources, strict=True))
        with pytest.raises(OSError) as info:
            _direct.read_memory_many(pid, [(targets[5].data_ptr(), 8, 4)])  # page 0: unmapped
        assert info.value.errno == errno.EFAULT
    finally:
        os.write(parent_w, b"x")
        os.close(parent_w)
        os.waitpid(pid, 0)
