"""A physical cluster that does not answer in time exits 4, like one that refuses: not 3.

``timeout`` is the metadata service's; ``backend_timeout`` a physical cluster's.
Both are ``Timeout`` (504), so code that retries timeouts is unchanged.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from backends.kafka.backend import KafkaBackend
from backends.northguard.backend import NorthguardBackend
from xinfra.commands.output import EXIT_CLUSTER_UNREACHABLE, EXIT_SERVICE_UNREACHABLE, exit_code
from xinfra.errors import BackendTimeout, BackendUnavailable, Timeout, error_from_code
from xinfra.model import ClusterKind, PhysicalCluster


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose connections the kernel accepts and nobody ever answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield listener.getsockname()[1]
    listener.close()


async def test_a_silent_northguard_broker_is_a_backend_timeout(silent_port: int) -> None:
    cluster = PhysicalCluster(
        name="silent",
        kind=ClusterKind.NORTHGUARD,
        bootstrap=f"127.0.0.1:{silent_port}",
        attributes={"request_timeout_s": "1"},
    )
    backend = NorthguardBackend(cluster)
    try:
        with pytest.raises(BackendTimeout) as raised:
            await backend.list_topics()
    finally:
        await backend.close()
    assert exit_code(raised.value) == EXIT_CLUSTER_UNREACHABLE


async def test_a_silent_kafka_broker_is_a_physical_cluster_failure(silent_port: int) -> None:
    """librdkafka reports a broker that never answers its handshake as a transport failure."""
    cluster = PhysicalCluster(
        name="silent",
        kind=ClusterKind.KAFKA,
        bootstrap=f"127.0.0.1:{silent_port}",
        attributes={"request_timeout_s": "1"},
    )
    backend = KafkaBackend(cluster)
    try:
        with pytest.raises(BackendUnavailable) as raised:
            await backend.list_topics()
    finally:
        await backend.close()
    assert exit_code(raised.value) == EXIT_CLUSTER_UNREACHABLE


def test_the_codes_round_trip_and_keep_their_exit_codes() -> None:
    backend = error_from_code("backend_timeout", "kafka did not answer")
    assert isinstance(backend, BackendTimeout) and isinstance(backend, Timeout)
    assert backend.http_status == 504
    assert exit_code(backend) == EXIT_CLUSTER_UNREACHABLE
    service = error_from_code("timeout", "the service did not answer")
    assert type(service) is Timeout
    assert exit_code(service) == EXIT_SERVICE_UNREACHABLE
