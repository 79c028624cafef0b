"""The service on the real Kafka backend (tansu): topics created and deleted on the broker, and
no half topic when the broker becomes unreachable.  Skipped, loudly, while backends.kafka is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
from ms_harness import Service, running
from test_ms_api import VC, assert_problem

from metadata_service import ServiceConfig
from xinfra.backend import open_backend
from xinfra.model import ClusterKind, PhysicalCluster
from xinfra.services.kafka import start_kafka

try:
    import backends.kafka.backend  # noqa: F401

    KAFKA_BACKEND = True
except ImportError as error:
    KAFKA_BACKEND = False
    REASON = f"backends.kafka.backend cannot be imported yet ({error}); Kafka-backed service tests SKIPPED"

pytestmark = pytest.mark.skipif(not KAFKA_BACKEND, reason=REASON if not KAFKA_BACKEND else "")


@pytest.fixture
async def kafka_service(service_config: ServiceConfig) -> Service:  # type: ignore[misc]
    from dataclasses import replace

    async with running(replace(service_config, backend_factory=open_backend)) as service:
        yield service


async def test_topic_lifecycle_on_kafka(kafka_service: Service, kafka_bootstrap: str) -> None:
    service = kafka_service
    await service.ok(
        "POST",
        "/v1/clusters",
        201,
        json={"name": "kafka", "kind": "kafka", "bootstrap": kafka_bootstrap},
    )
    metadata = await service.ok(
        "POST",
        f"/v1/vclusters/{VC}/topics",
        201,
        json={"name": "k-orders", "cluster": "kafka", "shards": 3},
    )
    physical = metadata["epochs"][0]["physical_topic"]
    backend = open_backend(
        PhysicalCluster(name="kafka", kind=ClusterKind.KAFKA, bootstrap=kafka_bootstrap)
    )
    try:
        info = await backend.describe_topic(physical)
        assert len(info.shards) == 3
        await service.ok("DELETE", f"/v1/vclusters/{VC}/topics/k-orders", 204)
        assert physical not in await backend.list_topics()
    finally:
        await backend.close()


async def test_unreachable_broker_leaves_no_half_topic(
    kafka_service: Service, tmp_path: Path
) -> None:
    service = kafka_service
    broker = start_kafka(tmp_path / "kafka")
    try:
        await service.ok(
            "POST",
            "/v1/clusters",
            201,
            json={"name": "doomed", "kind": "kafka", "bootstrap": broker.url},
        )
    finally:
        broker.stop()
    response = await service.http.post(
        f"/v1/vclusters/{VC}/topics", json={"name": "t", "cluster": "doomed", "shards": 2}
    )
    assert response.status_code in (503, 504), response.text
    assert_problem(await service.http.get(f"/v1/vclusters/{VC}/topics/t"), 404, "topic_not_found")
    assert (await service.ok("GET", f"/v1/vclusters/{VC}/topics"))["topics"] == []
