"""The server side of an HTTP/2 connection without sockets (ftdist._rpc.h2):
frames in, events and frames out."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftdist._rpc import h2, hpack

pytestmark = pytest.mark.timeout(120)

_REQUEST = hpack.encode(
    [(b":method", b"POST"), (b":path", b"/svc/Method"), (b"content-type", b"application/grpc")]
)


def _frames(out: bytearray) -> list[tuple[int, int, int, bytes]]:
    frames = []
    pos = 0
    while pos < len(out):
        length = int.from_bytes(out[pos : pos + 3], "big")
        kind, flags = out[pos + 3], out[pos + 4]
        sid = int.from_bytes(out[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        frames.append((kind, flags, sid, bytes(out[pos + 9 : pos + 9 + length])))
        pos += 9 + length
    out.clear()
    return frames


def _settings(**values: int) -> bytes:
    keys = {"initial_window": 0x4, "max_frame": 0x5}
    return h2.frame(
        h2.SETTINGS, 0, 0, b"".join(struct.pack(">HI", keys[k], v) for k, v in values.items())
    )


def _open(**peer_settings: int) -> h2.ServerConnection:
    conn = h2.ServerConnection(recv_window=1 << 20)
    first = _frames(conn.out)
    assert first[0][0] == h2.SETTINGS
    assert conn.receive(h2.PREFACE + _settings(**peer_settings)) == []
    assert [f[:2] for f in _frames(conn.out)] == [(h2.SETTINGS, h2.ACK)]
    return conn


def test_a_request_in_pieces_gives_headers_then_data() -> None:
    conn = _open()
    wire = h2.frame(h2.HEADERS, h2.END_HEADERS, 1, _REQUEST) + h2.frame(
        h2.DATA, h2.END_STREAM, 1, b"\0\0\0\0\2hi"
    )
    events = []
    for i in range(len(wire)):  # one byte at a time
        events += conn.receive(wire[i : i + 1])
    assert events[0] == h2.HeadersReceived(1, hpack.Decoder().decode(_REQUEST), False)
    assert events[1] == h2.DataReceived(1, b"\0\0\0\0\2hi", True)


def test_padding_priority_and_continuation_are_read() -> None:
    conn = _open()
    padded = bytes([3]) + b"\0" * 5 + _REQUEST[:4] + b"pad"
    events = conn.receive(
        h2.frame(h2.HEADERS, h2.PADDED | h2.PRIORITY_FLAG, 1, padded)
        + h2.frame(h2.CONTINUATION, h2.END_HEADERS, 1, _REQUEST[4:])
        + h2.frame(h2.DATA, h2.PADDED | h2.END_STREAM, 1, b"\x02ab\0\0")
    )
    assert events[0].headers == hpack.Decoder().decode(_REQUEST)  # type: ignore[union-attr]
    assert events[1] == h2.DataReceived(1, b"ab", True)


def test_a_reply_beyond_the_peer_window_waits_for_window_update() -> None:
    conn = _open(initial_window=10)
    conn.receive(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 1, _REQUEST))
    conn.send_response(1, b"H", b"pp", b"x" * 23, b"T")
    frames = _frames(conn.out)
    assert [(k, len(p)) for k, _, _, p in frames] == [(h2.HEADERS, 1), (h2.DATA, 10)]
    assert frames[1][3] == b"pp" + b"x" * 8
    assert conn.queued_messages(1) == 1
    conn.receive(h2.frame(h2.WINDOW_UPDATE, 0, 1, struct.pack(">I", 100)))
    frames = _frames(conn.out)
    assert [(k, f, len(p)) for k, f, _, p in frames] == [
        (h2.DATA, 0, 15),
        (h2.HEADERS, h2.END_STREAM | h2.END_HEADERS, 1),
    ]
    assert conn.queued_messages(1) == 0


def test_the_connection_window_holds_every_stream() -> None:
    conn = _open()
    for sid in (1, 3):
        conn.receive(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, sid, _REQUEST))
    conn.send_response(1, b"H", b"", b"a" * 65_000, b"T")
    conn.send_response(3, b"H", b"", b"b" * 1000, b"T")
    first = _frames(conn.out)
    assert sum(len(p) for k, _, _, p in first if k == h2.DATA) == 65_535  # shared window
    ended = [sid for k, f, sid, _ in first if k == h2.HEADERS and f & h2.END_STREAM]
    assert ended == [1]
    conn.receive(h2.frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
    rest = _frames(conn.out)
    assert [(sid, len(p)) for k, _, sid, p in rest if k == h2.DATA] == [(3, 66_000 - 65_535)]
    assert [sid for k, f, sid, _ in rest if k == h2.HEADERS and f & h2.END_STREAM] == [3]


def test_data_frames_respect_the_peer_frame_size() -> None:
    conn = _open(max_frame=16_384)
    conn.receive(h2.frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
    conn.receive(_settings(initial_window=1 << 20))
    _frames(conn.out)
    conn.receive(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 1, _REQUEST))
    conn.send_response(1, b"H", b"", b"z" * 40_000, b"T" * 20_000)
    frames = _frames(conn.out)
    assert max(len(p) for _, _, _, p in frames) <= 16_384
    assert [k for k, _, _, _ in frames][-2:] == [h2.HEADERS, h2.CONTINUATION]


def test_reset_drops_what_was_queued_and_reports_the_stream() -> None:
    conn = _open(initial_window=0)
    conn.receive(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 1, _REQUEST))
    conn.send_headers(1, b"H")
    conn.send_message(1, b"queued")
    assert conn.queued_messages(1) == 1
    events = conn.receive(h2.frame(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL)))
    assert events == [h2.StreamReset(1, h2.CANCEL)]
    assert conn.queued_messages(1) == 0


def test_ping_is_answered_and_our_ping_ack_reported() -> None:
    conn = _open()
    conn.receive(h2.frame(h2.PING, 0, 0, b"12345678"))
    assert _frames(conn.out) == [(h2.PING, h2.ACK, 0, b"12345678")]
    assert conn.receive(h2.frame(h2.PING, h2.ACK, 0, b"ftdistka")) == [h2.PingAcked(b"ftdistka")]


def test_request_data_replenishes_the_windows() -> None:
    conn = h2.ServerConnection(recv_window=1000)
    conn.receive(h2.PREFACE)
    _frames(conn.out)
    conn.receive(h2.frame(h2.HEADERS, h2.END_HEADERS, 1, _REQUEST))
    conn.receive(h2.frame(h2.DATA, 0, 1, b"x" * 600))
    updates = [(sid, p) for k, _, sid, p in _frames(conn.out) if k == h2.WINDOW_UPDATE]
    assert updates == [(0, struct.pack(">I", 600)), (1, struct.pack(">I", 600))]


@pytest.mark.parametrize(
    ("wire", "why"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "preface"),
        (h2.PREFACE + h2.frame(h2.DATA, 0, 0, b"x"), "stream 0"),
        (h2.PREFACE + h2.frame(h2.HEADERS, h2.END_HEADERS, 2, _REQUEST), "HEADERS on stream 2"),
        (h2.PREFACE + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, b"\xbe"), "not in the table"),
        (
            h2.PREFACE + h2.frame(h2.HEADERS, 0, 1, _REQUEST[:2]) + h2.frame(h2.DATA, 0, 1, b"x"),
            "interrupted",
        ),
        (h2.PREFACE + h2.frame(h2.PUSH_PROMISE, 0, 1, b"\0\0\0\2"), "push"),
        (h2.PREFACE + b"\x01\0\0" + bytes([h2.DATA, 0]) + b"\0\0\0\1", "above 16384"),
        (h2.PREFACE + h2.frame(h2.WINDOW_UPDATE, 0, 0, b"\0\0\0\0"), "WINDOW_UPDATE of 0"),
        (h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, b"\0\5\0\0\0\1"), "max frame size"),
        (h2.PREFACE + h2.frame(h2.HEADERS, h2.PRIORITY_FLAG, 1, b"\0\0"), "priority fields"),
        (
            # One 4 KiB field put in the table, then named 40 times: 40 bytes
            # of block, 160 KiB of headers.
            h2.PREFACE
            + h2.frame(
                h2.HEADERS,
                h2.END_HEADERS,
                1,
                b"\x40\x01x" + hpack._encode_integer(4000, 7, 0) + b"v" * 4000 + b"\xbe" * 40,
            ),
            "header list above",
        ),
    ],
)
def test_protocol_errors_queue_goaway_and_raise(wire: bytes, why: str) -> None:
    conn = h2.ServerConnection()
    _frames(conn.out)
    with pytest.raises(h2.ConnectionError_, match=why):
        conn.receive(wire)
    assert _frames(conn.out)[-1][0] == h2.GOAWAY


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=12))
def test_garbage_after_the_preface_raises_only_connection_error(chunks: list[bytes]) -> None:
    conn = h2.ServerConnection()
    conn.receive(h2.PREFACE)
    try:
        for chunk in chunks:
            conn.receive(chunk)
            conn.send_response(1, b"H", b"", b"m", b"T")
    except h2.ConnectionError_:
        pass


def test_client_trailers_are_not_a_new_stream() -> None:
    conn = _open()
    trailers = hpack.encode([(b"x-trailer", b"1")])
    events = conn.receive(
        h2.frame(h2.HEADERS, h2.END_HEADERS, 1, _REQUEST)
        + h2.frame(h2.DATA, 0, 1, b"\0\0\0\0\0")
        + h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 1, trailers)
    )
    assert [(type(e).__name__, getattr(e, "opened", None)) for e in events] == [
        ("HeadersReceived", True),
        ("DataReceived", None),
        ("HeadersReceived", False),
    ]


def test_what_waits_for_the_window_is_counted_until_sent() -> None:
    conn = _open(initial_window=0)
    for sid in (1, 3, 5):
        conn.receive(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, sid, _REQUEST))
        conn.send_response(sid, b"H", b"pp", b"x" * 98, b"T")
    assert conn.queued_bytes == 3 * (100 + 1)  # each message and its trailers
    assert conn.streams == 3
    conn.receive(h2.frame(h2.RST_STREAM, 0, 3, struct.pack(">I", h2.CANCEL)))
    assert conn.queued_bytes == 2 * 101
    conn.receive(_settings(initial_window=1 << 20))
    assert conn.queued_bytes == 0
    assert conn.streams == 0


_UNIT_SECONDS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.floats(0, 1e13, allow_nan=False), st.integers(0, 10**12)))
def test_grpc_timeout_is_never_shorter_than_asked_and_fits_the_spec(seconds: float) -> None:
    from ftdist._rpc.h2_client import grpc_timeout

    value = grpc_timeout(seconds)
    digits, unit = value[:-1], value[-1:]
    # gRPC's grammar: 1 to 8 ASCII digits, then one unit letter.
    assert digits.isdigit() and 1 <= len(digits) <= 8 and unit in _UNIT_SECONDS, value
    told = int(digits) * _UNIT_SECONDS[unit]
    cap = 99_999_999 * 3600.0
    assert told >= min(seconds, cap) * (1 - 1e-12) and told >= 1e-6, (seconds, value)
    # Rounded up by less than one of its unit, except past the largest value.
    assert seconds > cap or told - seconds < _UNIT_SECONDS[unit] * (1 + 1e-9), (seconds, value)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 99_999_999), st.sampled_from(sorted(_UNIT_SECONDS)))
def test_a_servers_reading_of_grpc_timeout_is_the_grammars(count: int, unit: bytes) -> None:
    from ftdist._rpc.h2_call import parse_grpc_timeout

    for digits in {str(count).encode(), str(count).zfill(8).encode()}:
        seconds = parse_grpc_timeout(digits + unit)
        assert seconds is not None and seconds == pytest.approx(count * _UNIT_SECONDS[unit])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=12))
def test_anything_outside_the_grammar_reads_as_no_timeout(value: bytes) -> None:
    from ftdist._rpc.h2_call import parse_grpc_timeout

    digits, unit = value[:-1], value[-1:]
    valid = 1 <= len(digits) <= 8 and digits.isdigit() and unit in _UNIT_SECONDS
    assert (parse_grpc_timeout(value) is not None) == valid, value


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-6, 1e9, allow_nan=False))
def test_what_the_client_sends_the_server_reads_back_no_shorter(seconds: float) -> None:
    from ftdist._rpc.h2_call import parse_grpc_timeout
    from ftdist._rpc.h2_client import grpc_timeout

    read = parse_grpc_timeout(grpc_timeout(seconds))
    assert read is not None and read >= seconds * (1 - 1e-9), (seconds, read)
