"""
Durations
=========

ftdist's API takes durations as :class:`datetime.timedelta`; for torchft
compatibility most places also accept a plain number in a stated unit
(seconds for collective timeouts, milliseconds for lighthouse settings).
Every such argument is read here, so that each one accepts the same forms
and fails with the same message.
"""

from __future__ import annotations

from datetime import timedelta

SECOND = timedelta(seconds=1)
MILLISECOND = timedelta(milliseconds=1)


def as_timedelta(
    value: object, name: str, *, unit: timedelta = SECOND, allow_zero: bool = False
) -> timedelta:
    """Read a duration given as a ``timedelta`` or as a number of ``unit``.

    Args:
        value: the duration.
        name: the parameter's name, for the error message.
        unit: what a plain number counts (seconds unless stated).
        allow_zero: accept a zero duration (negative ones never are).

    Returns:
        The duration.

    Raises:
        TypeError: ``value`` is neither a timedelta nor a number.
        ValueError: ``value`` is negative, or zero without ``allow_zero``.
    """
    if isinstance(value, timedelta):
        td = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        td = unit * float(value)
    else:
        what = "seconds" if unit == SECOND else "milliseconds" if unit == MILLISECOND else unit
        raise TypeError(f"{name} must be a datetime.timedelta or a number of {what}, got {value!r}")
    if td < timedelta(0) or (td == timedelta(0) and not allow_zero):
        bound = "must not be negative" if allow_zero else "must be positive"
        raise ValueError(f"{name} {bound}, got {td}")
    return td


def to_seconds(value: object, name: str) -> float:
    """Read a positive duration (a ``timedelta`` or seconds) as seconds.

    Raises:
        TypeError: ``value`` is neither a timedelta nor a number.
        ValueError: ``value`` is not positive.
    """
    return as_timedelta(value, name).total_seconds()
