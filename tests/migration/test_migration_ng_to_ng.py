"""A topic migrated between two Northguard clusters (two brokers) under keyed load and a group.

The same machinery as Kafka to Northguard, with a Northguard source: the
source is sealed natively at the cut-over, so a producer whose batch was in
flight to it is refused and moves to the target, and a late append to the
old physical topic is refused too (never acknowledged, then dropped by
readers).  The check is independent of the migration: keyed producers record
what they were told is acknowledged; a group of two members reads while the
topic moves, and a reader from the beginning reads afterwards; each must get
every acknowledged record exactly once, in per-key order.  Each send is timed,
and the longest wait of the sends of each step stays below the documented
bound (``migration.machine.producer_stall_s_max``).
"""

from __future__ import annotations

from typing import Any

import pytest
from sdk_live import (
    LiveService,
    assert_exactly_once,
    assert_per_key_order,
    needs_northguard,
)
from test_migration_live import call, group_reading, more
from test_sdk_epochs import _check_read_back, assert_acked_inside_sealed_epochs
from timed_load import TimedBatchStream, TimedStream, timed_load
from waiting import wait_until

from migration.machine import producer_stall_s_max
from xinfra.backend import open_backend
from xinfra.errors import Sealed
from xinfra.model import EpochState, PhysicalCluster, Record

pytestmark = [needs_northguard]

ACK_TIMEOUT_S = 10.0
"""Each step's wait for the clients; the stall bound follows from it."""


@pytest.mark.parametrize("stream_type", [TimedStream, TimedBatchStream], ids=["send", "send_batch"])
async def test_a_topic_moves_between_two_northguard_clusters_under_keyed_load_and_a_group(
    live: LiveService, northguard: str, second_northguard: str, stream_type: type[TimedStream]
) -> None:
    topic = f"ng-moved-{stream_type.__name__.lower()}"
    await live.create_topic(topic, northguard, 3)
    async with group_reading(live, topic, f"readers-{stream_type.__name__.lower()}") as seen:
        async with timed_load(live, topic, stream_type) as stream:
            await more(stream)
            stream.step = "planned"
            planned = await call(live, "POST", topic, target_cluster=second_northguard)
            assert (planned["source_cluster"], planned["target_cluster"]) == (
                northguard,
                second_northguard,
            )
            for state in ("dual_write", "cut_over", "completed"):
                await more(stream)
                stream.step = state
                step = await call(
                    live,
                    "POST",
                    topic,
                    "/advance",
                    expected_state=state,
                    ack_timeout_s=ACK_TIMEOUT_S,
                )
                assert (step["state"], step["late_clients"]) == (state, [])
            await wait_until(lambda: stream.in_epoch(1) >= 200, 30)
            stream.step = "after"
            await more(stream)
        await wait_until(lambda: sum(map(len, seen)) >= len(stream.acked), 60)
    everything = seen[0] + seen[1]
    assert_exactly_once(everything, set(stream.acked))
    for values in seen:
        assert_per_key_order(values)  # a key lives on one shard, read by one member at a time

    stalls = stream.stall_s_max()
    assert set(stalls) >= {"before", "planned", "dual_write", "cut_over", "completed", "after"}
    bound_s = producer_stall_s_max(ACK_TIMEOUT_S)
    assert all(s < bound_s for s in stalls.values()), f"bound {bound_s} s, stalls {stalls}"

    metadata = await live.metadata(topic)
    assert [(e.cluster, e.state, e.mirror_of) for e in metadata.epochs] == [
        (northguard, EpochState.SEALED, None),
        (second_northguard, EpochState.ACTIVE, 0),
    ]
    assert_acked_inside_sealed_epochs(metadata, stream)
    await _check_read_back(live, topic, stream)  # zero lost, zero twice, per-key order

    # The source is sealed natively: a late append to its physical topic is refused.
    source = metadata.epochs[0]
    body = await live.call(lambda c: c.request("GET", f"/v1/clusters/{northguard}"))
    backend = open_backend(
        PhysicalCluster(name=body["name"], kind=body["kind"], bootstrap=body["bootstrap"])
    )
    try:
        assert (await backend.describe_topic(source.physical_topic)).sealed
        late = backend.producer(source.physical_topic)
        with pytest.raises(Sealed):
            await late.send(0, [Record(b"late")])
        reader = backend.reader(source.physical_topic)
        assert source.end_offsets is not None
        assert await reader.end_offsets() == source.end_offsets, "nothing appended after it"
        await reader.close()
    finally:
        await backend.close()
    status: Any = await call(live, "GET", topic)
    assert status["orphaned"]["records"] == 0
