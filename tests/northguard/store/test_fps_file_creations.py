"""The segment files a store makes are counted and timed, once each, when an open makes them.

A first write to N new ranges makes N files (an inode allocation each: up to
~1 ms of kernel CPU on ext4): the store counts the opens that make one
(``file_creations``), and the broker exports the count and the time.  The
pool closing and opening a file again, a restart opening the files, and a
recovery replaying the WAL into files that are there make none.  Real files.
"""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest
from store_faults import StoreFactory

from backends.northguard.broker.metrics import BrokerMetrics
from backends.northguard.store.file_pool import DESCRIPTORS_MIN

SEGMENTS = 120


def _sid(n: int) -> str:
    return f"r{n}-1"


async def test_each_new_segment_file_is_counted_once_by_the_open_that_makes_it(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(
        group_commit_ms=1.0, checkpoint_ms=3_600_000.0, descriptors_max=DESCRIPTORS_MIN
    )
    await asyncio.gather(*(store.create_segment(_sid(n), 0) for n in range(SEGMENTS)))
    assert store.file_creations.files == 0  # creating a segment makes no file
    for offset in range(2):
        await asyncio.gather(*(store.append(_sid(n), offset, 1, b"v") for n in range(SEGMENTS)))
        assert await store.checkpoint()
    assert store.pool.opens > SEGMENTS  # closed by the pool and opened again: not made again
    assert store.file_creations.files == SEGMENTS
    assert store.file_creations.seconds > 0
    metrics = BrokerMetrics()
    metrics.watch_store(store)
    exported = generate_latest(metrics.registry).decode()
    assert f"northguard_store_segment_files_created_total {float(SEGMENTS)}" in exported
    assert "northguard_store_segment_file_create_seconds_total " in exported
    await store.close()

    store = await open_fps(descriptors_max=DESCRIPTORS_MIN)
    for n in range(SEGMENTS):
        assert [entry.base_offset for entry in await store.read(_sid(n), 0, 1 << 20)] == [0, 1]
    assert store.pool.opens >= SEGMENTS
    assert store.file_creations.files == 0


async def test_recovery_into_files_written_before_a_crash_makes_none(
    open_fps: StoreFactory,
) -> None:
    """Files written but never checkpointed are there, not yet durable: recovery opens them."""
    store = await open_fps(group_commit_ms=1.0, checkpoint_ms=3_600_000.0)
    await asyncio.gather(*(store.create_segment(_sid(n), 0) for n in range(SEGMENTS)))
    await asyncio.gather(*(store.append(_sid(n), 0, 1, b"v") for n in range(SEGMENTS)))
    await store.seal(_sid(0))  # first writes every segment's acknowledged frames to its file
    assert store.file_creations.files == SEGMENTS
    assert store.stats.checkpoints == 0
    await store.crash()

    store = await open_fps()
    assert store.stats.adopted_frames == SEGMENTS  # every file opened: its frames found in it
    assert store.file_creations.files == 0
