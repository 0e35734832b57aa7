"""torchft's ``torchft.utils``: the accelerator helpers of :mod:`ftdist._accelerator`."""

from ftdist._accelerator import get_stream_context, record_event, synchronize

__all__ = ["get_stream_context", "record_event", "synchronize"]
