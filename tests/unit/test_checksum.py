"""The word-sum checksum: its definition, split invariance, and what it detects."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftdist.checkpointing._checksum import MASK, WordSum

pytestmark = pytest.mark.timeout(120)

SETTINGS = settings(max_examples=150, deadline=None)
segments = st.lists(st.binary(max_size=1200), min_size=1, max_size=5)
# Whole words (as most tensors are) or not, empty ones included.
_aligned = st.integers(0, 40).flatmap(lambda n: st.binary(min_size=8 * n, max_size=8 * n))
mixed_segments = st.lists(st.one_of(_aligned, _aligned, st.binary(max_size=100)), max_size=12)


def _by_definition(segs: list[bytes]) -> tuple[int, int]:
    data = b"".join(s + b"\0" * (-len(s) % 8) for s in segs)
    s1 = s2 = 0
    for k in range(len(data) // 8):
        w = int.from_bytes(data[8 * k : 8 * k + 8], "little")
        s1 += w
        s2 += (k + 1) * w
    return s1 & MASK, s2 & MASK


def _digest(segs: list[bytes], cuts: list[int] | None = None) -> tuple[int, int]:
    d = WordSum()
    for seg in segs:
        start = 0
        for cut in sorted(c % (len(seg) + 1) for c in cuts or []):
            d.update(seg[start : max(start, cut)])
            start = max(start, cut)
        d.update(seg[start:])
        d.end_segment()
    return d.digest()


@SETTINGS
@given(segs=segments, cuts=st.lists(st.integers(0, 1300), max_size=6))
def test_the_digest_is_its_definition_however_the_segments_are_split(
    segs: list[bytes], cuts: list[int]
) -> None:
    assert _digest(segs, cuts) == _digest(segs) == _by_definition(segs)


@SETTINGS
@given(seg=st.binary(min_size=1, max_size=3000), at=st.integers(0), flip=st.integers(1, 255))
def test_any_change_within_one_word_is_detected(seg: bytes, at: int, flip: int) -> None:
    i = at % len(seg)
    bad = bytearray(seg)
    bad[i] ^= flip
    assert _digest([bytes(bad)]) != _digest([seg])


@SETTINGS
@given(
    seg=st.binary(min_size=16, max_size=3000).filter(lambda b: len(b) % 8 == 0),
    i=st.integers(0),
    j=st.integers(0),
)
def test_two_words_swapped_are_detected(seg: bytes, i: int, j: int) -> None:
    n = len(seg) // 8
    a, b = i % n, j % n
    wa, wb = seg[8 * a : 8 * a + 8], seg[8 * b : 8 * b + 8]
    if a == b or wa == wb:
        return
    words = [seg[8 * k : 8 * k + 8] for k in range(n)]
    words[a], words[b] = wb, wa
    # (b - a) * (wa - wb) vanishes mod 2**64 only when the product has 64
    # factors of two; words that differ in their low bits never do.
    delta = ((b - a) * (int.from_bytes(wa, "little") - int.from_bytes(wb, "little"))) & MASK
    assert (_digest([b"".join(words)]) != _digest([seg])) == (delta != 0)


def test_segment_boundaries_count() -> None:
    # The same bytes split into segments differently are different data.
    assert _digest([b"abc", b"def"]) != _digest([b"abcdef"])
    assert _digest([b"", b"abc"]) == _digest([b"abc"])


def test_large_buffers_match_the_definition_across_blocks() -> None:
    data = bytes(range(256)) * 5000 + b"xyz"  # many rows, a ragged end
    d = WordSum()
    d.update(memoryview(data))
    expected = _by_definition([data])
    assert d.digest() == expected
    assert WordSum().fold64() == 0


@SETTINGS
@given(
    segs=segments,
    cuts=st.lists(st.integers(0, 1300), max_size=6),
    row=st.sampled_from([1, 2, 3, 8, 64]),
    block_rows=st.integers(1, 5),
    small=st.sampled_from([0, 1, 5, 8192]),
    tiny=st.sampled_from([0, 8, 13, 64]),
)
def test_row_width_block_size_and_small_path_never_change_the_digest(
    segs: list[bytes], cuts: list[int], row: int, block_rows: int, small: int, tiny: int
) -> None:
    # The widths are tuned for speed only; small ones make these short
    # inputs cross many rows and blocks (and ragged tails of each), and
    # thresholds of 0 send every piece through the rows.
    import numpy as np

    from ftdist.checkpointing import _checksum

    weights = np.arange(row, dtype=np.uint64)
    with (
        mock.patch.object(_checksum, "_ROW", row),
        mock.patch.object(_checksum, "_COLUMN_WEIGHTS", weights),
        mock.patch.object(_checksum, "_BLOCK_WORDS", row * block_rows + 1),
        mock.patch.object(_checksum, "_SMALL_WORDS", small),
        mock.patch.object(_checksum, "_TINY_BYTES", tiny),
    ):
        assert _digest(segs, cuts) == _by_definition(segs)


def test_summing_behind_gives_the_same_digest_and_stops_its_thread() -> None:
    import threading

    from ftdist.checkpointing._checksum import SumBehind

    segs = [bytes(range(256)) * 300, b"abc", b"", bytes(5000)]
    with SumBehind() as behind:
        for seg in segs:
            behind.update(memoryview(seg)[:100])
            behind.update(memoryview(seg)[100:])
            behind.end_segment()
        assert behind.digest() == _digest(segs)
    assert not [t for t in threading.enumerate() if t.name == "ftdist-checksum"]
    with SumBehind() as unused:  # no piece, no thread
        assert unused._thread is None


@SETTINGS
@given(segs=segments, batch=st.sampled_from([1, 7, 64, 1 << 20]))
def test_summing_behind_in_batches_of_any_size_gives_the_same_digest_and_segments(
    segs: list[bytes], batch: int
) -> None:
    # Small pieces wait in a batch until it holds ``batch`` bytes; however
    # the pieces and segment ends fall across hand-offs, the digest and each
    # segment's own sums are those of summing in place.
    import threading

    from ftdist.checkpointing import _checksum
    from ftdist.checkpointing._checksum import SumBehind, WordSum

    expected = WordSum(record=True)
    with mock.patch.object(_checksum, "BATCH_BYTES", batch), SumBehind(record=True) as behind:
        for seg in segs:
            for part in (seg[:3], seg[3:]):
                behind.update(memoryview(part))
                expected.update(memoryview(part))
            behind.end_segment()
            expected.end_segment()
        assert behind.digest() == expected.digest() == _digest(segs)
        assert behind.segments == expected.segments
    assert not [t for t in threading.enumerate() if t.name == "ftdist-checksum"]


@SETTINGS
@given(segs=mixed_segments, opened=st.binary(max_size=20), close_first=st.booleans())
def test_whole_segments_summed_together_equal_one_by_one(
    segs: list[bytes], opened: bytes, close_first: bool
) -> None:
    # update_segments joins whole-word segments and splits each one's sums
    # out; it must agree with feeding them one by one, also when it is
    # called inside an open segment (it then feeds them one by one itself).
    from ftdist.checkpointing._checksum import WordSum

    joined, single = WordSum(record=True), WordSum(record=True)
    for d in (joined, single):
        d.update(opened)
        if close_first:
            d.end_segment()
    back_to_back = WordSum(record=True)
    back_to_back.update(opened)
    if close_first:
        back_to_back.end_segment()
    joined.update_segments([memoryview(seg) for seg in segs])
    # The same segments lying back to back in one buffer (a batch received
    # into one staging buffer).
    back_to_back.update_joined(b"".join(segs), [len(seg) for seg in segs])
    for seg in segs:
        single.update(seg)
        single.end_segment()
    assert joined.digest() == single.digest() == back_to_back.digest()
    assert joined.segments == single.segments == back_to_back.segments


def test_segments_back_to_back_must_add_up_to_the_buffer() -> None:
    with pytest.raises(ValueError, match="segments of 16 bytes in all given with 24 bytes"):
        WordSum().update_joined(bytes(24), [8, 8])


@SETTINGS
@given(segs=mixed_segments, batch=st.sampled_from([1, 64, 1 << 20]))
def test_summing_behind_whole_pieces_gives_the_same_digest_and_segments(
    segs: list[bytes], batch: int
) -> None:
    # Whole small segments, as a model's small tensors come: the helper sums
    # runs of them together.
    from ftdist.checkpointing import _checksum
    from ftdist.checkpointing._checksum import SumBehind, WordSum

    expected = WordSum(record=True)
    with mock.patch.object(_checksum, "BATCH_BYTES", batch), SumBehind(record=True) as behind:
        for i, seg in enumerate(segs):
            if i % 5 == 4:  # now and then a segment in two pieces
                behind.update(memoryview(seg)[:4])
                behind.update(memoryview(seg)[4:])
            else:
                behind.update(memoryview(seg))
            behind.end_segment()
            expected.update(seg)
            expected.end_segment()
        assert behind.digest() == expected.digest()
        assert behind.segments == expected.segments


def test_summing_behind_closed_early_drops_what_it_holds_and_stops_its_thread() -> None:
    import threading

    from ftdist.checkpointing import _checksum
    from ftdist.checkpointing._checksum import SumBehind

    with mock.patch.object(_checksum, "BATCH_BYTES", 10):
        behind = SumBehind()
        behind.update(bytes(64))  # handed over: the helper starts
        behind.update(b"abc")  # still batched
        assert behind._thread is not None
        behind.close()
        assert not behind._thread.is_alive()
        assert behind._batch == []
    assert not [t for t in threading.enumerate() if t.name == "ftdist-checksum"]


@SETTINGS
@given(segments, st.integers(min_value=0, max_value=4))
def test_recorded_segment_sums_compose_into_the_whole_digest(segs: list[bytes], split: int) -> None:
    # What a receiver relies on to fingerprint received tensors without
    # reading them again: each segment's own sums, placed after any others,
    # give the digest of the whole.
    recorded = WordSum(record=True)
    for seg in segs:
        recorded.update(seg)
        recorded.end_segment()
    assert recorded.segments is not None and len(recorded.segments) == len(segs)
    whole = _by_definition(segs)
    assert recorded.digest() == whole
    rebuilt = WordSum()
    head = WordSum()
    for seg in segs[: split % (len(segs) + 1)]:
        head.update(seg)
        head.end_segment()
    rebuilt.add(head.total())  # a run of several segments at once
    for run in recorded.segments[split % (len(segs) + 1) :]:
        rebuilt.add(run)
    assert rebuilt.digest() == whole
    assert rebuilt.total() == recorded.total()


def test_a_changed_word_changes_its_recorded_segment_only() -> None:
    a, b = WordSum(record=True), WordSum(record=True)
    for d, middle in ((a, b"x" * 16), (b, b"x" * 8 + b"y" * 8)):
        for seg in (b"first", middle, b"last"):
            d.update(seg)
            d.end_segment()
    assert a.segments is not None and b.segments is not None
    assert [x == y for x, y in zip(a.segments, b.segments, strict=True)] == [True, False, True]


@SETTINGS
@given(seg=st.one_of(st.binary(max_size=200), st.integers(8180, 8200).map(lambda n: bytes(8 * n))))
def test_a_segments_own_sums_are_a_fresh_digests_total(seg: bytes) -> None:
    # own_sums is the lean path a fingerprint takes per tensor: the same
    # sums as a fresh WordSum, padding and the large-segment path included.
    from ftdist.checkpointing._checksum import own_sums

    seg = bytes(b ^ (i * 37 & 0xFF) for i, b in enumerate(seg))  # not all zeros
    digest = WordSum()
    digest.update(seg)
    got = own_sums(seg)
    assert got == digest.total()
    assert (got.s1, got.s2) == _by_definition([seg]) and got.words == -(-len(seg) // 8)


@SETTINGS
@given(
    segs=mixed_segments,
    join_below=st.sampled_from([0, 9, 64, 1 << 20]),
    run_bytes=st.sampled_from([1, 24, 200, 4 << 20]),
)
def test_a_digest_of_joined_runs_equals_feeding_one_by_one(
    segs: list[bytes], join_below: int, run_bytes: int
) -> None:
    # digest_of (a direct read's source) pads and joins small segments into
    # runs: any threshold and run size must give the digest of the segments.
    from ftdist.checkpointing import _checksum

    one_by_one = WordSum()
    for seg in segs:
        one_by_one.update(seg)
        one_by_one.end_segment()
    with (
        mock.patch.object(_checksum, "_DIGEST_JOIN_BELOW", join_below),
        mock.patch.object(_checksum, "_RUN_BYTES", run_bytes),
    ):
        joined = _checksum.digest_of(segs)
    assert joined.digest() == one_by_one.digest() == _by_definition(segs)


def test_same_size_sums_refuse_segments_that_are_not_whole_rows() -> None:
    from ftdist.checkpointing._checksum import STACK_UNIT, same_size_sums

    with pytest.raises(ValueError, match="segments of 8 in 16 bytes"):
        same_size_sums(bytes(16), 8)
    with pytest.raises(ValueError, match=f"segments of {STACK_UNIT} in {STACK_UNIT + 8} bytes"):
        same_size_sums(bytes(STACK_UNIT + 8), STACK_UNIT)
