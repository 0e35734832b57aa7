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
constant time.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Mapping

__all__ = [
    "ENV_TOKEN",
    "ENV_TOKEN_FILE",
    "METADATA_KEY",
    "bearer",
    "job_token",
    "token_matches",
    "warn_if_open",
]

logger = logging.getLogger("ftdist.auth")

ENV_TOKEN = "FTDIST_JOB_TOKEN"
ENV_TOKEN_FILE = "FTDIST_JOB_TOKEN_FILE"
# gRPC metadata keys are lower case; HTTP header names are case-insensitive.
METADATA_KEY = "authorization"
_BEARER = "Bearer "
_MAX_TOKEN_BYTES = 4096

_warned = threading.Event()


def job_token(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The job's token: ``explicit``, else ``FTDIST_JOB_TOKEN``, else ``FTDIST_JOB_TOKEN_FILE``.

    Args:
        explicit: a token given in code or on a command line.
        environ: the environment to read (``os.environ`` when None).

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
