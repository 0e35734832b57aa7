"""
Failure news
============

The lighthouse tells every subscriber at once when a member of the current
quorum dies (its connection closed, or its heartbeats stopped): ftdist's
``ftdist.LighthouseEvents/Subscribe`` stream, which torchft clients never
open. A Manager follows it so that it can abort a collective waiting on a
dead peer instead of waiting out the collective timeout.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from ftdist.lighthouse.client import LighthouseClient

logger = logging.getLogger(__name__)

# Leaving must not hold up a process that is exiting.
_LEAVE_TIMEOUT_S = 2.0
# The stream is idle between events, so only pings notice that a partition
# left its connection half-open; reopened within about this long after the
# network is back, it is open again before the lighthouse's side of the old
# one is closed by TCP's user timeout (10 s), which would read as a death.
_STREAM_KEEPALIVE_S = 1.0
_MAX_BACKOFF_S = 1.0


class FailureNews:
    """Follows the lighthouse's failure-news stream on a thread.

    Args:
        lighthouse_addr: the lighthouse (None: no news, e.g. a torchft lighthouse).
        replica_id: this replica group's id; the lighthouse counts this
            stream's end as the group's death.
        on_failed: called with ``(replica_id, reason)`` for each dead member.
        connect_timeout: per connection attempt.
    """

    def __init__(
        self,
        lighthouse_addr: str | None,
        replica_id: str,
        on_failed: Callable[[str, str], None],
        connect_timeout: Any,
    ) -> None:
        self._addr = lighthouse_addr
        self._replica_id = replica_id
        self._on_failed = on_failed
        self._connect_timeout = connect_timeout
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._stream: Any = None
        self._client: LighthouseClient | None = None
        self._thread: threading.Thread | None = None
        if lighthouse_addr:
            self._thread = threading.Thread(target=self._run, name="ftdist-news", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        backoff = 0.1
        listener = f"{socket.gethostname()}:{os.getpid()}"
        while not self._closed.is_set():
            try:
                client = LighthouseClient(
                    self._addr or "", self._connect_timeout, keepalive=_STREAM_KEEPALIVE_S
                )
                with self._lock:
                    if self._closed.is_set():
                        client.close()
                        return
                    self._client = client
                    self._stream = client.subscribe(self._replica_id, listener)
                    stream = self._stream
                backoff = 0.1
                for event in stream:
                    if event.kind == "member_failed":
                        self._on_failed(event.replica_id, event.reason)
            except Exception as exc:
                if self._closed.is_set():
                    return
                logger.info("failure news stream interrupted (%s); reconnecting", exc)
            finally:
                with self._lock:
                    if self._client is not None:
                        self._client.close()
                    self._client, self._stream = None, None
            self._closed.wait(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    def close(self, leaving: bool = False) -> None:
        """Stop following the stream; joins the thread.

        Args:
            leaving: the replica group leaves the job: tell the lighthouse
                first, so that this stream's end is not taken for a death.
        """
        if leaving and self._addr:
            try:
                with LighthouseClient(self._addr, _LEAVE_TIMEOUT_S) as client:
                    client.leave(self._replica_id, timeout=_LEAVE_TIMEOUT_S)
            except Exception as exc:  # leaving is best effort; closing is not
                logger.info(
                    "could not tell the lighthouse that %s leaves: %s", self._replica_id, exc
                )
        self._closed.set()
        with self._lock:
            if self._stream is not None:
                self._stream.close()
        if self._thread is not None:
            self._thread.join(timeout=10)
