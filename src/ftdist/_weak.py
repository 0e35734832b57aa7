"""
Callbacks that do not own their object
======================================

An object hands its parts bound methods to call back (a failure handler, a
log prefix, the state to serve), and owns those parts: each bound method is
a reference back, so the object and its parts form a cycle. Reference
counting never frees a cycle; the cyclic collector does, and a long-lived
object is in its oldest generation, which it collects rarely. A Manager shut
down and dropped stayed alive that way, with the model its state functions
reach (on a GPU, memory nothing else could use) until the collector ran.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["weakly"]

R = TypeVar("R")


def weakly(method: Callable[..., R], gone: Callable[[], R] | None = None) -> Callable[..., R]:
    """``method`` (a bound method), callable without keeping its object alive.

    Args:
        method: the bound method to call.
        gone: called instead, for its value, once the object is collected;
            without it, a call then raises ``ReferenceError``.

    Raises:
        TypeError: ``method`` is not a bound method.
    """
    ref = weakref.WeakMethod(method)
    name = getattr(method, "__qualname__", repr(method))

    def call(*args: Any, **kwargs: Any) -> R:
        bound = ref()
        if bound is not None:
            return bound(*args, **kwargs)
        if gone is None:
            raise ReferenceError(f"{name}: its object was garbage-collected")
        return gone()

    return call
