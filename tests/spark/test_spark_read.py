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

import pytest

from backends.northguard.launcher import start_northguard
from clients.spark.plan import Slice
from clients.spark.read import read_slice
from xinfra.backend import open_backend
from xinfra.errors import OffsetOutOfRange
from xinfra.keyspace import shard_ranges
from xinfra.model import ClusterKind, PhysicalCluster, Record

RECORDS = 5


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

    async def fill() -> None:
        backend = open_backend(cluster)
        try:
            await backend.create_topic(topic, shard_ranges(1))
            producer = backend.producer(topic)
            await producer.send(0, [Record(b"v%d" % i) for i in range(RECORDS)])
            await producer.close()
        finally:
            await backend.close()

    asyncio.run(fill())
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
