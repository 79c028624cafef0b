"""Asynchronous commits of a group member, on a real service and tansu (Kafka's ``commitAsync``):
a commit returns at once with a future, commits are applied in the order asked, a blocking commit
and ``close`` wait for the earlier asynchronous ones, and a failure reaches the future and the
callback (never lost silently) without holding up the commits after it."""

from __future__ import annotations

import uuid

import httpx
import pytest
from groups_harness import HEADERS, VC, Deadline, ThreadService, create_topic
from test_group_sdk import member, produce

from clients import XinfraConsumer, XinfraRecord
from xinfra.errors import OffsetOutOfRange
from xinfra.model import Position

Shard = tuple[str, int]
Outcome = tuple[dict[Shard, Position], BaseException | None]


async def read_all(consumer: XinfraConsumer, count: int) -> int:
    """Poll until ``count`` records came; returns the epoch they were read in."""
    deadline = Deadline(30, f"{count} records")
    records: list[XinfraRecord] = []
    while len(records) < count:
        deadline.check()
        records += await consumer.poll(100, timeout_s=0.5)
    return records[0].epoch


def committed_offset(url: str, group: str, topic: str) -> int:
    body = httpx.get(f"{url}/v1/vclusters/{VC}/groups/{group}/checkpoints", headers=HEADERS).json()
    [position] = [p for p in body["positions"] if p["topic"] == topic]
    offset: int = position["offset"]
    return offset


async def test_async_commits_apply_in_order_and_a_blocking_commit_waits_for_them(
    service: ThreadService, kafka: str
) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topic(service.url, topic, shards=1)
    await produce(service.url, topic, [f"v{i}".encode() for i in range(6)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = await member(service.url, group, auto_commit=False)
    try:
        await consumer.subscribe([topic])
        epoch = await read_all(consumer, 6)
        outcomes: list[Outcome] = []
        futures = [
            consumer.commit_async(
                {(topic, 0): Position(epoch, 0, offset)},
                callback=lambda positions, error: outcomes.append((positions, error)),
            )
            for offset in range(1, 6)
        ]
        assert not any(f.done() for f in futures)  # returned at once, nothing awaited
        await consumer.commit({(topic, 0): Position(epoch, 0, 6)})
        assert all(f.done() for f in futures)  # the blocking commit waited for the earlier ones
        assert [p[(topic, 0)].offset for p, _ in outcomes] == [1, 2, 3, 4, 5]  # in order
        assert all(error is None for _, error in outcomes)
        assert committed_offset(service.url, group, topic) == 6
    finally:
        await consumer.close()


async def test_a_failed_async_commit_reaches_its_future_and_callback(
    service: ThreadService, kafka: str
) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topic(service.url, topic, shards=1)
    await produce(service.url, topic, [f"v{i}".encode() for i in range(3)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = await member(service.url, group, auto_commit=False)
    try:
        await consumer.subscribe([topic])
        epoch = await read_all(consumer, 3)
        outcomes: list[Outcome] = []
        bad = consumer.commit_async(
            {(topic, 0): Position(epoch, 0, 10_000)},  # beyond the end offset: refused
            callback=lambda positions, error: outcomes.append((positions, error)),
        )
        good = consumer.commit_async({(topic, 0): Position(epoch, 0, 2)})
        assert await good == {(topic, 0): Position(epoch, 0, 2)}  # not held up by the failure
        with pytest.raises(OffsetOutOfRange):
            await bad
        [(positions, error)] = outcomes
        assert positions == {(topic, 0): Position(epoch, 0, 10_000)}
        assert isinstance(error, OffsetOutOfRange) and error.code == "offset_out_of_range"
        assert committed_offset(service.url, group, topic) == 2
    finally:
        await consumer.close()


async def test_close_waits_for_async_commits(service: ThreadService, kafka: str) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topic(service.url, topic, shards=1)
    await produce(service.url, topic, [f"v{i}".encode() for i in range(4)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = await member(service.url, group, auto_commit=False)
    try:
        await consumer.subscribe([topic])
        epoch = await read_all(consumer, 4)
        future = consumer.commit_async({(topic, 0): Position(epoch, 0, 3)})
    finally:
        await consumer.close()  # no auto-commit: only the asynchronous commit moves the position
    assert future.done() and future.result() == {(topic, 0): Position(epoch, 0, 3)}
    assert committed_offset(service.url, group, topic) == 3
