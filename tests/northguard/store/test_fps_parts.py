"""The fps store's parts on their own: framing, the offset indexes, the read cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from store_faults import StoreFactory

from backends.northguard.store import Entry, MemoryOffsetIndex, OffsetIndex, RocksOffsetIndex
from backends.northguard.store.framing import (
    HEADER_BYTES,
    FrameStatus,
    decode_frame,
    encode_frame,
    frame_bytes_of,
)
from backends.northguard.store.offset_index import IndexPoint, SegmentEnd
from backends.northguard.store.read_cache import ENTRY_OVERHEAD_BYTES, ReadCache


@given(
    segment_id=st.from_regex(r"[a-z0-9][a-z0-9._-]{0,40}", fullmatch=True),
    base_offset=st.integers(0, (1 << 63) - 1),
    record_count=st.integers(1, (1 << 32) - 1),
    batch=st.binary(max_size=2000),
)
def test_frames_round_trip(
    segment_id: str, base_offset: int, record_count: int, batch: bytes
) -> None:
    data = b"junk" + encode_frame(segment_id, base_offset, record_count, batch)
    decoded = decode_frame(data, 4)
    assert decoded.status is FrameStatus.OK and decoded.frame is not None
    frame = decoded.frame
    assert (frame.segment_id, frame.base_offset, frame.record_count, frame.batch) == (
        segment_id,
        base_offset,
        record_count,
        batch,
    )
    assert decoded.frame_bytes == len(data) - 4
    assert decode_frame(data, len(data)).status is FrameStatus.END


@given(flip=st.integers(0, HEADER_BYTES + 2 + 100 - 1), bit=st.integers(0, 7))
def test_every_single_bit_flip_is_detected(flip: int, bit: int) -> None:
    data = bytearray(encode_frame("s1", 1234, 10, bytes(range(100))))
    data[flip] ^= 1 << bit
    assert decode_frame(bytes(data), 0).status is not FrameStatus.OK


def test_partial_and_zero_frames_are_told_apart() -> None:
    frame = encode_frame("s1", 0, 1, b"x" * 100)
    assert decode_frame(frame[:10], 0).status is FrameStatus.TRUNCATED
    assert decode_frame(frame[:-1], 0).status is FrameStatus.TRUNCATED
    assert decode_frame(bytes(4096), 0).status is FrameStatus.ZERO
    assert decode_frame(bytes(10), 0).status is FrameStatus.ZERO


@pytest.fixture(params=["rocks", "memory"])
def index(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OffsetIndex]:
    made: OffsetIndex = (
        RocksOffsetIndex(tmp_path / "index") if request.param == "rocks" else MemoryOffsetIndex()
    )
    yield made
    made.close()


def test_index_floor_truncate_and_delete(index: OffsetIndex) -> None:
    index.write(
        [
            IndexPoint("a", 100, 0),
            IndexPoint("a", 250, 4096),
            IndexPoint("a", 400, 9000),
            IndexPoint("ab", 5, 1),
        ],
        {"a": SegmentEnd(12_000, 500), "ab": SegmentEnd(50, 10)},
    )
    assert index.floor("a", 99) is None
    assert index.floor("a", 100) == IndexPoint("a", 100, 0)
    assert index.floor("a", 399) == IndexPoint("a", 250, 4096)
    assert index.floor("a", 10**12) == IndexPoint("a", 400, 9000)
    assert index.floor("b", 10**12) is None  # never another segment's point, even a prefix
    assert index.floor("ab", 4) is None
    assert index.end("a") == SegmentEnd(12_000, 500)
    assert sorted(index.segment_ids()) == ["a", "ab"]
    index.truncate("a", SegmentEnd(4096, 250))
    assert index.floor("a", 10**12) == IndexPoint("a", 100, 0)
    assert index.end("a") == SegmentEnd(4096, 250)
    index.delete_segment("a")
    assert (index.floor("a", 10**12), index.end("a")) == (None, None)
    assert index.floor("ab", 5) == IndexPoint("ab", 5, 1)
    index.sync()


def test_rocks_index_survives_reopen(tmp_path: Path) -> None:
    index = RocksOffsetIndex(tmp_path / "index")
    index.write([IndexPoint("s", 7, 70)], {"s": SegmentEnd(99, 9)})
    index.close()
    index = RocksOffsetIndex(tmp_path / "index")
    assert (index.floor("s", 8), index.end("s")) == (IndexPoint("s", 7, 70), SegmentEnd(99, 9))
    index.close()


def entry(base: int, size: int = 1000) -> Entry:
    return Entry(base, 1, bytes([base % 256]) * size)


def test_read_cache_is_bounded_and_evicts_the_least_recently_used_segment_first() -> None:
    cost = 1000 + ENTRY_OVERHEAD_BYTES
    cache = ReadCache(bytes_max=10 * cost)
    for base in range(8):
        cache.add("a", entry(base))
    for base in range(4):
        cache.add("b", entry(base))
    assert cache.bytes <= cache.bytes_max
    assert (
        cache.read("a", 0, 1 << 20) is None and cache.read("a", 1, 1 << 20) is None
    )  # a's oldest went
    assert [e.base_offset for e in cache.read("a", 2, 1 << 20) or []] == list(range(2, 8))
    assert [e.base_offset for e in cache.read("b", 0, 1 << 20) or []] == list(range(4))
    cache.add("b", entry(4))  # a was read before b: a is older, loses its head
    assert cache.read("a", 2, 1 << 20) is None and cache.read("b", 0, 1) is not None
    assert cache.read("b", 5, 1 << 20) is None  # past the cached end
    cache.truncate("b", 2)
    assert [e.base_offset for e in cache.read("b", 0, 1 << 20) or []] == [0, 1]
    cache.add("c", entry(0, size=100 * cost))  # larger than the whole cache: not cached
    assert cache.read("c", 0, 1) is None and cache.bytes <= cache.bytes_max
    cache.drop("b")
    assert cache.read("b", 0, 1) is None


async def test_unwritten_bytes_count_acknowledged_frames_until_a_write_takes_them(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(checkpoint_ms=60_000)  # no timed checkpoint during the test
    await store.create_segment("s1", 0)
    assert store.unwritten_bytes() == 0
    await store.append("s1", 0, 1, b"x" * 1000)
    await store.append("s1", 1, 1, b"y" * 500)
    assert store.unwritten_bytes() == frame_bytes_of("s1", 1000) + frame_bytes_of("s1", 500)
    assert await store.checkpoint()
    assert store.unwritten_bytes() == 0


async def test_wal_bytes_are_what_a_crash_would_replay_until_a_checkpoint_releases_them(
    open_fps: StoreFactory,
) -> None:
    # No timed checkpoint; no cache, so a read writes the frames to their segment file.
    store = await open_fps(checkpoint_ms=60_000, read_cache_bytes_max=0)
    await store.create_segment("s1", 0)
    assert store.wal_bytes() == 0
    await store.append("s1", 0, 1, b"x" * 1000)
    await store.append("s1", 1, 1, b"y" * 500)
    held = frame_bytes_of("s1", 1000) + frame_bytes_of("s1", 500)
    assert store.wal_bytes() == held
    await store.read("s1", 0, 1 << 20)
    assert store.unwritten_bytes() == 0  # in the segment file, not yet synced: still held
    assert store.wal_bytes() == held
    assert await store.checkpoint()  # rolls the WAL, syncs the file, removes the rolled file
    assert store.wal_bytes() == 0
    await store.append("s1", 2, 1, b"z" * 10)
    assert store.wal_bytes() == frame_bytes_of("s1", 10)


async def test_store_read_cache_serves_the_tail_within_its_bound(open_fps: StoreFactory) -> None:
    store = await open_fps(read_cache_bytes_max=20_000)
    await store.create_segment("s1", 0)
    written = [await store.append("s1", n, 1, bytes([n]) * 1000) for n in range(100)]
    assert 0 < store.cache_bytes() <= 20_000
    assert await store.read("s1", 99, 1 << 20) == written[99:]
    assert (store.stats.cache_hits, store.stats.cache_misses) == (1, 0)
    assert await store.read("s1", 0, 5000) == written[:5]
    assert (store.stats.cache_hits, store.stats.cache_misses) == (1, 1)
