"""HPACK decoding (ftdist._rpc.hpack): RFC 7541's own examples, every
representation an encoder may choose, and garbage that must fail cleanly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftdist._rpc import hpack

pytestmark = pytest.mark.timeout(120)

_CODES = hpack._canonical_codes(hpack._CODE_LENGTHS)


def _huffman(raw: bytes) -> bytes:
    bits = 0
    count = 0
    for byte in raw:
        bits = (bits << hpack._CODE_LENGTHS[byte]) | _CODES[byte]
        count += hpack._CODE_LENGTHS[byte]
    pad = -count % 8
    bits = (bits << pad) | ((1 << pad) - 1)
    count += pad
    return bits.to_bytes(count // 8, "big") if count else b""


def _integer(value: int, prefix: int, first: int) -> bytes:
    return hpack._encode_integer(value, prefix, first)


def _string(raw: bytes, huffman: bool) -> bytes:
    body = _huffman(raw) if huffman else raw
    return _integer(len(body), 7, 0x80 if huffman else 0) + body


class _Encoder:
    """A test-side encoder that uses every representation and keeps its own
    copy of the dynamic table, to check the decoder against."""

    def __init__(self, draw: st.DataObject) -> None:
        self.draw = draw
        self.table: list[tuple[bytes, bytes]] = []
        self.max = 4096

    def size(self) -> int:
        return sum(len(n) + len(v) + 32 for n, v in self.table)

    def evict(self) -> None:
        while self.size() > self.max:
            self.table.pop()

    def full_table(self) -> list[tuple[bytes, bytes]]:
        return list(hpack.STATIC_TABLE) + self.table

    def field(self, name: bytes, value: bytes) -> bytes:
        table = self.full_table()
        choice = self.draw.draw(st.sampled_from(["indexed", "incremental", "without", "never"]))
        if choice == "indexed" and (name, value) in table:
            return _integer(table.index((name, value)) + 1, 7, 0x80)
        huffman = self.draw.draw(st.booleans())
        names = [n for n, _ in table]
        name_index = names.index(name) + 1 if name in names and self.draw.draw(st.booleans()) else 0
        if choice == "incremental" or choice == "indexed":
            head = _integer(name_index, 6, 0x40)
        else:
            head = _integer(name_index, 4, 0x10 if choice == "never" else 0)
        body = head + (b"" if name_index else _string(name, huffman)) + _string(value, huffman)
        if choice in ("incremental", "indexed"):
            self.table.insert(0, (name, value))
            self.evict()
        return body

    def size_update(self, size: int) -> bytes:
        self.max = size
        self.evict()
        return _integer(size, 5, 0x20)


_names = st.sampled_from([b":path", b"content-type", b"grpc-timeout", b"x-a", b"authorization"])
_values = st.binary(max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.lists(st.lists(st.tuples(_names, _values), max_size=8), max_size=6))
def test_every_representation_decodes_to_what_was_encoded(
    data: st.DataObject, blocks: list[list[tuple[bytes, bytes]]]
) -> None:
    encoder = _Encoder(data)
    decoder = hpack.Decoder()
    for headers in blocks:
        block = b""
        if data.draw(st.booleans()):
            block += encoder.size_update(data.draw(st.integers(0, 4096)))
        block += b"".join(encoder.field(n, v) for n, v in headers)
        assert decoder.decode(block) == headers
        # The same bytes again: the cache must give the same answer only
        # when the table is as it was.
        again = b"".join(encoder.field(n, v) for n, v in headers)
        assert decoder.decode(again) == headers


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_huffman_round_trip(raw: bytes) -> None:
    assert hpack.huffman_decode(_huffman(raw)) == raw


def test_rfc_7541_request_examples_with_huffman() -> None:
    # RFC 7541 C.4.1 to C.4.3: three requests on one connection.
    decoder = hpack.Decoder()
    first = bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff")
    assert decoder.decode(first) == [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":path", b"/"),
        (b":authority", b"www.example.com"),
    ]
    second = bytes.fromhex("828684be5886a8eb10649cbf")
    assert decoder.decode(second)[-1] == (b"cache-control", b"no-cache")
    third = bytes.fromhex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf")
    assert decoder.decode(third) == [
        (b":method", b"GET"),
        (b":scheme", b"https"),
        (b":path", b"/index.html"),
        (b":authority", b"www.example.com"),
        (b"custom-key", b"custom-value"),
    ]


@pytest.mark.parametrize(
    ("block", "why"),
    [
        (b"\xbe", "not in the table"),  # index 62, empty dynamic table
        (b"\x80", "not in the table"),  # index 0
        (b"\x3f\xe2\x1f", "above"),  # table size update to 4097
        (b"\x00\x85ab", "inside a string"),
        (b"\x00\x81\xff", "padding"),  # 8 one-bits: EOS's prefix, too long
        (b"\xff\xff\xff\xff\xff\xff", "integer"),
    ],
)
def test_malformed_blocks_raise_hpack_error(block: bytes, why: str) -> None:
    with pytest.raises(hpack.HpackError, match=why):
        hpack.Decoder().decode(block)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_decodes_or_raises_hpack_error_only(block: bytes) -> None:
    try:
        hpack.Decoder().decode(block)
    except hpack.HpackError:
        pass


def test_encode_writes_literals_that_decode() -> None:
    fields = [(b":status", b"200"), (b"grpc-message", b"x" * 300)]
    assert hpack.Decoder().decode(hpack.encode(fields)) == fields


def test_the_decoded_list_is_capped_not_just_the_block() -> None:
    decoder = hpack.Decoder()
    big = b"\x40\x01x" + hpack._encode_integer(4000, 7, 0) + b"v" * 4000
    assert decoder.decode(big, max_list=5000) == [(b"x", b"v" * 4000)]
    with pytest.raises(hpack.HpackError, match="header list above 5000"):
        decoder.decode(b"\xbe" * 2, max_list=5000)
