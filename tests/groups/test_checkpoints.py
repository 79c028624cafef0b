"""Checkpoints on real MariaDB and Redis: coalescing, acknowledged only once durable, the
cache answering first and never changing an answer (flushed, stale or down)."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from waiting import wait_until

from metadata_service.checkpoints.buffer import CoalescingBuffer
from metadata_service.checkpoints.cache import CheckpointCache, MemoryCache, RedisCache
from metadata_service.checkpoints.service import CheckpointService
from metadata_service.checkpoints.store import CheckpointStore
from metadata_service.migrate import upgrade_database
from xinfra.services.redis import start_redis

VC = "default"


async def db(function: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(function, *args)


@pytest.fixture
def engine(mysql_url: str) -> Any:
    upgrade_database(mysql_url)
    engine = sa.create_engine(mysql_url, pool_size=4)
    yield engine
    engine.dispose()


@pytest.fixture(params=["memory", "redis"])
def cache(request: pytest.FixtureRequest, redis_url: str) -> CheckpointCache:
    if request.param == "memory":
        return MemoryCache()
    return RedisCache(redis_url, prefix=f"test-{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def checkpoints(engine: Any, cache: CheckpointCache) -> AsyncIterator[CheckpointService]:
    service = CheckpointService(db, CheckpointStore(engine), cache, interval_s=0.005)
    await service.start()
    yield service
    await service.stop()


def rows(engine: Any, group: str) -> list[tuple[str, int, int, int]]:
    with engine.connect() as connection:
        result = connection.execute(
            sa.text(
                "SELECT topic, epoch, shard, position FROM checkpoints "
                "WHERE virtual_cluster = :vc AND group_name = :g ORDER BY topic, epoch, shard"
            ),
            {"vc": VC, "g": group},
        )
        return [tuple(r) for r in result]  # type: ignore[misc]


def inserts_running(engine: Any) -> int:
    """Checkpoint upserts MariaDB is executing now (here: waiting for a row lock)."""
    with engine.connect() as c:
        return int(
            c.execute(
                sa.text(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                    "WHERE INFO LIKE 'INSERT INTO checkpoints%'"
                )
            ).scalar()
        )


async def test_commits_to_one_key_coalesce_and_the_last_wins(
    checkpoints: CheckpointService, engine: Any
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    statements = checkpoints.store.statements
    # 500 concurrent commits, 200 of them to one key: a handful of statements, one row per key.
    commits = [{(VC, group, "t", 0, 0): offset} for offset in range(200)]
    commits += [{(VC, group, "t", 0, shard): 7} for shard in range(1, 301)]
    await asyncio.gather(*(checkpoints.commit(c) for c in commits))
    assert rows(engine, group)[0] == ("t", 0, 0, 199)
    assert len(rows(engine, group)) == 301
    used = checkpoints.store.statements - statements
    assert 1 <= used <= 10, f"{len(commits)} commits became {used} statements"
    assert (await checkpoints.read_group(VC, group))[("t", 0, 0)] == 199


async def test_a_commit_is_acknowledged_only_after_its_flush(
    checkpoints: CheckpointService, engine: Any
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    key = (VC, group, "t", 0, 0)
    await checkpoints.commit({key: 1})
    with engine.connect() as blocker:
        # Hold the row's lock: the flush's upsert must wait for it, and so must the commit.
        transaction = blocker.begin()
        blocker.execute(
            sa.text("SELECT * FROM checkpoints WHERE group_name = :g FOR UPDATE"), {"g": group}
        )
        commit = asyncio.create_task(checkpoints.commit({key: 2}))
        await wait_until(
            lambda: asyncio.to_thread(inserts_running, engine), what="the flush to block"
        )
        assert not commit.done(), "acknowledged before its flush committed"
        transaction.rollback()
    await asyncio.wait_for(commit, 30)
    assert rows(engine, group) == [("t", 0, 0, 2)]


async def test_flushes_overlap_but_an_older_value_never_lands_after_a_newer(
    checkpoints: CheckpointService, engine: Any
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    key, other = (VC, group, "t", 0, 0), (VC, group, "t", 0, 1)
    await checkpoints.commit({key: 1})
    with engine.connect() as blocker:
        transaction = blocker.begin()
        # The one row, by its whole primary key: a record lock, no gap lock on its neighbours.
        blocker.execute(
            sa.text(
                "SELECT * FROM checkpoints WHERE virtual_cluster = :vc AND group_name = :g "
                "AND topic = 't' AND epoch = 0 AND shard = 0 FOR UPDATE"
            ),
            {"vc": VC, "g": group},
        )

        async def one_blocked() -> bool:
            return await asyncio.to_thread(inserts_running, engine) == 1

        async def two_flights() -> bool:
            return checkpoints.buffer.in_flight == 2

        older = asyncio.create_task(checkpoints.commit({key: 2}))
        await wait_until(one_blocked, what="the first flush to block on the row")
        # Pipelined: a flush of another key is written and acknowledged meanwhile.
        await asyncio.wait_for(checkpoints.commit({other: 9}), 30)
        # A newer value of the blocked key waits for the flight that holds the older one:
        # taken into a flight of its own, it never reaches MySQL before that one has landed.
        newer = asyncio.create_task(checkpoints.commit({key: 3}))
        await wait_until(two_flights, what="the newer value to be taken into a second flight")
        assert await asyncio.to_thread(inserts_running, engine) == 1
        assert not older.done() and not newer.done()
        transaction.rollback()
    await asyncio.wait_for(asyncio.gather(older, newer), 30)
    assert rows(engine, group) == [("t", 0, 0, 3), ("t", 0, 1, 9)]
    assert (await checkpoints.read_group(VC, group))[("t", 0, 0)] == 3


async def test_reads_hit_the_cache_and_a_flushed_cache_changes_no_answer(
    checkpoints: CheckpointService, engine: Any
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    await checkpoints.commit({(VC, group, "t", 0, s): 10 + s for s in range(3)})
    first = await checkpoints.read_group(VC, group)
    hits = checkpoints.cache_hits
    # Behind the cache's back: the cache still answers, which shows reads go to it first.
    with engine.begin() as c:
        c.execute(
            sa.text("UPDATE checkpoints SET position = 0 WHERE group_name = :g"), {"g": group}
        )
    assert await checkpoints.read_group(VC, group) == first
    assert checkpoints.cache_hits == hits + 1
    # Commits write through: the cached answer follows them.
    await checkpoints.commit({(VC, group, "t", 1, 0): 99})
    assert (await checkpoints.read_group(VC, group))[("t", 1, 0)] == 99
    # The cache flushed: the answer comes from MySQL (where the test zeroed the old rows).
    await checkpoints.cache.drop_group((VC, group))
    again = await checkpoints.read_group(VC, group)
    assert again == {("t", 0, 0): 0, ("t", 0, 1): 0, ("t", 0, 2): 0, ("t", 1, 0): 99}


async def test_redis_down_or_stale_changes_no_answer(engine: Any, tmp_path: Path) -> None:
    process = start_redis(tmp_path)
    service = CheckpointService(
        db, CheckpointStore(engine), RedisCache(process.url), interval_s=0.005
    )
    await service.start()
    group = f"g-{uuid.uuid4().hex[:8]}"
    key = (VC, group, "t", 0, 0)
    try:
        await service.commit({key: 1})
        assert await service.read_group(VC, group) == {("t", 0, 0): 1}  # now cached
        # Redis frozen: the write-through fails, the commit is still acknowledged (MySQL has it).
        os.kill(process.pid, signal.SIGSTOP)
        try:
            await service.commit({key: 2})
        finally:
            os.kill(process.pid, signal.SIGCONT)
        # Redis is back with the old value: the group is suspect, the answer is MySQL's.
        assert await service.read_group(VC, group) == {("t", 0, 0): 2}
        assert await service.read_group(VC, group) == {("t", 0, 0): 2}
        # Redis gone for good: commits and reads carry on.
        process.stop()
        await service.commit({key: 3})
        assert await service.read_group(VC, group) == {("t", 0, 0): 3}
    finally:
        await service.stop()
        process.stop()


def test_the_embedded_store_upserts_too(tmp_path: Path) -> None:
    """SQLite (the embedded default) takes the same one-statement upsert."""
    url = f"sqlite:///{tmp_path / 'metadata.db'}"
    upgrade_database(url)
    store = CheckpointStore(sa.create_engine(url))
    store.upsert({(VC, "g", "t", 0, 0): 1, (VC, "g", "t", 0, 1): 2})
    store.upsert({(VC, "g", "t", 0, 0): 5})
    assert store.read_group(VC, "g") == {("t", 0, 0): 5, ("t", 0, 1): 2}
    assert store.list_groups(VC) == ["g"]
    assert store.delete_group(VC, "g", "t") == 2


async def test_offer_never_waits_and_declines_when_the_buffer_is_full_or_stopped() -> None:
    """``offer`` (the hot commit route's) joins the next flush or says no; ``put`` waits."""
    release = asyncio.Event()
    flushed: list[dict[str, int]] = []

    async def flush(batch: dict[str, int]) -> None:
        await release.wait()
        flushed.append(batch)

    buffer: CoalescingBuffer[str] = CoalescingBuffer(flush, interval_s=0.001, keys_max=2)
    assert buffer.offer({"a": 1}) is None, "offered to a buffer that is not running"
    buffer.start()
    first = buffer.offer({"a": 1})
    second = buffer.offer({"b": 2})
    assert first is not None and second is first, "two commits of one batch share its flush"
    assert buffer.offer({"c": 3}) is None, "two keys wait already: no room for a third"
    waiting = asyncio.create_task(buffer.put({"c": 3}))

    async def flying() -> bool:
        return buffer.in_flight >= 1

    await wait_until(flying, what="the first batch to fly")
    assert not first.done() and not waiting.done()
    release.set()
    await first
    await waiting
    assert flushed[0] == {"a": 1, "b": 2} and {"c": 3} in flushed
    await buffer.stop()
    assert buffer.offer({"d": 4}) is None, "offered to a stopped buffer"


async def test_a_commit_to_an_idle_buffer_flies_at_once_and_a_batch_grows_while_one_flies() -> None:
    """Group commit: nothing in flight, a commit is flushed without waiting for the interval
    (its latency is the write's, not the write's plus a timer); while a flight is out, the
    next commits wait together and fly as one batch when it lands."""
    flushed: list[dict[str, int]] = []
    release = asyncio.Event()

    async def flush(batch: dict[str, int]) -> None:
        if not flushed:
            await release.wait()  # the first flight stays out until released
        flushed.append(dict(batch))

    buffer: CoalescingBuffer[str] = CoalescingBuffer(flush, interval_s=300.0)
    buffer.start()
    first = buffer.offer({"a": 1})
    assert first is not None

    async def flying() -> bool:
        return buffer.in_flight == 1

    await wait_until(flying, what="the first commit to fly without waiting for the interval")
    second, third = buffer.offer({"b": 2}), buffer.offer({"c": 3})
    assert second is not None and third is second, "commits behind a flight share a batch"
    assert buffer.in_flight == 1 and not first.done()
    release.set()
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert flushed == [{"a": 1}, {"b": 2, "c": 3}]
    await asyncio.wait_for(buffer.put({"d": 4}), 10)  # idle again: at once
    assert flushed[-1] == {"d": 4}
    await buffer.stop()


def test_the_mysql_upsert_writes_any_name_literally_and_splits_long_flushes(
    engine: Any, request: pytest.FixtureRequest
) -> None:
    """The upsert's literals (escaped by the driver) round-trip names with quotes, backslashes,
    percent signs and non-ASCII; a flush past the statement bound is several statements of
    one transaction, and the last value per key wins."""
    store = CheckpointStore(engine, statement_bytes_max=2000)
    request.addfinalizer(store.close)
    group = f"g-{uuid.uuid4().hex[:8]}"
    odd = ["A.b_c-9", "it's", 'a"b', "c\\\\d", "e%sf%%", "ü-€", "x'); DROP TABLE checkpoints; --"]
    store.upsert({(VC, group, topic, 0, 0): i for i, topic in enumerate(odd)})
    many = {(VC, group, "t", 1, shard): shard for shard in range(300)}
    statements = store.statements
    store.upsert(many)
    assert store.statements - statements > 1, "300 rows fit a 2000-byte statement?"
    store.upsert({(VC, group, "t", 1, 7): 70})
    got = dict(
        ((topic, epoch, shard), position) for topic, epoch, shard, position in rows(engine, group)
    )
    assert {t: got[(t, 0, 0)] for t in odd} == {t: i for i, t in enumerate(odd)}
    assert {s: got[("t", 1, s)] for s in range(300)} == {s: 70 if s == 7 else s for s in range(300)}


def test_a_flush_is_its_upsert_and_commit_and_a_dropped_connection_fails_only_its_flush(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On MySQL the upserts have their own pool in autocommit, without a ping at checkout or
    a rollback at return: a flush of one statement is one round trip, its INSERT (several
    statements are one transaction, BEGIN to COMMIT).  A connection the server dropped fails
    the flush that finds it (its commits are refused, none acknowledged), and the next flush
    writes on a new one."""
    import pymysql

    store = CheckpointStore(engine, flush_connections=1, statement_bytes_max=2000)
    try:
        assert store.flush_engine is not engine and store.open_pool() == 1
        calls: list[str] = []

        def counting(name: str) -> Callable[..., Any]:
            done = getattr(pymysql.connections.Connection, name)

            def call(self: Any, *args: Any) -> Any:
                calls.append(args[0].split()[0] if name == "query" else name)
                return done(self, *args)

            return call

        for name in ("query", "ping", "commit", "rollback"):
            monkeypatch.setattr(pymysql.connections.Connection, name, counting(name))
        group = f"g-{uuid.uuid4().hex[:8]}"
        for position in range(3):
            store.upsert({(VC, group, "t", 0, 0): position})
        assert calls == ["INSERT"] * 3, "a flush is its upsert"
        assert rows(engine, group) == [("t", 0, 0, 2)]
        calls.clear()
        store.upsert({(VC, group, "t", 1, shard): shard for shard in range(100)})
        assert calls[0] == "BEGIN" and calls[-1] == "COMMIT" and len(calls) > 3, calls
        assert set(calls[1:-1]) == {"INSERT"}
        monkeypatch.undo()
        store.upsert({(VC, group, "t", 1, 0): 0})  # back to one shard of epoch 0 below
        with engine.begin() as connection:
            connection.exec_driver_sql(
                f"DELETE FROM checkpoints WHERE group_name = '{group}' AND epoch = 1"
            )

        with store.flush_engine.connect() as connection:
            flushing = connection.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
            connection.rollback()
        with engine.connect() as admin:
            admin.exec_driver_sql(f"KILL {int(flushing)}")  # type: ignore[call-overload]
        with pytest.raises(sa.exc.OperationalError):
            store.upsert({(VC, group, "t", 0, 0): 3})
        assert rows(engine, group) == [("t", 0, 0, 2)]
        store.upsert({(VC, group, "t", 0, 0): 4})
        assert rows(engine, group) == [("t", 0, 0, 4)]
    finally:
        store.close()
