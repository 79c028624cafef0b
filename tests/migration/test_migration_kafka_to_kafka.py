"""A cluster upgrade: a topic migrated between two Kafka-protocol clusters (two tansu brokers).

The same machinery as Kafka to Northguard, with a Kafka target: the mirror
headers ride on Kafka records, the source is sealed virtually (its end offsets
recorded, orphans counted), and the target becomes the active epoch.  The
check is independent of the migration: keyed producers record what they were
told is acknowledged; a group of two members reads while the topic moves, and
a reader from the beginning reads afterwards; each must get every
acknowledged record exactly once, in per-key order.
"""

from __future__ import annotations

import asyncio
from typing import Any

from sdk_live import (
    ADMIN_TOKEN,
    VC,
    LiveService,
    assert_exactly_once,
    assert_per_key_order,
    needs_kafka,
    wait_until,
)
from test_migration_live import call, load, more
from test_sdk_epochs import _check_read_back, assert_acked_inside_sealed_epochs

from clients import GroupOptions, open_consumer
from xinfra.model import EpochState

pytestmark = [needs_kafka]


async def test_a_topic_moves_between_two_kafka_clusters_under_keyed_load_and_a_group(
    live: LiveService, kafka: str, second_kafka: str
) -> None:
    topic = "upgraded"
    await live.create_topic(topic, kafka, 3)
    members = [
        await open_consumer(
            live.url,
            ADMIN_TOKEN,
            VC,
            group="upgrade-readers",
            group_options=GroupOptions(auto_commit_interval_s=0.2),
        )
        for _ in range(2)
    ]
    seen: list[list[bytes | None]] = [[], []]
    stop = asyncio.Event()

    async def read(index: int) -> None:
        while not stop.is_set():
            seen[index].extend(r.value for r in await members[index].poll(500, timeout_s=0.2))

    try:
        for consumer in members:
            await consumer.subscribe([topic])
        readers = [asyncio.create_task(read(i)) for i in range(2)]
        async with load(live, topic) as stream:
            await more(stream)
            planned = await call(live, "POST", topic, target_cluster=second_kafka)
            assert (planned["source_cluster"], planned["target_cluster"]) == (kafka, second_kafka)
            for state in ("dual_write", "cut_over", "completed"):
                await more(stream)
                step = await call(live, "POST", topic, "/advance", expected_state=state)
                assert (step["state"], step["late_clients"]) == (state, [])
            await wait_until(lambda: stream.in_epoch(1) >= 200, 30)
        await wait_until(lambda: sum(map(len, seen)) >= len(stream.acked), 60)
        stop.set()
        await asyncio.gather(*readers)
    finally:
        stop.set()
        for consumer in members:
            await consumer.close()
    everything = seen[0] + seen[1]
    assert_exactly_once(everything, set(stream.acked))
    for values in seen:
        assert_per_key_order(values)  # a key lives on one shard, read by one member at a time

    metadata = await live.metadata(topic)
    assert [(e.cluster, e.state, e.mirror_of) for e in metadata.epochs] == [
        (kafka, EpochState.SEALED, None),
        (second_kafka, EpochState.ACTIVE, 0),
    ]
    assert_acked_inside_sealed_epochs(metadata, stream)
    await _check_read_back(live, topic, stream)  # zero lost, zero twice, per-key order
    status: Any = await call(live, "GET", topic)
    assert status["orphaned"]["records"] == 0 and status["orphaned"]["errors"] == []
