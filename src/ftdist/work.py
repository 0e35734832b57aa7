"""
Work objects, by torchft's names
================================

``_DummyWork`` (``torchft.work._DummyWork``; ``torchft.process_group._DummyWork``
in the early-2025 API) is ftdist's
:class:`~ftdist.process_group.work.CompletedWork`: the same class object,
reachable under both module paths, so that ``isinstance`` checks agree
whichever name the code imported.
"""

from __future__ import annotations

from ftdist.process_group.work import CompletedWork

_DummyWork = CompletedWork

__all__ = ["_DummyWork"]
