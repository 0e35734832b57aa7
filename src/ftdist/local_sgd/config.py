"""
LocalSGD's settings
===================

What ``ftdist.local_sgd`` reads from the environment, each variable spelled
out here (docs/configuration.md lists them all):

``FTDIST_USE_BUCKETIZATION`` / torchft's ``TORCHFT_USE_BUCKETIZATION``
    ``True`` forces streaming DiLoCo to sync a fragment in buckets
    (torchft's rule: only the exact string ``True`` counts).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["USE_BUCKETIZATION_ENV", "bucketization_forced"]

# torchft's name of the variable (torchft.local_sgd.USE_BUCKETIZATION_ENV).
USE_BUCKETIZATION_ENV = "TORCHFT_USE_BUCKETIZATION"


def bucketization_forced(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FTDIST_USE_BUCKETIZATION`` or ``TORCHFT_USE_BUCKETIZATION`` is ``True``."""
    env = os.environ if environ is None else environ
    return "True" in (env.get("FTDIST_USE_BUCKETIZATION"), env.get("TORCHFT_USE_BUCKETIZATION"))
