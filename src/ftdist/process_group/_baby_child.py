"""
The program a Baby group's child process runs
=============================================

A child starts as a warm spare: torch is already imported (it is forked from
a fork server that preloaded it) and it blocks waiting for a ``configure``
message. Once configured it serves collectives until its pipe closes.

Ops are issued asynchronously and answered from the backend's completion
callbacks, so an ``irecv`` posted before an ``isend`` cannot deadlock the
child. Replies are strings, never exception objects: a C++ exception type
may not unpickle in the parent.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import re
import signal
import threading
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from ftdist.process_group._shm import Importer
from ftdist.process_group._store import create_store_client
from ftdist.process_group.gloo import create_gloo_backend
from ftdist.process_group.nccl import create_nccl_backend
from ftdist.process_group.work import on_complete
from ftdist.process_group.xccl import create_xccl_backend

_BACKENDS = {"gloo": create_gloo_backend, "nccl": create_nccl_backend, "xccl": create_xccl_backend}


# The signal on which a child writes every thread's Python stack to its
# stacks pipe: how a child that stopped answering explains itself. Not
# SIGUSR1, which launchers and test harnesses take for their own dumps.
STACKS_SIGNAL = signal.SIGUSR2


def child_main(conn: Connection, stacks: Connection) -> None:
    """Entry point of a Baby child; exits the process when done.

    Args:
        conn: the duplex pipe to the parent (configure, ops, replies).
        stacks: the write end of a pipe the parent reads this process's
            Python stacks from after sending :data:`STACKS_SIGNAL`.
    """
    # Ctrl-C in a terminal reaches the whole process group; the parent
    # decides when its backend dies, not the keyboard.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # From the signal handler, in C: a child stuck in a backend's C++ code,
    # GIL held or not, still answers.
    faulthandler.register(STACKS_SIGNAL, file=stacks.fileno(), all_threads=True, chain=False)
    try:
        conn.send(("up",))
        msg = conn.recv()
        if msg[0] == "configure":
            backend = _configure(conn, *msg[1:])
            if backend is not None:
                # An XCCL backend's tensors are XPU tensors: known once, not per op.
                _serve(conn, backend, xpu=msg[1] == "xccl")
    except (EOFError, OSError):
        pass
    # Skip interpreter teardown: a backend blocked on a dead peer would make
    # its destructor wait out the collective timeout.
    os._exit(0)


def _configure(
    conn: Connection,
    kind: str,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta,
    device: int | None,
) -> Any:
    try:
        if device is not None:
            (torch.xpu if kind == "xccl" else torch.cuda).set_device(device)
        store = create_store_client(store_addr, timeout=timeout)
        backend = _BACKENDS[kind](store, rank, world_size, timeout)
    except Exception as exc:
        # Whether peers simply did not arrive in time: the parent then
        # raises a TimeoutError (as torchft does), not a plain failure.
        timed_out = isinstance(exc, (TimeoutError, dist.DistStoreError)) or bool(
            re.search(r"time[d ]*out", str(exc), re.IGNORECASE)
        )
        conn.send(("error", f"{type(exc).__name__}: {exc}", timed_out))
        return None
    conn.send(("ready", os.getpid()))
    return backend


def _on_done(
    reply: Any,
    op_id: int,
    name: str,
    work: Any,
    cuda: bool,
    xpu: bool,
    _value: Any,
    error: BaseException | None,
) -> None:
    if error is not None:
        reply(("done", op_id, f"{type(error).__name__}: {error}", None))
        return
    try:
        extra: Any = None
        if name == "recv_anysource":
            extra = work.source_rank()
        if xpu:
            # No inter-process XPU events: finish the op before answering.
            work.wait()
            torch.xpu.synchronize()
        if cuda:
            work.wait()
            event = torch.cuda.Event(interprocess=True)
            event.record()
            extra = event
    except Exception as exc:
        reply(("done", op_id, f"{type(exc).__name__}: {exc}", None))
        return
    reply(("done", op_id, None, extra))


def _serve(conn: Connection, backend: Any, xpu: bool) -> None:
    importer = Importer()
    send_lock = threading.Lock()

    def reply(msg: tuple[Any, ...]) -> None:
        with send_lock:
            try:
                conn.send(msg)
            except OSError:
                pass  # the parent is gone; the read loop will notice

    while True:
        msg = conn.recv()
        if msg[0] != "op":
            return
        _, op_id, name, args, new, retired, event = msg
        importer.add(new)
        importer.drop(retired)
        try:
            decoded = importer.decode(args)
            if event is not None:
                event.wait()
            work = getattr(backend, name)(*decoded)
        except Exception as exc:
            reply(("done", op_id, f"{type(exc).__name__}: {exc}", None))
            continue
        if work is None:
            reply(("done", op_id, None, None))
            continue
        on_complete(
            work, functools.partial(_on_done, reply, op_id, name, work, event is not None, xpu)
        )
