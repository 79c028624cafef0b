"""An executor's read of one slice (``clients.spark.read.read_slice``), without a JVM.

The slice reader runs on Spark's Python workers; what it does when a shard
cannot serve the planned offsets is decided here, on a real broker.
"""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from backends.northguard.launcher import start_northguard
from clients.spark import read as spark_read
from clients.spark.plan import Slice
from clients.spark.read import read_slice
from clients.spark.reader_pool import ReaderPool
from xinfra.backend import open_backend
from xinfra.errors import OffsetOutOfRange
from xinfra.keyspace import shard_ranges
from xinfra.model import ClusterKind, PhysicalCluster, Record

RECORDS = 5


async def _fill(cluster: PhysicalCluster, topic: str) -> None:
    """A one-shard ``topic`` on ``cluster`` holding ``RECORDS`` records, offsets 0.."""
    backend = open_backend(cluster)
    try:
        await backend.create_topic(topic, shard_ranges(1))
        producer = backend.producer(topic)
        await producer.send(0, [Record(b"v%d" % i) for i in range(RECORDS)])
        await producer.close()
    finally:
        await backend.close()


@pytest.fixture(scope="module")
def northguard_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process = start_northguard(Path(tmp_path_factory.mktemp("northguard")))
    yield process.url
    process.stop()


@pytest.fixture(params=[ClusterKind.KAFKA, ClusterKind.NORTHGUARD], ids=lambda kind: kind.value)
def short_topic(request: pytest.FixtureRequest) -> tuple[PhysicalCluster, str]:
    """A one-shard topic holding ``RECORDS`` records, offsets 0..4, on each kind of cluster."""
    kind: ClusterKind = request.param
    fixture = "kafka_bootstrap" if kind is ClusterKind.KAFKA else "northguard_bootstrap"
    cluster = PhysicalCluster(
        name="spark-read", kind=kind, bootstrap=request.getfixturevalue(fixture)
    )
    topic = f"spark-read-{uuid.uuid4().hex[:8]}"

    asyncio.run(_fill(cluster, topic))
    return cluster, topic


def _slice(cluster: PhysicalCluster, topic: str, start: int, end: int) -> Slice:
    return Slice(
        topic="t",
        epoch=0,
        shard=0,
        start=start,
        end=end,
        cluster=cluster.model_dump_json(),
        physical_topic=topic,
    )


@pytest.mark.timeout(120)
def test_a_slice_past_the_shards_end_fails_instead_of_spinning(
    short_topic: tuple[PhysicalCluster, str],
) -> None:
    """Offsets 10..20 of a shard that ends at 5 (records lost on the cluster): the broker
    answers OffsetOutOfRange at every poll; the reader must say so, not poll forever."""
    cluster, topic = short_topic
    with pytest.raises(OffsetOutOfRange, match="records were lost on the cluster"):
        list(read_slice(_slice(cluster, topic, 10, 20), False, True))


@pytest.mark.timeout(120)
def test_a_slice_past_the_shards_end_is_skipped_without_fail_on_data_loss(
    short_topic: tuple[PhysicalCluster, str],
) -> None:
    cluster, topic = short_topic
    assert list(read_slice(_slice(cluster, topic, 10, 20), False, False)) == []


def test_a_slice_inside_the_shard_reads_exactly_its_offsets(
    short_topic: tuple[PhysicalCluster, str],
) -> None:
    cluster, topic = short_topic
    batches = list(read_slice(_slice(cluster, topic, 1, 4), False, True))
    offsets = [offset for batch in batches for offset in batch.column("offset").to_pylist()]
    values = [value for batch in batches for value in batch.column("value").to_pylist()]
    assert offsets == [1, 2, 3]
    assert values == [b"v1", b"v2", b"v3"]


def test_the_collector_is_paused_only_inside_a_poll(
    short_topic: tuple[PhysicalCluster, str],
) -> None:
    """read_slice pauses the cyclic collector while it polls and builds a batch; Spark's code,
    which runs between the batches, and the caller after the read find it as they left it."""
    cluster, topic = short_topic
    seen = [gc.isenabled() for _ in read_slice(_slice(cluster, topic, 0, RECORDS), False, True)]
    assert seen and all(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        batches = list(read_slice(_slice(cluster, topic, 0, RECORDS), False, True))
        assert sum(batch.num_rows for batch in batches) == RECORDS
        assert not gc.isenabled()
    finally:
        gc.enable()


def _offsets(batches: Iterator[pa.RecordBatch]) -> list[int]:
    return [offset for batch in batches for offset in batch.column("offset").to_pylist()]


def test_a_worker_pool_reuses_one_reader_for_the_slices_of_a_topic(
    short_topic: tuple[PhysicalCluster, str],
) -> None:
    """Slices read one after the other through a pool share its reader (re-assigned each time);
    two read at once (interleaved in one thread) get their own; a slice that fails or is left
    unfinished closes its reader instead of returning it."""
    cluster, topic = short_topic
    pool = ReaderPool()
    try:
        assert _offsets(read_slice(_slice(cluster, topic, 0, 3), False, True, pool)) == [0, 1, 2]
        assert _offsets(read_slice(_slice(cluster, topic, 2, 5), False, True, pool)) == [2, 3, 4]
        assert pool.opened == 1
        first = read_slice(_slice(cluster, topic, 0, 2), False, True, pool)
        second = read_slice(_slice(cluster, topic, 3, 5), False, True, pool)
        assert list(zip(_offsets(first), _offsets(second), strict=True)) == [(0, 3), (1, 4)]
        assert pool.opened == 1  # the second, finding the pool held, opened and closed its own
        with pytest.raises(OffsetOutOfRange):
            list(read_slice(_slice(cluster, topic, 10, 20), False, True, pool))
        abandoned = read_slice(_slice(cluster, topic, 0, 5), False, True, pool)
        next(abandoned)
        abandoned.close()
        assert _offsets(read_slice(_slice(cluster, topic, 4, 5), False, True, pool)) == [4]
        assert pool.opened == 3
    finally:
        pool.close()


def test_the_worker_heap_is_frozen_only_in_a_process_spark_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An application's own process (here pytest's) keeps its collector as it was."""
    monkeypatch.setattr(spark_read, "_worker_heap_frozen", False)
    frozen = gc.get_freeze_count()
    spark_read.freeze_worker_heap()
    assert gc.get_freeze_count() == frozen


@pytest.mark.timeout(180)
def test_a_pooled_reader_reads_on_after_its_broker_restarted(tmp_path: Path) -> None:
    """An idle pooled Northguard reader holds connections the restart broke; the next slice
    through the pool must read all the same (Spark's local mode does not retry a task)."""
    process = start_northguard(tmp_path)
    cluster = PhysicalCluster(name="restarts", kind=ClusterKind.NORTHGUARD, bootstrap=process.url)
    topic = f"spark-restart-{uuid.uuid4().hex[:8]}"

    pool = ReaderPool()
    try:
        asyncio.run(_fill(cluster, topic))
        assert _offsets(read_slice(_slice(cluster, topic, 0, 3), False, True, pool)) == [0, 1, 2]
        process.restart()
        assert _offsets(read_slice(_slice(cluster, topic, 1, 5), False, True, pool)) == [1, 2, 3, 4]
    finally:
        pool.close()
        process.stop()
