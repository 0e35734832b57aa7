"""Every duration argument is read by one function, with one set of messages."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ftdist._durations import MILLISECOND, as_timedelta, to_seconds


def test_durations_take_timedelta_or_seconds() -> None:
    assert to_seconds(timedelta(milliseconds=1500), "t") == 1.5
    assert to_seconds(2, "t") == 2.0
    assert as_timedelta(0.25, "t") == timedelta(milliseconds=250)
    assert as_timedelta(1500, "t", unit=MILLISECOND) == timedelta(seconds=1.5)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "t must be positive, got 0:00:00"),
        (-1, ValueError, "t must be positive"),
        (timedelta(seconds=-1), ValueError, "t must be positive"),
        ("5", TypeError, "t must be a datetime.timedelta or a number of seconds, got '5'"),
        (True, TypeError, "t must be a datetime.timedelta"),
        (None, TypeError, "got None"),
    ],
)
def test_bad_durations_name_the_argument(value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        as_timedelta(value, "t")


def test_zero_only_where_allowed() -> None:
    assert as_timedelta(0, "t", allow_zero=True) == timedelta(0)
    with pytest.raises(ValueError, match="t must not be negative"):
        as_timedelta(-0.5, "t", allow_zero=True)
    with pytest.raises(TypeError, match="number of milliseconds"):
        as_timedelta("x", "t", unit=MILLISECOND)
