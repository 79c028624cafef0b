"""The ``SegmentStore`` contract, run against the fps store and the memory store alike."""

from __future__ import annotations

import asyncio

import pytest

from backends.northguard.store import Entry, SegmentState, SegmentStore
from xinfra.errors import Conflict, InvalidRequest, NotFound, OffsetOutOfRange, Sealed


def batch(number: int, size: int = 50) -> bytes:
    return (f"batch-{number}-".encode() * size)[:size]


async def fill(
    store: SegmentStore, segment_id: str, start: int, count: int, records: int = 10
) -> list[Entry]:
    """``count`` sequential appends of ``records`` records each; asserts contiguity."""
    entries = []
    offset = start
    for number in range(count):
        entry = await store.append(segment_id, offset, records, batch(number))
        assert entry.base_offset == offset and entry.end_offset == offset + records
        entries.append(entry)
        offset = entry.end_offset
    return entries


async def test_create_is_durable_idempotent_and_listed(store: SegmentStore) -> None:
    info = await store.create_segment("s1", 1000)
    assert (info.start_offset, info.end_offset, info.state) == (1000, 1000, SegmentState.ACTIVE)
    assert await store.create_segment("s1", 1000) == info
    assert store.segment("s1") == info
    assert [s.segment_id for s in store.segments()] == ["s1"]
    with pytest.raises(Conflict):
        await store.create_segment("s1", 0)


@pytest.mark.parametrize("bad_id", ["", "../x", "a/b", "-lead", "x" * 201, "sp ace"])
async def test_segment_ids_that_cannot_name_a_file_are_refused(
    store: SegmentStore, bad_id: str
) -> None:
    with pytest.raises(InvalidRequest):
        await store.create_segment(bad_id, 0)


async def test_unknown_segment_is_not_found(store: SegmentStore) -> None:
    with pytest.raises(NotFound):
        store.segment("nope")
    with pytest.raises(NotFound):
        await store.append("nope", 0, 1, b"x")
    with pytest.raises(NotFound):
        await store.read("nope", 0, 100)
    with pytest.raises(NotFound):
        await store.seal("nope")


async def test_appends_are_contiguous_and_read_back_byte_for_byte(store: SegmentStore) -> None:
    await store.create_segment("s1", 500)
    written = await fill(store, "s1", 500, 40)
    assert store.segment("s1").end_offset == 500 + 40 * 10
    assert store.segment("s1").size_bytes >= 40 * 50
    read = await store.read("s1", 500, 1 << 30)
    assert read == written
    offsets = [e.base_offset for e in read]
    assert offsets == list(range(500, 900, 10))


async def test_append_off_the_log_end_is_refused(store: SegmentStore) -> None:
    await store.create_segment("s1", 0)
    await store.append("s1", 0, 5, b"abc")
    for wrong in (0, 4, 6, 100):
        with pytest.raises(InvalidRequest):
            await store.append("s1", wrong, 1, b"x")
    with pytest.raises(InvalidRequest):
        await store.append("s1", 5, 0, b"x")
    with pytest.raises(InvalidRequest):
        await store.append("s1", 5, 1, b"")
    assert store.segment("s1").end_offset == 5


async def test_pipelined_appends_keep_call_order(store: SegmentStore) -> None:
    await store.create_segment("s1", 0)
    tasks = [asyncio.ensure_future(store.append("s1", i * 3, 3, batch(i))) for i in range(300)]
    entries = await asyncio.gather(*tasks)
    assert [e.base_offset for e in entries] == [i * 3 for i in range(300)]
    assert await store.read("s1", 0, 1 << 30) == entries


async def test_submitted_appends_are_taken_in_call_order_and_fail_in_their_future(
    store: SegmentStore,
) -> None:
    """``submit`` queues the append when called (no task to be scheduled first): appends issued
    back to back, with no await between them, keep their order; a refusal is the future's."""
    await store.create_segment("s1", 0)
    futures = [store.submit("s1", i * 3, 3, batch(i)) for i in range(300)]
    refused = [store.submit("s1", 0, 1, b"x"), store.submit("s1", 900, 0, b"x")]
    entries = await asyncio.gather(*futures)
    assert [e.base_offset for e in entries] == [i * 3 for i in range(300)]
    for future in refused:
        with pytest.raises(InvalidRequest):
            await future
    with pytest.raises(NotFound):
        await store.submit("nope", 0, 1, b"x")
    assert await store.read("s1", 0, 1 << 30) == entries


async def test_read_returns_the_entry_holding_the_offset_and_respects_bytes_max(
    store: SegmentStore,
) -> None:
    await store.create_segment("s1", 100)
    written = await fill(store, "s1", 100, 10)  # 10 entries of 10 records, 50 bytes each
    assert await store.read("s1", 137, 120) == written[3:5]  # 137 is inside [130, 140)
    assert await store.read("s1", 100, 1) == written[:1]  # at least one entry
    assert await store.read("s1", 195, 0) == written[9:]
    assert await store.read("s1", 200, 1000) == []  # the log end
    for outside in (99, 201, -1):
        with pytest.raises(OffsetOutOfRange):
            await store.read("s1", outside, 1000)


async def test_empty_segment_reads_empty_at_its_start(store: SegmentStore) -> None:
    await store.create_segment("s1", 42)
    assert await store.read("s1", 42, 100) == []


async def test_sealed_segment_refuses_appends_and_seal_is_idempotent(store: SegmentStore) -> None:
    await store.create_segment("s1", 0)
    await fill(store, "s1", 0, 3)
    info = await store.seal("s1")
    assert (info.state, info.end_offset) == (SegmentState.SEALED, 30)
    with pytest.raises(Sealed):
        await store.append("s1", 30, 1, b"x")
    assert await store.seal("s1") == info
    assert await store.seal("s1", 30) == info
    with pytest.raises(Sealed):
        await store.seal("s1", 20)
    assert len(await store.read("s1", 0, 1 << 20)) == 3


async def test_seal_with_end_offset_truncates_at_an_entry_boundary(store: SegmentStore) -> None:
    await store.create_segment("s1", 0)
    written = await fill(store, "s1", 0, 10)
    size_before = store.segment("s1").size_bytes
    with pytest.raises(InvalidRequest):
        await store.seal("s1", 101)  # past the log end
    with pytest.raises(InvalidRequest):
        await store.seal("s1", 45)  # inside an entry
    info = await store.seal("s1", 40)
    assert (info.end_offset, info.state) == (40, SegmentState.SEALED)
    assert info.size_bytes < size_before
    assert await store.read("s1", 0, 1 << 20) == written[:4]
    assert await store.read("s1", 40, 1 << 20) == []
    with pytest.raises(OffsetOutOfRange):
        await store.read("s1", 50, 1 << 20)


async def test_seal_at_the_start_empties_the_segment(store: SegmentStore) -> None:
    await store.create_segment("s1", 7)
    await fill(store, "s1", 7, 2)
    info = await store.seal("s1", 7)
    assert (info.end_offset, info.size_bytes) == (7, 0)


async def test_delete_removes_and_is_idempotent(store: SegmentStore) -> None:
    await store.create_segment("s1", 0)
    await store.create_segment("s2", 0)
    await fill(store, "s1", 0, 3)
    await store.delete_segment("s1")
    await store.delete_segment("s1")
    with pytest.raises(NotFound):
        await store.read("s1", 0, 10)
    assert [s.segment_id for s in store.segments()] == ["s2"]
    info = await store.create_segment("s1", 0)  # the id can be reused, empty
    assert info.end_offset == 0
    assert await store.read("s1", 0, 100) == []


async def test_segments_are_independent(store: SegmentStore) -> None:
    await store.create_segment("a", 0)
    await store.create_segment("b", 1000)
    tasks = []
    for i in range(50):
        tasks.append(asyncio.ensure_future(store.append("a", i, 1, batch(i))))
        tasks.append(asyncio.ensure_future(store.append("b", 1000 + 2 * i, 2, batch(i + 100))))
    await asyncio.gather(*tasks)
    a = await store.read("a", 0, 1 << 20)
    b = await store.read("b", 1000, 1 << 20)
    assert [e.batch for e in a] == [batch(i) for i in range(50)]
    assert [e.batch for e in b] == [batch(i + 100) for i in range(50)]
    await store.seal("a")
    await store.append("b", 1100, 1, b"still open")
