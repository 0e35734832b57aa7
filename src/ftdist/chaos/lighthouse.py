"""
The lighthouse the chaos suite restarts
=======================================

:class:`RestartableLighthouse` holds the run's
:class:`~ftdist.coordination.LighthouseServer` and can stop it and start a
new one on the same address, as an operator restarting a crashed lighthouse
would: the replica groups keep its address and must carry on.
"""

from __future__ import annotations

import time
from typing import Any

RESTART_BIND_TRIES_S = 10.0


class RestartableLighthouse:
    """A lighthouse on ``host``, restartable on the port it first bound.

    Args:
        host: the address to bind (the bridge's lighthouse address, or
            ``127.0.0.1``).
        min_replicas: the quorum's least replica groups.
        join_timeout_ms: how long a ready quorum waits for stragglers.
        heartbeat_timeout_ms: silence after which a group is dead.

    Raises:
        OSError: no port could be bound.
    """

    def __init__(
        self, host: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int
    ) -> None:
        self.host = host
        self.min_replicas = min_replicas
        self.join_timeout_ms = join_timeout_ms
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.restarts = 0
        self._server: Any = self._start(0)
        self.port: int = int(self._server.port)

    def _start(self, port: int) -> Any:
        from ftdist.lighthouse import LighthouseServer

        return LighthouseServer(
            bind=f"{self.host}:{port}",
            min_replicas=self.min_replicas,
            join_timeout_ms=self.join_timeout_ms,
            heartbeat_timeout_ms=self.heartbeat_timeout_ms,
            http_port=-1,
        )

    @property
    def address(self) -> str:
        """``http://host:port``: the same before and after restarts."""
        return f"http://{self.host}:{self.port}"

    @property
    def up(self) -> bool:
        """Whether a lighthouse is serving."""
        return self._server is not None

    def stop(self) -> None:
        """Shut the lighthouse down (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()

    def start(self) -> None:
        """Start a new lighthouse on the same port (no-op while one is up).

        Raises:
            OSError: the port stayed taken for ``RESTART_BIND_TRIES_S``.
        """
        if self._server is not None:
            return
        deadline = time.monotonic() + RESTART_BIND_TRIES_S
        while True:
            try:
                self._server = self._start(self.port)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.restarts += 1


__all__ = ["RestartableLighthouse"]
