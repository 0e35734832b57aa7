"""
Manager settings
================

Every knob of the :class:`~ftdist.manager.Manager` is resolved here, once, in
one order: an explicit argument, then the environment, then the default.
Environment variables are read under their ``FTDIST_*`` names first and
their ``TORCHFT_*`` names second, so torchft launch scripts keep working;
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` come from torchrun.

| setting | argument | environment | default |
|---|---|---|---|
| timeout | ``timeout`` | ``FTDIST_TIMEOUT_SEC`` | 60 s |
| quorum timeout | ``quorum_timeout`` | ``FTDIST_QUORUM_TIMEOUT_SEC`` | 60 s |
| connect timeout | ``connect_timeout`` | ``FTDIST_CONNECT_TIMEOUT_SEC`` | 60 s |
| quorum retries | ``quorum_retries`` | ``FTDIST_QUORUM_RETRIES`` | 0 |
| lighthouse | ``lighthouse_addr`` | ``FTDIST_LIGHTHOUSE`` | required |
| manager port | ``port`` | ``FTDIST_MANAGER_PORT`` | 0 (any free port) |
| group rank | ``rank`` | ``RANK`` | 0 |
| group world size | ``world_size`` | ``WORLD_SIZE`` | 1 |
| store | ``store_addr``/``store_port`` | ``MASTER_ADDR``/``MASTER_PORT`` | a store of its own (group world size 1 only) |
| first heal's receive reserve | — | ``FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB`` | 1024 MiB (read by :mod:`ftdist.checkpointing.config`) |
| manager client's unary calls | ``ManagerClient(rpc_client=...)`` | ``FTDIST_MANAGER_RPC_CLIENT`` | ``h2`` (see :func:`manager_rpc_client`) |
| manager server's gRPC server | ``ManagerServer(rpc_server=...)`` | ``FTDIST_MANAGER_RPC_SERVER`` | ``h2`` (see :func:`manager_rpc_server`) |
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any

from ftdist._advertise import advertised_host
from ftdist._rpc.common import pick_rpc_client
from ftdist.lighthouse.config import lighthouse_address

DEFAULT_TIMEOUT = timedelta(seconds=60)

# torchft's names for the replica group's store keys and its environment
# variables, for code that uses them.
MANAGER_ADDR_KEY = "manager_addr"
REPLICA_ID_KEY = "replica_id"
MANAGER_PORT_ENV = "TORCHFT_MANAGER_PORT"
TIMEOUT_SEC_ENV = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_SEC_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_SEC_ENV = "TORCHFT_CONNECT_TIMEOUT_SEC"
QUORUM_RETRIES_ENV = "TORCHFT_QUORUM_RETRIES"
TORCH_FR_DUMP_TEMP_FILE_ENV = "TORCH_FR_DUMP_TEMP_FILE"

# Whether torchft's quantized allreduce could run: Triton and a collectives
# module are installed (checked without importing either).
IS_TRITON_AVAILABLE = (
    importlib.util.find_spec("triton") is not None
    and importlib.util.find_spec("ftdist.collectives") is not None
)


def get_timeout(timeout_sec_env: str | None, default_timeout_sec: timedelta) -> timedelta:
    """torchft's helper: whole seconds from an environment value, else the default.

    Args:
        timeout_sec_env: the environment variable's value (or None).
        default_timeout_sec: used when the value is None or empty.

    Raises:
        ValueError: the value is not an integer.
    """
    if timeout_sec_env:
        return timedelta(seconds=int(timeout_sec_env))
    return default_timeout_sec


def manager_rpc_client(value: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """How a :class:`~ftdist.manager.client.ManagerClient` makes its calls to
    its replica group's manager server on plaintext: ``value``, else
    ``FTDIST_MANAGER_RPC_CLIENT``, else ``"h2"`` (ftdist's own HTTP/2 client,
    from the calling thread); ``"grpcio"`` is a grpcio channel. Group rank 0
    calls its own server in process either way; TLS always goes through
    grpcio.

    Raises:
        ValueError: for anything but ``h2`` or ``grpcio`` (any case).
    """
    env = os.environ if environ is None else environ
    chosen = value if value is not None else env.get("FTDIST_MANAGER_RPC_CLIENT", "h2")
    return pick_rpc_client(chosen, "FTDIST_MANAGER_RPC_CLIENT")


def manager_rpc_server(value: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Which gRPC server a :class:`~ftdist.manager.server.ManagerServer`
    runs on plaintext: ``value``, else ``FTDIST_MANAGER_RPC_SERVER``, else
    ``"h2"`` (ftdist's own HTTP/2 server, one thread); ``"grpcio"`` is
    grpcio's thread-pool server. TLS always runs on grpcio's.

    Raises:
        ValueError: for anything but ``h2`` or ``grpcio`` (any case).
    """
    env = os.environ if environ is None else environ
    chosen = value if value is not None else env.get("FTDIST_MANAGER_RPC_SERVER", "h2")
    return pick_rpc_client(chosen, "FTDIST_MANAGER_RPC_SERVER", "rpc_server")


def _reserve_bytes(env: Mapping[str, str]) -> int:
    # Imported here: the checkpointing package imports torch, and this module
    # must not (the manager client reads its setting here, and the command
    # line and ftdist.coordination import that client without torch).
    from ftdist.checkpointing.config import receive_reserve_bytes

    return receive_reserve_bytes(None, env)


def extract_trailing_digits(s: str) -> int:
    """The decimal digits at the end of ``s`` as an int, 0 if none (``"train_3"`` -> 3)."""
    digits = len(s) - len(s.rstrip("0123456789"))
    return int(s[-digits:]) if digits else 0


class WorldSizeMode(IntEnum):
    """How many replica groups take part in a step.

    ``DYNAMIC``: every replica group in the quorum. ``FIXED_WITH_SPARES``: at
    most ``min_replica_size``; the others are hot spares that contribute
    zeros and take over when a participant dies.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


def _env(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The first of ``names`` set (non-empty) in ``env``: ftdist's name, then torchft's."""
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return value
    return None


def _duration(
    name: str, value: Any, env: Mapping[str, str], env_names: tuple[str, ...], default: timedelta
) -> timedelta:
    if value is None:
        raw = _env(env, env_names)
        if raw is None:
            return default
        try:
            value = timedelta(seconds=float(raw))
        except ValueError:
            raise ValueError(
                f"environment variable {' or '.join(env_names)}={raw!r} is not a number of seconds"
            ) from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = timedelta(seconds=float(value))
    if not isinstance(value, timedelta):
        raise TypeError(f"{name} must be a datetime.timedelta, got {value!r}")
    if value <= timedelta(0):
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _int(
    name: str, value: Any, env: Mapping[str, str], env_names: tuple[str, ...], default: int | None
) -> int | None:
    if value is None:
        for env_name in env_names:
            raw = env.get(env_name)
            if raw not in (None, ""):
                try:
                    return int(raw)
                except ValueError:
                    raise ValueError(
                        f"environment variable {env_name}={raw!r} is not an integer"
                    ) from None
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


@dataclass(frozen=True)
class ManagerConfig:
    """The resolved settings of one Manager (see the module table)."""

    timeout: timedelta
    quorum_timeout: timedelta
    connect_timeout: timedelta
    quorum_retries: int
    lighthouse_addr: str | None
    port: int
    group_rank: int
    group_world_size: int
    store_addr: str | None
    store_port: int | None
    hostname: str
    heartbeat_interval: timedelta
    min_replica_size: int = 1
    max_retries: int | None = None
    check_consistency_every: int = 0
    # torchrun's restart attempt (TORCHELASTIC_RESTART_COUNT): each attempt
    # of a replica group meets under its own store prefix.
    restart_attempt: str = "0"
    # The most memory (bytes) a never-committed replica populates for its
    # first heal's fresh tensors while its quorum forms.
    reserve: int = 0

    @classmethod
    def resolve(
        cls,
        *,
        timeout: Any = None,
        quorum_timeout: Any = None,
        connect_timeout: Any = None,
        quorum_retries: Any = None,
        lighthouse_addr: str | None = None,
        port: Any = None,
        rank: Any = None,
        world_size: Any = None,
        store_addr: str | None = None,
        store_port: Any = None,
        hostname: str | None = None,
        heartbeat_interval: Any = None,
        min_replica_size: Any = 1,
        max_retries: Any = None,
        check_consistency_every: Any = None,
        needs_lighthouse: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> ManagerConfig:
        """Resolve every setting: argument > environment > default.

        Args:
            needs_lighthouse: group rank 0 must have a lighthouse address.

        Raises:
            TypeError: an argument has the wrong type.
            ValueError: a value is out of range, an environment variable is
                malformed, or a lighthouse address is missing; the message
                names it.
        """
        env = os.environ if env is None else env
        if (
            not isinstance(min_replica_size, int)
            or isinstance(min_replica_size, bool)
            or (min_replica_size < 1)
        ):
            raise ValueError(f"min_replica_size must be an int >= 1, got {min_replica_size!r}")
        if max_retries is not None and (
            not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0
        ):
            raise ValueError(f"max_retries must be None or an int >= 0, got {max_retries!r}")
        group_world_size = _int("world_size", world_size, env, ("WORLD_SIZE",), 1)
        group_rank = _int("rank", rank, env, ("RANK",), 0)
        assert group_world_size is not None and group_rank is not None
        if group_world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {group_world_size}")
        if not 0 <= group_rank < group_world_size:
            raise ValueError(f"rank must be in [0, {group_world_size}), got {group_rank}")
        retries = _int(
            "quorum_retries",
            quorum_retries,
            env,
            ("FTDIST_QUORUM_RETRIES", "TORCHFT_QUORUM_RETRIES"),
            0,
        )
        mport = _int("port", port, env, ("FTDIST_MANAGER_PORT", "TORCHFT_MANAGER_PORT"), 0)
        sport = _int("store_port", store_port, env, ("MASTER_PORT",), None)
        saddr = store_addr or env.get("MASTER_ADDR") or None
        if (saddr is None) != (sport is None):
            raise ValueError(f"store_addr and store_port go together, got {saddr!r} and {sport!r}")
        if saddr is None and group_world_size > 1:
            raise ValueError(
                "a replica group of several ranks needs a shared store: pass "
                "store_addr/store_port or set MASTER_ADDR/MASTER_PORT (torchrun does)"
            )
        _every = _int(
            "check_consistency_every",
            check_consistency_every,
            env,
            ("FTDIST_CHECK_CONSISTENCY_EVERY",),
            0,
        )
        if _every is None or _every < 0:
            raise ValueError(
                f"check_consistency_every must be >= 0 steps (0: only after reconfigures), "
                f"got {_every}"
            )
        lighthouse = lighthouse_addr or lighthouse_address(env)
        if needs_lighthouse and group_rank == 0 and not lighthouse:
            raise ValueError(
                "no lighthouse address: pass lighthouse_addr= or set "
                "FTDIST_LIGHTHOUSE (or TORCHFT_LIGHTHOUSE)"
            )
        return cls(
            timeout=_duration(
                "timeout",
                timeout,
                env,
                ("FTDIST_TIMEOUT_SEC", "TORCHFT_TIMEOUT_SEC"),
                DEFAULT_TIMEOUT,
            ),
            quorum_timeout=_duration(
                "quorum_timeout",
                quorum_timeout,
                env,
                ("FTDIST_QUORUM_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC"),
                DEFAULT_TIMEOUT,
            ),
            connect_timeout=_duration(
                "connect_timeout",
                connect_timeout,
                env,
                ("FTDIST_CONNECT_TIMEOUT_SEC", "TORCHFT_CONNECT_TIMEOUT_SEC"),
                DEFAULT_TIMEOUT,
            ),
            quorum_retries=int(retries or 0),
            lighthouse_addr=lighthouse,
            port=int(mport or 0),
            group_rank=group_rank,
            group_world_size=group_world_size,
            store_addr=saddr,
            store_port=sport,
            hostname=advertised_host(hostname, env),
            heartbeat_interval=_duration(
                "heartbeat_interval", heartbeat_interval, {}, (), timedelta(milliseconds=100)
            ),
            min_replica_size=min_replica_size,
            max_retries=max_retries,
            check_consistency_every=_every,
            restart_attempt=env.get("TORCHELASTIC_RESTART_COUNT") or "0",
            reserve=_reserve_bytes(env),
        )
