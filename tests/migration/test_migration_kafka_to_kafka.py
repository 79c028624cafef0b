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

from typing import Any

import pytest
from sdk_live import (
    LiveService,
    assert_exactly_once,
    assert_per_key_order,
    needs_kafka,
)
from test_migration_live import call, group_reading, load, more
from test_sdk_epochs import Stream, _check_read_back, assert_acked_inside_sealed_epochs
from timed_load import TimedBatchStream
from waiting import wait_until

from xinfra.model import EpochState

pytestmark = [needs_kafka]


@pytest.mark.parametrize("stream_type", [Stream, TimedBatchStream], ids=["send", "send_batch"])
async def test_a_topic_moves_between_two_kafka_clusters_under_keyed_load_and_a_group(
    live: LiveService, kafka: str, second_kafka: str, stream_type: type[Stream]
) -> None:
    topic = f"upgraded-{stream_type.__name__.lower()}"
    await live.create_topic(topic, kafka, 3)
    async with group_reading(live, topic, f"upgrade-{stream_type.__name__.lower()}") as seen:
        async with load(live, topic, stream_type) as stream:
            await more(stream)
            planned = await call(live, "POST", topic, target_cluster=second_kafka)
            assert (planned["source_cluster"], planned["target_cluster"]) == (kafka, second_kafka)
            for state in ("dual_write", "cut_over", "completed"):
                await more(stream)
                step = await call(live, "POST", topic, "/advance", expected_state=state)
                assert (step["state"], step["late_clients"]) == (state, [])
            await wait_until(lambda: stream.in_epoch(1) >= 200, 30)
        await wait_until(lambda: sum(map(len, seen)) >= len(stream.acked), 60)
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
