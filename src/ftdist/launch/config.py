"""
Launcher configuration
======================

:class:`MultiprocessConfig` is ml-starter's config of the same name, field
for field: how many processes, where they meet, which backends their
groups use, and how they start. :class:`FaultTolerance` switches
:func:`~ftdist.launch.launch_subprocesses` to fault-tolerant mode.

Invariants: nothing here imports torch at import time (the command line
builds these objects); a field left at :data:`MISSING` (``"???"``,
omegaconf's sentinel) is filled in by :meth:`MultiprocessConfig.resolve`;
every check raises ``TypeError``/``ValueError`` naming the field and the
fix, before any process starts.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ftdist._durations import as_timedelta
from ftdist.lighthouse.config import lighthouse_address

#: omegaconf's "missing" sentinel: a field the caller did not set.
MISSING: Any = "???"
#: The rendezvous port :meth:`MultiprocessConfig.resolve` prefers when it is free.
DEFAULT_PORT = 29500
LAUNCH_METHODS = ("forkserver", "spawn", "fork")
# Environment variables a lighthouse address is read from, in order.


def is_missing(config: Any, key: str) -> bool:
    """True if ``config.key`` is unset: omegaconf's missing value, or the ``"???"`` sentinel."""
    is_container = getattr(config, "_get_node", None)
    if is_container is not None:
        from omegaconf import OmegaConf

        return bool(OmegaConf.is_missing(config, key))
    return bool(getattr(config, key) == MISSING)


def get_unused_port(default: int | None = None) -> int:
    """A port that is free now: ``default`` if it can be bound, else one the kernel picks.

    The port is not reserved (another process may take it before it is
    used); :func:`~ftdist.launch.launch_subprocesses` does not use this but
    binds its store to port 0 itself.
    """
    if default is not None:
        with socket.socket() as sock:
            try:
                sock.bind(("", default))
            except OSError:
                pass
            else:
                return default
    with socket.socket() as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def _int_field(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"MultiprocessConfig.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"MultiprocessConfig.{name} must be at least {minimum}, got {value}")
    return value


def _backend_field(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise TypeError(
            f"MultiprocessConfig.{name} must be a backend name such as 'gloo' or 'nccl', "
            f"or None, got {value!r}"
        )


@dataclass
class MultiprocessConfig:
    """How many processes to launch, where they meet, and which backends they use.

    Attributes:
        rank: global rank; the launcher sets it per child.
        local_rank: rank on this machine; set per child to ``rank % local_world_size``.
        world_size: processes in the job; default the CUDA device count (1 without CUDA).
        local_world_size: processes per machine; default ``min(device count, world_size)``.
        master_addr: where the rendezvous store is reached.
        master_port: its port; unset means any free port (the launcher's
            store binds port 0 and the children learn the port, so there is
            no race).
        init_method: ``torch.distributed.init_process_group``'s ``init_method``.
        model_parallelism: ranks per model-parallel group.
        pipeline_parallelism: ranks per pipeline-parallel group.
        backend: the default group's backend; None means
            ``$TORCH_DISTRIBUTED_BACKEND``, else ``nccl`` with CUDA, else ``gloo``.
        model_parallel_backend: backend of the model-parallel groups (default ``backend``).
        pipeline_parallel_backend: backend of the pipeline-parallel groups (default ``backend``).
        data_parallel_backend: backend of the data-parallel groups (default ``backend``).
        launch_method: ``"forkserver"`` (ftdist's fork server, torch already
            imported), ``"spawn"`` or ``"fork"``.
    """

    rank: int = -1
    local_rank: int = -1
    world_size: int = MISSING
    local_world_size: int = MISSING
    master_addr: str = "127.0.0.1"
    master_port: int = MISSING
    init_method: str = "env://"
    model_parallelism: int = 1
    pipeline_parallelism: int = 1
    backend: str | None = None
    model_parallel_backend: str | None = None
    pipeline_parallel_backend: str | None = None
    data_parallel_backend: str | None = None
    launch_method: str = "forkserver"

    @classmethod
    def resolve(cls, config: MultiprocessConfig) -> None:
        """Fill in the unset fields of ``config``, in place, then check every field.

        ``world_size`` becomes the CUDA device count (1 without CUDA),
        ``local_world_size`` ``min(device count, world_size)``, and
        ``master_port`` :data:`DEFAULT_PORT` if it is free, else a free port
        (free now, not reserved: launching through
        :func:`~ftdist.launch.launch_subprocesses` with the port unset
        avoids that race).

        Raises:
            TypeError: a field has the wrong type.
            ValueError: a field is out of range, or ``launch_method`` is unknown.
        """
        device_count = _device_count()
        if is_missing(config, "world_size"):
            config.world_size = device_count
        _int_field("world_size", config.world_size, 1)
        if is_missing(config, "local_world_size"):
            config.local_world_size = min(device_count, config.world_size)
        if is_missing(config, "master_port"):
            config.master_port = get_unused_port(DEFAULT_PORT)
        validate(config)


def _device_count() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 1


def validate(config: MultiprocessConfig, *, allow_missing_port: bool = False) -> None:
    """Check every field of a resolved config.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range, or ``launch_method`` is unknown.
    """
    _int_field("world_size", config.world_size, 1)
    _int_field("local_world_size", config.local_world_size, 1)
    _int_field("rank", config.rank, -1)
    _int_field("local_rank", config.local_rank, -1)
    if not (allow_missing_port and is_missing(config, "master_port")):
        _int_field("master_port", config.master_port, 0)
        if config.master_port > 65535:
            raise ValueError(
                f"MultiprocessConfig.master_port must be a TCP port (0-65535), "
                f"got {config.master_port}"
            )
    _int_field("model_parallelism", config.model_parallelism, 1)
    _int_field("pipeline_parallelism", config.pipeline_parallelism, 1)
    if not isinstance(config.master_addr, str) or not config.master_addr:
        raise TypeError(
            f"MultiprocessConfig.master_addr must be a host name or address, "
            f"got {config.master_addr!r}"
        )
    if not isinstance(config.init_method, str) or "://" not in config.init_method:
        raise ValueError(
            "MultiprocessConfig.init_method must be a URL such as 'env://', "
            f"'tcp://host:port' or 'file:///path', got {config.init_method!r}"
        )
    for name in (
        "backend",
        "model_parallel_backend",
        "pipeline_parallel_backend",
        "data_parallel_backend",
    ):
        _backend_field(name, getattr(config, name))
    if config.launch_method not in LAUNCH_METHODS:
        raise ValueError(
            f"MultiprocessConfig.launch_method must be one of {LAUNCH_METHODS}, "
            f"got {config.launch_method!r}"
        )


@dataclass(frozen=True)
class FaultTolerance:
    """Fault-tolerant launching: each data-parallel replica group runs under a Manager.

    Pass it (or ``True`` for the defaults) as ``fault_tolerant=`` to
    :func:`~ftdist.launch.launch_subprocesses`.

    Attributes:
        max_restarts: restarts allowed per replica group before the launch fails.
        min_replica_size: fewest replica groups a step may commit with (the
            Manager's ``min_replica_size``; also the embedded lighthouse's
            ``min_replicas``).
        lighthouse: the lighthouse address; default ``$FTDIST_LIGHTHOUSE``,
            then ``$TORCHFT_LIGHTHOUSE``, else a lighthouse in the launching
            process.
        join_timeout: how long the embedded lighthouse's ready quorum waits
            for stragglers.
        timeout: the Managers' collective and heal timeout.
        quorum_timeout: the Managers' quorum timeout.
        connect_timeout: the Managers' connection timeout.

    Durations are ``timedelta``s or seconds.

    Raises:
        TypeError, ValueError: a field of the wrong type or range.
        replica_id: prefix of the replica groups' ids (``"{replica_id}{index}"``).
    """

    max_restarts: int = 10
    min_replica_size: int = 1
    lighthouse: str | None = None
    join_timeout: timedelta = timedelta(milliseconds=100)
    timeout: timedelta = timedelta(seconds=30)
    quorum_timeout: timedelta = timedelta(seconds=60)
    connect_timeout: timedelta = timedelta(seconds=30)
    replica_id: str = "replica_"

    def __post_init__(self) -> None:
        for name, minimum in (("max_restarts", 0), ("min_replica_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(
                    f"FaultTolerance.{name} must be an int >= {minimum}, got {value!r}"
                )
        for name in ("join_timeout", "timeout", "quorum_timeout", "connect_timeout"):
            td = as_timedelta(getattr(self, name), f"FaultTolerance.{name}", allow_zero=True)
            object.__setattr__(self, name, td)
        if self.lighthouse is not None and not isinstance(self.lighthouse, str):
            raise TypeError(
                f"FaultTolerance.lighthouse must be a str or None, got {self.lighthouse!r}"
            )
        if not isinstance(self.replica_id, str):
            raise TypeError(f"FaultTolerance.replica_id must be a str, got {self.replica_id!r}")

    def lighthouse_address(self) -> str | None:
        """The lighthouse to join: the field, then the environment; None embeds one."""
        return self.lighthouse or lighthouse_address()


def stacks_dir(environ: Mapping[str, str] | None = None) -> str:
    """``FTDIST_STACKS_DIR``: where ranks write their stacks on SIGUSR1 ("" when unset)."""
    env = os.environ if environ is None else environ
    return env.get("FTDIST_STACKS_DIR", "")


__all__ = [
    "DEFAULT_PORT",
    "LAUNCH_METHODS",
    "MISSING",
    "FaultTolerance",
    "MultiprocessConfig",
    "get_unused_port",
    "is_missing",
    "stacks_dir",
    "validate",
]
