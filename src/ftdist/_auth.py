"""
The job secret
==============

One token, shared by every process of a job, gates every server ftdist runs:
the lighthouse and the manager servers (gRPC metadata), the checkpoint
servers and the dashboard's actions (HTTP headers). It is read here and only
here: an explicit value, then ``FTDIST_JOB_TOKEN``, then the file named by
``FTDIST_JOB_TOKEN_FILE``. Without a token the servers accept anyone (as
torchft's do), and the first server started says so once in the log.

Clients present the token as ``authorization: Bearer <token>`` (gRPC
metadata) or ``Authorization: Bearer <token>`` (HTTP); servers compare it in
constant time. Optional TLS (gRPC's own credentials) is configured here too:
``FTDIST_TLS_CERT``/``FTDIST_TLS_KEY`` (a server's certificate and key),
``FTDIST_TLS_CA`` (the certificate clients trust; setting it makes them use
TLS) and ``FTDIST_TLS_SERVER_NAME`` (the name clients expect in the
certificate, when it is not the host they dial). docs/security.md has the
threat model.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ENV_TLS_CA",
    "ENV_TLS_CERT",
    "ENV_TLS_KEY",
    "ENV_TLS_SERVER_NAME",
    "ENV_TOKEN",
    "ENV_TOKEN_FILE",
    "METADATA_KEY",
    "TlsFiles",
    "bearer",
    "job_token",
    "refusal",
    "tls_files",
    "token_matches",
    "warn_if_open",
]

logger = logging.getLogger("ftdist.auth")

ENV_TOKEN = "FTDIST_JOB_TOKEN"
ENV_TOKEN_FILE = "FTDIST_JOB_TOKEN_FILE"
ENV_TLS_CERT = "FTDIST_TLS_CERT"
ENV_TLS_KEY = "FTDIST_TLS_KEY"
ENV_TLS_CA = "FTDIST_TLS_CA"
ENV_TLS_SERVER_NAME = "FTDIST_TLS_SERVER_NAME"
# gRPC metadata keys are lower case; HTTP header names are case-insensitive.
METADATA_KEY = "authorization"
_BEARER = "Bearer "
_MAX_TOKEN_BYTES = 4096

_warned = threading.Event()


def job_token(
    explicit: str | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    token_file: str | None = None,
) -> str | None:
    """The job's token: ``explicit``, else the file ``token_file``, else
    ``FTDIST_JOB_TOKEN``, else the file ``FTDIST_JOB_TOKEN_FILE`` names.

    Args:
        explicit: a token given in code.
        environ: the environment to read (``os.environ`` when None).
        token_file: a file holding the token (a ``--token-file`` flag); its
            surrounding whitespace is ignored.

    Returns:
        The token, or None when the job has none.

    Raises:
        ValueError: the token is empty, too long, or has characters that
            cannot travel in a header (whitespace, control characters).
        OSError: the token file cannot be read.
    """
    env = os.environ if environ is None else environ
    source = "the token argument"
    token = explicit
    if token is None and token_file:
        with open(token_file, encoding="utf-8") as f:
            token, source = f.read().strip(), f"the token file {token_file}"
    if token is None and env.get(ENV_TOKEN):
        token, source = env[ENV_TOKEN], ENV_TOKEN
    if token is None and env.get(ENV_TOKEN_FILE):
        path = env[ENV_TOKEN_FILE]
        with open(path, encoding="utf-8") as f:
            token, source = f.read().strip(), f"{ENV_TOKEN_FILE}={path}"
    if token is None:
        return None
    if not token:
        raise ValueError(f"the job token from {source} is empty; give a non-empty secret")
    if len(token.encode()) > _MAX_TOKEN_BYTES:
        raise ValueError(f"the job token from {source} is longer than {_MAX_TOKEN_BYTES} bytes")
    if any(c.isspace() or not c.isprintable() or not c.isascii() for c in token):
        raise ValueError(
            f"the job token from {source} must be printable ASCII without spaces "
            "(it travels in a header)"
        )
    return token


def bearer(token: str) -> str:
    """The header or metadata value that presents ``token``."""
    return _BEARER + token


def token_matches(presented: str | bytes | None, expected: str | None) -> bool:
    """Whether a presented ``Authorization`` value carries the job token.

    Constant time in the token's content. With no ``expected`` token every
    request is accepted.
    """
    if expected is None:
        return True
    if presented is None:
        return False
    if isinstance(presented, bytes):
        try:
            presented = presented.decode("ascii")
        except UnicodeDecodeError:
            return False
    if not presented.startswith(_BEARER):
        return False
    return hmac.compare_digest(presented[len(_BEARER) :].encode(), expected.encode())


def warn_if_open(token: str | None, what: str) -> None:
    """Log once per process that ``what`` runs without a job token."""
    if token is not None or _warned.is_set():
        return
    _warned.set()
    logger.warning(
        "%s runs without a job token: anyone who can reach its ports can join the job, "
        "read its model state or stop it. Set %s (or %s) in every process of the job.",
        what,
        ENV_TOKEN,
        ENV_TOKEN_FILE,
    )


def refusal(presented: str | bytes | None, expected: str | None, what: str) -> str | None:
    """Why a request presenting ``presented`` is refused, or None to accept it.

    Args:
        presented: the request's ``Authorization`` value (None when absent).
        expected: the job token; None accepts everything.
        what: the server, for the message ("this lighthouse").

    Returns:
        None, or the message for an UNAUTHENTICATED status or a 401 answer.
    """
    if token_matches(presented, expected):
        return None
    if presented is None:
        return (
            f"{what} requires the job token: set {ENV_TOKEN} (or {ENV_TOKEN_FILE}) to the "
            "job's token in this process"
        )
    return (
        f"{what} refused the job token presented: it is not the job's token "
        f"(check {ENV_TOKEN} / {ENV_TOKEN_FILE} in this process)"
    )


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Where the TLS material of a process is; every field may be None.

    Attributes:
        cert: a server's certificate chain (PEM file).
        key: that certificate's private key (PEM file).
        ca: the certificate(s) a client trusts (PEM file); a client with one
            uses TLS.
        server_name: the name a client expects in the server's certificate
            (one job-wide certificate can then serve every host).
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def server_pair(self) -> tuple[bytes, bytes] | None:
        """The ``(key, certificate chain)`` PEM bytes a server presents, or None.

        Raises:
            OSError: a file cannot be read.
        """
        if self.cert is None or self.key is None:
            return None
        return _read(self.key), _read(self.cert)

    def root(self) -> bytes | None:
        """The PEM bytes of :attr:`ca`, or None.

        Raises:
            OSError: the file cannot be read.
        """
        return None if self.ca is None else _read(self.ca)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def tls_files(
    cert: str | None = None,
    key: str | None = None,
    ca: str | None = None,
    server_name: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> TlsFiles:
    """TLS settings: each argument, else its ``FTDIST_TLS_*`` variable.

    Args:
        cert: the server certificate file (``FTDIST_TLS_CERT``).
        key: its private key file (``FTDIST_TLS_KEY``).
        ca: the file of certificates clients trust (``FTDIST_TLS_CA``).
        server_name: the certificate name clients expect
            (``FTDIST_TLS_SERVER_NAME``).
        environ: the environment to read (``os.environ`` when None).

    Returns:
        The settings; all None when TLS is not configured.

    Raises:
        ValueError: a certificate without its key or the other way round.
    """
    env = os.environ if environ is None else environ
    files = TlsFiles(
        cert=cert or env.get(ENV_TLS_CERT) or None,
        key=key or env.get(ENV_TLS_KEY) or None,
        ca=ca or env.get(ENV_TLS_CA) or None,
        server_name=server_name or env.get(ENV_TLS_SERVER_NAME) or None,
    )
    if (files.cert is None) != (files.key is None):
        raise ValueError(
            f"TLS needs a certificate and its key together (got cert={files.cert!r}, "
            f"key={files.key!r}); set both {ENV_TLS_CERT} and {ENV_TLS_KEY}, or neither"
        )
    return files
