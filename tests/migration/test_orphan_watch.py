"""The service counts orphans past a sealed Kafka source by itself, without a status request.

Records that a bare producer writes past the recorded end offsets of a
migration's sealed Kafka source are acknowledged by Kafka and never delivered;
the periodic check (``migration_orphan_check_s``) must show them in
``/metrics`` with nobody asking for the migration's status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

import httpx
import pytest
from confluent_kafka import Producer
from sdk_live import VC, LiveService, needs_kafka, needs_northguard
from test_migration_live import call
from waiting import wait_until

from metadata_service import ServiceConfig

pytestmark = [needs_kafka, needs_northguard]


@pytest.fixture
def service_config(service_config: ServiceConfig) -> ServiceConfig:
    return dataclasses.replace(service_config, migration_orphan_check_s=0.1)


async def _metric(live: LiveService, name: str) -> float | None:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{live.url}/metrics")).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return None if found is None else float(found[1])


async def test_orphans_past_a_sealed_kafka_source_reach_the_metrics_unasked(
    live: LiveService, kafka: str, northguard: str, kafka_bootstrap: str
) -> None:
    await live.create_topic("kafka-watched", kafka, 2)
    physical = (await live.metadata("kafka-watched")).epochs[0].physical_topic
    await call(live, "POST", "kafka-watched", target_cluster=northguard)
    for _ in range(2):
        await call(live, "POST", "kafka-watched", "/advance")  # dual_write, then cut_over
    gauge = f'xinfra_migration_orphaned_records{{epoch="0",topic="kafka-watched",vcluster="{VC}"}}'

    async def checked() -> bool:
        return await _metric(live, gauge) is not None

    await wait_until(checked, 30)
    assert await _metric(live, gauge) == 0.0

    late = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for i in range(4):
        late.produce(physical, b"orphan-%d" % i, partition=0)
    assert await asyncio.to_thread(late.flush, 30) == 0
    del late

    async def counted() -> bool:
        return await _metric(live, gauge) == 4.0

    await wait_until(counted, 30)  # no status was asked: the periodic check found them
    passes = await _metric(live, "xinfra_migration_orphan_checks_total")
    assert passes is not None and passes >= 2
