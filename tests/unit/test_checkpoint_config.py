"""The checkpoint transports' settings: argument > environment > default."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from ftdist.checkpointing.config import direct_reads, local_socket, receive_reserve_bytes

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


@pytest.mark.parametrize(
    ("argument", "value", "expected"),
    [
        (None, None, 1024 << 20),
        (None, " ", 1024 << 20),
        (None, "64", 64 << 20),
        (None, "0", 0),
        (4096, "64", 4096),
        (0, None, 0),
        (5, "lots", 5),  # never read
    ],
)
def test_the_receive_reserve_is_argument_then_environment_then_a_gib(
    argument: int | None, value: str | None, expected: int
) -> None:
    env = {} if value is None else {"FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB": value}
    assert receive_reserve_bytes(argument, env) == expected


@pytest.mark.parametrize("value", ["-1", "1.5", "1G", "lots", "\u00b2", "\uff11\uff12"])
def test_a_receive_reserve_that_is_not_whole_mib_names_itself_and_the_fix(value: str) -> None:
    with pytest.raises(ValueError, match=rf"RECEIVE_RESERVE_MB='{value}'.*whole number of MiB"):
        receive_reserve_bytes(None, {"FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB": value})


@pytest.mark.parametrize("argument", [-1, 1.5, True])
def test_a_receive_reserve_argument_that_is_not_whole_bytes_is_refused(argument: object) -> None:
    with pytest.raises(ValueError, match="whole number of bytes"):
        receive_reserve_bytes(argument, {})  # type: ignore[arg-type]
