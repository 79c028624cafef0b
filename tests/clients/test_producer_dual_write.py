"""The producer's dual-write pipeline, against in-process fakes of the service and the backends.

During dual writes a batch goes to the source, then (carrying the source
positions it mirrors) to the target; a send is acknowledged only when both
hold it.  The source write of the next batch of a shard may proceed while the
target write of the previous one is in flight; each cluster still sees the
shard's batches in order, and a failed target write is retried before any
later batch's copy, so retries never reorder.  Every wait here is on an
event the fakes set: nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from clients.producer import XinfraProducer, XinfraProducerOptions
from xinfra.backend import ShardProducer
from xinfra.errors import BackendTimeout
from xinfra.keyspace import shard_ranges
from xinfra.model import (
    ClusterKind,
    Epoch,
    EpochState,
    PhysicalCluster,
    Position,
    Record,
    Shard,
    TopicMetadata,
    VirtualTopic,
    mirrored_position,
)

TOPIC = "moving"
WAIT_S = 10.0
"""A bound on each wait for a send (a producer that never sends fails the test, not hangs it)."""


def dual_write_metadata(version: int = 3, cut_over: bool = False) -> TopicMetadata:
    """Source epoch 0 on Kafka, its mirror epoch 1 on Northguard; ``cut_over``: 0 sealed at 1."""
    shards = [Shard(index=0, key_range=r) for r in shard_ranges(1)]
    return TopicMetadata(
        topic=VirtualTopic(virtual_cluster="default", name=TOPIC),
        version=version,
        epochs=[
            Epoch(
                number=0,
                cluster="kafka",
                physical_topic="src",
                shards=shards,
                state=EpochState.SEALED if cut_over else EpochState.DUAL_WRITE,
                end_offsets={0: 1} if cut_over else None,
            ),
            Epoch(
                number=1,
                cluster="northguard",
                physical_topic="dst",
                shards=shards,
                state=EpochState.DUAL_WRITE,
                mirror_of=0,
            ),
        ],
        clusters={
            "kafka": PhysicalCluster(name="kafka", kind=ClusterKind.KAFKA, bootstrap="k:1"),
            "northguard": PhysicalCluster(
                name="northguard", kind=ClusterKind.NORTHGUARD, bootstrap="n:1"
            ),
        },
    )


class FakeSource:
    """A metadata service whose topic changes when the test ``publish``es a version."""

    def __init__(self, metadata: TopicMetadata) -> None:
        self.metadata = metadata
        self.published = asyncio.Event()

    def publish(self, metadata: TopicMetadata) -> None:
        self.metadata = metadata
        self.published.set()

    async def connect(self, timeout_s: float) -> None:
        return None

    async def topic_metadata(self, topic: str) -> TopicMetadata:
        return self.metadata

    async def wait_for_change(
        self, topic: str, after_version: int, timeout_s: float
    ) -> TopicMetadata | None:
        while self.metadata.version <= after_version:
            self.published.clear()
            await self.published.wait()
        return self.metadata

    async def acknowledge(self, topic: str, version: int) -> None:
        return None

    def check(self) -> None:
        return None

    async def close(self) -> None:
        return None


class Held(ShardProducer):
    """A log whose sends the test acknowledges (or fails) one by one; stores on acknowledgement."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.log: list[Record] = []
        self.sends: list[tuple[list[Record], asyncio.Future[list[int]]]] = []
        self.arrived = asyncio.Event()
        self.after_earlier: list[bool] = []
        """Per send: whether every earlier send was answered when it came."""

    def send(self, shard: int, records: Sequence[Record]) -> asyncio.Future[list[int]]:
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self.after_earlier.append(all(f.done() for _, f in self.sends))
        self.sends.append((list(records), future))
        self.arrived.set()
        return future

    async def next_send(self, index: int) -> tuple[list[Record], asyncio.Future[list[int]]]:
        """The ``index``-th send (0-based) once it arrived."""
        async with asyncio.timeout(WAIT_S):
            while len(self.sends) <= index:
                self.arrived.clear()
                await self.arrived.wait()
        return self.sends[index]

    def ack(self, index: int) -> list[int]:
        records, future = self.sends[index]
        offsets = list(range(len(self.log), len(self.log) + len(records)))
        self.log.extend(records)
        future.set_result(offsets)
        return offsets

    def fail(self, index: int) -> None:
        self.sends[index][1].set_exception(BackendTimeout(f"{self.name}: no answer"))

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        return None


class FakePool:
    def __init__(self) -> None:
        self.by_cluster = {"kafka": Held("source"), "northguard": Held("target")}

    def producer(self, cluster: PhysicalCluster, physical_topic: str) -> ShardProducer:
        return self.by_cluster[cluster.name]

    def adopt(self, metadata: TopicMetadata) -> None:
        return None

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        return None


async def open_dual(**options: Any) -> tuple[XinfraProducer, Held, Held]:
    pool = FakePool()
    producer = XinfraProducer(
        FakeSource(dual_write_metadata()),  # type: ignore[arg-type]  (the protocol's methods)
        XinfraProducerOptions(linger_ms=0, **options),
        pool,  # type: ignore[arg-type]
    )
    await producer.start([TOPIC])
    return producer, pool.by_cluster["kafka"], pool.by_cluster["northguard"]


def values(records: list[Record]) -> list[bytes | None]:
    return [r.value for r in records]


def mirrors(records: list[Record]) -> list[Position | None]:
    return [mirrored_position(r.headers) for r in records]


async def test_next_source_write_proceeds_while_the_previous_target_write_is_in_flight() -> None:
    producer, source, target = await open_dual()
    first = await producer.send(TOPIC, b"a", key=b"k")
    await source.next_send(0)
    source.ack(0)
    await target.next_send(0)  # batch 1's mirror is in flight, unacknowledged
    second = await producer.send(TOPIC, b"b", key=b"k")
    records, _ = await source.next_send(1)  # batch 2 reaches the source meanwhile
    assert values(records) == [b"b"]
    assert not first.done(), "acknowledged only once the target holds it too"
    source.ack(1)
    # The target sees batch 2 only after batch 1 was issued to it, each with its source position.
    mirrored, _ = await target.next_send(1)
    assert values(mirrored) == [b"b"] and mirrors(mirrored) == [Position(0, 0, 1)]
    assert not first.done() and not second.done()
    target.ack(0)
    target.ack(1)
    assert await first == Position(0, 0, 0)
    assert await second == Position(0, 0, 1)
    assert values(target.log) == [b"a", b"b"]
    assert mirrors(target.log) == [Position(0, 0, 0), Position(0, 0, 1)]
    await producer.close()


async def test_a_failed_target_write_is_retried_before_any_later_copy() -> None:
    producer, source, target = await open_dual(retry_backoff_s_max=0.05)
    first = await producer.send(TOPIC, b"a", key=b"k")
    await source.next_send(0)
    source.ack(0)
    await target.next_send(0)
    second = await producer.send(TOPIC, b"b", key=b"k")
    await source.next_send(1)
    source.ack(1)
    await target.next_send(1)
    # Batch 1's copy fails after batch 2's copy was issued (a backend keeping order fails the
    # later copy too): both go again, in order, batch 2's only after batch 1's is acknowledged.
    target.fail(0)
    target.fail(1)
    retried, _ = await target.next_send(2)
    assert values(retried) == [b"a"] and mirrors(retried) == [Position(0, 0, 0)]
    assert not first.done() and not second.done()
    assert len(target.sends) == 3, "batch 2's copy waits for batch 1's retry"
    target.ack(2)
    again, _ = await target.next_send(3)
    assert values(again) == [b"b"] and mirrors(again) == [Position(0, 0, 1)]
    target.ack(3)
    assert await first == Position(0, 0, 0)
    assert await second == Position(0, 0, 1)
    assert values(source.log) == [b"a", b"b"], "the source is written once per batch"
    assert values(target.log) == [b"a", b"b"]
    await producer.close()


async def test_after_the_cut_over_the_next_batch_follows_the_copies_in_flight_to_the_target() -> (
    None
):
    producer, source, target = await open_dual()
    first = await producer.send(TOPIC, b"a", key=b"k")
    await source.next_send(0)
    source.ack(0)
    await target.next_send(0)  # batch 1's copy in flight
    watch = producer._watches[TOPIC]
    changed = watch.changed
    producer.source.publish(dual_write_metadata(4, cut_over=True))  # type: ignore[attr-defined]
    await changed.wait()  # the producer runs on the cut-over: the target is the only write epoch
    waiting = asyncio.Event()
    drain = producer._drain

    async def spy(queue: Any, below: int = 1) -> None:
        waiting.set()  # the sender holds batch 2 back
        await drain(queue, below)

    producer._drain = spy  # type: ignore[method-assign]
    second = await producer.send(TOPIC, b"b", key=b"k")
    async with asyncio.timeout(WAIT_S):
        await waiting.wait()
    assert len(target.sends) == 1, "batch 2 waits for batch 1's copy"
    target.ack(0)
    records, _ = await target.next_send(1)
    assert target.after_earlier == [True, True], "batch 2 went to the target after batch 1's copy"
    assert values(records) == [b"b"] and mirrors(records) == [None]
    target.ack(1)
    assert await first == Position(0, 0, 0)
    assert await second == Position(1, 0, 1)
    assert values(source.log) == [b"a"] and values(target.log) == [b"a", b"b"]
    await producer.close()
