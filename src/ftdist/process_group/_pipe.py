"""
A pipe whose reads time out
===========================

:class:`MonitoredPipe` wraps one end of a ``multiprocessing`` pipe: ``recv`` never blocks past its timeout, and
an exception object sent by the peer is raised on this side, so a child
process can report a failure as a value. The Baby process groups talk to
their child through it. torchft calls it ``torchft.multiprocessing._MonitoredPipe``;
:mod:`ftdist.multiprocessing` re-exports it under that name.
"""

from __future__ import annotations

from datetime import timedelta
from multiprocessing.connection import Connection


class MonitoredPipe:
    """One end of a pipe with a bounded ``recv``.

    Args:
        pipe: a ``multiprocessing`` connection (one end of ``Pipe()``).
    """

    def __init__(self, pipe: Connection) -> None:
        self._pipe = pipe

    def send(self, obj: object) -> None:
        """Send ``obj`` (pickled) to the peer.

        Raises:
            BrokenPipeError: the peer has closed its end or exited
                (``ConnectionResetError`` on some platforms).
            OSError: this end is closed.
        """
        self._pipe.send(obj)

    def recv(self, timeout: float | timedelta) -> object:
        """Receive the next object, waiting at most ``timeout``.

        Args:
            timeout: seconds, or a timedelta.

        Returns:
            The object the peer sent.

        Raises:
            TimeoutError: nothing arrived within ``timeout``.
            EOFError: the peer closed its end with nothing left to read.
            Exception: the peer sent an exception object; it is raised here.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if not self._pipe.poll(seconds):
            raise TimeoutError(f"pipe.recv() timed out after {seconds} seconds")
        out = self._pipe.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def close(self) -> None:
        """Close this end."""
        self._pipe.close()

    def closed(self) -> bool:
        """Whether this end is closed.

        Returns:
            True after :meth:`close`.
        """
        return bool(self._pipe.closed)


__all__ = ["MonitoredPipe"]
