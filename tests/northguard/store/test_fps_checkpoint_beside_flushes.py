"""A checkpoint writes the acknowledged frames to their segment files beside the flushes.

A checkpoint took the store's flush lock, then wrote every frame acknowledged
since the last one to its segment file: after a first write to 4,096 new
ranges that was 4,096 files made and written, 2-4 s here, and no append was
acknowledged meanwhile (``bench/northguard_scale.py``'s first write to the
next 4,096 ranges took 3-4 s instead of 0.5).  The write pass now runs
before the lock; under it, only what the flushes added meanwhile is written
before the WAL rolls, so the WAL still rolls with every frame it holds in a
segment file.  Real files; the segment file's write is held (no sleeps).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from store_faults import FaultyRuntime, Hold, StoreFactory

WAIT_S = 10.0  # an append behind a held checkpoint write waited 30 s (the hold's bound)


async def test_an_append_is_acknowledged_while_a_checkpoint_writes_segment_files(
    open_fps: StoreFactory, faulty_runtime: FaultyRuntime, tmp_path: Path
) -> None:
    store = await open_fps(
        faulty_runtime, group_commit_ms=1.0, checkpoint_ms=3_600_000.0, segment_write_bytes=1 << 30
    )
    await store.create_segment("a", 0)
    await store.create_segment("b", 0)
    await store.append("a", 0, 1, b"first")  # acknowledged: in the WAL, not in a.seg yet
    written = faulty_runtime.faulty_disk.holds["pwrite", "a.seg"] = Hold()
    checkpoint = asyncio.ensure_future(store.checkpoint())
    assert await asyncio.to_thread(written.reached.wait, WAIT_S), "no segment write started"
    try:
        # The checkpoint is writing a.seg (held): appends are still flushed and acknowledged.
        entry = await asyncio.wait_for(store.append("b", 0, 1, b"beside"), WAIT_S)
        assert entry.base_offset == 0
        assert not checkpoint.done()
    finally:
        written.release.set()
    assert await asyncio.wait_for(checkpoint, WAIT_S) is True  # both in synced files: WAL gone
    await store.close()
    reopened = await open_fps(group_commit_ms=1.0)
    assert [e.batch for e in await reopened.read("a", 0, 1 << 20)] == [b"first"]
    assert [e.batch for e in await reopened.read("b", 0, 1 << 20)] == [b"beside"]
    assert reopened.stats.recovered_frames == 0  # nothing was left for the WAL to replay
