"""The checkpoint transports' settings: argument > environment > default."""

from __future__ import annotations

import pytest

from ftdist.checkpointing.config import local_socket


@pytest.mark.parametrize(
    ("argument", "env", "expected"),
    [
        (None, {}, True),
        (None, {"FTDIST_CHECKPOINT_LOCAL_SOCKET": ""}, True),
        (None, {"FTDIST_CHECKPOINT_LOCAL_SOCKET": "1"}, True),
        (None, {"FTDIST_CHECKPOINT_LOCAL_SOCKET": " On "}, True),
        (None, {"FTDIST_CHECKPOINT_LOCAL_SOCKET": "0"}, False),
        (None, {"FTDIST_CHECKPOINT_LOCAL_SOCKET": "false"}, False),
        (True, {"FTDIST_CHECKPOINT_LOCAL_SOCKET": "0"}, True),
        (False, {}, False),
        (False, {"FTDIST_CHECKPOINT_LOCAL_SOCKET": "maybe"}, False),  # never read
    ],
)
def test_argument_then_environment_then_on(
    argument: bool | None, env: dict[str, str], expected: bool
) -> None:
    assert local_socket(argument, env) is expected


def test_a_value_neither_on_nor_off_names_itself_and_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"FTDIST_CHECKPOINT_LOCAL_SOCKET='2'.*set it to 1 .* or 0"
    ):
        local_socket(None, {"FTDIST_CHECKPOINT_LOCAL_SOCKET": "2"})
