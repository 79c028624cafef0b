"""Kafka-specific tests run on the session's tansu broker (``kafka_bootstrap``)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from backends.kafka.backend import KafkaBackend
from xinfra.model import ClusterKind, PhysicalCluster


@pytest.fixture
async def kafka_backend(kafka_bootstrap: str) -> AsyncIterator[KafkaBackend]:
    backend = KafkaBackend(
        PhysicalCluster(name="kafka", kind=ClusterKind.KAFKA, bootstrap=kafka_bootstrap)
    )
    yield backend
    await backend.close()


@pytest.fixture
def topic_name() -> str:
    return f"kafka-{uuid.uuid4().hex[:12]}"
