"""Many segments: bounded open files, one fsync per flush, lazy restarts, batched creates and seals."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from store_faults import FaultyRuntime, StoreFactory

from backends.northguard.store import Entry
from backends.northguard.store.file_pool import check_descriptors_max
from xinfra.errors import StorageError, Unavailable

SEGMENTS = 300
POOL = 16


def _sid(n: int) -> str:
    return f"r{n}-1"


async def _fill_all(store: object, start: int = 0) -> dict[str, Entry]:
    from backends.northguard.store import FpsStore

    assert isinstance(store, FpsStore)
    entries = await asyncio.gather(
        *(store.append(_sid(n), start, 1, b"v%d@%d" % (n, start)) for n in range(SEGMENTS))
    )
    return {_sid(n): entry for n, entry in enumerate(entries)}


async def test_many_segments_are_served_through_a_bounded_pool_across_a_restart(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(descriptors_max=POOL, group_commit_ms=5.0)
    await asyncio.gather(*(store.create_segment(_sid(n), 0) for n in range(SEGMENTS)))
    assert store.stats.create_batches <= 3  # created together, not one sync each
    acked = await _fill_all(store)
    assert store.pool.descriptors <= POOL
    assert store.stats.fsyncs == store.stats.flushes  # the WAL's alone, whatever the segments
    await store.close()
    store = await open_fps(descriptors_max=POOL)
    assert store.pool.opens == 0  # a clean restart opens no segment file
    for sid, entry in acked.items():
        assert await store.read(sid, 0, 1 << 20) == [entry]
        assert store.pool.descriptors <= POOL
    sealed = await store.seal_many([_sid(n) for n in range(SEGMENTS)])
    assert {info.end_offset for info in sealed.values()} == {1}


async def test_a_crash_between_checkpoints_loses_nothing_acknowledged(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(descriptors_max=POOL, group_commit_ms=5.0, checkpoint_ms=60_000.0)
    await asyncio.gather(*(store.create_segment(_sid(n), 0) for n in range(SEGMENTS)))
    first = await _fill_all(store)
    second = await _fill_all(store, 1)
    assert store.stats.checkpoints == 0  # only the WAL was synced
    await store.crash()
    store = await open_fps(descriptors_max=POOL)
    for n in range(SEGMENTS):
        assert await store.read(_sid(n), 0, 1 << 20) == [first[_sid(n)], second[_sid(n)]]


async def test_no_descriptor_fails_one_segment_not_the_store(
    open_fps: StoreFactory, faulty_runtime: FaultyRuntime
) -> None:
    """Appends are acknowledged on the WAL's fsync; a segment file that cannot then be opened
    refuses its later appends, keeps its WAL, and catches up once a descriptor is free."""
    store = await open_fps(
        faulty_runtime, descriptors_max=POOL, group_commit_ms=5.0, read_cache_bytes_max=0
    )
    for sid in ("a", "b"):
        await store.create_segment(sid, 0)
    await store.append("a", 0, 1, b"a0")
    assert await store.checkpoint()
    store.pool.close_all()
    faulty_runtime.faulty_disk.faults["open"] = ("b.seg",)
    results = await asyncio.gather(
        store.append("a", 1, 1, b"a1"), store.append("b", 0, 1, b"b0"), return_exceptions=True
    )
    assert results == [Entry(1, 1, b"a1"), Entry(0, 1, b"b0")]  # both in the synced WAL
    assert not await store.checkpoint()  # b.seg could not be written: the WAL is kept
    assert not store.failed
    with pytest.raises(StorageError, match="file descriptor"):
        await store.append("b", 1, 1, b"refused")
    with pytest.raises(StorageError, match="file descriptor"):
        await store.read("b", 0, 1 << 20)
    faulty_runtime.faulty_disk.faults["open"] = ("a.seg",)
    store.pool.close_all()
    with pytest.raises(StorageError, match="file descriptor"):
        await store.read("a", 0, 1 << 20)
    faulty_runtime.faulty_disk.faults.clear()
    assert await store.read("a", 0, 1 << 20) == [Entry(0, 1, b"a0"), Entry(1, 1, b"a1")]
    sealed = await store.seal("b")  # the broken segment is written, then sealed at its end
    assert sealed.end_offset == 1
    assert await store.read("b", 0, 1 << 20) == [Entry(0, 1, b"b0")]
    await store.append("a", 2, 1, b"a2")
    assert await store.checkpoint()  # everything is in synced segment files now
    await store.crash()
    store = await open_fps(descriptors_max=POOL)
    assert store.stats.recovered_frames == 0
    assert await store.read("b", 0, 1 << 20) == [Entry(0, 1, b"b0")]
    assert len(await store.read("a", 0, 1 << 20)) == 3


async def test_a_deleted_id_is_not_reused_while_the_wal_may_still_hold_its_entries(
    open_fps: StoreFactory, faulty_runtime: FaultyRuntime
) -> None:
    """A delete checkpoints so the WAL files holding the segment's frames go; when another segment
    keeps them (no descriptor to write it), re-creating the id waits until they can go."""
    store = await open_fps(faulty_runtime, descriptors_max=POOL, group_commit_ms=5.0)
    for sid in ("s1", "b"):
        await store.create_segment(sid, 0)
    await store.append("s1", 0, 1, b"old s1")
    store.pool.close_all()
    faulty_runtime.faulty_disk.faults["open"] = ("b.seg",)
    await store.append("b", 0, 1, b"b0")  # acknowledged; b.seg cannot be written yet
    await store.delete_segment("s1")  # its checkpoint must keep the WAL: b0 is only there
    with pytest.raises(Unavailable, match="retry"):
        await store.create_segment("s1", 0)
    faulty_runtime.faulty_disk.faults.clear()
    assert (await store.create_segment("s1", 0)).end_offset == 0  # the WAL could go now
    await store.crash()
    store = await open_fps(descriptors_max=POOL)
    assert store.segment("s1").end_offset == 0  # the old entry did not come back into the new s1
    assert await store.read("b", 0, 1 << 20) == [Entry(0, 1, b"b0")]


def test_the_pool_bound_is_checked_against_the_process_limit() -> None:
    assert check_descriptors_max(None, limit=1024) == 256
    assert check_descriptors_max(400, limit=1024) == 400
    with pytest.raises(ValueError, match="RLIMIT_NOFILE 1024"):
        check_descriptors_max(1000, limit=1024)


async def test_a_pool_bound_too_close_to_the_limit_is_refused_at_start(tmp_path: Path) -> None:
    from backends.northguard.runtime import RealRuntime
    from backends.northguard.store import FpsStore

    with pytest.raises(ValueError, match="not well under"):
        FpsStore(RealRuntime(), tmp_path / "data", descriptors_max=1 << 30)


async def test_a_seal_without_a_descriptor_is_refused_alone(
    open_fps: StoreFactory, faulty_runtime: FaultyRuntime
) -> None:
    store = await open_fps(faulty_runtime, descriptors_max=POOL, group_commit_ms=5.0)
    await store.create_segment("a", 0)
    for n in range(3):
        await store.append("a", n, 1, b"x")
    store.pool.close_all()
    faulty_runtime.faulty_disk.faults["open"] = ("a.seg",)
    with pytest.raises(Unavailable, match="file descriptor"):
        await store.seal("a", 1)  # finding the cut reads the file
    assert not store.failed
    faulty_runtime.faulty_disk.faults.clear()
    assert (await store.seal("a", 1)).end_offset == 1


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0)  # a loop turn: the writer task runs


async def test_small_appends_to_many_segments_wait_for_the_checkpoint_one_write_each(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(group_commit_ms=1.0, checkpoint_ms=60_000.0)
    await asyncio.gather(*(store.create_segment(_sid(n), 0) for n in range(SEGMENTS)))
    acked = [await _fill_all(store, start) for start in range(3)]
    assert store.stats.segment_writes == 0  # in the synced WAL and in memory, not one write each
    assert await store.checkpoint()  # writes them, syncs them, and releases the WAL
    assert store.stats.segment_writes == SEGMENTS  # three appends, one write per segment
    await store.close()
    store = await open_fps()
    for n in range(SEGMENTS):
        expected = [entries[_sid(n)] for entries in acked]
        assert await store.read(_sid(n), 0, 1 << 20) == expected


async def test_a_segment_with_enough_unwritten_bytes_is_written_without_the_checkpoint(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(group_commit_ms=1.0, checkpoint_ms=60_000.0, segment_write_bytes=4096)
    await store.create_segment("big", 0)
    await store.create_segment("small", 0)
    await store.append("small", 0, 1, b"s")
    await store.append("big", 0, 1, b"b" * 5000)
    await asyncio.wait_for(_until(lambda: store.stats.segment_writes == 1), 30)
    segments = store.data_dir / "segments"
    assert (segments / "big.seg").exists() and not (segments / "small.seg").exists()
    assert store.stats.checkpoints == 0


async def test_a_read_of_frames_not_in_the_file_nor_the_cache_writes_them(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(group_commit_ms=1.0, checkpoint_ms=60_000.0, read_cache_bytes_max=0)
    await store.create_segment("s", 0)
    entries = [await store.append("s", n, 1, b"v%d" % n) for n in range(3)]
    assert store.stats.segment_writes == 0
    assert await store.read("s", 0, 1 << 20) == entries
    assert store.stats.segment_writes == 1


async def test_unwritten_bytes_past_the_bound_are_all_written(open_fps: StoreFactory) -> None:
    store = await open_fps(group_commit_ms=1.0, checkpoint_ms=60_000.0, unwritten_bytes_max=10_000)
    await asyncio.gather(*(store.create_segment(_sid(n), 0) for n in range(SEGMENTS)))
    for start in range(2):
        await asyncio.gather(
            *(store.append(_sid(n), start, 1, b"x" * 100) for n in range(SEGMENTS))
        )
    await asyncio.wait_for(_until(lambda: store.stats.segment_writes >= SEGMENTS), 30)
    assert store.stats.checkpoints == 0
