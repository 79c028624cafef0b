"""The service on real Kafka (tansu) and real Northguard brokers: a topic moves from a Kafka epoch to a
Northguard epoch with the same key ranges, and deleting it removes both physical topics.
Skipped, loudly, while backends.northguard cannot be imported."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from ms_harness import Service, running
from test_ms_api import VC

from metadata_service import ServiceConfig
from xinfra.backend import open_backend
from xinfra.errors import TopicNotFound
from xinfra.keyspace import shard_ranges
from xinfra.model import ClusterKind, PhysicalCluster, TopicMetadata

try:
    importlib.import_module("backends.northguard.backend")
    launcher: Any = importlib.import_module("backends.northguard.launcher")
    MISSING = None
except ImportError as error:
    MISSING = f"NORTHGUARD SERVICE TESTS SKIPPED: backends.northguard cannot be imported ({error})"

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture
def northguard_bootstrap(tmp_path: Path) -> Iterator[str]:
    broker = launcher.start_northguard(tmp_path / "northguard")
    yield broker.url
    broker.stop()


@pytest.fixture
async def real_service(service_config: ServiceConfig) -> AsyncIterator[Service]:
    async with running(replace(service_config, backend_factory=open_backend)) as service:
        yield service


async def test_kafka_epoch_then_northguard_epoch(
    real_service: Service, kafka_bootstrap: str, northguard_bootstrap: str
) -> None:
    service = real_service
    ng = PhysicalCluster(name="ng", kind=ClusterKind.NORTHGUARD, bootstrap=northguard_bootstrap)
    await service.ok(
        "POST",
        "/v1/clusters",
        201,
        json={"name": "kafka", "kind": "kafka", "bootstrap": kafka_bootstrap},
    )
    await service.ok("POST", "/v1/clusters", 201, json=ng.model_dump(mode="json"))
    await service.ok(
        "POST",
        f"/v1/vclusters/{VC}/topics",
        201,
        json={"name": "moving", "cluster": "kafka", "shards": 4},
    )
    moved = TopicMetadata.model_validate(
        await service.ok(
            "POST", f"/v1/vclusters/{VC}/topics/moving/epochs", 201, json={"cluster": "ng"}
        )
    )
    assert [e.cluster for e in moved.epochs] == ["kafka", "ng"]
    assert moved.epochs[0].end_offsets == {0: 0, 1: 0, 2: 0, 3: 0}
    physical = moved.epochs[1].physical_topic
    backend = open_backend(ng)
    try:
        info = await backend.describe_topic(physical)
        assert info.shards == shard_ranges(4), (
            "the Northguard epoch keeps the Kafka epoch's key ranges"
        )
        await service.ok("DELETE", f"/v1/vclusters/{VC}/topics/moving", 204)
        with pytest.raises(TopicNotFound):
            await backend.describe_topic(physical)
    finally:
        await backend.close()
