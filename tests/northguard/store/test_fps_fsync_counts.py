"""Each fsync is counted once, as the work's that made it: a flush's count is its WAL's alone even
while a checkpoint syncs the segment directory beside it, a checkpoint's is its own even while a
flush rolls the WAL beside it, and together they are every fsync the store made.

Real files; the order of the two threads' calls is set with holds
(``store_faults``), never with sleeps.  A checkpoint syncs its segment files
and their directory without ``_lock``, so flushes run beside it: a count taken
as the difference of the store-wide counters across a flush took the
checkpoint's directory syncs as the flush's (and the checkpoint took a WAL
roll's rename as its own).
"""

from __future__ import annotations

import asyncio

from store_faults import FaultyRuntime, Hold, StoreFactory

from backends.northguard.store.fps import DIRECTORY_MARKER

SEGMENTS = 64  # new files per checkpoint: segment fsyncs and a directory sync beside the flush
WAL_FILE_BYTES_MAX = 64 * 1024
MARKER = DIRECTORY_MARKER + ".tmp"  # the segment directory's sync: this file's fsync, its rename


async def test_flushes_and_checkpoints_count_only_the_fsyncs_they_made(
    open_fps: StoreFactory, faulty_runtime: FaultyRuntime
) -> None:
    store = await open_fps(
        runtime=faulty_runtime,
        checkpoint_ms=3_600_000.0,  # only the checkpoints this test runs (and a WAL roll's)
        wal_file_bytes_max=WAL_FILE_BYTES_MAX,
        group_commit_ms=1.0,
    )
    disk = faulty_runtime.faulty_disk
    first = [f"a{n}" for n in range(SEGMENTS)]
    second = [f"b{n}" for n in range(SEGMENTS)]
    await asyncio.gather(*(store.create_segment(sid, 0) for sid in first + second))
    made_before = store.syncs.get()
    flushes_before, fsyncs_before = store.stats.flushes, store.stats.fsyncs
    checkpoint_fsyncs_before = store.stats.checkpoint_fsyncs
    segment_syncs_before = store.syncs.get("segment"), store.syncs.get("filesystem")
    await asyncio.gather(*(store.append(sid, 0, 1, b"x" * 100) for sid in first))

    # A flush in its WAL fsync while the checkpoint syncs the directory of 64 new files.
    marker = disk.holds["fsync", MARKER] = Hold()
    renamed = disk.holds["rename", MARKER] = Hold(released=True)
    checkpoint = asyncio.ensure_future(store.checkpoint())
    await asyncio.to_thread(marker.reached.wait, 30)  # segment files synced, directory not yet
    wal = disk.holds["fsync", ".wal"] = Hold()
    flushes, fsyncs = store.stats.flushes, store.stats.fsyncs
    append = asyncio.ensure_future(store.append("a0", 1, 1, b"y"))
    assert await asyncio.to_thread(wal.reached.wait, 30)
    marker.release.set()
    assert await asyncio.to_thread(renamed.done.wait, 30)  # the directory synced meanwhile
    wal.release.set()
    await asyncio.wait_for(append, 30)
    assert await asyncio.wait_for(checkpoint, 30)
    assert store.stats.flushes - flushes == 1
    assert store.stats.fsyncs - fsyncs == 1  # its WAL's, not the directory's beside it

    # A flush that rolls the WAL while the checkpoint syncs the directory of 64 new files.
    await asyncio.gather(*(store.append(sid, 0, 1, b"x" * 100) for sid in second))
    marker = disk.holds["fsync", MARKER] = Hold()
    checkpoint = asyncio.ensure_future(store.checkpoint())  # rolls the WAL: position 0
    await asyncio.to_thread(marker.reached.wait, 30)
    await store.append("b0", 1, 1, b"y")  # the new WAL file is no longer empty
    fsyncs = store.stats.fsyncs
    await store.append("b0", 2, 1, bytes(WAL_FILE_BYTES_MAX))  # past the file's bound: rolls
    assert store.stats.fsyncs - fsyncs == 3  # the new file's (its .tmp's, the rename's), then its
    marker.release.set()
    assert await asyncio.wait_for(checkpoint, 30)

    await store.close()  # the checkpoint the roll asked for, and the close's, have ended
    flushes = store.stats.flushes - flushes_before
    flush_fsyncs = store.stats.fsyncs - fsyncs_before
    checkpoint_fsyncs = store.stats.checkpoint_fsyncs - checkpoint_fsyncs_before
    assert flush_fsyncs == flushes + 2  # one WAL fsync each, two more for the one roll
    segment_fsyncs = store.syncs.get("segment") - segment_syncs_before[0]
    filesystem_syncs = store.syncs.get("filesystem") - segment_syncs_before[1]
    # Every segment file it wrote: an fsync each, or (64 files) one sync of them all.
    assert segment_fsyncs + SEGMENTS * filesystem_syncs >= 2 * SEGMENTS
    assert checkpoint_fsyncs >= segment_fsyncs + filesystem_syncs
    assert flush_fsyncs + checkpoint_fsyncs == store.syncs.get() - made_before
