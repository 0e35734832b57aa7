"""
launch_subprocesses
===================

ml-starter's ``launch_subprocesses``: run a function in one process per rank,
each with torch.distributed and its model-, pipeline- and data-parallel
groups initialised, and raise in the caller if any of them fails.

What it adds:

- **Fault tolerance** (``fault_tolerant=True`` or a
  :class:`~ftdist.launch.config.FaultTolerance`): the world is split into
  data-parallel replica groups of ``model_parallelism *
  pipeline_parallelism`` ranks; each group is a torch.distributed world of
  its own, runs under a :class:`~ftdist.manager.Manager` per rank (see
  :func:`~ftdist.launch.get_manager`), and is restarted from the warm fork
  server when one of its processes fails, while the other groups keep
  training.
- **No port race**: the rendezvous store is bound by this process (port 0
  unless ``master_port`` is set) before any child starts.
- **No orphans**: children die with this process, even when it is SIGKILLed.

Reserved keyword: ``fault_tolerant`` is taken by the launcher, never passed
to the function.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ftdist.launch.config import (
    FaultTolerance,
    MultiprocessConfig,
    is_missing,
)

logger = logging.getLogger(__name__)


def process_context(method: str) -> Any:
    """The multiprocessing context of a launch method ("forkserver" is ftdist's fork server).

    Raises:
        ValueError: ``method`` is not a start method of this platform.
    """
    import multiprocessing as mp

    if method == "forkserver":
        from ftdist._forkserver import forkserver_context

        return forkserver_context()
    return mp.get_context(method)


def _check_picklable(method: str, **things: Any) -> None:
    if method == "fork":
        return
    for name, value in things.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"{name} must be picklable to reach a {method!r} child: use a module-level "
                f"function (or functools.partial of one) and picklable arguments; "
                f"pickling {value!r} failed: {exc}"
            ) from exc


def _rendezvous(cfg: MultiprocessConfig) -> tuple[bool, int]:
    """``(store_is_tcp, port)``: whether children meet on a TCPStore, and its port."""
    url = urlsplit(cfg.init_method)
    if url.scheme == "env":
        return True, cfg.master_port
    if url.scheme == "tcp":
        if url.port is None:
            raise ValueError(f"init_method {cfg.init_method!r} has no port: use tcp://host:port")
        return True, url.port
    return False, cfg.master_port


def _run_in_process(
    func: Callable[..., None],
    cfg: MultiprocessConfig,
    setup: Callable[[], None] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    from ftdist.launch import process

    logger.warning("Multi-process trainer expects more than one device; running single-process")
    cfg.rank, cfg.local_rank = 0, 0
    saved = dict(os.environ)
    try:
        if setup is not None:
            setup()
        process.init_and_run(func, cfg, *args, **kwargs)
    finally:
        # Leaves the caller as it found it, so that it can launch again.
        process.teardown()
        os.environ.clear()
        os.environ.update(saved)


def launch_subprocesses(
    func: Callable[..., None],
    cfg: MultiprocessConfig,
    setup: Callable[[], None] | None = None,
    rank_offset: int = 0,
    *args: Any,
    fault_tolerant: bool | FaultTolerance = False,
    **kwargs: Any,
) -> None:
    """Run ``func(*args, **kwargs)`` in one process per rank and wait for all of them.

    Each process runs ``setup()`` (if given), initialises torch.distributed
    and the parallel groups (:func:`~ftdist.launch.init_and_run`), then
    ``func``. With ``cfg.world_size <= 1`` (and no fault tolerance), ``func``
    runs in this process instead.

    Args:
        func: the function; picklable (module-level) unless ``launch_method="fork"``.
        cfg: the configuration; resolved in place
            (:meth:`MultiprocessConfig.resolve`), with ``master_port`` set
            to the port actually bound.
        setup: run in each process before anything else (seeding, logging).
        rank_offset: the global rank of this call's first process, to launch
            a slice of a larger world: this call starts
            ``cfg.local_world_size`` processes if that is set, else the
            ranks ``rank_offset .. world_size - 1``.
        args: positional arguments for ``func``.
        fault_tolerant: ``True`` or a :class:`FaultTolerance`: run each
            data-parallel replica group under a Manager and restart a failed
            group (see the module docstring).
        kwargs: keyword arguments for ``func``.

    Raises:
        ProcessFailedError: a process raised, exited non-zero or died (with
            fault tolerance: a replica group ran out of restarts); it carries
            the rank and the child's traceback, and the other processes were
            stopped. A ``RuntimeError``.
        TypeError: ``func``/``setup`` is not callable or not picklable, or
            ``cfg`` is not a :class:`MultiprocessConfig`.
        ValueError: an inconsistent configuration (sizes, offsets, ports).
        OSError: the configured ``master_port`` is in use.
    """
    if not callable(func):
        raise TypeError(f"func must be callable, got {func!r}")
    if setup is not None and not callable(setup):
        raise TypeError(f"setup must be callable or None, got {setup!r}")
    if not isinstance(cfg, MultiprocessConfig) and not hasattr(cfg, "_get_node"):
        raise TypeError(f"cfg must be a MultiprocessConfig, got {type(cfg).__name__}")
    if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
        raise ValueError(f"rank_offset must be an int >= 0, got {rank_offset!r}")
    ft = FaultTolerance() if fault_tolerant is True else fault_tolerant or None
    if ft is not None and not isinstance(ft, FaultTolerance):
        raise TypeError(f"fault_tolerant must be a bool or FaultTolerance, got {fault_tolerant!r}")
    explicit_local = not is_missing(cfg, "local_world_size")
    auto_port = is_missing(cfg, "master_port")
    if ft is not None and (rank_offset or not auto_port or cfg.init_method != "env://"):
        raise ValueError(
            "fault-tolerant launches start the whole world (rank_offset=0) and bind a store "
            "per replica group on a free port: leave master_port unset and init_method at "
            "'env://'"
        )
    if auto_port:
        cfg.master_port = 0  # bound by the store below: never a race
    MultiprocessConfig.resolve(cfg)
    if cfg.world_size <= 1 and ft is None:
        _run_in_process(func, cfg, setup, args, kwargs)
        return
    count = cfg.local_world_size if explicit_local else cfg.world_size - rank_offset
    if count < 1 or rank_offset + count > cfg.world_size:
        raise ValueError(
            f"rank_offset {rank_offset} with {count} processes does not fit a world of "
            f"{cfg.world_size}; set local_world_size to the processes of this call"
        )
    tcp_store, port = _rendezvous(cfg)
    if rank_offset and (auto_port or port == 0):
        raise ValueError(
            "with rank_offset > 0 the processes join a store on another launcher: "
            "set master_port (or a tcp:// init_method) to its port"
        )
    _check_picklable(cfg.launch_method, func=func, setup=setup, args=args, kwargs=kwargs)
    if ft is None:
        _launch(func, cfg, setup, args, kwargs, rank_offset, count, tcp_store, port)
    else:
        from ftdist.launch.fault_tolerant import launch_fault_tolerant

        if count != cfg.world_size:
            raise ValueError(
                "fault-tolerant launches start the whole world: leave local_world_size unset "
                f"or set it to world_size ({cfg.world_size})"
            )
        launch_fault_tolerant(
            func, cfg, setup, args, kwargs, ft, process_context(cfg.launch_method)
        )


def _launch(
    func: Callable[..., None],
    cfg: MultiprocessConfig,
    setup: Callable[[], None] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rank_offset: int,
    count: int,
    tcp_store: bool,
    port: int,
) -> None:
    from ftdist.launch.children import FunctionJob
    from ftdist.launch.supervisor import Supervisor

    env = {"TORCHELASTIC_USE_AGENT_STORE": "True"} if tcp_store else {}

    def make_job(rank: int, group: int, attempt: int, store_port: int) -> tuple[Any, Any]:
        child = copy.copy(cfg)
        child.rank, child.local_rank = rank, rank % cfg.local_world_size
        child.master_port = store_port
        if child.init_method.startswith("tcp://"):
            host = urlsplit(child.init_method).hostname
            child.init_method = f"tcp://{host}:{store_port}"
        return FunctionJob(func, setup, child, args, kwargs), env

    logger.info("Launching %d training workers", count)
    supervisor = Supervisor(
        context=process_context(cfg.launch_method),
        groups=1,
        group_size=count,
        first_rank=rank_offset,
        make_job=make_job,
        master_addr=cfg.master_addr,
        master_port=port,
        host_stores=tcp_store and rank_offset == 0,
        fault_tolerant=False,
        max_restarts=0,
    )
    try:
        supervisor.run()
    finally:
        if supervisor.ports:
            cfg.master_port = supervisor.ports[0]


__all__ = ["launch_subprocesses", "process_context"]
