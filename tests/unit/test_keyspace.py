"""The keyspace is frozen: these vectors fail the day someone changes the hash or the arithmetic."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xinfra.keyspace import (
    FULL_RANGE,
    KEYSPACE_SIZE,
    KeyRange,
    check_covering,
    key_hash,
    shard_of_hash,
    shard_of_key,
    shard_of_key_in,
    shard_ranges,
)

# xxh3_64, seed 0.  The first is the reference value of the xxHash project for empty input.
HASH_VECTORS = [
    (b"", 0x2D06800538D394C2),
    (b"a", 16629034431890738719),
    (b"abc", 8696274497037089104),
    (b"user-42", 5836184775705692621),
    (b"\x00" * 8, 14374147212387527897),
    ("ключ".encode(), 11102353883453021918),
    (bytes(range(256)), 10666956326096416113),
]

SHARD_VECTORS = [  # (key, shard of 8, shard of 13)
    (b"a", 7, 11),
    (b"abc", 3, 6),
    (b"user-42", 2, 4),
    (b"\x00" * 8, 6, 10),
    ("ключ".encode(), 4, 7),
]


@pytest.mark.parametrize(("key", "expected"), HASH_VECTORS)
def test_hash_is_frozen(key: bytes, expected: int) -> None:
    assert key_hash(key) == expected


@pytest.mark.parametrize(("key", "of_8", "of_13"), SHARD_VECTORS)
def test_shard_of_key_is_frozen(key: bytes, of_8: int, of_13: int) -> None:
    assert shard_of_key(key, 8) == of_8
    assert shard_of_key(key, 13) == of_13


@pytest.mark.parametrize("count", [1, 2, 3, 7, 8, 13, 64, 1000, 4096])
def test_ranges_cover_the_keyspace_exactly(count: int) -> None:
    ranges = shard_ranges(count)
    assert len(ranges) == count
    check_covering(ranges)
    assert sum(r.size for r in ranges) == KEYSPACE_SIZE
    sizes = {r.size for r in ranges}
    assert max(sizes) - min(sizes) <= 1, "ranges are as equal as integers allow"


def test_powers_of_two_give_aligned_ranges() -> None:
    assert shard_ranges(4)[1] == KeyRange(1 << 62, 2 << 62)


@pytest.mark.parametrize("count", [1, 3, 8, 13, 1000])
def test_boundaries_belong_to_the_right_shard(count: int) -> None:
    for index, key_range in enumerate(shard_ranges(count)):
        assert shard_of_hash(key_range.start, count) == index
        assert shard_of_hash(key_range.end - 1, count) == index


@given(st.binary(max_size=64), st.integers(min_value=1, max_value=4096))
def test_shard_of_key_agrees_with_ranges(key: bytes, count: int) -> None:
    ranges = shard_ranges(count)
    shard = shard_of_key(key, count)
    assert ranges[shard].contains(key_hash(key))
    assert shard_of_key_in(key, ranges) == shard


@given(
    st.integers(min_value=0, max_value=KEYSPACE_SIZE - 2),
    st.integers(min_value=2, max_value=KEYSPACE_SIZE),
)
def test_split_then_merge_round_trips(start: int, size: int) -> None:
    end = min(start + size, KEYSPACE_SIZE)
    if end - start < 2:
        return
    parent = KeyRange(start, end)
    low, high = parent.split()
    assert low.end == high.start and low.start == parent.start and high.end == parent.end
    assert low.merge(high) == parent
    assert high.merge(low) == parent


def test_buddy_tree_from_the_full_range() -> None:
    left, right = FULL_RANGE.split()
    left_left, left_right = left.split()
    assert left_left.merge(left_right) == left
    with pytest.raises(ValueError, match="not buddies"):
        KeyRange(0, 3).merge(KeyRange(3, 5))  # adjacent, but not the halves of [0, 5)
    with pytest.raises(ValueError, match="not adjacent"):
        left_left.merge(right)


def test_uneven_ranges_are_ordered_with_the_larger_half_high() -> None:
    low, high = KeyRange(0, 5).split()
    assert (low, high) == (KeyRange(0, 2), KeyRange(2, 5))
    with pytest.raises(ValueError, match="too small"):
        KeyRange(3, 4).split()


@pytest.mark.parametrize("bounds", [(0, 0), (5, 4), (-1, 3), (0, KEYSPACE_SIZE + 1)])
def test_bad_ranges_are_rejected(bounds: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        KeyRange(*bounds)


def test_coverings_with_gaps_or_overlaps_are_rejected() -> None:
    a, b, c = shard_ranges(3)
    with pytest.raises(ValueError, match="gap or overlap"):
        check_covering([a, c])
    with pytest.raises(ValueError, match="not 0"):
        check_covering([b, c])
    with pytest.raises(ValueError, match="not 2"):
        check_covering([a, b])
    with pytest.raises(ValueError, match="no ranges"):
        check_covering([])


def test_json_round_trip_keeps_2_to_the_64() -> None:
    assert FULL_RANGE.to_json() == ["0", str(KEYSPACE_SIZE)]
    assert KeyRange.from_json(FULL_RANGE.to_json()) == FULL_RANGE


CHI2_999 = {7: 24.322, 12: 32.909}
"""Chi-square critical values at the 0.1% level for 7 and 12 degrees of freedom."""


@pytest.mark.parametrize("count", [8, 13])
def test_keys_spread_evenly_chi_square(count: int) -> None:
    """200k random keys: the shard counts must pass a chi-square test at the 0.1% level."""
    samples = 200_000
    keys = random.Random(20261122).randbytes(samples * 8)  # seeded: the test is deterministic
    observed = [0] * count
    for index in range(samples):
        observed[shard_of_key(keys[index * 8 : index * 8 + 8], count)] += 1
    expected = samples / count
    statistic = sum((o - expected) ** 2 / expected for o in observed)
    assert statistic < CHI2_999[count - 1], (statistic, observed)


@pytest.mark.parametrize("count", [8, 13])
def test_sequential_keys_spread_evenly(count: int) -> None:
    """Keys like user-0, user-1, ... (the common case) must spread as well as random ones."""
    samples = 100_000
    observed = [0] * count
    for index in range(samples):
        observed[shard_of_key(f"user-{index}".encode(), count)] += 1
    expected = samples / count
    statistic = sum((o - expected) ** 2 / expected for o in observed)
    assert statistic < CHI2_999[count - 1], (statistic, observed)
