"""Nothing acknowledged is lost silently at a seal.

A Northguard epoch is sealed natively: a producer that still writes its
physical topic after the seal gets ``Sealed``, never an acknowledgement.  A
Kafka epoch cannot be sealed by protocol: records written past its recorded
end offsets (here by a bare confluent-kafka producer on the old physical
topic) are reported as orphaned by the migration status, the CLI and a metric.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from confluent_kafka import Producer
from sdk_live import ADMIN_TOKEN, VC, LiveService, needs_kafka, needs_northguard
from test_migration_live import call
from test_sdk_cli import run

from xinfra.backend import open_backend
from xinfra.errors import Sealed
from xinfra.model import PhysicalCluster, Record

pytestmark = [needs_kafka, needs_northguard]


async def test_a_late_producer_after_a_northguard_seal_is_refused(
    live: LiveService, northguard: str
) -> None:
    await live.create_topic("ng-late", northguard, 2)
    physical = (await live.metadata("ng-late")).epochs[0].physical_topic
    body = await live.call(lambda c: c.request("GET", f"/v1/clusters/{northguard}"))
    backend = open_backend(
        PhysicalCluster(name=body["name"], kind=body["kind"], bootstrap=body["bootstrap"])
    )
    try:
        late = backend.producer(physical)  # a bare producer the service knows nothing of
        assert await late.send(0, [Record(b"before")]) == [0]
        metadata = await live.add_epoch("ng-late", northguard)  # seals epoch 0
        assert metadata.epochs[0].end_offsets == {0: 1, 1: 0}
        with pytest.raises(Sealed):
            await late.send(0, [Record(b"after the seal")])
        with pytest.raises(Sealed):
            await late.send(1, [Record(b"after the seal")])
        assert (await backend.describe_topic(physical)).sealed
        reader = backend.reader(physical)
        assert await reader.end_offsets() == {0: 1, 1: 0}, "nothing appended after the seal"
        await reader.close()
    finally:
        await backend.close()


async def test_records_past_a_sealed_kafka_epoch_are_reported_as_orphaned(
    live: LiveService, kafka: str, northguard: str, kafka_bootstrap: str
) -> None:
    await live.create_topic("kafka-late", kafka, 2)
    physical = (await live.metadata("kafka-late")).epochs[0].physical_topic
    await call(live, "POST", "kafka-late", target_cluster=northguard)
    for _ in range(2):
        await call(live, "POST", "kafka-late", "/advance")  # dual_write, then cut_over (sealed)
    status = await call(live, "GET", "kafka-late")
    assert status["state"] == "cut_over"
    assert status["orphaned"]["records"] == 0

    late = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    outcomes: list[object] = []
    for i in range(3):
        late.produce(
            physical, b"orphan-%d" % i, partition=1, on_delivery=lambda e, _m: outcomes.append(e)
        )
    assert await asyncio.to_thread(late.flush, 30) == 0
    assert outcomes == [None, None, None], "Kafka acknowledged them: they cannot be refused"
    del late

    status = await call(live, "GET", "kafka-late")
    assert status["orphaned"]["records"] == 3
    [epoch] = status["orphaned"]["epochs"]
    assert (epoch["epoch"], epoch["physical_topic"], epoch["by_shard"]) == (0, physical, {"1": 3})

    shown = await asyncio.to_thread(
        run, ["migrate", "status", "kafka-late", "--json"], live.url, ADMIN_TOKEN
    )
    assert json.loads(shown.stdout)["orphaned"]["records"] == 3
    text = await asyncio.to_thread(run, ["migrate", "status", "kafka-late"], live.url, ADMIN_TOKEN)
    assert "3 records orphaned" in text.stdout.decode(), text.stdout.decode()

    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{live.url}/metrics")).text
    assert (
        f'xinfra_migration_orphaned_records{{epoch="0",topic="kafka-late",vcluster="{VC}"}} 3.0'
        in metrics
    )
