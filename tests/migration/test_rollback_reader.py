"""A consumer reading the target when the migration is rolled back returns to the source.

During dual writes the target is the topic's newest epoch, so a consumer that
joins at ``latest`` reads the target (mirrors of the source records).  A
rollback drops that epoch and deletes its physical topic; the consumer must
then continue in the source at the translated position: the source offset
after the last source record whose mirror it delivered.  Nothing lost, nothing
twice: per shard, the source offsets it delivers are one contiguous run with
no repeat, up to the last acknowledged record.
"""

from __future__ import annotations

import asyncio

from sdk_live import (
    VC,
    LiveService,
    assert_per_key_order,
    needs_kafka,
    needs_northguard,
)
from test_migration_live import call, load, more
from waiting import wait_until

from clients import XinfraRecord, open_consumer
from xinfra.model import EpochState

pytestmark = [needs_kafka, needs_northguard]


async def test_a_consumer_reading_the_target_at_a_rollback_resumes_in_the_source_exactly(
    live: LiveService, kafka: str, northguard: str
) -> None:
    topic = "rolled"
    await live.create_topic(topic, kafka, 2)
    token = await live.client_token("rolled-reader")
    got: list[XinfraRecord] = []
    stop = asyncio.Event()
    consumer = await open_consumer(live.url, token, VC, topics=[topic])

    async def read() -> None:
        while not stop.is_set():
            got.extend(await consumer.poll(500, timeout_s=0.2))

    try:
        async with load(live, topic) as stream:
            await more(stream)
            await call(live, "POST", topic, target_cluster=northguard)
            await call(live, "POST", topic, "/advance", expected_state="dual_write")
            await consumer.assign(topic, start="latest")
            assert {p.epoch for p in consumer.positions().values()} == {1}, "joined the target"
            reader = asyncio.create_task(read())
            await wait_until(lambda: reader.done() or sum(r.epoch == 1 for r in got) >= 300, 30)
            back = await call(live, "POST", topic, "/rollback")
            assert back["state"] == "rolled_back"
            await wait_until(lambda: reader.done() or sum(r.epoch == 0 for r in got) >= 300, 30)
            await more(stream)
        await wait_until(lambda: reader.done() or _caught_up(got, stream.acked), 60)
        stop.set()
        await reader  # raises what poll raised
    finally:
        stop.set()
        await consumer.close()

    metadata = await live.metadata(topic)
    assert [(e.number, e.state) for e in metadata.epochs] == [(0, EpochState.ACTIVE)]
    assert {p.epoch for p in stream.acked.values()} == {0}
    values = [r.value for r in got]
    assert len(values) == len(set(values)), "a record delivered twice"
    assert_per_key_order(values)
    by_shard: dict[int, list[int]] = {}
    for value in values:
        assert value is not None
        position = stream.acked[value]
        by_shard.setdefault(position.shard, []).append(position.offset)
    ends = {s: 1 + max(p.offset for p in stream.acked.values() if p.shard == s) for s in (0, 1)}
    for shard, offsets in by_shard.items():
        first = offsets[0]
        assert offsets == list(range(first, ends[shard])), (
            f"shard {shard}: source offsets not one run from {first} to {ends[shard]}: "
            f"{len(offsets)} delivered"
        )


def _caught_up(got: list[XinfraRecord], acked: dict[bytes, object]) -> bool:
    """Every shard's last acknowledged record was delivered."""
    last: dict[int, tuple[int, bytes]] = {}
    for value, position in acked.items():
        shard, offset = position.shard, position.offset  # type: ignore[attr-defined]
        if shard not in last or offset > last[shard][0]:
            last[shard] = (offset, value)
    delivered = {r.value for r in got}
    return all(value in delivered for _, value in last.values())
