"""
HPACK, the header compression of HTTP/2 (RFC 7541), for a gRPC server
=====================================================================

A server must decode everything a client may send: indexed fields from the
static and the dynamic table, literals with or without indexing, table size
updates and Huffman-coded strings (gRPC's C core and Rust's ``h2`` code most
values). It need not compress what it sends: the replies here are a status, a
content type and a few trailers, so :func:`encode` writes literals that never
touch the decoder's table on the other side.

Huffman decoding walks a table of 4-bit steps built once from the code
lengths (the code is canonical, so the lengths define it): two lookups per
byte instead of a loop per bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["Decoder", "HpackError", "encode", "huffman_decode"]


class HpackError(ValueError):
    """A header block that cannot be decoded: the connection must end
    with COMPRESSION_ERROR (the decoder's table is no longer in step)."""


# RFC 7541 Appendix A: the static table, index 1 first.
_STATIC_NAMES = (
    ":authority :method :method :path :path :scheme :scheme :status :status :status "
    ":status :status :status :status accept-charset accept-encoding accept-language "
    "accept-ranges accept access-control-allow-origin age allow authorization "
    "cache-control content-disposition content-encoding content-language "
    "content-length content-location content-range content-type cookie date etag "
    "expect expires from host if-match if-modified-since if-none-match if-range "
    "if-unmodified-since last-modified link location max-forwards proxy-authenticate "
    "proxy-authorization range referer refresh retry-after server set-cookie "
    "strict-transport-security transfer-encoding user-agent vary via www-authenticate"
).split()
_STATIC_VALUES = {
    2: "GET",
    3: "POST",
    4: "/",
    5: "/index.html",
    6: "http",
    7: "https",
    8: "200",
    9: "204",
    10: "206",
    11: "304",
    12: "400",
    13: "404",
    14: "500",
    16: "gzip, deflate",
}
STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = tuple(
    (name.encode(), _STATIC_VALUES.get(index, "").encode())
    for index, name in enumerate(_STATIC_NAMES, start=1)
)
assert len(STATIC_TABLE) == 61

# RFC 7541 Appendix B: the code length of every symbol, 0-255 then EOS (256).
# Codes of one length are consecutive in symbol order (a canonical code).
_CODE_LENGTHS = bytes(
    int(n)
    for n in """
    13 23 28 28 28 28 28 28 28 24 30 28 28 30 28 28
    28 28 28 28 28 28 30 28 28 28 28 28 28 28 28 28
    6 10 10 12 13 6 8 11 10 10 8 11 8 6 6 6
    5 5 5 6 6 6 6 6 6 6 7 8 15 6 12 10
    13 6 7 7 7 7 7 7 7 7 7 7 7 7 7 7
    7 7 7 7 7 7 7 7 8 7 8 13 19 13 14 6
    15 5 6 5 6 5 6 6 6 5 7 7 6 6 6 5
    6 7 6 5 5 6 7 7 7 7 7 15 11 14 13 28
    20 22 20 20 22 22 22 23 22 23 23 23 23 23 24 23
    24 24 22 23 24 23 23 23 23 21 22 23 22 23 23 24
    22 21 20 22 22 23 23 21 23 22 22 24 21 22 23 23
    21 21 22 21 23 22 23 23 20 22 22 22 23 22 22 23
    26 26 20 19 22 23 22 25 26 26 26 27 27 26 24 25
    19 21 26 27 27 26 27 24 21 21 26 26 28 27 27 27
    20 24 20 21 22 21 21 23 22 22 25 25 24 24 26 23
    26 27 26 26 27 27 27 27 27 28 27 27 27 27 27 26
    30
""".split()
)
_EOS = 256


def _canonical_codes(lengths: bytes) -> list[int]:
    codes = [0] * len(lengths)
    code = 0
    previous = 0
    for rank, symbol in enumerate(sorted(range(len(lengths)), key=lambda s: (lengths[s], s))):
        if rank:
            code = (code + 1) << (lengths[symbol] - previous)
        previous = lengths[symbol]
        codes[symbol] = code
    return codes


def _build_steps() -> tuple[list[int], list[int], frozenset[int]]:
    """Tables for decoding 4 bits at a time.

    States are the inner nodes of the code tree (0 is the root). For state s
    and nibble n, ``next_state[s*16+n]`` is where the walk ends and
    ``emitted[s*16+n]`` the symbol completed on the way, or -1 (a nibble can
    complete at most one symbol: no code is shorter than 5 bits). -2 marks a
    walk into EOS, which a string must never contain.
    """
    codes = _canonical_codes(_CODE_LENGTHS)
    children: list[list[int]] = [[0, 0]]  # inner node -> [child0, child1]; leaf = ~symbol
    for symbol, (code, length) in enumerate(zip(codes, _CODE_LENGTHS, strict=True)):
        node = 0
        for depth in range(length - 1, -1, -1):
            bit = (code >> depth) & 1
            if depth == 0:
                children[node][bit] = ~symbol
            else:
                if children[node][bit] == 0:
                    children.append([0, 0])
                    children[node][bit] = len(children) - 1
                node = children[node][bit]
    next_state = [0] * (len(children) * 16)
    emitted = [-1] * (len(children) * 16)
    for state in range(len(children)):
        for nibble in range(16):
            node = state
            out = -1
            for shift in (3, 2, 1, 0):
                child = children[node][(nibble >> shift) & 1]
                if child < 0:
                    out = -2 if ~child == _EOS else ~child
                    node = 0
                else:
                    node = child
            next_state[state * 16 + nibble] = node
            emitted[state * 16 + nibble] = out
    # Where a string may end: the root, or up to 7 bits into the all-ones
    # path (the most significant bits of EOS pad the last byte).
    accepting = {0}
    node = 0
    for _ in range(7):
        node = children[node][1]
        accepting.add(node)
    return next_state, emitted, frozenset(accepting)


_NEXT, _EMIT, _ACCEPTING = _build_steps()


def huffman_decode(data: bytes) -> bytes:
    """Decode a Huffman-coded HPACK string.

    Raises:
        HpackError: if it holds EOS or ends in anything but up to 7 bits of padding.
    """
    nxt, emit = _NEXT, _EMIT
    out = bytearray()
    state = 0
    for byte in data:
        index = state * 16 + (byte >> 4)
        symbol = emit[index]
        if symbol >= 0:
            out.append(symbol)
        elif symbol == -2:
            raise HpackError("Huffman string holds EOS")
        index = nxt[index] * 16 + (byte & 15)
        symbol = emit[index]
        if symbol >= 0:
            out.append(symbol)
        elif symbol == -2:
            raise HpackError("Huffman string holds EOS")
        state = nxt[index]
    if state not in _ACCEPTING:
        raise HpackError("Huffman string ends in something other than padding")
    return bytes(out)


_HUFFMAN_CACHE_ENTRIES = 1024
_BLOCK_CACHE_ENTRIES = 64
# Only small strings and blocks are remembered: the caches stay below a
# megabyte whatever clients send.
_CACHED_BYTES = 512
_huffman_cache: dict[bytes, bytes] = {}


def _integer(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """Decode an integer with an N-bit prefix at ``data[pos]``: (value, next pos)."""
    mask = (1 << prefix_bits) - 1
    value = data[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(data):
            raise HpackError("header block ends inside an integer")
        byte = data[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
        if shift > 28:
            raise HpackError("integer in header block is too large")


class Decoder:
    """The decoding side of one connection's HPACK state.

    Args:
        max_table_size: the table size this side advertised
            (SETTINGS_HEADER_TABLE_SIZE; 4096 unless changed).
    """

    def __init__(self, max_table_size: int = 4096) -> None:
        self._limit = max_table_size
        self._max = max_table_size
        self._table: deque[tuple[bytes, bytes]] = deque()
        self._size = 0
        # Blocks that left the table as it was, by content: a client that
        # indexed its headers sends the same few bytes for every call.
        self._version = 0
        self._blocks: dict[bytes, tuple[int, list[tuple[bytes, bytes]]]] = {}

    def _field(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= 61:
            return STATIC_TABLE[index - 1]
        position = index - 62
        if index == 0 or position >= len(self._table):
            raise HpackError(f"header index {index} is not in the table")
        return self._table[position]

    def _add(self, name: bytes, value: bytes) -> None:
        self._version += 1
        self._table.appendleft((name, value))
        self._size += len(name) + len(value) + 32
        self._evict()

    def _evict(self) -> None:
        while self._size > self._max and self._table:
            name, value = self._table.pop()
            self._size -= len(name) + len(value) + 32

    def _string(self, data: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(data):
            raise HpackError("header block ends before a string")
        huffman = data[pos] & 0x80
        length, pos = _integer(data, pos, 7)
        end = pos + length
        if end > len(data):
            raise HpackError("header block ends inside a string")
        raw = data[pos:end]
        if not huffman:
            return raw, end
        # Clients code the same values again and again (Rust's h2 never
        # indexes :path, so every call's path arrives Huffman-coded).
        decoded = _huffman_cache.get(raw)
        if decoded is None:
            decoded = huffman_decode(raw)
            if len(raw) > _CACHED_BYTES:
                return decoded, end
            if len(_huffman_cache) >= _HUFFMAN_CACHE_ENTRIES:
                _huffman_cache.clear()
            _huffman_cache[raw] = decoded
        return decoded, end

    def decode(self, data: bytes, max_list: int = 1 << 30) -> list[tuple[bytes, bytes]]:
        """Decode one complete header block.

        Args:
            data: the block.
            max_list: the largest header list accepted, counted as HTTP/2
                does (each field's name and value plus 32 bytes).

        Raises:
            HpackError: if the block is malformed or its list is above
                ``max_list``; the connection cannot go on.
        """
        cached = self._blocks.get(data)
        if cached is not None and cached[0] == self._version:
            return list(cached[1])
        version = self._version
        headers = self._decode(data, max_list)
        if self._version == version and len(data) <= _CACHED_BYTES:
            if len(self._blocks) >= _BLOCK_CACHE_ENTRIES:
                self._blocks.clear()
            self._blocks[bytes(data)] = (version, headers)
            return list(headers)
        return headers

    def _decode(self, data: bytes, max_list: int) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        pos = 0
        end = len(data)
        size = 0
        while pos < end:
            if size > max_list:
                raise HpackError(f"header list above {max_list} bytes")
            first = data[pos]
            if first & 0x80:
                index, pos = _integer(data, pos, 7)
                field = self._field(index)
                headers.append(field)
                size += len(field[0]) + len(field[1]) + 32
                continue
            if first & 0xE0 == 0x20:
                table_size, pos = _integer(data, pos, 5)
                if table_size > self._limit:
                    raise HpackError(f"table size update to {table_size} is above {self._limit}")
                self._max = table_size
                self._version += 1
                self._evict()
                continue
            indexing = first & 0x40
            index, pos = _integer(data, pos, 6 if indexing else 4)
            if index:
                name = self._field(index)[0]
            else:
                name, pos = self._string(data, pos)
            value, pos = self._string(data, pos)
            if indexing:
                self._add(name, value)
            headers.append((name, value))
            size += len(name) + len(value) + 32
        if size > max_list:
            raise HpackError(f"header list above {max_list} bytes")
        return headers


def _encode_integer(value: int, prefix_bits: int, first: int) -> bytes:
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytes([first | value])
    out = bytearray([first | mask])
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A header block of literals without indexing and without Huffman
    coding: nothing in it changes the peer's table."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00"
        out += _encode_integer(len(name), 7, 0)
        out += name
        out += _encode_integer(len(value), 7, 0)
        out += value
    return bytes(out)
