"""Cluster registration: an invalid bootstrap or attribute is a 400 problem+json, decided before any
network check (with the real backends, so a check would hang or fail as 503/504); a failed
registration leaves no backend client behind in the service."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from ms_harness import Service, running
from test_ms_api import assert_problem

from metadata_service import ServiceConfig
from xinfra.backend import open_backend

INVALID_BOOTSTRAPS = [
    ":9092",
    "127.0.0.1:abc",
    "127.0.0.1:99999",
    "127.0.0.1:0",
    "127.0.0.1:-1",
    "127.0.0.1",
    "127.0.0.1:",
    "127.0.0.1:9092,",
    ",127.0.0.1:9092",
    "a b:9092",
    "host_name:9092",
    "-host:9092",
    "[::1:9092",
    "[::1]",
    "::1:9092",
    "http://127.0.0.1:9092",
    "127.0.0.1:9092/x",
    "127.0.0.1:\uff19\uff10\uff19\uff12",  # fullwidth digits: str.isdigit() would take them
]

INVALID_ATTRIBUTES = [
    {"request_timeout_s": "abc"},
    {"request_timeout_s": ""},
    {"request_timeout_s": "nan"},
    {"request_timeout_s": "NaN"},
    {"request_timeout_s": "inf"},
    {"request_timeout_s": "-Infinity"},
    {"request_timeout_s": "1e400"},
    {"request_timeout_s": "-1"},
    {"request_timeout_s": "0"},
    {"request_timeout_s": "1e9"},
    {"replication_factor": "x"},
    {"replication_factor": "1.5"},
    {"replication_factor": "0"},
    {"replication_factor": "-2"},
]

VALID = [
    ("kafka", "127.0.0.1:9092", {}),
    ("kafka", "broker-1.example.com:9092, broker-2:9093", {"replication_factor": "3"}),
    ("kafka", "[::1]:9092", {"request_timeout_s": "2.5", "replication_factor": "-1"}),
    ("northguard", "localhost:65535", {"request_timeout_s": "30", "rack": "r1"}),
]


@pytest.fixture
async def real_service(service_config: ServiceConfig) -> AsyncIterator[Service]:
    """The service with the real backends: a network check would answer 503/504, not 400."""
    async with running(replace(service_config, backend_factory=open_backend)) as service:
        yield service


async def _refused(service: Service, body: dict[str, Any], check: bool) -> None:
    started = time.monotonic()
    response = await service.http.post(
        "/v1/clusters", params={"check": str(check).lower()}, json=body
    )
    assert_problem(response, 400, "invalid_request")
    assert time.monotonic() - started < service.config.backend_timeout_s
    assert (await service.ok("GET", "/v1/clusters"))["clusters"] == []
    assert service.app.state.services.runtime.backends.open_count == 0


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("kind", ["kafka", "northguard"])
async def test_invalid_bootstrap_is_400_before_any_network_check(
    real_service: Service, kind: str, check: bool
) -> None:
    for bootstrap in INVALID_BOOTSTRAPS:
        await _refused(real_service, {"name": "c", "kind": kind, "bootstrap": bootstrap}, check)


@pytest.mark.parametrize("check", [True, False])
async def test_invalid_attributes_are_400_before_any_network_check(
    real_service: Service, check: bool
) -> None:
    for attributes in INVALID_ATTRIBUTES:
        body = {
            "name": "c",
            "kind": "kafka",
            "bootstrap": "127.0.0.1:9092",
            "attributes": attributes,
        }
        await _refused(real_service, body, check)


async def test_valid_registrations_are_stored_without_check(real_service: Service) -> None:
    for index, (kind, bootstrap, attributes) in enumerate(VALID):
        body = {"name": f"c{index}", "kind": kind, "bootstrap": bootstrap, "attributes": attributes}
        await real_service.ok("POST", "/v1/clusters", 201, params={"check": "false"}, json=body)
    assert len((await real_service.ok("GET", "/v1/clusters"))["clusters"]) == len(VALID)


async def test_failed_check_leaves_no_client_retrying_in_the_service(
    real_service: Service,
) -> None:
    """A Kafka client kept after a failed check would reconnect for the life of the service."""
    response = await real_service.http.post(
        "/v1/clusters", json={"name": "gone", "kind": "kafka", "bootstrap": "127.0.0.1:1"}
    )
    assert response.status_code in (503, 504), response.text
    assert real_service.app.state.services.runtime.backends.open_count == 0
    assert (await real_service.ok("GET", "/v1/clusters"))["clusters"] == []


async def test_name_conflict_is_409_before_any_network_check(real_service: Service) -> None:
    body = {"name": "k", "kind": "kafka", "bootstrap": "127.0.0.1:1"}
    await real_service.ok("POST", "/v1/clusters", 201, params={"check": "false"}, json=body)
    assert_problem(await real_service.http.post("/v1/clusters", json=body), 409, "conflict")
    assert real_service.app.state.services.runtime.backends.open_count == 0
