"""Lighthouse address lists: how ``LighthouseClient`` reads the replicas of a
replicated lighthouse, and which lists it refuses before connecting."""

from __future__ import annotations

from typing import Any

import pytest

from ftdist.lighthouse.client import LighthouseClient, parse_addresses

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("h1:1", ("h1:1",)),
        ("  http://h1:1/ ", ("http://h1:1/",)),
        ("http://h1:1,http://h2:2", ("http://h1:1", "http://h2:2")),
        ("h1:1, h2:2 ,http://h3:3", ("h1:1", "h2:2", "http://h3:3")),
        ("https://h1:1,https://h2:2", ("https://h1:1", "https://h2:2")),
        ("[::1]:1,[::1]:2", ("[::1]:1", "[::1]:2")),
    ],
)
def test_addresses_are_split_in_order(spec: str, expected: tuple[str, ...]) -> None:
    assert parse_addresses(spec) == expected


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("h1:1,,h2:2", "empty entry"),
        ("h1:1,", "empty entry"),
        (",h1:1", "empty entry"),
        ("h1:1,h2", "'h2'"),
        ("h1:1,http://h2:port", "'http://h2:port'"),
        ("h1:1,h1:1", "h1:1 twice"),
        ("h1:1,http://h1:1/", "h1:1 twice"),
        ("https://h1:1,http://h2:2", "mixes https://"),
        ("https://h1:1,h2:2", "mixes https://"),
    ],
)
def test_malformed_lists_name_the_entry_and_the_form(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match="lighthouse address") as info:
        parse_addresses(spec)
    message = str(info.value)
    assert words in message
    if "twice" not in words and "mixes" not in words:
        assert "host:port or http://host:port" in message


@pytest.mark.parametrize("spec", ["", "host", "http://host", "host:port"])
def test_one_address_keeps_its_message(spec: str) -> None:
    with pytest.raises(ValueError, match=r"must be host:port or http://host:port\."):
        parse_addresses(spec)


def test_not_a_string_is_a_type_error() -> None:
    bad: Any = ["h1:1", "h2:2"]
    with pytest.raises(TypeError, match="must be a string"):
        parse_addresses(bad)


@pytest.mark.parametrize("spec", ["h1:1,,h2:2", "h1:1,h1:1", "h1:1,nope"])
def test_client_refuses_a_bad_list_before_connecting(spec: str) -> None:
    # Nothing listens on these: a client that got as far as connecting would
    # fail with CoordinationError after the timeout instead.
    with pytest.raises(ValueError, match="lighthouse address"):
        LighthouseClient(spec, connect_timeout=30)
