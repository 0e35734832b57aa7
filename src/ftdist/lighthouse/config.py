"""
Lighthouse configuration
========================

One frozen :class:`LighthouseConfig` holds every knob of a lighthouse, and
:func:`resolve_lighthouse_config` is the only place that reads the environment
for it. Precedence is the usual one: an explicit argument (Python keyword or
command-line flag) wins over the environment, which wins over the default.

=================================== =============================== ==========
Field                               Environment variable            Default
=================================== =============================== ==========
``bind``                            ``FTDIST_LIGHTHOUSE_BIND``      ``[::]:29510``
``min_replicas``                    ``FTDIST_LIGHTHOUSE_MIN_REPLICAS`` required
``join_timeout``                    ``FTDIST_LIGHTHOUSE_JOIN_TIMEOUT_MS`` 100 ms (API), 60 s (CLI)
``quorum_tick``                     ``FTDIST_LIGHTHOUSE_QUORUM_TICK_MS`` 100 ms
``heartbeat_timeout``               ``FTDIST_LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS`` 5 s
``http_port``                       ``FTDIST_LIGHTHOUSE_HTTP_PORT`` 0 (API), 29511 (CLI); -1 = off
``kill_token``                      ``FTDIST_LIGHTHOUSE_KILL_TOKEN`` none
``token``                           ``FTDIST_JOB_TOKEN[_FILE]``     none (open)
``tls_cert``, ``tls_key``           ``FTDIST_TLS_CERT``, ``_KEY``   none (plaintext)
``etcd``                            ``FTDIST_LIGHTHOUSE_ETCD``      none (a single lighthouse)
``job``                             ``FTDIST_LIGHTHOUSE_JOB``       required with ``etcd``
``lease_ttl``                       ``FTDIST_LIGHTHOUSE_LEASE_TTL_MS`` 2 s
``takeover_grace``                  ``FTDIST_LIGHTHOUSE_TAKEOVER_GRACE_MS`` 1 s
``etcd_ca``, ``_cert``, ``_key``    ``FTDIST_ETCD_CA``, ``_CERT``, ``_KEY`` none
``rpc_server``                      ``FTDIST_LIGHTHOUSE_RPC_SERVER`` ``h2``
=================================== =============================== ==========

With ``etcd`` the lighthouse is one replica of a replicated set
(:mod:`ftdist.lighthouse.replica`); those settings form its
:class:`ReplicationConfig`.

The job token and the TLS files are read by :mod:`ftdist._auth`, like every
other process of the job reads them. The caps (``max_replica_ids``,
``max_subscribers``, ``max_parked_per_replica``, ``max_data_bytes``) are
Python settings only; docs/security.md explains them.

``rpc_server`` picks the gRPC server: ``h2``, ftdist's own HTTP/2 server
(:mod:`ftdist._rpc.h2_server`, a third of grpcio's CPU per call), or
``grpcio``, grpcio's core (:mod:`ftdist._rpc.cq_server`). A lighthouse
serving TLS always runs on grpcio's core.

A client's side has one setting, read by :func:`lighthouse_rpc_client`:
``FTDIST_LIGHTHOUSE_RPC_CLIENT`` picks how a :class:`~ftdist.lighthouse.client.LighthouseClient`
makes its unary calls (quorum, heartbeat, status) on plaintext: ``h2``
(the default: :mod:`ftdist._rpc.h2_client`, from the calling thread) or
``grpcio`` (grpcio's channel, as before it). TLS always goes through grpcio.

The two join-timeout defaults are torchft's: its Python ``LighthouseServer``
defaults to 100 ms (tests want quick quorums), its command line to 60 s
(production wants stragglers to make it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from ftdist._auth import job_token, tls_files
from ftdist._rpc.common import pick_rpc_client


def lighthouse_address(environ: Mapping[str, str] | None = None) -> str | None:
    """Where trainers find the lighthouse: ``FTDIST_LIGHTHOUSE``, then torchft's
    ``TORCHFT_LIGHTHOUSE`` (``http://host:port`` or ``host:port``); None when neither is set.

    The Manager, ``ftdist run`` and ``ftdist status`` all read it here.
    """
    env = os.environ if environ is None else environ
    return env.get("FTDIST_LIGHTHOUSE") or env.get("TORCHFT_LIGHTHOUSE") or None


def lighthouse_rpc_client(
    value: str | None = None, environ: Mapping[str, str] | None = None
) -> str:
    """How lighthouse clients make unary calls on plaintext: ``value``, else
    ``FTDIST_LIGHTHOUSE_RPC_CLIENT``, else ``"h2"``.

    Raises:
        ValueError: for anything but ``h2`` or ``grpcio`` (any case).
    """
    env = os.environ if environ is None else environ
    chosen = value if value is not None else env.get("FTDIST_LIGHTHOUSE_RPC_CLIENT", "h2")
    return pick_rpc_client(chosen, "FTDIST_LIGHTHOUSE_RPC_CLIENT")


__all__ = [
    "API_DEFAULTS",
    "CLI_DEFAULTS",
    "ENV_VARS",
    "LighthouseConfig",
    "ReplicationConfig",
    "lighthouse_address",
    "lighthouse_rpc_client",
    "resolve_lighthouse_config",
]

ENV_VARS: Mapping[str, str] = {
    "bind": "FTDIST_LIGHTHOUSE_BIND",
    "min_replicas": "FTDIST_LIGHTHOUSE_MIN_REPLICAS",
    "join_timeout_ms": "FTDIST_LIGHTHOUSE_JOIN_TIMEOUT_MS",
    "quorum_tick_ms": "FTDIST_LIGHTHOUSE_QUORUM_TICK_MS",
    "heartbeat_timeout_ms": "FTDIST_LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS",
    "http_port": "FTDIST_LIGHTHOUSE_HTTP_PORT",
    "kill_token": "FTDIST_LIGHTHOUSE_KILL_TOKEN",
    "etcd": "FTDIST_LIGHTHOUSE_ETCD",
    "job": "FTDIST_LIGHTHOUSE_JOB",
    "lease_ttl_ms": "FTDIST_LIGHTHOUSE_LEASE_TTL_MS",
    "takeover_grace_ms": "FTDIST_LIGHTHOUSE_TAKEOVER_GRACE_MS",
    "etcd_ca": "FTDIST_ETCD_CA",
    "etcd_cert": "FTDIST_ETCD_CERT",
    "etcd_key": "FTDIST_ETCD_KEY",
    "rpc_server": "FTDIST_LIGHTHOUSE_RPC_SERVER",
}
"""Environment variable for each setting."""

API_DEFAULTS: Mapping[str, object] = {
    "bind": "[::]:29510",
    "join_timeout_ms": 100,
    "quorum_tick_ms": 100,
    "heartbeat_timeout_ms": 5000,
    "http_port": 0,
    "kill_token": None,
    "lease_ttl_ms": 2000,
    "takeover_grace_ms": 1000,
    "rpc_server": "h2",
}
"""Defaults of the Python API (torchft's ``LighthouseServer`` defaults)."""

CLI_DEFAULTS: Mapping[str, object] = {
    **API_DEFAULTS,
    "join_timeout_ms": 60000,
    "http_port": 29511,
}
"""Defaults of ``ftdist lighthouse`` (torchft's ``torchft_lighthouse`` defaults)."""

_DEFAULT_MAX_DATA_BYTES = 64 * 1024
# Far above any job (1024 replica groups of 8 ranks open 8192 failure-news
# streams); they bound what clients that misbehave can make the lighthouse hold.
_DEFAULT_MAX_REPLICA_IDS = 65536
_DEFAULT_MAX_SUBSCRIBERS = 16384
# A manager has one quorum request parked, two while a retry overlaps a call
# the lighthouse has not yet seen cancelled.
_DEFAULT_MAX_PARKED_PER_REPLICA = 4
_RPC_SERVERS = ("h2", "grpcio")
_CAPS = ("max_data_bytes", "max_replica_ids", "max_subscribers", "max_parked_per_replica")


_JOB_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
# etcd grants at least 1.5 election timeouts (2 s with its defaults); a
# shorter TTL would be raised silently, and the leader would time itself
# against the wrong figure (it uses the granted TTL, never this one).
_MIN_LEASE_TTL = timedelta(seconds=1)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicationConfig:
    """Settings of one replica of a replicated lighthouse.

    Attributes:
        etcd: the etcd cluster's client URLs.
        job: the job's name; its keys live under ``/ftdist/<job>/`` and only
            replicas of the same job elect one leader together.
        lease_ttl: the TTL asked for the replica's etcd lease; a dead
            leader is replaced about this long after its last renewal.
        takeover_grace: how long a new leader waits to learn which replica
            groups are alive before it forms a quorum that is not the
            previous one asked again.
        etcd_ca: PEM file of the CA certificates that sign etcd's.
        etcd_cert: PEM client certificate presented to etcd.
        etcd_key: its private key.
    """

    etcd: tuple[str, ...]
    job: str
    lease_ttl: timedelta = timedelta(seconds=2)
    takeover_grace: timedelta = timedelta(seconds=1)
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None

    def __post_init__(self) -> None:
        """Validate every field.

        Raises:
            ValueError: naming the first invalid field, its value and the fix.
        """
        if not self.job or len(self.job) > 128 or not set(self.job) <= _JOB_CHARS:
            raise ValueError(
                f"job ({self.job!r}) must be 1 to 128 letters, digits, '.', '_' or '-'; "
                "give the job's name with --job or FTDIST_LIGHTHOUSE_JOB"
            )
        if self.lease_ttl < _MIN_LEASE_TTL:
            raise ValueError(f"lease_ttl ({self.lease_ttl}) must be at least 1 s.")
        if self.takeover_grace < timedelta(0):
            raise ValueError(f"takeover_grace ({self.takeover_grace}) must not be negative.")
        if (self.etcd_cert is None) != (self.etcd_key is None):
            raise ValueError("etcd_cert and etcd_key go together: give both or neither.")


@dataclass(frozen=True, kw_only=True, slots=True)
class LighthouseConfig:
    """Every setting of a lighthouse, validated.

    Attributes:
        bind: gRPC listen address, ``host:port``; port 0 picks a free port.
        min_replicas: fewest replica groups a new (non-fast) quorum needs.
        join_timeout: how long a ready quorum waits for heartbeating
            replica groups that have not asked yet.
        quorum_tick: how often the lighthouse re-evaluates the quorum and
            checks heartbeats, besides on every request.
        heartbeat_timeout: a replica group silent for this long is dead.
        http_port: dashboard port on the bind host; 0 picks a free port,
            None turns the dashboard off.
        kill_token: a secret that enables the dashboard's kill action (kept
            for compatibility; the job token enables and authorizes it too).
        token: the job token every RPC and dashboard action needs; None
            leaves the lighthouse open.
        tls_cert: the PEM certificate chain served over TLS; None serves
            plaintext.
        tls_key: that certificate's private key (PEM file).
        max_data_bytes: largest ``QuorumMember.data`` accepted.
        max_replica_ids: most replica ids whose heartbeat is remembered; a
            new id beyond it is refused (RESOURCE_EXHAUSTED) unless an
            expired one can be forgotten.
        max_subscribers: most failure-news streams open at once.
        max_parked_per_replica: most quorum requests of one replica id
            waiting at once.
        replication: with etcd, this lighthouse is one replica of a
            replicated set; None: the single lighthouse.
        rpc_server: ``"h2"`` (ftdist's HTTP/2 server) or ``"grpcio"``
            (grpcio's core); TLS always runs on grpcio's core.
    """

    bind: str
    min_replicas: int
    join_timeout: timedelta
    quorum_tick: timedelta
    heartbeat_timeout: timedelta
    http_port: int | None = 0
    kill_token: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    max_data_bytes: int = _DEFAULT_MAX_DATA_BYTES
    max_replica_ids: int = _DEFAULT_MAX_REPLICA_IDS
    max_subscribers: int = _DEFAULT_MAX_SUBSCRIBERS
    max_parked_per_replica: int = _DEFAULT_MAX_PARKED_PER_REPLICA
    replication: ReplicationConfig | None = None
    rpc_server: str = "h2"

    def __post_init__(self) -> None:
        """Validate every field.

        Raises:
            ValueError: naming the first invalid field and its value.
        """
        if not self.bind or ":" not in self.bind:
            raise ValueError(f"bind ({self.bind!r}) must be host:port, e.g. '[::]:29510'.")
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be at least 1.")
        if self.join_timeout < timedelta(0):
            raise ValueError(f"join_timeout ({self.join_timeout}) must not be negative.")
        if self.quorum_tick <= timedelta(0):
            raise ValueError(f"quorum_tick ({self.quorum_tick}) must be positive.")
        if self.heartbeat_timeout <= timedelta(0):
            raise ValueError(f"heartbeat_timeout ({self.heartbeat_timeout}) must be positive.")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port ({self.http_port}) must be in 0..65535 or None.")
        if self.kill_token is not None and not self.kill_token:
            raise ValueError("kill_token must be None (kill disabled) or a non-empty string.")
        if self.max_data_bytes < 0:
            raise ValueError(f"max_data_bytes ({self.max_data_bytes}) must not be negative.")
        for name in _CAPS[1:]:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be at least 1.")
        if self.token is not None and not self.token:
            raise ValueError("token must be None (no job token) or a non-empty string.")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither.")
        if self.rpc_server not in _RPC_SERVERS:
            raise ValueError(
                f"rpc_server ({self.rpc_server!r}) must be one of {', '.join(_RPC_SERVERS)}; "
                "set FTDIST_LIGHTHOUSE_RPC_SERVER=h2 (the default) or grpcio"
            )


def _duration(name: str, value: object) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} ({value!r}) must be milliseconds or a timedelta.")
    try:
        return timedelta(milliseconds=float(value))
    except ValueError as exc:
        raise ValueError(f"{name} ({value!r}) must be a number of milliseconds.") from exc


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} ({value!r}) must be an integer.")
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError as exc:
        raise ValueError(f"{name} ({value!r}) must be an integer.") from exc


def resolve_lighthouse_config(
    *,
    defaults: Mapping[str, object] = API_DEFAULTS,
    environ: Mapping[str, str] | None = None,
    **explicit: object,
) -> LighthouseConfig:
    """Build a config from explicit values, then the environment, then defaults.

    Args:
        defaults: defaults for the settings not given explicitly nor in the
            environment (:data:`API_DEFAULTS` or :data:`CLI_DEFAULTS`).
        environ: the environment to read; ``os.environ`` when None.
        **explicit: settings by name (``bind``, ``min_replicas``,
            ``join_timeout_ms``, ``quorum_tick_ms``, ``heartbeat_timeout_ms``,
            ``http_port``, ``kill_token``, ``token``, ``token_file``, ``rpc_server``,
            ``tls_cert``, ``tls_key`` and the caps ``max_data_bytes``,
            ``max_replica_ids``, ``max_subscribers``,
            ``max_parked_per_replica``); a value of None means "not given".
            Durations are milliseconds or timedeltas. An ``http_port`` below
            0 turns the dashboard off. ``token``/``token_file`` fall back to
            ``FTDIST_JOB_TOKEN``/``FTDIST_JOB_TOKEN_FILE``, the TLS files to
            ``FTDIST_TLS_CERT``/``FTDIST_TLS_KEY``.

    Returns:
        The validated config.

    Raises:
        TypeError: on an unknown setting name.
        ValueError: when a value (explicit or from the environment) is invalid
            or ``min_replicas`` is given nowhere.
        OSError: the token file cannot be read.
    """
    env = os.environ if environ is None else environ
    known = {*ENV_VARS, *_CAPS, "token", "token_file", "tls_cert", "tls_key"}
    replication = _replication(explicit, env, defaults)
    unknown = set(explicit) - known
    if unknown:
        raise TypeError(f"unknown lighthouse settings: {sorted(unknown)}")

    def pick(name: str) -> object:
        value = explicit.get(name)
        if value is not None:
            return value
        var = ENV_VARS.get(name)
        if var is not None and env.get(var, "") != "":
            return env[var]
        return defaults.get(name)

    min_replicas = pick("min_replicas")
    if min_replicas is None:
        raise ValueError(f"min_replicas is required: pass it or set {ENV_VARS['min_replicas']}.")
    http_port_raw = pick("http_port")
    http_port = None if http_port_raw is None else _integer("http_port", http_port_raw)
    if http_port is not None and http_port < 0:
        http_port = None
    kill_token = pick("kill_token")
    token = job_token(
        None if explicit.get("token") is None else str(explicit["token"]),
        env,
        token_file=None if explicit.get("token_file") is None else str(explicit["token_file"]),
    )
    tls = tls_files(
        cert=None if explicit.get("tls_cert") is None else str(explicit["tls_cert"]),
        key=None if explicit.get("tls_key") is None else str(explicit["tls_key"]),
        environ=env,
    )
    caps = {
        name: _integer(name, explicit[name]) for name in _CAPS if explicit.get(name) is not None
    }
    return LighthouseConfig(
        bind=str(pick("bind")),
        min_replicas=_integer("min_replicas", min_replicas),
        join_timeout=_duration("join_timeout_ms", pick("join_timeout_ms")),
        quorum_tick=_duration("quorum_tick_ms", pick("quorum_tick_ms")),
        heartbeat_timeout=_duration("heartbeat_timeout_ms", pick("heartbeat_timeout_ms")),
        http_port=http_port,
        kill_token=None if kill_token is None else str(kill_token),
        token=token,
        tls_cert=tls.cert,
        tls_key=tls.key,
        replication=replication,
        rpc_server=str(_or(pick("rpc_server"), "h2")).strip().lower(),
        **caps,
    )


def _or(value: object, default: object) -> object:
    return default if value is None else value


def _replication(
    explicit: Mapping[str, object], env: Mapping[str, str], defaults: Mapping[str, object]
) -> ReplicationConfig | None:
    from ftdist.etcd.client import parse_endpoints

    def pick(name: str) -> object:
        value = explicit.get(name)
        if value is not None:
            return value
        var = ENV_VARS[name]
        if env.get(var, "") != "":
            return env[var]
        return defaults.get(name)

    etcd = pick("etcd")
    if etcd is None or etcd == "":
        return None
    if not isinstance(etcd, (str, list, tuple)):
        raise TypeError(f"etcd must be a comma-separated string or a list of URLs, got {etcd!r}")
    job = pick("job")
    if job is None:
        raise ValueError(
            "a replicated lighthouse needs the job's name: pass job (--job NAME) or set "
            f"{ENV_VARS['job']}, the same on every replica"
        )

    def optional(name: str) -> str | None:
        value = pick(name)
        return None if value is None else str(value)

    return ReplicationConfig(
        etcd=parse_endpoints(etcd),
        job=str(job),
        lease_ttl=_duration("lease_ttl_ms", _or(pick("lease_ttl_ms"), 2000)),
        takeover_grace=_duration("takeover_grace_ms", _or(pick("takeover_grace_ms"), 1000)),
        etcd_ca=optional("etcd_ca"),
        etcd_cert=optional("etcd_cert"),
        etcd_key=optional("etcd_key"),
    )
