"""The checkpoint transports' settings: argument > environment > default."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from ftdist.checkpointing.config import direct_reads, local_socket

Setting = Callable[[bool | None, Mapping[str, str] | None], bool]
SETTINGS: list[tuple[Setting, str]] = [
    (local_socket, "FTDIST_CHECKPOINT_LOCAL_SOCKET"),
    (direct_reads, "FTDIST_CHECKPOINT_DIRECT_READS"),
]


@pytest.mark.parametrize(("setting", "name"), SETTINGS)
@pytest.mark.parametrize(
    ("argument", "value", "expected"),
    [
        (None, None, True),
        (None, "", True),
        (None, "1", True),
        (None, " On ", True),
        (None, "0", False),
        (None, "false", False),
        (True, "0", True),
        (False, None, False),
        (False, "maybe", False),  # never read
    ],
)
def test_argument_then_environment_then_on(
    setting: Setting, name: str, argument: bool | None, value: str | None, expected: bool
) -> None:
    env = {} if value is None else {name: value}
    assert setting(argument, env) is expected


@pytest.mark.parametrize(("setting", "name"), SETTINGS)
def test_a_value_neither_on_nor_off_names_itself_and_the_fix(setting: Setting, name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}='2'.*set it to 1 .* or 0"):
        setting(None, {name: "2"})
