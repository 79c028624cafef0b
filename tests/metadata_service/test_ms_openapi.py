"""Property-based run against the OpenAPI document: >= 1000 generated requests (valid and
invalid) on a live server over MariaDB; no 5xx, every response conforms to the document."""

from __future__ import annotations

import uuid

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ms_harness import ADMIN_TOKEN
from ms_memory_backend import memory_cluster
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup

REQUESTS_MIN = 1000
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_openapi_document_is_complete(live_url: str) -> None:
    document = requests.get(f"{live_url}/openapi.json", timeout=10).json()
    assert "Problem" in document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert operation.get("summary") or operation.get("description"), (method, path)
            if path.startswith("/v1"):
                problem = operation["responses"]["422"]["content"]
                assert "application/problem+json" in problem, (method, path)


def test_generated_requests_never_fail_the_server(live_url: str) -> None:
    document = requests.get(f"{live_url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(document)
    # Some real state so that generated requests also reach the success paths.
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    bootstrap = f"memory-{uuid.uuid4().hex[:8]}:9092"
    memory_cluster(bootstrap)
    session = requests.Session()
    session.headers.update(headers)
    assert (
        session.post(
            f"{live_url}/v1/clusters", json={"name": "k1", "kind": "kafka", "bootstrap": bootstrap}
        ).status_code
        == 201
    )
    assert (
        session.post(
            f"{live_url}/v1/vclusters/default/topics",
            json={"name": "t", "cluster": "k1", "shards": 2},
        ).status_code
        == 201
    )

    strategies = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            strategies.append(operation.as_strategy(generation_mode=mode))
    sent = 0
    statuses: dict[int, int] = {}

    @settings(
        max_examples=1300,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=st.one_of(strategies))
    def check(case: schemathesis.Case) -> None:
        nonlocal sent
        if case.operation.path.endswith("/metadata"):  # no generated long-poll stalls the run
            case.query = {**(case.query or {}), "timeout_s": 0}
        try:
            response = case.call(base_url=live_url, session=session, headers=headers, timeout=30)
        except (
            requests.exceptions.InvalidHeader,
            requests.exceptions.InvalidURL,
            UnicodeError,
            ValueError,
        ):
            return  # the generated request cannot even be sent over HTTP
        sent += 1
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as failures:
            raise AssertionError(f"{case.method} {case.formatted_path}: {failures}") from None

    check()
    print(f"sent {sent} requests; statuses {sorted(statuses.items())}")
    assert sent >= REQUESTS_MIN, f"only {sent} requests sent"
    assert not any(status >= 500 for status in statuses), statuses


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
