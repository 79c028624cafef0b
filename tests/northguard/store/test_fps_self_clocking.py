"""Self-clocking group commit: an idle store flushes at once; appends that arrive while a flush
runs share the next one; two flushes start at least ``group_commit_ms`` apart unless a group
fills.  Asserted on the store's own flush and fsync counters, never on time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from store_faults import FaultyRuntime, StoreFactory

from backends.northguard.runtime import RealRuntime


class FrozenTimers(RealRuntime):
    """The real runtime whose timers never fire: whatever completes here needed no timer."""

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        handle = asyncio.get_running_loop().call_later(3600.0, callback)
        handle.cancel()
        return handle


async def test_an_idle_store_flushes_a_lone_append_without_a_timer(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(runtime=FrozenTimers(seed=1))  # the default group commit
    await store.create_segment("s1", 0)
    entry = await asyncio.wait_for(store.append("s1", 0, 1, b"alone"), 30)
    assert (entry.base_offset, store.flush_count, store.stats.fsyncs) == (0, 1, 1)


async def test_appends_during_a_flush_share_the_next_one(
    open_fps: StoreFactory, faulty_runtime: FaultyRuntime
) -> None:
    store = await open_fps(runtime=faulty_runtime)
    await store.create_segment("s1", 0)
    await store.create_segment("s2", 0)
    disk = faulty_runtime.faulty_disk
    disk.faults["stall_fsync"] = (".wal",)  # the first flush holds its WAL fsync until released
    first = asyncio.ensure_future(store.append("s1", 0, 1, b"first"))
    await asyncio.to_thread(disk.stalled.wait, 30)
    later = [
        asyncio.ensure_future(store.append(sid, i + start, 1, bytes([i]) * 100))
        for i in range(200)
        for sid, start in (("s1", 1), ("s2", 0))
    ]
    await asyncio.sleep(0)  # every later append is queued behind the running flush
    assert store.flush_count == 0
    disk.faults.clear()
    disk.unstall.set()
    await asyncio.wait_for(asyncio.gather(first, *later), 60)
    assert store.flush_count == 2  # the stalled one, then one for all 400 that queued behind it
    assert store.stats.flush_appends_max == 400
    assert store.stats.fsyncs <= 3 * store.flush_count  # one WAL fsync each (three if it rolls)
    assert (store.segment("s1").end_offset, store.segment("s2").end_offset) == (201, 200)


async def test_flushes_start_group_commit_ms_apart_unless_a_group_fills(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(
        runtime=FrozenTimers(seed=1), group_commit_ms=600_000.0, group_commit_records_max=10
    )
    await store.create_segment("s1", 0)
    await asyncio.wait_for(store.append("s1", 0, 1, b"idle"), 30)  # idle: at once
    second = asyncio.ensure_future(store.append("s1", 1, 1, b"spaced"))
    for _ in range(10):
        await asyncio.sleep(0)  # turns of the loop, no time: the next flush may not start yet
    assert (store.flush_count, second.done()) == (1, False)
    third = asyncio.ensure_future(store.append("s1", 2, 9, b"fills the group"))
    await asyncio.wait_for(asyncio.gather(second, third), 30)  # a full group goes at once
    assert (store.flush_count, store.stats.flush_appends_max) == (2, 2)
