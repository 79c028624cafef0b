"""The one keyspace of Xinfra: a 64-bit key hash and contiguous key ranges over it.

Every placement decision in the project goes through this module, so that a
Kafka partition and a Northguard range are the same thing to Xinfra: shard *i*
of an epoch with N shards owns ``shard_ranges(N)[i]``, on Kafka it is partition
*i*, on Northguard it is the range with those bounds.  Two topics with the same
ranges are aligned, so a join between them needs no shuffle.

The hash is **xxh3_64 with seed 0** over the key bytes.  It is frozen: changing
it would move every existing key to another shard and break per-key order of
every topic ever written.  ``tests/unit/test_keyspace.py`` pins it with vectors.

Shard arithmetic is exact integer arithmetic on ``[0, 2**64)``:
range *i* of N is ``[ceil(i * 2**64 / N), ceil((i + 1) * 2**64 / N))`` and
the shard of hash *h* is ``(h * N) >> 64``; the two agree for every *h*.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

KEYSPACE_BITS = 64
KEYSPACE_SIZE = 1 << KEYSPACE_BITS
"""Exclusive upper bound of the keyspace; the end of the last range."""
SHARD_COUNT_MAX = 4096
"""The most shards (Kafka partitions, Northguard ranges) an epoch of a topic has."""


key_hash: Callable[[bytes], int] = xxhash.xxh3_64_intdigest
"""The frozen 64-bit hash of a record key (xxh3_64, seed 0).

The C function itself, not a wrapper: the producer hashes every keyed record,
and a Python frame would cost more than the hash."""


@dataclass(frozen=True, slots=True, order=True)
class KeyRange:
    """A half-open interval ``[start, end)`` of the keyspace, never empty."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end <= KEYSPACE_SIZE):
            raise ValueError(
                f"key range [{self.start}, {self.end}) is not a non-empty part of [0, 2**64)"
            )

    @property
    def size(self) -> int:
        return self.end - self.start

    def contains(self, hash_value: int) -> bool:
        return self.start <= hash_value < self.end

    def split(self) -> tuple[KeyRange, KeyRange]:
        """The two buddies of this range: its lower and upper half.

        Splitting a range of size 1 is impossible and raises ``ValueError``.
        """
        if self.size < 2:
            raise ValueError(f"key range [{self.start}, {self.end}) is too small to split")
        middle = self.start + self.size // 2
        return KeyRange(self.start, middle), KeyRange(middle, self.end)

    def merge(self, other: KeyRange) -> KeyRange:
        """The parent of two buddies, in either order.

        Two ranges are buddies when they are exactly the two halves that
        ``split`` makes of their union (the buddy-allocator rule).  Whether two
        buddies may merge in a given topic (they must share a parent there) is
        the coordinator's decision, not arithmetic.
        """
        low, high = (self, other) if self.start <= other.start else (other, self)
        if low.end != high.start:
            raise ValueError(f"key ranges {low} and {high} are not adjacent")
        parent = KeyRange(low.start, high.end)
        if parent.split() != (low, high):
            raise ValueError(f"key ranges {low} and {high} are not buddies")
        return parent

    def to_json(self) -> list[str]:
        """Bounds as decimal strings: 2**64 does not fit a JSON number safely."""
        return [str(self.start), str(self.end)]

    @classmethod
    def from_json(cls, bounds: Sequence[str | int]) -> KeyRange:
        start, end = bounds
        return cls(int(start), int(end))

    def __str__(self) -> str:
        return f"[{self.start:#018x}, {self.end:#x})"


FULL_RANGE = KeyRange(0, KEYSPACE_SIZE)


def shard_ranges(shard_count: int) -> list[KeyRange]:
    """The N contiguous ranges that partition the keyspace, shard 0 first."""
    if shard_count < 1:
        raise ValueError(f"shard count must be at least 1, got {shard_count}")
    if shard_count > KEYSPACE_SIZE:
        raise ValueError(f"shard count {shard_count} exceeds the keyspace")
    bounds = [-(-index * KEYSPACE_SIZE // shard_count) for index in range(shard_count + 1)]
    return [KeyRange(bounds[i], bounds[i + 1]) for i in range(shard_count)]


def shard_of_hash(hash_value: int, shard_count: int) -> int:
    """The index of the shard of ``shard_ranges(shard_count)`` that holds the hash."""
    return (hash_value * shard_count) >> KEYSPACE_BITS


def shard_of_key(key: bytes, shard_count: int) -> int:
    """The shard of a record key among N equal contiguous ranges."""
    return shard_of_hash(key_hash(key), shard_count)


def shard_of_key_in(key: bytes, ranges: Sequence[KeyRange]) -> int:
    """The index of the range that holds the key, for any sorted covering of the keyspace.

    Used when a topic's ranges are not the N equal ranges (after splits and
    merges on Northguard).  Binary search: O(log N).
    """
    hash_value = key_hash(key)
    low, high = 0, len(ranges)
    while low < high:
        middle = (low + high) // 2
        if ranges[middle].end <= hash_value:
            low = middle + 1
        else:
            high = middle
    if low == len(ranges) or not ranges[low].contains(hash_value):
        raise ValueError(f"ranges do not cover hash {hash_value:#x}")
    return low


def check_covering(ranges: Sequence[KeyRange]) -> None:
    """Raise ``ValueError`` unless the ranges, in order, cover the keyspace exactly once."""
    if not ranges:
        raise ValueError("no ranges: the keyspace is not covered")
    if ranges[0].start != 0:
        raise ValueError(f"ranges start at {ranges[0].start}, not 0")
    for previous, current in itertools.pairwise(ranges):
        if previous.end != current.start:
            raise ValueError(f"gap or overlap between {previous} and {current}")
    if ranges[-1].end != KEYSPACE_SIZE:
        raise ValueError(f"ranges end at {ranges[-1].end}, not 2**64")
