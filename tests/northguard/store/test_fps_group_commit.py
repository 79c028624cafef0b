"""Group commit: many concurrent appends share few flushes; the time, byte and record bounds each cut a group."""

from __future__ import annotations

import asyncio

from store_faults import StoreFactory


async def test_concurrent_appends_share_one_flush(open_fps: StoreFactory) -> None:
    store = await open_fps(group_commit_ms=10.0)
    await store.create_segment("s1", 0)
    await store.create_segment("s2", 0)
    tasks = [
        asyncio.ensure_future(store.append(sid, i * 5, 5, bytes([i % 256]) * 100))
        for i in range(500)
        for sid in ("s1", "s2")
    ]
    entries = await asyncio.gather(*tasks)
    # All 1000 appends are queued in one turn of the loop, before the 10 ms timer can fire.
    assert store.flush_count <= 2
    assert store.stats.flush_appends_max >= 500
    assert store.stats.flushed_appends == 1000
    assert [e.base_offset for e in entries[::2]] == [i * 5 for i in range(500)]
    assert store.segment("s1").end_offset == store.segment("s2").end_offset == 2500


async def test_record_bound_cuts_groups_without_waiting_for_the_timer(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(group_commit_ms=600_000.0, group_commit_records_max=100)
    await store.create_segment("s1", 0)
    tasks = [asyncio.ensure_future(store.append("s1", i * 10, 10, b"r" * 10)) for i in range(200)]
    entries = await asyncio.wait_for(
        asyncio.gather(*tasks), 60
    )  # a 10-minute timer never fires here
    assert entries[-1].end_offset == 2000
    assert store.stats.flush_appends_max <= 10  # 10 appends x 10 records
    assert store.flush_count == 20


async def test_byte_bound_cuts_groups_without_waiting_for_the_timer(open_fps: StoreFactory) -> None:
    store = await open_fps(group_commit_ms=600_000.0, group_commit_bytes_max=10_000)
    await store.create_segment("s1", 0)
    tasks = [asyncio.ensure_future(store.append("s1", i, 1, b"b" * 1000)) for i in range(100)]
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert store.stats.flush_appends_max <= 10
    assert store.flush_count >= 10
    assert store.stats.flushed_bytes == 100_000


async def test_timer_flushes_a_lone_append(open_fps: StoreFactory) -> None:
    store = await open_fps(group_commit_ms=1.0)
    await store.create_segment("s1", 0)
    entry = await asyncio.wait_for(store.append("s1", 0, 1, b"alone"), 60)
    assert (entry.base_offset, store.flush_count) == (0, 1)


async def test_a_full_queue_makes_appends_wait_in_call_order(open_fps: StoreFactory) -> None:
    store = await open_fps(group_commit_ms=1.0, group_commit_bytes_max=2_000, queue_bytes_max=4_000)
    await store.create_segment("s1", 0)
    tasks = [asyncio.ensure_future(store.append("s1", i, 1, bytes([i]) * 500)) for i in range(100)]
    entries = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert [e.base_offset for e in entries] == list(range(100))
    assert [e.batch[0] for e in await store.read("s1", 0, 1 << 20)] == list(range(100))
    assert store.stats.flush_appends_max <= 4


async def test_a_cancelled_caller_does_not_break_the_group(open_fps: StoreFactory) -> None:
    store = await open_fps(group_commit_ms=1.0)
    await store.create_segment("s1", 0)
    first = asyncio.ensure_future(store.append("s1", 0, 1, b"a"))
    second = asyncio.ensure_future(store.append("s1", 1, 1, b"b"))
    await asyncio.sleep(0)  # let both tasks queue their append, then abandon the first
    first.cancel()
    assert (await second).base_offset == 1
    assert [e.batch for e in await store.read("s1", 0, 100)] == [b"a", b"b"]


async def test_on_done_is_called_once_per_append_by_its_flush_and_never_inside_submit(
    open_fps: StoreFactory,
) -> None:
    """``submit``'s ``on_done``: a durable append's is called by the flush that made it durable,
    with every append of that flush already resolved (the range log then commits them in one
    pass); a refused one's at a later turn, never inside ``submit`` (its caller is mid-update)."""
    store = await open_fps(group_commit_ms=10.0)
    await store.create_segment("s1", 0)
    seen: list[tuple[int, list[bool]]] = []
    futures: list[asyncio.Future[object]] = []

    def on_done(future: asyncio.Future[object]) -> None:
        seen.append((future.result().base_offset, [f.done() for f in futures]))  # type: ignore[attr-defined]

    futures += [store.submit("s1", i, 1, b"v", on_done) for i in range(8)]  # type: ignore[arg-type]
    await asyncio.gather(*futures)
    assert [offset for offset, _ in seen] == list(range(8))
    assert all(all(done) for _, done in seen)  # each call saw the whole flush resolved
    assert store.flush_count == 1

    refused: list[asyncio.Future[object]] = []
    bad = store.submit("s1", 100, 1, b"v", refused.append)  # type: ignore[arg-type]
    assert bad.done() and refused == []  # resolved, its on_done not yet run
    await asyncio.sleep(0)
    assert refused == [bad] and isinstance(bad.exception(), Exception)
