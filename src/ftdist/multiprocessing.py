"""torchft's ``torchft.multiprocessing``: :class:`ftdist.process_group._pipe.MonitoredPipe`."""

from ftdist.process_group._pipe import MonitoredPipe as _MonitoredPipe

__all__ = ["_MonitoredPipe"]
