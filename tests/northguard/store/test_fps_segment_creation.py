"""Creating segments: many at once, durable as soon as ``create_segment`` returns, files made lazily.

``create_segment`` makes the segment's metadata durable (one synced index
batch for every creation that arrives together); the segment's file is made
by the first write to it, off the acknowledgement path, and its directory
entry is made durable by the checkpoint that records its end (or by the
recovery that re-creates it from the WAL), before any WAL file that holds its
entries is released.  These tests pull the plug (``PowerLossDisk``) around
each of those steps: a segment acknowledged to exist, and every append
acknowledged to it, survive.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from store_faults import StoreFactory

from backends.northguard.power_loss import PowerLossIndex, PowerLossRuntime
from backends.northguard.store import Entry, FpsStore
from backends.northguard.store.segment_meta import SEGMENT_SUFFIX

DATA = Path("/power-loss/data")
SEGMENTS = 120


def _sid(n: int) -> str:
    return f"r{n}-1"


def _store(runtime: PowerLossRuntime, index: PowerLossIndex) -> FpsStore:
    """Checkpoints only when the test asks, so each phase is exact."""
    return FpsStore(runtime, DATA, group_commit_ms=1.0, checkpoint_ms=3_600_000.0, index=index)


async def _reboot(runtime: PowerLossRuntime, store: FpsStore, index: PowerLossIndex) -> FpsStore:
    """Pull the plug under ``store`` and open a new one on what survived."""
    runtime.disk.power_loss()
    await store.crash()
    reopened = _store(runtime, index.reopened())
    await reopened.open()
    return reopened


async def _append_to_half(store: FpsStore) -> dict[str, Entry]:
    """One entry at the start of every other segment, all in flight together."""
    written = list(range(0, SEGMENTS, 2))
    entries = await asyncio.gather(
        *(store.append(_sid(n), 10 * n, 1, b"first of %d" % n) for n in written)
    )
    return {_sid(n): entry for n, entry in zip(written, entries, strict=True)}


async def _create_all(store: FpsStore) -> None:
    await asyncio.gather(*(store.create_segment(_sid(n), 10 * n) for n in range(SEGMENTS)))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["wal-only", "checkpointed"])
async def test_segments_created_together_survive_a_power_loss_written_or_not(
    checkpointed: bool,
) -> None:
    """Created in one batch; half of them written (acknowledged: in the WAL, or in checkpointed
    files with the WAL released); after the power loss every segment is there, each written one
    with its entry, each unwritten one empty and appendable at its start."""
    runtime = PowerLossRuntime()
    index = runtime.disk.index()
    store = _store(runtime, index)
    await store.open()
    await _create_all(store)
    assert store.stats.create_batches <= 2  # created together, not one sync each
    acked = await _append_to_half(store)
    if checkpointed:
        assert await store.checkpoint()  # files synced, their directory entries too, WAL gone
    store = await _reboot(runtime, store, index)
    try:
        assert len(store.segments()) == SEGMENTS
        for n in range(SEGMENTS):
            assert store.segment(_sid(n)).start_offset == 10 * n
        for sid, entry in acked.items():
            assert await store.read(sid, entry.base_offset, 1 << 20) == [entry]
        for n in range(1, SEGMENTS, 2):
            assert store.segment(_sid(n)).end_offset == 10 * n
            entry = await store.append(_sid(n), 10 * n, 1, b"late")
            assert await store.read(_sid(n), 10 * n, 1 << 20) == [entry]
    finally:
        await store.close()


async def test_recovery_makes_the_files_it_recreates_durable_before_dropping_the_wal() -> None:
    """Acknowledged in the WAL only, the plug pulled twice: once before any checkpoint (the files
    and their directory entries are lost, the WAL holds the entries), once right after the
    recovery that re-created the files from the WAL and released it."""
    runtime = PowerLossRuntime()
    index = runtime.disk.index()
    store = _store(runtime, index)
    await store.open()
    await _create_all(store)
    acked = await _append_to_half(store)
    store = await _reboot(runtime, store, index)
    store = await _reboot(runtime, store, index)
    try:
        for sid, entry in acked.items():
            assert await store.read(sid, entry.base_offset, 1 << 20) == [entry]
    finally:
        await store.close()


@pytest.mark.parametrize("restarted", [False, True], ids=["same-process", "clean-restart"])
async def test_a_reused_id_never_gets_the_deleted_files_entries_after_a_power_loss(
    restarted: bool,
) -> None:
    """A segment written and checkpointed, deleted, created again with the same id (by the same
    process, or after a clean restart) and written: after the power loss the new segment holds
    its own entry, never the old file's."""
    runtime = PowerLossRuntime()
    index = runtime.disk.index()
    store = _store(runtime, index)
    await store.open()
    await store.create_segment("s1", 0)
    await store.create_segment("other", 0)
    for offset in range(3):
        await store.append("s1", offset, 1, b"old %d" % offset)
    assert await store.checkpoint()
    await store.delete_segment("s1")
    if restarted:
        await store.close()
        store = _store(runtime, index)
        await store.open()
    await store.create_segment("s1", 0)
    new = await store.append("s1", 0, 1, b"new 0")
    await store.append("other", 0, 1, b"keeps the WAL busy")
    store = await _reboot(runtime, store, index)
    try:
        assert await store.read("s1", 0, 1 << 20) == [new]
        assert store.segment("s1").end_offset == 1
    finally:
        await store.close()


async def test_creating_a_segment_makes_no_file_until_it_is_written(
    open_fps: StoreFactory, tmp_path: Path
) -> None:
    """Creation is metadata only (one synced index batch for many); the first write makes the file."""
    store = await open_fps(group_commit_ms=1.0, checkpoint_ms=3_600_000.0)
    await asyncio.gather(*(store.create_segment(_sid(n), 0) for n in range(SEGMENTS)))
    segments_dir = tmp_path / "data" / "segments"
    assert list(segments_dir.glob("*" + SEGMENT_SUFFIX)) == []
    entry = await store.append(_sid(3), 0, 1, b"v")
    assert await store.checkpoint()
    assert [p.name for p in segments_dir.glob("*" + SEGMENT_SUFFIX)] == [_sid(3) + SEGMENT_SUFFIX]
    await store.close()
    store = await open_fps()
    assert len(store.segments()) == SEGMENTS
    assert await store.read(_sid(3), 0, 1 << 20) == [entry]
    assert await store.read(_sid(4), 0, 1 << 20) == []
    assert store.pool.opens == 1  # the empty segments have no file to open
