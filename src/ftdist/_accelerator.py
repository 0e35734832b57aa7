"""
Accelerator helpers
===================

Small helpers that hide which accelerator (CUDA or XPU) is present. On a
machine without an accelerator they are no-ops. torchft calls them
``torchft.utils``; :mod:`ftdist.utils` re-exports them under that name.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


def get_stream_context(stream: torch.Stream | None) -> AbstractContextManager[Any]:
    """A context manager that makes ``stream`` the current stream.

    Args:
        stream: a CUDA or XPU stream, or None.

    Returns:
        ``torch.cuda.stream(stream)`` or ``torch.xpu.stream(stream)`` for the
        accelerator present, else a context manager that does nothing (also
        for ``stream=None``).
    """
    if stream is None:
        return nullcontext()
    if torch.cuda.is_available():
        return torch.cuda.stream(stream)  # type: ignore[arg-type]
    if torch.xpu.is_available():
        return torch.xpu.stream(stream)  # type: ignore[arg-type]
    return nullcontext()


def record_event() -> Any:
    """Record an event on the current accelerator stream and return it.

    A CUDA event is created ``interprocess=True``, so another process can wait
    on it (the Baby process groups pass such events to their child).

    Returns:
        The recorded ``torch.cuda.Event`` or ``torch.xpu.Event``.

    Raises:
        RuntimeError: there is no CUDA or XPU device.
    """
    if torch.xpu.is_available():
        xpu_event = torch.xpu.Event()
        torch.xpu.current_stream().record_event(xpu_event)
        return xpu_event
    if not torch.cuda.is_available():
        raise RuntimeError("record_event() needs a CUDA or XPU device; none is available")
    cuda_event = torch.cuda.Event(interprocess=True)
    torch.cuda.current_stream().record_event(cuda_event)
    return cuda_event


def synchronize() -> None:
    """Wait for the current accelerator stream to finish its queued work (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    elif torch.xpu.is_available():
        torch.xpu.current_stream().synchronize()


__all__ = ["get_stream_context", "record_event", "synchronize"]
